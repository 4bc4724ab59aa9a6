// The backward main kernel's parameters and the small device helpers every part of it uses:
// issuing one warpgroup GEMM, locating a dQ chunk, the deterministic-mode turn, element packing.
#pragma once
#include <cute/tensor.hpp>

#include <type_traits>

#include "flash_bwd/block_range.h"
#include "flash_bwd/sync.cuh"
#include "flash_bwd/tile_order.h"
#include "flash_bwd/traits.cuh"

namespace jax_fa3::flash_bwd {

template <typename Traits>
struct KernelParams {
  typename Traits::TmaQs tma_q;  // the Q of S^T: Q, or q8 (fp8)
  typename Traits::TmaQ tma_do;
  typename Traits::TmaKV tma_k;  // K, or K~ (fp8: the B of dQ only)
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
  BlockGeometry geom;     // whole rows (unused by the key-range kernels but for block sizes)
  // Key-range kernels (common/key_ranges.h): (b, s_pad, 2) and (b, num_granules, 4) int32.
  const int* key_ranges;
  const int* key_covers;
  int num_granules;       // s_pad / 64
  TileOrder order;        // which (K block, kv head, batch) each CTA takes (tile_order.h)
};

// The fp8 kernel's (fp8_traits.cuh) further operands. Its lse_log2 and dpsum are the caller's
// LSE' * log2(e) (2^8 r folded in) and D (- dlse), padded like the 16-bit kernel's.
template <typename Traits>
struct Fp8KernelParams : KernelParams<Traits> {
  typename Traits::TmaK8 tma_k8;
  typename Traits::TmaT8 tma_qt;   // q8^T (b, h, d, s_t)
  typename Traits::TmaT8 tma_dot;  // dO8^T
  ShapeSDHB shape_t;               // (d, s_t, h, b), s_t = s_q rounded up to 32
  const float* q_scale;   // (b, h, s_q_pad): each row's q8 scale (0 in the padding)
  const float* dk_coef;   // (b, h, s_q_pad): w of the dK operand (0 in the padding)
  const float* k_scale;   // (b, h_k, s_k): each key's k8 scale
  const float* dv_scale;  // (b, h_k): s_max / 2^8
};

template <typename Traits>
using KernelParamsOf =
    std::conditional_t<Traits::kFp8, Fp8KernelParams<Traits>, KernelParams<Traits>>;

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
template <bool kKeyRanges, typename Traits>
__device__ __forceinline__ int* wait_dq_turn(KernelParams<Traits> const& p,
                                             const BlockGeometry& geom, int bidb, int qh, int m,
                                             int n_block) {
  int* sem = p.semaphores + q_block_index(bidb, p.h, qh, p.num_m_blocks, m);
  const int n_first =
      kKeyRanges ? key_range_n_first(p.key_covers, bidb, p.num_granules, m,
                                     Traits::kBlockM / kKeyRangeGranule, Traits::kBlockN, p.s_k)
                 : geom.n_first(m);
  const int target = n_block - n_first;
  while (ld_acquire_gpu(sem) != target) {
  }
  return sem;
}

// Key ranges: the Q blocks [m_begin, m_end) that K block n_block visits (block_range.h). Every
// thread of a full warp calls it: the warp counts the granules' reaches 32 at a time.
template <typename Traits>
__device__ __forceinline__ void key_range_q_blocks(KernelParams<Traits> const& p, int bidb,
                                                   int n_block, int& m_begin, int& m_end) {
  const int n0 = n_block * Traits::kBlockN;
  const int n1 = min(n0 + Traits::kBlockN, p.s_k);  // see block_range.h
  const int2* covers = reinterpret_cast<const int2*>(p.key_covers) +
                       2 * (int64_t(bidb) * p.num_granules);  // (reach_lo, reach_hi) of each
  int below = 0, reaching = 0;
  for (int g = threadIdx.x % 32; g < p.num_granules; g += 32) {
    const int2 reach = __ldg(covers + 2 * g);
    below += clamp_key(reach.y, p.s_k) <= n0;
    reaching += clamp_key(reach.x, p.s_k) < n1;
  }
  below = __reduce_add_sync(0xffffffffu, below);
  reaching = __reduce_add_sync(0xffffffffu, reaching);
  key_range_m_range(below, reaching, Traits::kBlockM / kKeyRangeGranule, p.num_m_blocks, m_begin,
                    m_end);
}

// Key ranges: the keys that every row of Q block m sees, for the per-piece mask test.
template <typename Traits>
__device__ __forceinline__ TileKeys q_block_keys(KernelParams<Traits> const& p, int bidb, int m) {
  constexpr int kGranules = Traits::kBlockM / kKeyRangeGranule;
  return tile_keys(p.key_covers, bidb, p.num_granules, m * kGranules, kGranules, p.s_k);
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
