// Backward preprocess: per (batch, head, query row) D = rowsum(dO * O) in fp32 and LSE in the log2
// domain, both padded to a whole number of Q blocks (D = 0, LSE = +inf in the padding, so padded
// rows get P = 0 and dS = 0 without a special case), and the row's share of the fp32 dQ
// accumulator zeroed: the workspace's Q-block chunks of kBlockM rows x bucket floats, in (b, h,
// Q block) order, are `bucket` floats per preprocess row in row order, whatever the fragment order
// inside a chunk (traits.cuh, dq_slot), so row r zeroes floats [r * bucket, (r + 1) * bucket).
// One pass instead of a memset and this kernel (FlashAttention-3 does the same). kLanes lanes per
// row, 16-byte loads: 8 at d <= 64, 16 at d <= 128, 32 above, so that no lane idles at d = 64, 128
// (a warp per row left half or three quarters of them without a load, fewer bytes in flight per
// warp).
#pragma once
#include <cstdint>

#include <cutlass/numeric_types.h>

namespace jax_fa3::flash_bwd {

constexpr int kPreprocessThreads = 256;

// Lanes per row for head dim d: the smallest power of two >= d / 8, at least 8, at most 32.
inline int preprocess_lanes_per_row(int d) { return d <= 64 ? 8 : d <= 128 ? 16 : 32; }

template <typename Element, int kLanes>
__global__ void __launch_bounds__(kPreprocessThreads)
    flash_bwd_preprocess_kernel(const Element* __restrict__ out, const Element* __restrict__ dout,
                                const float* __restrict__ lse, float* __restrict__ lse_log2,
                                float* __restrict__ dpsum, float* __restrict__ dq_accum,
                                int bucket, int b, int s_q, int h, int d, int s_q_pad) {
  constexpr int kRowsPerBlock = kPreprocessThreads / kLanes;
  const int lane = threadIdx.x % kLanes;
  const int64_t row = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / kLanes;
  // Rows past the end still take part in the shuffles below (whole warps), with nothing loaded.
  const bool in_range = row < int64_t(b) * h * s_q_pad;
  const int i = static_cast<int>(row % s_q_pad);
  const int64_t bh = row / s_q_pad;
  const int hh = static_cast<int>(bh % h);
  const int64_t bb = bh / h;
  float acc = 0.f;
  float l = __int_as_float(0x7f800000);  // +inf
  if (in_range && i < s_q) {
    const int64_t base = ((bb * s_q + i) * h + hh) * d;
    for (int c = lane * 8; c < d; c += kLanes * 8) {
      const uint4 ov = *reinterpret_cast<const uint4*>(out + base + c);
      const uint4 gv = *reinterpret_cast<const uint4*>(dout + base + c);
      const Element* o8 = reinterpret_cast<const Element*>(&ov);
      const Element* g8 = reinterpret_cast<const Element*>(&gv);
#pragma unroll
      for (int e = 0; e < 8; ++e) acc += float(o8[e]) * float(g8[e]);
    }
    l = lse[bh * s_q + i] * 1.4426950408889634f;  // +inf stays +inf
  }
  // xor offsets below kLanes stay inside the row's aligned group of lanes.
#pragma unroll
  for (int o = kLanes / 2; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if (in_range && lane == 0) {
    dpsum[row] = acc;
    lse_log2[row] = l;
  }
  if (in_range) {
    float4* zero_row = reinterpret_cast<float4*>(dq_accum + row * bucket);
    for (int c = lane; c < bucket / 4; c += kLanes) zero_row[c] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
}

}  // namespace jax_fa3::flash_bwd
