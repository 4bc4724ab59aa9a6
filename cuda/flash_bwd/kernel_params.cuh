// The backward main kernel's parameters and the small device helpers every part of it uses:
// issuing one warpgroup GEMM, locating a dQ chunk, the deterministic-mode turn, element packing.
#pragma once
#include <cute/tensor.hpp>

#include <type_traits>

#include "flash_bwd/block_range.h"
#include "flash_bwd/sync.cuh"
#include "flash_bwd/traits.cuh"

namespace jax_fa3::flash_bwd {

template <typename Traits>
struct KernelParams {
  typename Traits::TmaQ tma_q;
  typename Traits::TmaQ tma_do;
  typename Traits::TmaKV tma_k;
  typename Traits::TmaKV tma_v;
  ShapeSDHB shape_q;   // (s_q, d, h, b)
  ShapeSDHB shape_k;   // (s_k, d, h_k, b)
  const float* lse_log2;  // (b, h, s_q_pad)
  const float* dpsum;     // (b, h, s_q_pad)
  float* dq_accum;        // (b, h, num_m_blocks) chunks of Traits::kDqChunkFloats
  int* semaphores;        // (b, h, num_m_blocks), deterministic only
  void* dk;               // (b, s_k, h_k, d)
  void* dv;
  int b, s_q, s_k, h, h_k, d, s_q_pad, num_m_blocks;
  float softmax_scale;
  float score_log2;       // multiplies S (no softcap) or tanh(...) (softcap) before exp2
  float tanh_in_scale;    // softmax_scale / softcap
  bool has_softcap;
  bool deterministic;
  BlockGeometry geom;     // whole rows; a bounded kernel narrows it to its batch row
  const int* seq_bounds;  // (b, 4) int32 per-row bounds (common/seq_bounds.h) or nullptr
};

// Issue one warpgroup GEMM (all k-blocks) and commit it as one wgmma group; the caller waits.
// An A operand in registers (RS) is fenced too: the wgmma reads it asynchronously.
template <bool kZeroInit, typename TiledMma, typename TA, typename TB, typename TC>
__device__ __forceinline__ void wg_gemm(TiledMma& mma, TA&& a, TB const& b, TC& c) {
  using namespace cute;
  // An SS operand is a tensor of smem descriptors; an RS one holds the elements themselves.
  constexpr bool kARegs = std::is_same_v<typename std::remove_reference_t<TA>::value_type, typename TiledMma::ValTypeA>;
  if constexpr (kARegs) warpgroup_fence_operand(a);
  warpgroup_fence_operand(c);
  warpgroup_arrive();
  mma.accumulate_ = kZeroInit ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
  CUTE_UNROLL
  for (int kb = 0; kb < size<2>(a); ++kb) {
    cute::gemm(mma, a(_, _, kb), b(_, _, kb), c);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  if constexpr (kARegs) warpgroup_fence_operand(a);
}

// Start of Q block m's dQ chunk (Traits::kDqChunkFloats floats) of query head qh in the workspace.
template <typename Traits>
__device__ __forceinline__ float* dq_chunk(KernelParams<Traits> const& p, int bidb, int qh, int m) {
  return p.dq_accum +
         q_block_index(bidb, p.h, qh, p.num_m_blocks, m) * int64_t(Traits::kDqChunkFloats);
}

// Deterministic mode: dQ of a Q block is added in increasing K-block order. The block's semaphore
// counts the K blocks that have added so far; returns it once it is this K block's turn.
template <typename Traits>
__device__ __forceinline__ int* wait_dq_turn(KernelParams<Traits> const& p,
                                             const BlockGeometry& geom, int bidb, int qh, int m,
                                             int n_block) {
  int* sem = p.semaphores + q_block_index(bidb, p.h, qh, p.num_m_blocks, m);
  const int target = n_block - geom.n_first(m);
  while (ld_acquire_gpu(sem) != target) {
  }
  return sem;
}

// The batch row's bounds for a mask test in a mainloop: a bounded kernel loads them where they are
// used (row_bounds_at_use: not hoisted into registers across the loop, where the d = 64 softcap
// kernel has none to spare: it spilled inside the loop); whole rows: the kernel parameters and
// the caller's whole-row diagonal `off` (s_k - s_q, computed once: recomputed here, it changed
// the schedule of the whole-row mainloops).
template <bool kBounded, typename Traits>
__device__ __forceinline__ RowBounds mask_bounds(KernelParams<Traits> const& p, int bidb, int off) {
  if constexpr (kBounded) {
    return row_bounds_at_use(p.seq_bounds, bidb, p.s_q, p.s_k);
  } else {
    return RowBounds{p.s_q, p.s_k, off};
  }
}

template <typename Element>
__device__ __forceinline__ uint32_t pack2(float x, float y) {
  const Element a(x), b(y);
  return uint32_t(a.raw()) | (uint32_t(b.raw()) << 16);
}

template <typename Element>
__device__ __forceinline__ uint32_t pack2(Element a, Element b) {
  return uint32_t(a.raw()) | (uint32_t(b.raw()) << 16);
}

}  // namespace jax_fa3::flash_bwd
