// The dK operand of the fp8 backward (jax_fa3/_fp8_backward_emulation.py): y_ji = dS'_ij * w_i
// is quantized to e4m3 per key row j against a lazy running maximum M_j of |y_ji| over the Q
// blocks the CTA visits (in its order: query heads, then Q blocks), as e4m3(y_ji * 2^6 / M_j).
// M_j moves to a block's maximum only when that exceeds M_j * 2^2.8, and the dK accumulator's row
// j is then multiplied by M_old / M_new; at the end dK_j = acc_j * M_j / 2^6 * softmax_scale.
// So |2^6 y / M| <= 2^(6 + 2.8) = 445.7 < 448 (e4m3's largest) without a per-block rescale.
//
// Key-major: a thread's S^T accumulator holds two key rows (frag_row 0, 1) and the same two rows
// of the dK accumulator; each key row's kBlockM columns are spread over the four lanes of a quad.
#pragma once
#include <cute/tensor.hpp>

#include "common/accumulator_fragment.cuh"

namespace jax_fa3::flash_bwd {

// 2^Y_PRESCALE_LOG2 of the emulation.
constexpr float kFp8DkPrescale = 64.f;
// float32(2^LAZY_MAX_MARGIN_LOG2) = float32(2^2.8), the emulation's margin (checked against it by
// tests/test_cuda_layouts.py).
constexpr float kFp8DkLazyMargin = 6.96440450636899f;
// MIN_RUNNING_MAX of the emulation: M only moves above it, so 2^6 / M stays finite (2^106 at most)
// and no 0 * inf reaches the operand where dS' or w is 0.
constexpr float kFp8DkMinRunningMax = 0x1p-100f;

struct Fp8DkOperandScale {
  float running[2] = {0.f, 0.f};                        // M of the thread's two key rows
  float inv[2] = {kFp8DkPrescale, kFp8DkPrescale};      // 2^6 / M (2^6 while M = 0)

  // Folds one Q block into the running maxima: y = the block's y^T = dS'^T * w, per accumulator
  // element (replaced in place by the caller: dS' itself has gone to the dS tile already, so it
  // is multiplied by w once, for the maxima and the operand both); where a maximum moves, that
  // key row of dk (no wgmma in flight on it) is multiplied by M_old / M_new (0 when M_old = 0: the
  // row is still zero). The divisions are __fdividef (MUFU.RCP and a product, within 2 ulp of
  // the emulation's rounded quotients; 0 for a maximum above 2^126): the IEEE division's slow
  // path is a called subroutine, with a stack frame in the kernel.
  template <class FragY, class FragDK>
  __device__ __forceinline__ void update(FragY const& y, FragDK& dk) {
    float block_max[2] = {0.f, 0.f};
#pragma unroll
    for (int i = 0; i < cute::size(y); ++i) {
      block_max[frag_row(i)] = fmaxf(block_max[frag_row(i)], fabsf(y(i)));
    }
    float rescale[2];
    bool moved_any = false;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float m = quad_max(block_max[r]);
      const bool moved = m > fmaxf(running[r] * kFp8DkLazyMargin, kFp8DkMinRunningMax);
      rescale[r] = !moved ? 1.f : running[r] > 0.f ? __fdividef(running[r], m) : 0.f;
      if (moved) {
        running[r] = m;
        inv[r] = __fdividef(kFp8DkPrescale, m);
      }
      moved_any |= moved;
    }
    // Moves are rare after the first blocks: the accumulator is left alone otherwise.
    if (moved_any) {
#pragma unroll
      for (int i = 0; i < cute::size(dk); ++i) dk(i) *= rescale[frag_row(i)];
    }
  }

  // The value quantized for accumulator index i: y_ji * 2^6 / M_j with y = dS' * w (the
  // emulation's order). |y| <= margin * M, so the product is at most 445.7 and always finite;
  // w * 2^6 / M first could overflow where w is large (rows of tiny dO) and give 0 * inf = NaN.
  __device__ __forceinline__ float operand(float y, int i) const { return y * inv[frag_row(i)]; }

  // dK's factor of key row r at the end.
  __device__ __forceinline__ float dk_scale(int r, float softmax_scale) const {
    return running[r] / kFp8DkPrescale * softmax_scale;
  }
};

}  // namespace jax_fa3::flash_bwd
