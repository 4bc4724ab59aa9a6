// Online softmax on the wgmma accumulator of S, entirely in registers.
//
// Fragment layout: common/accumulator_fragment.cuh (a thread owns two rows of S; the four lanes
// of a quad share a row). The same flat order is the wgmma A-operand register order for 16-bit
// types (k16 chunk = two 8-column chunks), which is why P can be handed to the PV GEMM without
// any shuffle.
#pragma once
#include "common/cute_config.h"
#include <climits>
#include <cmath>
#include <cute/tensor.hpp>

#include "common/accumulator_fragment.cuh"
#include "common/key_ranges.h"
#include "flash_fwd/exp2_fma.h"

namespace jax_fa3::fwd {

using jax_fa3::FragCoord;
using jax_fa3::frag_col;
using jax_fa3::frag_row;
using jax_fa3::quad_max;
using jax_fa3::quad_sum;

template <typename Frag>
__device__ __forceinline__ void apply_softcap(Frag& s, float pre, float cap) {
#pragma unroll
  for (int i = 0; i < cute::size(s); ++i) s(i) = cap * tanhf(s(i) * pre);
}

// Sets invisible scores to -inf. row_g/col_g: global row of v1 = 0 and column of idx 0.
// Each row sees one column interval [lo, hi); it is computed once per row, relative to col_g, so
// that every element costs two compares against compile-time column offsets (frag_col) and a
// select, and only four integers stay live across the loop.
template <typename Frag>
__device__ __forceinline__ void apply_mask(Frag& s, int row_g, int col_g, int s_k, int off, int left,
                                           int right) {
  int lo[2], hi[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row_g + 8 * r;
    hi[r] = s_k - col_g;
    if (right >= 0) hi[r] = min(hi[r], row + off + right + 1 - col_g);
    lo[r] = left >= 0 ? row + off - left - col_g : INT_MIN;
  }
#pragma unroll
  for (int i = 0; i < cute::size(s); ++i) {
    const int r = frag_row(i);
    const int col = frag_col(i);
    if (col >= hi[r] || col < lo[r]) s(i) = -INFINITY;
  }
}

// Sets scores outside each row's key range (common/key_ranges.h) to -inf; col_g: the column of
// idx 0. The same two compares per element as apply_mask.
template <typename Frag>
__device__ __forceinline__ void apply_key_ranges(Frag& s, const KeyRange (&keys)[2], int col_g) {
  const int lo[2] = {keys[0].lo - col_g, keys[1].lo - col_g};
  const int hi[2] = {keys[0].hi - col_g, keys[1].hi - col_g};
#pragma unroll
  for (int i = 0; i < cute::size(s); ++i) {
    const int r = frag_row(i);
    const int col = frag_col(i);
    if (col >= hi[r] || col < lo[r]) s(i) = -INFINITY;
  }
}

// The running max and sum of one thread's two rows, and the update that folds a block of scores
// into them. Scaling (a policy) says how a score turns into an exp2 argument:
//   p = exp2(s * coef(row, element) - shift(row)),  shift = max in log2 units - kOffsetLog2,
// how a block's row max is gathered, whether the max moves on every increase or only past a
// margin (lazy), and whether the row sums are accumulated here (16-bit) or elsewhere (fp8: on
// the tensor cores, fp8/row_sum.h, handed over with set_row_sums()). Policies: RowScaling below,
// KeyGroupScaling (fp8/softmax.h).
template <class Scaling>
struct OnlineSoftmax {
  using Coef = typename Scaling::Coef;
  // Running max (Scaling::max_log2 turns it into log2 units), quad-uniform, and this thread's
  // partial sum of the rows' P (the quad sum happens once, in finalize()).
  float row_max[2];
  float row_sum[2];

  __device__ __forceinline__ void reset() {
    row_max[0] = row_max[1] = -INFINITY;
    row_sum[0] = row_sum[1] = 0.f;
  }

  // One update in two halves, so that callers can interleave the exponentials with other work
  // (consumer.h). update_max: the new row maxima, in `correction` the factor by which O (and the
  // old sum) must be multiplied, exp2(old max - new max) in log2 units, and the exp2 shift.
  template <typename Frag>
  __device__ __forceinline__ void update_max(Frag const& s, const Coef& coef,
                                             float (&correction)[2], float (&shift)[2]) {
    const auto block_max = Scaling::block_max(s, row_max);
    if constexpr (!Scaling::kReduceMaxOnJump) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        reduce_row(r, Scaling::row_tile_max(block_max, coef, row_max[r], r), coef, correction,
                   shift);
      }
    } else {
      // A quad's row max exceeds the margin only if one of its threads' does: when no thread of
      // the warp jumps, every row keeps its max and the correction is exactly 1 (0 for a row that
      // has seen only -inf, whose row sum is 0 already), as reduce_row would find, without its
      // quad shuffles and two exp2.
      static_assert(Scaling::kLazyMax, "only a lazy max can skip the reduction");
      float tile_max[2];
      bool jumps = false;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        tile_max[r] = Scaling::row_tile_max(block_max, coef, row_max[r], r);
        jumps |= tile_max[r] - row_max[r] > Scaling::kMaxMarginLog2;
      }
      if (__any_sync(0xffffffffu, jumps)) {
#pragma unroll
        for (int r = 0; r < 2; ++r) reduce_row(r, tile_max[r], coef, correction, shift);
      } else {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const bool empty = row_max[r] == -INFINITY;
          correction[r] = empty ? 0.f : 1.f;
          shift[r] = less_offset(empty ? 0.f : Scaling::max_log2(row_max[r], coef));
        }
      }
    }
  }

  // exponentiate: the flat elements [kBegin, kEnd) of s turn into unnormalized probabilities
  // p = exp2(s * coef - shift) in place (summed into the rows if Scaling::kSumsRows).
  // kExp2FmaPeriod: exp2_fma.h.
  template <int kExp2FmaPeriod, int kBegin, int kEnd, typename Frag>
  __device__ __forceinline__ void exponentiate(Frag& s, const Coef& coef,
                                               const float (&shift)[2]) {
    static_assert(kBegin % Scaling::kRangeAlign == 0 && kEnd % Scaling::kRangeAlign == 0,
                  "exponentiate whole coefficient groups");
#pragma unroll
    for (int i = kBegin; i < kEnd; ++i) {
      const float p = softmax_exp2<kExp2FmaPeriod>(
          s(i) * Scaling::exp2_coef(coef, frag_row(i), i) - shift[frag_row(i)], i);
      s(i) = p;
      if constexpr (Scaling::kSumsRows) row_sum[frag_row(i)] += p;
    }
  }

  // This thread's share of the rows' sums, computed elsewhere (fp8: TensorRowSum::hand_over).
  __device__ __forceinline__ void set_row_sums(const float (&mine)[2]) {
    row_sum[0] = mine[0];
    row_sum[1] = mine[1];
  }

  // Completes the row sums across the quad; gives O's factor Scaling::normalizer(o_scale, sum)
  // (0 for a row that saw no key) and the natural-log LSE of the probabilities (+inf for such a
  // row, FlashAttention's convention). scale_log2: softmax_scale * log2 e, for Scaling::max_log2.
  __device__ __forceinline__ void finalize(float scale_log2, float o_scale, float (&inv_sum)[2],
                                           float (&lse)[2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float sum = quad_sum(row_sum[r]);
      const bool empty = sum == 0.f || sum != sum;
      inv_sum[r] = empty ? 0.f : Scaling::normalizer(o_scale, sum);
      lse[r] = empty ? INFINITY
                     : less_offset(Scaling::max_log2(row_max[r], scale_log2) + __log2f(sum)) *
                           0.6931471805599453f;
    }
  }

 private:
  // x - Scaling::kOffsetLog2, stated so that a zero offset costs no instruction.
  __device__ __forceinline__ static float less_offset(float x) {
    if constexpr (Scaling::kOffsetLog2 == 0.f) {
      return x;
    } else {
      return x - Scaling::kOffsetLog2;
    }
  }

  // The quad's row max (kept, if the max is lazy, unless it exceeds the running max by more than
  // the margin), the correction and the exp2 shift of row r.
  __device__ __forceinline__ void reduce_row(int r, float tile_max, const Coef& coef,
                                             float (&correction)[2], float (&shift)[2]) {
    float new_max = quad_max(tile_max);
    if constexpr (Scaling::kLazyMax) {
      // -inf - -inf is NaN: a row that has seen only -inf keeps -inf.
      if (!(new_max - row_max[r] > Scaling::kMaxMarginLog2)) new_max = row_max[r];
    }
    // A row that has seen only -inf so far keeps a finite base so that exp2 gives 0, not NaN.
    const float base = new_max == -INFINITY ? 0.f : Scaling::max_log2(new_max, coef);
    // old max -inf -> exp2(-inf) = 0: nothing accumulated yet, the factor is irrelevant.
    correction[r] = exp2f(Scaling::max_log2(row_max[r], coef) - base);
    row_max[r] = new_max;
    shift[r] = less_offset(base);
    if constexpr (Scaling::kSumsRows) row_sum[r] *= correction[r];
  }
};

// 16-bit scores: one coefficient for every score (softmax_scale * log2 e), so the running max is
// kept on the raw scores and scaled where it is used; it moves on every increase (eager), P is not
// shifted, and the row sums are accumulated by exponentiate().
struct RowScaling {
  using Coef = float;
  static constexpr float kOffsetLog2 = 0.f;
  static constexpr bool kLazyMax = false;
  static constexpr float kMaxMarginLog2 = 0.f;
  static constexpr bool kReduceMaxOnJump = false;
  static constexpr bool kSumsRows = true;
  static constexpr int kRangeAlign = 1;

  // The rows' maxima over the block's raw scores and the running max (both rows at once: one
  // FMNMX chain per row).
  struct BlockMax {
    float row[2];
  };
  template <typename Frag>
  __device__ __forceinline__ static BlockMax block_max(Frag const& s, const float (&row_max)[2]) {
    BlockMax m{{row_max[0], row_max[1]}};
#pragma unroll
    for (int i = 0; i < cute::size(s); ++i) m.row[frag_row(i)] = fmaxf(m.row[frag_row(i)], s(i));
    return m;
  }
  __device__ __forceinline__ static float row_tile_max(const BlockMax& m, float, float, int r) {
    return m.row[r];
  }
  __device__ __forceinline__ static float max_log2(float max, float scale_log2) {
    return max * scale_log2;
  }
  __device__ __forceinline__ static float exp2_coef(float scale_log2, int, int) {
    return scale_log2;
  }
  // 1 / sum: 16-bit O carries no scale (o_scale is 1). Written as a literal reciprocal, which
  // compiles to one MUFU.RCP; a division by a variable that is 1 costs an FADD more.
  __device__ __forceinline__ static float normalizer(float, float sum) { return 1.f / sum; }
};
using RowOnlineSoftmax = OnlineSoftmax<RowScaling>;

// O *= correction, row by row (same fragment layout as S, with d/8 chunks).
template <typename Frag>
__device__ __forceinline__ void rescale_rows(Frag& o, const float (&factor)[2]) {
#pragma unroll
  for (int i = 0; i < cute::size(o); ++i) o(i) *= factor[frag_row(i)];
}

// Rows whose key range is empty (common/key_ranges.h) -> out 0, lse +inf. A select rather than a
// zero factor, so that inf or NaN in masked keys or values never leaks into O.
template <typename Frag>
__device__ __forceinline__ void clear_rows_without_keys(Frag& o, float (&lse)[2],
                                                        const KeyRange (&keys)[2]) {
  const bool empty[2] = {keys[0].lo >= keys[0].hi, keys[1].lo >= keys[1].hi};
  if (!(empty[0] | empty[1])) return;  // the common case
#pragma unroll
  for (int i = 0; i < cute::size(o); ++i) {
    if (empty[frag_row(i)]) o(i) = 0.f;
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (empty[r]) lse[r] = INFINITY;
  }
}

// O *= correction, skipped when no row of this warp changed its max (every factor is then exactly
// exp2(0) = 1, so skipping is the identity): a warp-uniform branch that saves d/2 FMULs per
// thread on most blocks of a long row, whose max settles after the first few blocks.
template <typename Frag>
__device__ __forceinline__ void rescale_rows_if_changed(Frag& o, const float (&factor)[2]) {
  if (__any_sync(0xffffffffu, (factor[0] != 1.f) | (factor[1] != 1.f))) rescale_rows(o, factor);
}

}  // namespace jax_fa3::fwd
