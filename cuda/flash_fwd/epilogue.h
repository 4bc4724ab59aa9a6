// Epilogue of one tile: O (already normalized, fp32 in the PV accumulator) -> Element -> shared
// memory (Traits::o_smem: O's own buffer, or Q's) with stmatrix -> one TMA store that clips
// rows >= s_q and columns >= d; LSE straight from registers.
#pragma once
#include "common/cute_config.h"
#include <cute/tensor.hpp>
#include <cute/atom/copy_traits_sm90.hpp>
#include <cute/arch/copy_sm90_tma.hpp>

#include "flash_fwd/barriers.h"
#include "flash_fwd/kernel_params.h"
#include "flash_fwd/softmax.h"

namespace jax_fa3::fwd {

using namespace cute;

// thread_idx: 0..255 over the consumer warpgroups. lse: this thread's two rows. write_out false:
// the barriers and the release of Q's buffer only, no global writes (a tail-split piece, whose
// partial is merged after the persistent loop: fp8/tail_split.h).
template <class Traits, class FragO>
__device__ __forceinline__ void store_tile(KernelParams<Traits> const& p,
                                           typename Traits::SharedStorage& ss, FragO const& tOrO,
                                           const float (&lse)[2], const TileCoord& c,
                                           int thread_idx, bool write_out = true) {
  using Element = typename Traits::ElementOut;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kHeadDim = Traits::kHeadDim;
  const FlashFwdScalars& sc = p.s;

  // fp32 -> Element in the accumulator's register order.
  Tensor tOrO_out = make_tensor_like<Element>(tOrO);
#pragma unroll
  for (int i = 0; i < size(tOrO); ++i) tOrO_out(i) = static_cast<Element>(tOrO(i));

  // p.early_q_release(): O's own buffer may still be read by the previous tile's TMA store,
  // which thread 0 issued without waiting: it waits now (long done after a whole tile), and the
  // barrier holds every consumer thread until then.
  // Else the O buffer (Q's for bf16/fp16, its own for fp8) is free for this warpgroup's rows: its
  // last S = QK^T wgmma has completed, and the other warpgroup only reads (and writes) its own 64
  // rows; the buffer is released to the producer (q_empty) only after thread 0's tma_store_wait
  // below.
  const bool early_q_release = p.early_q_release();
  if (early_q_release) {
    if (thread_idx == 0) tma_store_wait<0>();
    named_barrier_sync(kBarrierConsumers, Traits::kNumConsumerThreads);
  }
  Tensor sO = make_tensor(make_smem_ptr(Traits::o_smem(ss)), typename Traits::SmemLayoutO{});
  auto smem_copy = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{},
                                     typename Traits::TiledMmaPV{});
  auto thr_copy = smem_copy.get_thread_slice(thread_idx);
  copy(smem_copy, thr_copy.retile_S(tOrO_out), thr_copy.partition_D(sO));

  // stmatrix writes are generic-proxy; the TMA store reads through the async proxy.
  cutlass::arch::fence_view_async_shared();
  named_barrier_sync(kBarrierConsumers, Traits::kNumConsumerThreads);
  // Split-KV (params.h): piece p of batch row r is output row r * num_splits + p.
  const int out_batch = Traits::kKeyRanges ? c.batch * sc.num_splits + c.split : c.batch;
  if (thread_idx == 0) {
    Tensor mO = p.tma_o.get_tma_tensor(
        GmemShape(sc.s_q, sc.d, sc.h, Traits::kKeyRanges ? sc.b * sc.num_splits : sc.b));
    Tensor gO = local_tile(mO(_, _, c.head, out_batch), Shape<Int<kBlockM>, Int<kHeadDim>>{},
                           make_coord(c.m_block, _0{}));
    auto [tOgO, tOsO] = tma_partition(p.tma_o, _0{}, Layout<_1>{}, group_modes<0, 2>(sO),
                                      group_modes<0, 2>(gO));
    if (write_out) copy(p.tma_o, tOsO, tOgO);
    tma_store_arrive();
    if (!early_q_release) {
      // Only the shared-memory reads must be done before Q's buffer is refilled; the global
      // writes complete on their own before the kernel does.
      tma_store_wait<0>();
      mbar_arrive(&ss.q_empty);
    }
  }

  // LSE (b, h, s_q): the quad's lane 0 writes its two rows.
  const int thread_in_wg = thread_idx % 128;
  if (write_out && thread_in_wg % 4 == 0) {
    const FragCoord fc = FragCoord::of_thread(thread_in_wg);
    const int row = c.m_block * kBlockM + 64 * (thread_idx / 128) + fc.row0;
    float* lse_row = sc.lse + (int64_t(out_batch) * sc.h + c.head) * sc.s_q;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      if (row + 8 * r < sc.s_q) lse_row[row + 8 * r] = lse[r];
    }
  }
}

}  // namespace jax_fa3::fwd
