// fp8-only pieces of the consumer: score descaling, the online softmax with per-row scales and
// the 2^6 shift of P, and P -> packed e4m3 A-operand registers (layout: fp8/layout.h).
#pragma once
#include "common/cute_config.h"
#include <cmath>
#include <cstdint>
#include <cute/tensor.hpp>

#include "common/fp8_a_operand.cuh"
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
// alone (H200, 2026-12-02, benchmarks/RESULTS.md), margin 2.8 / shift 6 against 0.8 /
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

// The fp8 scaling policy of OnlineSoftmax (softmax.h). kGroups k-scale groups of 32 keys per
// tile (flat S indices 16g..16g+15 are group g: 8-column chunks 4g..4g+3); the coefficient of an
// element is coef[r][g] = row scale of row r * k scale of group g (> 0, so maxima commute with it):
// the max is taken per (row, group) on the raw scores, then scaled, 2 * kGroups FMULs per tile
// instead of one per element and kGroups independent FMNMX chains per row. The running max is
// kept in log2 units (score * softmax_scale * log2 e * q_scale * k_scale) and is lazy (margin
// above); P is shifted by 2^6. The row sums are not taken here but on the tensor cores
// (TensorRowSum, fp8/row_sum.h), which hands them over with set_row_sums() before finalize() or
// the tail split reads them. kReduceMaxOnJump: the row max's quad reduction and O correction
// only when some row of the warp jumps past the margin (OnlineSoftmax::update_max).
template <int kGroups, bool kReduceMaxOnJump_ = false>
struct KeyGroupScaling {
  using Coef = float[2][kGroups];
  static constexpr float kOffsetLog2 = kFp8POffsetLog2;
  static constexpr bool kLazyMax = true;
  static constexpr float kMaxMarginLog2 = kFp8LazyMaxMarginLog2;
  static constexpr bool kReduceMaxOnJump = kReduceMaxOnJump_;
  static constexpr bool kSumsRows = false;
  static constexpr int kRangeAlign = 16;  // whole k32 steps

  // The maxima per (row, group) of the block's raw scores; row_tile_max scales them and folds in
  // the running max.
  struct BlockMax {
    float group[2][kGroups];
  };
  template <typename Frag>
  __device__ __forceinline__ static BlockMax block_max(Frag const& s, const float (&)[2]) {
    static_assert(decltype(cute::size(s))::value == 16 * kGroups);
    BlockMax m;
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
      // Each row's chain starts at its first element (16 g + 2 r), not at -inf: one FMNMX less
      // per chain. fmaxf drops a NaN either way, so an all-NaN group gives NaN, which the
      // fmaxf of row_tile_max drops as it dropped -inf.
      m.group[0][g] = s(16 * g);
      m.group[1][g] = s(16 * g + 2);
#pragma unroll
      for (int i = 16 * g; i < 16 * g + 16; ++i) {
        if (i == 16 * g || i == 16 * g + 2) continue;
        m.group[frag_row(i)][g] = fmaxf(m.group[frag_row(i)][g], s(i));
      }
    }
    return m;
  }
  __device__ __forceinline__ static float row_tile_max(const BlockMax& m, const Coef& coef,
                                                       float row_max, int r) {
    float tile_max = row_max;
#pragma unroll
    for (int g = 0; g < kGroups; ++g) tile_max = fmaxf(tile_max, m.group[r][g] * coef[r][g]);
    return tile_max;
  }
  // The running max is in log2 units already.
  template <typename Scale>
  __device__ __forceinline__ static float max_log2(float max, const Scale&) {
    return max;
  }
  __device__ __forceinline__ static float exp2_coef(const Coef& coef, int r, int i) {
    return coef[r][i / 16];
  }
  // O's factor v_scale / (2^6 * row sum): the row sum is that of 2^6 * P.
  __device__ __forceinline__ static float normalizer(float v_scale, float sum) {
    return v_scale / sum;
  }
};
template <int kGroups, bool kReduceMaxOnJump = false>
using Fp8OnlineSoftmax = OnlineSoftmax<KeyGroupScaling<kGroups, kReduceMaxOnJump>>;

// P (fp32 in the S accumulator) -> e4m3 A-operand registers of the PV wgmma, in place order (see
// common/fp8_a_operand.cuh: the key permutation lives in the transposed V). tOrP: the A fragment
// (16 e4m3 per k32 step, register-major), same element count as tSrS.
// [kStepBegin, kStepEnd): the k32 steps to convert.
template <int kStepBegin, int kStepEnd, class FragS, class FragP>
__device__ __forceinline__ void convert_p_fp8(FragS const& tSrS, FragP& tOrP) {
  static_assert(decltype(size(tOrP))::value == decltype(size(tSrS))::value);
  static_assert(decltype(size(tSrS))::value % 16 == 0);
  fp8::pack_e4m3_a_operand<kStepBegin, kStepEnd>([&](int i) { return tSrS(i); }, tOrP);
}

}  // namespace jax_fa3::fwd
