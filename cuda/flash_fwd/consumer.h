// The consumer warpgroups: S = QK^T (wgmma SS), online softmax in registers, O += PV (wgmma RS),
// then the epilogue. Both warpgroups work on the same 128-row tile, 64 rows each, and walk the
// same K/V blocks (n_max - 1 down to n_min), so every barrier count below is per tile.
#pragma once
#include "flash_fwd/cute_config.h"
#include <cute/tensor.hpp>

#include "flash_fwd/barriers.h"
#include "flash_fwd/block_info.h"
#include "flash_fwd/epilogue.h"
#include "flash_fwd/kernel_params.h"
#include "flash_fwd/softmax.h"
#include "flash_fwd/wgmma.h"

namespace jax_fa3::fwd {

using namespace cute;

// One arrive per consumer warp releases a K or V stage (the empty barriers count 8): each warp
// arrives after its own wgmma.wait, so the stage is free only when all warps are done with it.
__device__ __forceinline__ void release_stage(uint64_t* empty_bar) {
  if (threadIdx.x % 32 == 0) mbar_arrive(empty_bar);
}

// P (fp32 probabilities in the S accumulator) -> Element A-operand registers of the PV wgmma.
// For 16-bit types the accumulator order is the A-fragment order (see softmax.h), so this is an
// element-wise conversion into a tensor with the A-fragment shape.
template <class Traits, class FragS>
__device__ __forceinline__ auto make_p_operand(FragS const& tSrS) {
  using Element = typename Traits::Element;
  Tensor tOrP = make_tensor<Element>(partition_shape_A(
      typename Traits::TiledMmaPV{}, Shape<Int<Traits::kBlockM>, Int<Traits::kBlockN>>{}));
  static_assert(decltype(size(tOrP))::value == decltype(size(tSrS))::value);
#pragma unroll
  for (int i = 0; i < size(tSrS); ++i) tOrP(i) = static_cast<Element>(tSrS(i));
  return tOrP;
}

template <class Traits>
__device__ __forceinline__ void run_consumer(KernelParams<Traits> const& p,
                                             typename Traits::SharedStorage& ss, int thread_idx) {
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  const FlashFwdScalars& sc = p.s;

  typename Traits::TiledMmaQK mma_qk;
  typename Traits::TiledMmaPV mma_pv;
  auto thr_qk = mma_qk.get_thread_slice(thread_idx);
  auto thr_pv = mma_pv.get_thread_slice(thread_idx);

  Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename Traits::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename Traits::SmemLayoutK{});
  Tensor sVt = make_tensor(make_smem_ptr(ss.v.data()), typename Traits::SmemLayoutVt{});
  Tensor tSrQ = thr_qk.partition_fragment_A(sQ);   // smem descriptors (MMA, 1, K)
  Tensor tSrK = thr_qk.partition_fragment_B(sK);   // (MMA, 1, K, stage)
  Tensor tOrV = thr_pv.partition_fragment_B(sVt);  // (MMA, 1, K, stage)

  const int thread_in_wg = thread_idx % 128;
  const FragCoord fc = FragCoord::of_thread(thread_in_wg);
  const int off = sc.s_k - sc.s_q;
  const bool use_softcap = sc.softcap > 0.f;

  PipelineState<Traits::kStages> kv;
  uint32_t q_phase = 0;
  for (int tile = blockIdx.x; tile < p.scheduler.num_tiles; tile += gridDim.x) {
    const TileCoord c = p.scheduler.coord(tile);
    const BlockRange range = block_range(c.m_block, kBlockM, kBlockN, sc.s_q, sc.s_k,
                                         sc.window_left, sc.window_right);
    const int row_g = c.m_block * kBlockM + 64 * (thread_idx / 128) + fc.row0;

    Tensor tOrO = partition_fragment_C(mma_pv, Shape<Int<kBlockM>, Int<kHeadDim>>{});
    clear(tOrO);
    OnlineSoftmax softmax;
    softmax.reset();

    mbar_wait(&ss.q_full, q_phase);
    q_phase ^= 1;
    for (int n_block = range.n_max - 1; n_block >= range.n_min; --n_block) {
      Tensor tSrS = partition_fragment_C(mma_qk, Shape<Int<kBlockM>, Int<kBlockN>>{});
      mbar_wait(&ss.k_full[kv.stage], kv.phase);
      warpgroup_gemm</*zero_init=*/true, /*wait=*/0>(mma_qk, tSrQ, tSrK(_, _, _, kv.stage), tSrS);
      release_stage(&ss.k_empty[kv.stage]);

      if (use_softcap) apply_softcap(tSrS, sc.softcap_pre, sc.softcap);
      if (block_needs_mask(c.m_block, n_block, kBlockM, kBlockN, sc.s_q, sc.s_k, sc.window_left,
                           sc.window_right)) {
        apply_mask(tSrS, row_g, n_block * kBlockN + fc.col0, sc.s_k, off, sc.window_left,
                   sc.window_right);
      }
      float correction[2];
      softmax.update(tSrS, sc.scale_log2, correction);
      rescale_rows(tOrO, correction);
      Tensor tOrP = make_p_operand<Traits>(tSrS);

      mbar_wait(&ss.v_full[kv.stage], kv.phase);
      warpgroup_gemm</*zero_init=*/false, /*wait=*/0, /*a_regs=*/true>(mma_pv, tOrP, tOrV(_, _, _, kv.stage), tOrO);
      release_stage(&ss.v_empty[kv.stage]);
      kv.advance();
    }

    float inv_sum[2], lse[2];
    softmax.finalize(sc.scale_log2, inv_sum, lse);
    rescale_rows(tOrO, inv_sum);
    store_tile<Traits>(p, ss, tOrO, lse, c, thread_idx);
  }
}

}  // namespace jax_fa3::fwd
