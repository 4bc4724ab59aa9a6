// Online softmax on the wgmma accumulator of S, entirely in registers.
//
// Fragment layout (m64nNk16 fp32 accumulator, CuTe's CLayout_64xN): thread t of a warpgroup,
// lane = t % 32, warp = t / 32, holds for every 8-column chunk j of the N columns four values
//   idx = v0 + 2*v1 + 4*j  ->  row 16*warp + lane/4 + 8*v1,  column 8*j + 2*(lane%4) + v0.
// So a thread owns two rows (v1 = 0, 1) and the four lanes of a quad (same lane/4) share a row:
// row reductions are a thread-local loop plus two xor-shuffles (1, 2) across the quad.
// The same flat order is the wgmma A-operand register order for 16-bit types (k16 chunk =
// two 8-column chunks), which is why P can be handed to the PV GEMM without any shuffle.
#pragma once
#include "flash_fwd/cute_config.h"
#include <climits>
#include <cmath>
#include <cute/tensor.hpp>

#include "flash_fwd/exp2_fma.h"

namespace jax_fa3::fwd {

struct FragCoord {
  // Row (0..63 inside the warpgroup's 64 rows) of v1 = 0, and this thread's first column.
  int row0, col0;
  __host__ __device__ __forceinline__ static FragCoord of_thread(int thread_in_wg) {
    const int lane = thread_in_wg % 32;
    return {16 * (thread_in_wg / 32) + lane / 4, 2 * (lane % 4)};
  }
};

__host__ __device__ __forceinline__ int frag_row(int idx) { return (idx >> 1) & 1; }
__host__ __device__ __forceinline__ int frag_col(int idx) { return 8 * (idx >> 2) + (idx & 1); }

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

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffff, x, 1);
  return x + __shfl_xor_sync(0xffffffff, x, 2);
}

struct OnlineSoftmax {
  // Running max of the raw (un-scaled) scores of this thread's two rows, quad-uniform, and this
  // thread's partial sum of exponentials (the quad sum happens once, in finalize()).
  float row_max[2];
  float row_sum[2];

  __device__ __forceinline__ void reset() {
    row_max[0] = row_max[1] = -INFINITY;
    row_sum[0] = row_sum[1] = 0.f;
  }

  // One update in two halves, so that callers can interleave the exponentials with other work
  // (consumer.h). update_max: the new row maxima, the exp2 shift max_scaled = max * scale_log2,
  // and in `correction` the factor by which O (and the old sum) must be multiplied:
  // exp2((old_max - new_max) * scale_log2).
  template <typename Frag>
  __device__ __forceinline__ void update_max(Frag const& s, float scale_log2,
                                             float (&correction)[2], float (&max_scaled)[2]) {
    float new_max[2] = {row_max[0], row_max[1]};
#pragma unroll
    for (int i = 0; i < cute::size(s); ++i) {
      new_max[frag_row(i)] = fmaxf(new_max[frag_row(i)], s(i));
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      new_max[r] = quad_max(new_max[r]);
      // A row that has seen only -inf so far keeps a finite base so that exp2 gives 0, not NaN.
      max_scaled[r] = new_max[r] == -INFINITY ? 0.f : new_max[r] * scale_log2;
      // old max -inf -> exp2(-inf) = 0: nothing accumulated yet, the factor is irrelevant.
      correction[r] = exp2f(row_max[r] * scale_log2 - max_scaled[r]);
      row_max[r] = new_max[r];
      row_sum[r] *= correction[r];
    }
  }

  // exponentiate: the flat elements [kBegin, kEnd) of s turn into unnormalized probabilities
  // p = exp2(s * scale_log2 - max_scaled) in place, summed into the rows. kExp2FmaPeriod:
  // exp2_fma.h.
  template <int kExp2FmaPeriod, int kBegin, int kEnd, typename Frag>
  __device__ __forceinline__ void exponentiate(Frag& s, float scale_log2,
                                               const float (&max_scaled)[2]) {
#pragma unroll
    for (int i = kBegin; i < kEnd; ++i) {
      const float p = softmax_exp2<kExp2FmaPeriod>(s(i) * scale_log2 - max_scaled[frag_row(i)], i);
      s(i) = p;
      row_sum[frag_row(i)] += p;
    }
  }

  // Completes the row sums across the quad; gives 1/sum for O (0 for a row that saw no key) and
  // the natural-log LSE (+inf for such a row, FlashAttention's convention).
  __device__ __forceinline__ void finalize(float scale_log2, float (&inv_sum)[2], float (&lse)[2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float sum = quad_sum(row_sum[r]);
      const bool empty = sum == 0.f || sum != sum;
      inv_sum[r] = empty ? 0.f : 1.f / sum;
      lse[r] = empty ? INFINITY
                     : (row_max[r] * scale_log2 + __log2f(sum)) * 0.6931471805599453f;
    }
  }
};

// O *= correction, row by row (same fragment layout as S, with d/8 chunks).
template <typename Frag>
__device__ __forceinline__ void rescale_rows(Frag& o, const float (&factor)[2]) {
#pragma unroll
  for (int i = 0; i < cute::size(o); ++i) o(i) *= factor[frag_row(i)];
}

// O *= correction, skipped when no row of this warp changed its max (every factor is then exactly
// exp2(0) = 1, so skipping is the identity): a warp-uniform branch that saves d/2 FMULs per
// thread on most blocks of a long row, whose max settles after the first few blocks.
template <typename Frag>
__device__ __forceinline__ void rescale_rows_if_changed(Frag& o, const float (&factor)[2]) {
  if (__any_sync(0xffffffffu, (factor[0] != 1.f) | (factor[1] != 1.f))) rescale_rows(o, factor);
}

}  // namespace jax_fa3::fwd
