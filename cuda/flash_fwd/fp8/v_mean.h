// V centring of the fp8 forward (jax_fa3/_fp8_emulation.py): V arrives quantized as e4m3(v - mean)
// and the epilogue adds the mean back, O = sum_j p_j (v_j - mean) + mean, exact for any mean since
// a row's weights sum to one.
//
// Why: the fp8 tensor cores add each product into the fp32 accumulator with about 13 mantissa bits
// (aligned to the larger exponent, truncated). Where V's values share a sign, the terms of PV never
// cancel, the accumulator grows with the keys and each addition drops more of the next product:
// V ~ N(2, 1) came out 7% low at 4k keys and 15% at 8k (H200, 2026-12-03). Centred, the
// accumulator holds a sum of terms of both signs, as with zero-mean V (0.03 row error at 8k).
#pragma once
#include <cute/tensor.hpp>

#include "flash_fwd/barriers.h"
#include "flash_fwd/softmax.h"

namespace jax_fa3::fwd {

// At tile start: the first d / 4 consumer threads copy the tile's d means, 16 bytes each, into
// the CTA's shared slot (cp.async: no registers held through the main loop; the consumer
// warpgroups share the tile, so one copy serves them all). The previous tile's reads of the slot
// are done: every consumer passed the epilogue's kBarrierConsumers (store_tile) since.
__device__ __forceinline__ void stage_v_mean(float* slot, const float* mean, int d,
                                             int consumer_thread) {
  if (4 * consumer_thread < d) {
    const uint32_t dst =
        static_cast<uint32_t>(__cvta_generic_to_shared(slot + 4 * consumer_thread));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst),
                 "l"(mean + 4 * consumer_thread) : "memory");
  }
  asm volatile("cp.async.commit_group;" ::: "memory");
}

// In the epilogue, before add_v_mean reads the slot: this thread's copy has landed (long since,
// a whole tile later) and, after the barrier, every other consumer thread's.
template <int kConsumerThreads>
__device__ __forceinline__ void wait_v_mean() {
  asm volatile("cp.async.wait_all;" ::: "memory");
  named_barrier_sync(kBarrierVMean, kConsumerThreads);
}

// o: the thread's O fragment, already normalized; mean: the (batch, kv-head)'s d floats (the
// CTA's shared slot); col0: the thread's first column (FragCoord); inv_sum: 0 marks a row
// that saw no key, whose O stays 0.
// Elements 4v..4v+3 are columns col0 + 8v, +1 of rows 0 and 1 (frag_row, frag_col); d is a
// multiple of 16 and col0 even, so one float2 covers both columns or neither.
template <class FragO>
__device__ __forceinline__ void add_v_mean(FragO& o, const float* mean, int col0, int d,
                                           const float (&inv_sum)[2]) {
  static_assert(decltype(cute::size(o))::value % 4 == 0);
#pragma unroll
  for (int v = 0; v < decltype(cute::size(o))::value / 4; ++v) {
    const int col = col0 + 8 * v;
    if (col >= d) continue;
    const float2 m = *reinterpret_cast<const float2*>(mean + col);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      if (inv_sum[r] == 0.f) continue;
      // __fadd_rn: not contracted with the normalization's product into an FMA, so that the
      // tail split's merge (fp8/tail_split.h), which rounds both, writes the same bits.
      o(4 * v + 2 * r) = __fadd_rn(o(4 * v + 2 * r), m.x);
      o(4 * v + 2 * r + 1) = __fadd_rn(o(4 * v + 2 * r + 1), m.y);
    }
  }
}

}  // namespace jax_fa3::fwd
