// fp8-only pieces of the consumer: score descaling, the online softmax with per-row scales and
// the 2^8 shift of P, and P -> packed e4m3 A-operand registers (layout: fp8_layout.h).
#pragma once
#include "flash_fwd/cute_config.h"
#include <cmath>
#include <cstdint>
#include <cute/tensor.hpp>

#include "flash_fwd/fp8_layout.h"
#include "flash_fwd/softmax.h"

namespace jax_fa3::fwd {

// P is quantized as e4m3(2^8 * P) (FA3's Max_offset): P in [0, 1] uses e4m3's range [2^-9, 448].
constexpr float kFp8POffsetLog2 = 8.f;

// S *= k_scale of each column (one FMUL per element). col_scale: this (batch, kv-head)'s row of
// per-key scales (s_pad floats); col_g: global column of flat index 0. Columns >= s_pad (the
// last block's tail) read nothing; they are >= s_k and masked to -inf afterwards, as are columns
// in [s_k, s_pad) whose scale is 0.
template <typename Frag>
__device__ __forceinline__ void descale_columns(Frag& s, const float* __restrict__ col_scale,
                                                int col_g, int s_pad) {
#pragma unroll
  for (int j = 0; j < cute::size(s) / 4; ++j) {
    const int col = col_g + 8 * j;  // even: the pair (col, col + 1) is one aligned float2
    float2 cs = make_float2(0.f, 0.f);
    if (col < s_pad) cs = __ldg(reinterpret_cast<const float2*>(col_scale + col));
    s(4 * j + 0) *= cs.x;
    s(4 * j + 1) *= cs.y;
    s(4 * j + 2) *= cs.x;
    s(4 * j + 3) *= cs.y;
  }
}

struct Fp8OnlineSoftmax {
  // Running max of the column-descaled scores (row scale not applied; it is positive, so the max
  // commutes with it) and this thread's partial sum of 2^8 * P (exact power-of-two shift of the
  // unquantized fp32 P; the quad sum happens in finalize()).
  float row_max[2];
  float row_sum[2];

  __device__ __forceinline__ void reset() {
    row_max[0] = row_max[1] = -INFINITY;
    row_sum[0] = row_sum[1] = 0.f;
  }

  // s -> 2^8 * exp2(s * row_scale - max * row_scale) in place (one FFMA + EX2 per element).
  // row_scale = softmax_scale * log2(e) * q_scale of the row's block.
  template <typename Frag>
  __device__ __forceinline__ void update(Frag& s, const float (&row_scale)[2],
                                         float (&correction)[2]) {
    float new_max[2] = {row_max[0], row_max[1]};
#pragma unroll
    for (int i = 0; i < cute::size(s); ++i) {
      new_max[frag_row(i)] = fmaxf(new_max[frag_row(i)], s(i));
    }
    float shift[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      new_max[r] = quad_max(new_max[r]);
      const float max_scaled = new_max[r] == -INFINITY ? 0.f : new_max[r] * row_scale[r];
      correction[r] = exp2f(row_max[r] * row_scale[r] - max_scaled);
      row_max[r] = new_max[r];
      row_sum[r] *= correction[r];
      shift[r] = max_scaled - kFp8POffsetLog2;
    }
#pragma unroll
    for (int i = 0; i < cute::size(s); ++i) {
      const float p = exp2f(s(i) * row_scale[frag_row(i)] - shift[frag_row(i)]);
      s(i) = p;
      row_sum[frag_row(i)] += p;
    }
  }

  // inv_sum = v_scale / (2^8 * rowsum) (0 for a row that saw no key); LSE natural log, +inf for
  // such a row.
  __device__ __forceinline__ void finalize(const float (&row_scale)[2], float v_scale,
                                           float (&inv_sum)[2], float (&lse)[2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float sum = quad_sum(row_sum[r]);
      const bool empty = sum == 0.f || sum != sum;
      inv_sum[r] = empty ? 0.f : v_scale / sum;
      lse[r] = empty ? INFINITY
                     : (row_max[r] * row_scale[r] + __log2f(sum) - kFp8POffsetLog2) *
                           0.6931471805599453f;
    }
  }
};

// Two fp32 -> packed e4m3x2 (round to nearest even, saturating): lo in bits 0..7, hi in 8..15.
__device__ __forceinline__ uint32_t cvt_e4m3x2(float lo, float hi) {
  uint16_t r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
}

// P (fp32 in the S accumulator) -> e4m3 A-operand registers of the PV wgmma, in place order (see
// fp8_layout.h: the key permutation lives in the transposed V). tOrP: the A fragment (16 e4m3
// per k32 step, register-major), same element count as tSrS.
template <class FragS, class FragP>
__device__ __forceinline__ void convert_p_fp8(FragS const& tSrS, FragP& tOrP) {
  static_assert(decltype(size(tOrP))::value == decltype(size(tSrS))::value);
  static_assert(decltype(size(tSrS))::value % 16 == 0);
  Tensor p32 = cute::recast<uint32_t>(tOrP);
#pragma unroll
  for (int step = 0; step < cute::size(tSrS) / 16; ++step) {
#pragma unroll
    for (int a = 0; a < 4; ++a) {
      const int base = 16 * step;
      const uint32_t lo = cvt_e4m3x2(tSrS(base + fp8::fp8_p_source(a, 0)),
                                     tSrS(base + fp8::fp8_p_source(a, 1)));
      const uint32_t hi = cvt_e4m3x2(tSrS(base + fp8::fp8_p_source(a, 2)),
                                     tSrS(base + fp8::fp8_p_source(a, 3)));
      p32(4 * step + a) = lo | (hi << 16);
    }
  }
}

}  // namespace jax_fa3::fwd
