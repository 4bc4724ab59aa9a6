// fp8-only pieces of the consumer: score descaling, the online softmax with per-row scales and
// the 2^6 shift of P, and P -> packed e4m3 A-operand registers (layout: fp8/layout.h).
#pragma once
#include "flash_fwd/cute_config.h"
#include <cmath>
#include <cstdint>
#include <cute/tensor.hpp>

#include "flash_fwd/fp8/layout.h"
#include "flash_fwd/softmax.h"

namespace jax_fa3::fwd {

// P is quantized as e4m3(2^6 * P): FA3's Max_offset idea (a power-of-two shift, so no per-row
// scale) with 6 instead of FA3's 8, so that the lazy max below can leave P up to 2^2.8 and
// 2^6 * P still fits e4m3 (448 = 2^8.807). P then uses e4m3's range [2^-9, 445.7]: P below
// 2^-16 rounds to zero, below 2^-12 is subnormal (with 2^8: 2^-18 and 2^-14).
constexpr float kFp8POffsetLog2 = 6.f;
// Lazy running max: a row keeps its max until a block's scores exceed it by more than this
// (log2 units), so O is rescaled on a jump, not on every new maximum; then P <= 2^2.8. Kernel
// alone (H200, eighteenth session, benchmarks/RESULTS.md), margin 2.8 / shift 6 against 0.8 /
// 8: d128 8k +1.6-2.1%, d256 +2.4%, d64 +0.7%; 1.8 / 7 gained about half of that at d128, 3.8 /
// 5 no more than 2.8 / 6. RMSE (the paper's outlier inputs): +0.2-0.9%.
constexpr float kFp8LazyMaxMarginLog2 = 2.8f;
static_assert(kFp8POffsetLog2 + kFp8LazyMaxMarginLog2 < 8.807f, "2^offset * P must fit e4m3");

// Keys per k-scale group: one k_scale serves 32 consecutive keys of a tile (keys 32g..32g+31)
// whenever block_size % 32 == 0 (tile starts are multiples of 32, so no block edge falls inside a
// group). The per-key scale then folds into the exp2 FFMA's per-(row, group) coefficient, and the
// running max is taken on raw scores per group: no per-element descale multiply at all.
constexpr int kFp8KeyScaleGroup = 32;

// Generic block sizes: S *= k_scale of each column (one FMUL per element, 32 float2 L1 loads per
// tile). col_scale: this (batch, kv-head)'s row of per-key scales (s_pad floats); col_g: global
// column of flat index 0. Columns >= s_pad (the last block's tail) read nothing; they are >= s_k
// and masked to -inf afterwards.
template <typename Frag>
__device__ __forceinline__ void descale_columns(Frag& s, const float* __restrict__ col_scale,
                                                int col_g, int s_pad) {
#pragma unroll
  for (int j = 0; j < cute::size(s) / 4; ++j) {
    const int col = col_g + 8 * j;  // even: the pair (col, col + 1) is one aligned float2
    float2 cs = make_float2(1.f, 1.f);
    if (col < s_pad) cs = __ldg(reinterpret_cast<const float2*>(col_scale + col));
    s(4 * j + 0) *= cs.x;
    s(4 * j + 1) *= cs.y;
    s(4 * j + 2) *= cs.x;
    s(4 * j + 3) *= cs.y;
  }
}

// kGroups k-scale groups of 32 keys per tile (flat S indices 16g..16g+15 are group g: 8-column
// chunks 4g..4g+3). kReduceMaxOnJump: see update_max(). The row sums are not taken here but on
// the tensor cores (TensorRowSum, fp8/row_sum.h), which hands them over with set_row_sums()
// before finalize() or the tail split reads them.
template <int kGroups, bool kReduceMaxOnJump = false>
struct Fp8OnlineSoftmax {
  // Running max of the scaled scores (log2 domain: score * softmax_scale * log2 e * q_scale *
  // k_scale), quad-uniform, and this thread's share of the row's sum of 2^6 * P8 (the quad sum
  // happens in finalize()).
  float row_max[2];
  float row_sum[2];

  __device__ __forceinline__ void reset() {
    row_max[0] = row_max[1] = -INFINITY;
    row_sum[0] = row_sum[1] = 0.f;
  }

  // s (raw or column-descaled scores; masked ones -inf) -> 2^6 * exp2(s * coef - max) in place.
  // coef[r][g] = row scale of row r * k scale of group g (> 0, so maxima commute with it): the
  // max is taken per (row, group) on the raw scores, then scaled: 2 * kGroups FMULs per tile
  // instead of one per element, and kGroups independent FMNMX chains per row.
  // One update is update_max() then exponentiate() (two calls so that the timeline of trace.h
  // can stamp between them). This half: the new row maxima, the O correction and the exp2 shift.
  template <typename Frag>
  __device__ __forceinline__ void update_max(Frag const& s, const float (&coef)[2][kGroups],
                                             float (&correction)[2], float (&shift)[2]) {
    static_assert(decltype(cute::size(s))::value == 16 * kGroups);
    float group_max[2][kGroups];
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
      // Each row's chain starts at its first element (16 g + 2 r), not at -inf: one FMNMX less
      // per chain. fmaxf drops a NaN either way, so an all-NaN group gives NaN, which the
      // fmaxf of row_tile_max drops as it dropped -inf.
      group_max[0][g] = s(16 * g);
      group_max[1][g] = s(16 * g + 2);
#pragma unroll
      for (int i = 16 * g; i < 16 * g + 16; ++i) {
        if (i == 16 * g || i == 16 * g + 2) continue;
        group_max[frag_row(i)][g] = fmaxf(group_max[frag_row(i)][g], s(i));
      }
    }
    // The quad's row max, kept unless it exceeds the running max by more than the margin; the O
    // correction and the exp2 shift.
    auto reduce_row = [&](int r, float tile_max) {
      float new_max = quad_max(tile_max);
      // -inf - -inf is NaN: a row that has seen only -inf keeps -inf.
      if (!(new_max - row_max[r] > kFp8LazyMaxMarginLog2)) new_max = row_max[r];
      // A row that has seen only -inf so far keeps a finite base so that exp2 gives 0, not NaN.
      const float base = new_max == -INFINITY ? 0.f : new_max;
      correction[r] = exp2f(row_max[r] - base);
      row_max[r] = new_max;
      shift[r] = base - kFp8POffsetLog2;
    };
    auto row_tile_max = [&](int r) {
      float tile_max = row_max[r];
#pragma unroll
      for (int g = 0; g < kGroups; ++g) tile_max = fmaxf(tile_max, group_max[r][g] * coef[r][g]);
      return tile_max;
    };
    if constexpr (!kReduceMaxOnJump) {
#pragma unroll
      for (int r = 0; r < 2; ++r) reduce_row(r, row_tile_max(r));
    } else {
      // A quad's row max exceeds the margin only if one of its threads' does: when no thread of
      // the warp jumps, every row keeps its max and the correction is exactly 1 (0 for a row that
      // has seen only -inf, whose row sum is 0 already), as reduce_row would find, without its
      // quad shuffles and two exp2. With the 2.8 margin almost no block jumps
      // after a row's first. Only in d128's 192-row kernel (fp8/traits.h, measured there).
      float tile_max[2];
      bool jumps = false;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        tile_max[r] = row_tile_max(r);
        jumps |= tile_max[r] - row_max[r] > kFp8LazyMaxMarginLog2;
      }
      if (__any_sync(0xffffffffu, jumps)) {
#pragma unroll
        for (int r = 0; r < 2; ++r) reduce_row(r, tile_max[r]);
      } else {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const bool empty = row_max[r] == -INFINITY;
          correction[r] = empty ? 0.f : 1.f;
          shift[r] = (empty ? 0.f : row_max[r]) - kFp8POffsetLog2;
        }
      }
    }
  }

  // Second half: s -> 2^6 * exp2(s * coef - shift) in place.
  // kExp2FmaPeriod: which exponentials run on the FMA pipe (exp2_fma.h).
  // [kBegin, kEnd): the flat elements to do.
  template <int kExp2FmaPeriod, int kBegin, int kEnd, typename Frag>
  __device__ __forceinline__ void exponentiate(Frag& s, const float (&coef)[2][kGroups],
                                               const float (&shift)[2]) {
    static_assert(kBegin % 16 == 0 && kEnd % 16 == 0, "whole k32 steps");
#pragma unroll
    for (int i = kBegin; i < kEnd; ++i) {
      s(i) = softmax_exp2<kExp2FmaPeriod>(s(i) * coef[frag_row(i)][i / 16] - shift[frag_row(i)], i);
    }
  }

  // This thread's share of the rows' sums of 2^6 * P as quantized (TensorRowSum::hand_over);
  // finalize() and the tail split's merge add the quad's shares up.
  __device__ __forceinline__ void set_row_sums(const float (&mine)[2]) {
    row_sum[0] = mine[0];
    row_sum[1] = mine[1];
  }

  // inv_sum = v_scale / (2^6 * rowsum) (0 for a row that saw no key); LSE natural log, +inf for
  // such a row.
  __device__ __forceinline__ void finalize(float v_scale, float (&inv_sum)[2], float (&lse)[2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float sum = quad_sum(row_sum[r]);
      const bool empty = sum == 0.f || sum != sum;
      inv_sum[r] = empty ? 0.f : v_scale / sum;
      lse[r] = empty ? INFINITY
                     : (row_max[r] + __log2f(sum) - kFp8POffsetLog2) * 0.6931471805599453f;
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
// fp8/layout.h: the key permutation lives in the transposed V). tOrP: the A fragment (16 e4m3
// per k32 step, register-major), same element count as tSrS.
// [kStepBegin, kStepEnd): the k32 steps to convert.
template <int kStepBegin, int kStepEnd, class FragS, class FragP>
__device__ __forceinline__ void convert_p_fp8(FragS const& tSrS, FragP& tOrP) {
  static_assert(decltype(size(tOrP))::value == decltype(size(tSrS))::value);
  static_assert(decltype(size(tSrS))::value % 16 == 0);
  cute::Tensor p32 = cute::recast<uint32_t>(tOrP);
#pragma unroll
  for (int step = kStepBegin; step < kStepEnd; ++step) {
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
