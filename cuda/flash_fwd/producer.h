// The producer warpgroup: one thread issues every TMA load of the CTA.
//
// Barrier protocol (all mbarriers in SharedStorage, initialised in kernel.h):
//   q_full      count 1 + tx   producer arrive_expect_tx(Q bytes); TMA completes the bytes
//   q_empty     count 8 or 1   p.early_q_release(): one arrive per consumer warp once its S
//                              GEMM of the tile's last K/V block finished (Q is dead; the next Q
//                              loads under the tile's tail). Else consumer thread 0 once the TMA
//                              store has read O (staged in Q's buffer, or for fp8 in its own)
//   k_full[s]   count 1 + tx   as q_full, per stage
//   k_empty[s]  count 8 (12)   one arrive per consumer warp once its S = QK^T wgmma finished
//   v_full[s], v_empty[s]      the same for V after the O += PV wgmma
// Parity: waiters of "full" wait for parity `phase` (starting 0); the producer waits on "empty"
// for parity `phase ^ 1`, which a fresh barrier reports as already completed (the buffers start
// empty). Stage/phase advance identically on both sides because both walk the same tiles and
// the same block ranges.
#pragma once
#include "common/cute_config.h"
#include <cute/tensor.hpp>

#include "flash_fwd/barriers.h"
#include "flash_fwd/block_info.h"
#include "flash_fwd/kernel_params.h"
#include "flash_fwd/fp8/tail_split.h"

namespace jax_fa3::fwd {

using namespace cute;

// The pool block holding logical K/V block n_block of batch row `batch` (the block itself
// without pages). A page index outside the pool is clamped into it: no load leaves the pool (the
// contract's "out-of-range pages are clamped when read").
template <class Traits>
__device__ __forceinline__ int kv_pool_block(const FlashFwdScalars& sc, int batch, int n_block) {
  if constexpr (Traits::kKeyRanges) {
    if (sc.kv_pages != nullptr) {
      const int per_page = sc.blocks_per_page;
      const int64_t entry = int64_t(batch) * sc.pages_per_seq + n_block / per_page;
      const int page = min(max(__ldg(sc.kv_pages + entry), 0), sc.num_pages - 1);
      return page * per_page + n_block % per_page;
    }
  }
  return n_block;
}

// Slots of the e4m3 cache's staging ring (fp8_cache.h); 1 (unused) for every other kernel.
template <class Traits, bool = Traits::kFp8Cache> struct NumCacheSlots {
  static constexpr int value = 1;
};
template <class Traits> struct NumCacheSlots<Traits, true> {
  static constexpr int value = Traits::kNumSlots;
};

// Where logical block n_block of a batch row starts among the slots its scales count (the row's
// for a contiguous cache, its page's for a paged one; a page holds whole blocks, so no page-table
// read): row r of the block takes the scale (first_slot % scale_block + r) / scale_block of the
// run that starts at first_slot's scale (fp8_cache.h).
template <class Traits>
__device__ __forceinline__ int block_first_slot(const FlashFwdScalars& sc, int n_block) {
  const bool paged = sc.kv_pages != nullptr;
  return (paged ? n_block % sc.blocks_per_page : n_block) * Traits::kBlockN;
}

// The e4m3 cache (fp8_cache.h): TMA of K or V block `pool_block` (logical block n_block of batch
// row `batch`) of kv head `kv_head` into the next staging slot, and the run of scales its rows
// use (block_first_slot) by cp.async into the slot's scales, once the converter has read the
// slot's previous block. The slot's full barrier counts two arrivals, the TMA's (with its bytes)
// and the cp.asyncs' completion (cp.async.mbarrier.arrive.noinc), so the converter never waits
// on a global load of its own. Entries past the scales' end are zero-filled: they belong to key
// rows past the cache, whose e4m3 bytes the TMA zero-filled too.
template <class Traits, class Tma>
__device__ __forceinline__ void load_cache_slot(Tma const& tma, const float* scales,
                                                KernelParams<Traits> const& p,
                                                typename Traits::SharedStorage& ss,
                                                PipelineState<Traits::kNumSlots>& slot,
                                                GmemShape const& shape, int kv_head, int batch,
                                                int kv_batch, int n_block, int pool_block) {
  Tensor s_slots = make_tensor(make_smem_ptr(ss.slots.data()), typename Traits::SmemLayoutSlot{});
  Tensor g_blocks = local_tile(tma.get_tma_tensor(shape)(_, _, kv_head, kv_batch),
                               Shape<Int<Traits::kBlockN>, Int<Traits::kHeadDim>>{},
                               make_coord(_, _0{}));  // (N, D, n)
  auto part = tma_partition(tma, _0{}, Layout<_1>{}, group_modes<0, 2>(s_slots),
                            group_modes<0, 2>(g_blocks));
  mbar_wait(&ss.slot_empty[slot.stage], slot.phase ^ 1);
  mbar_arrive_expect_tx(&ss.slot_full[slot.stage], Traits::kTmaBytesSlot);
  copy(tma.with(ss.slot_full[slot.stage]), get<0>(part)(_, pool_block),
       get<1>(part)(_, slot.stage));

  const FlashFwdScalars& sc = p.s;
  const bool paged = sc.kv_pages != nullptr;
  const int page = paged ? pool_block / sc.blocks_per_page : batch;
  const int first_slot = block_first_slot<Traits>(sc, n_block);
  const int first_scale = (page * sc.h_k + kv_head) * p.scale_blocks + first_slot / p.scale_block;
  const int count = (first_slot % p.scale_block + Traits::kBlockN - 1) / p.scale_block + 1;
  const uint32_t dst = cute::cast_smem_ptr_to_uint(ss.slot_scales[slot.stage]);
  for (int i = 0; i < count; ++i) {
    const bool inside = first_scale + i < p.num_scales;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst + 4 * i),
                 "l"(scales + (inside ? first_scale + i : 0)), "r"(inside ? 4 : 0)
                 : "memory");
  }
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(
                   cute::cast_smem_ptr_to_uint(&ss.slot_full[slot.stage]))
               : "memory");
  slot.advance();
}

template <class Traits>
__device__ __forceinline__ void run_producer(KernelParams<Traits> const& p,
                                             typename Traits::SharedStorage& ss) {
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  const FlashFwdScalars& sc = p.s;

  Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename Traits::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename Traits::SmemLayoutK{});
  Tensor sV = make_tensor(make_smem_ptr(ss.v.data()), typename Traits::SmemLayoutV{});
  // Key ranges with a paged cache (params.h): K/V are pools seen as one batch of
  // num_pages * page_size rows, and a logical block is found through the page table.
  const bool paged = Traits::kKeyRanges && sc.kv_pages != nullptr;
  const int kv_rows = paged ? sc.num_pages * sc.blocks_per_page * kBlockN : sc.s_k;
  const int kv_batches = paged ? 1 : sc.b;
  // Coordinate tensors of the TMA descriptors (no pointers: TMA addresses by coordinates).
  Tensor mQ = p.tma_q.get_tma_tensor(GmemShape(sc.s_q, sc.d, sc.h, sc.b));
  Tensor mK = p.tma_k.get_tma_tensor(GmemShape(kv_rows, sc.d, sc.h_k, kv_batches));
  // fp8: V^T (d, s_pad, h_k, b) from the transpose pre-pass (fp8/vt.h), keys contiguous.
  Tensor mV = [&] {
    if constexpr (Traits::kFp8) {
      return p.tma_v.get_tma_tensor(GmemShape(sc.d, p.s_pad, sc.h_k, sc.b));
    } else {
      return p.tma_v.get_tma_tensor(GmemShape(kv_rows, sc.d, sc.h_k, kv_batches));
    }
  }();
  const int group = sc.h / sc.h_k;  // GQA: query heads per kv head

  PipelineState<Traits::kStages> kv;
  [[maybe_unused]] PipelineState<NumCacheSlots<Traits>::value> slot;  // e4m3 cache only
  [[maybe_unused]] const GmemShape kv_shape(kv_rows, sc.d, sc.h_k, kv_batches);
  uint32_t q_phase = 0;
  for (int index = blockIdx.x; index < num_work_items<Traits::kTailSplit>(p.scheduler);
       index += gridDim.x) {
    const ItemBlocks work = item_blocks<Traits::kTailSplit, Traits::kKeyRanges>(
        p.scheduler, index, kBlockM, kBlockN, sc);
    const TileCoord c = work.tile;
    const int kv_head = c.head / group;
    const int kv_batch = paged ? 0 : c.batch;
    auto kv_block = [&](int n_block) { return kv_pool_block<Traits>(sc, c.batch, n_block); };
    // A tail-split piece (fp8/tail_split.h) visits part of the tile's blocks; the low piece's top
    // blocks (>= max_only_from) feed only its row maxima and need no V.
    const BlockRange range = work.piece.visit;
    Tensor gQ = local_tile(mQ(_, _, c.head, c.batch), Shape<Int<kBlockM>, Int<kHeadDim>>{},
                           make_coord(c.m_block, _0{}));                       // (M, D)
    Tensor gK = local_tile(mK(_, _, kv_head, kv_batch), Shape<Int<kBlockN>, Int<kHeadDim>>{},
                           make_coord(_, _0{}));                               // (N, D, n)
    Tensor gV = [&] {
      if constexpr (Traits::kFp8) {
        return local_tile(mV(_, _, kv_head, c.batch), Shape<Int<kHeadDim>, Int<kBlockN>>{},
                          make_coord(_0{}, _));                                // (D, N, n)
      } else {
        return local_tile(mV(_, _, kv_head, kv_batch), Shape<Int<kBlockN>, Int<kHeadDim>>{},
                          make_coord(_, _0{}));                                // (N, D, n)
      }
    }();
    // (TMA, n) source and (TMA, stage) destination views; std::get, not structured bindings,
    // because the lambdas below capture them (C++17).
    auto q_part = tma_partition(p.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ),
                                group_modes<0, 2>(gQ));
    auto k_part = tma_partition(p.tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK),
                                group_modes<0, 2>(gK));
    auto v_part = tma_partition(p.tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sV),
                                group_modes<0, 2>(gV));
    auto tKgK = get<0>(k_part);
    auto tKsK = get<1>(k_part);
    auto tVgV = get<0>(v_part);
    auto tVsV = get<1>(v_part);

    auto load_k = [&](int n_block) {
      if constexpr (Traits::kFp8Cache) {  // e4m3 into a slot; the converter fills the K stage
        load_cache_slot<Traits>(p.tma_k8, p.k_scales, p, ss, slot, kv_shape, kv_head, c.batch,
                                kv_batch, n_block, kv_block(n_block));
        return;
      }
      mbar_wait(&ss.k_empty[kv.stage], kv.phase ^ 1);
      mbar_arrive_expect_tx(&ss.k_full[kv.stage], Traits::kTmaBytesKV);
      copy(p.tma_k.with(ss.k_full[kv.stage]), tKgK(_, kv_block(n_block)), tKsK(_, kv.stage));
    };
    auto load_v = [&](int n_block) {
      if constexpr (Traits::kFp8Cache) {
        load_cache_slot<Traits>(p.tma_v8, p.v_scales, p, ss, slot, kv_shape, kv_head, c.batch,
                                kv_batch, n_block, kv_block(n_block));
        return;
      }
      mbar_wait(&ss.v_empty[kv.stage], kv.phase ^ 1);
      if (Traits::kTailSplit && n_block >= work.piece.max_only_from) {
        // No V for a row-max-only block: a plain arrive completes the stage's phase, so the
        // V barriers keep stepping with the K barriers (the consumers wait and release it).
        mbar_arrive(&ss.v_full[kv.stage]);
        return;
      }
      mbar_arrive_expect_tx(&ss.v_full[kv.stage], Traits::kTmaBytesKV);
      copy(p.tma_v.with(ss.v_full[kv.stage]), tVgV(_, kv_block(n_block)), tVsV(_, kv.stage));
    };

    // The first K block does not depend on the previous tile's epilogue: issue it before
    // waiting for Q's buffer, so it overlaps the consumers' epilogue.
    int n_block = range.n_max - 1;
    if (n_block >= range.n_min) load_k(n_block);
    mbar_wait(&ss.q_empty, q_phase ^ 1);
    mbar_arrive_expect_tx(&ss.q_full, Traits::kTmaBytesQ);
    copy(p.tma_q.with(ss.q_full), get<0>(q_part), get<1>(q_part));
    q_phase ^= 1;
    if (n_block >= range.n_min) {
      load_v(n_block);
      kv.advance();
      for (--n_block; n_block >= range.n_min; --n_block) {
        load_k(n_block);
        load_v(n_block);
        kv.advance();
      }
    }
  }
}

}  // namespace jax_fa3::fwd
