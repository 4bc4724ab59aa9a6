// The backward main kernel: one CTA per (K/V block, kv head, batch), looping over the query heads
// of its kv head (GQA) and, for each, over the Q blocks that can see the K/V block.
//
// Warpgroup 0 (producer, 24 registers): thread 0 issues TMA loads of K and V once, then of Q and dO
// (plus 1-D bulk copies of LSE*log2e and D) through a 2-stage mbarrier pipeline. Warp 1 is the
// dQ writer (d <= 192): per Q block it bulk-reduces the consumers' dQ partial from shared memory
// into the fp32 workspace, so the consumers never wait on global atomics.
// Warpgroups 1, 2 (consumers, 240 registers): the five GEMMs per Q block, in one of two
// arrangements (consumer_key_major.cuh for d <= 128, consumer_row_major.cuh for d = 192, 256);
// dK (times softmax_scale) and dV leave registers once, at the end.
#pragma once
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "flash_bwd/consumer_key_major.cuh"
#include "flash_bwd/consumer_row_major.cuh"
#include "flash_bwd/fp8_traits.cuh"
#include "flash_bwd/kernel_params.cuh"

namespace jax_fa3::flash_bwd {

// The dQ writer warp: walks the same (query head, Q block) sequence as the consumers; Q block
// number `it` uses sdq buffer it % kDqStages. For each block it waits for the partial in its
// buffer (kDqFull), lane 0 bulk-reduces it into the workspace, and the buffer is handed back
// (kDqEmpty) once the bulk unit has read it: with two buffers the writer waits for the previous
// block's reduce only, so one reduce reads while the consumers fill the other buffer. Every
// buffer's first kDqEmpty is given up front and a buffer is handed back only for a later use,
// so arrivals and waits match one for one. Deterministic mode: lane 0 first waits for its turn
// on the block's semaphore and releases the next K block only once its adds are complete.
template <typename Traits, bool kKeyRanges>
__device__ __forceinline__ void dq_writer(KernelParams<Traits> const& p, const float* sdq, int group,
                                          const BlockGeometry& geom, int m_begin, int m_end,
                                          int hk, int bidb, int n_block) {
  constexpr uint32_t kThreads = Traits::kNumMmaThreads + 32;
  constexpr uint32_t kBytes = Traits::kDqChunkFloats * sizeof(float);
  constexpr int kDqStages = Traits::kDqStages;
  const bool leader = threadIdx.x % 32 == 0;
  const int n_iters = (m_end - m_begin) * group;
  named_barrier_arrive(NamedBarrier::kDqEmpty, kThreads);  // n_iters > 0 here
  if (kDqStages == 2 && n_iters > 1) {
    named_barrier_arrive(dq_barrier(NamedBarrier::kDqEmpty, 1), kThreads);
  }
  int it = 0;
#pragma unroll 1
  for (int g = 0; g < group; ++g) {
    const int qh = hk * group + g;
#pragma unroll 1
    for (int m = m_begin; m < m_end; ++m, ++it) {
      const int buf = kDqStages == 1 ? 0 : it & 1;
      named_barrier_sync(dq_barrier(NamedBarrier::kDqFull, buf), kThreads);
      if (leader) {
        int* sem =
            p.deterministic ? wait_dq_turn<kKeyRanges>(p, geom, bidb, qh, m, n_block) : nullptr;
        bulk_reduce_add_s2g(dq_chunk(p, bidb, qh, m), sdq + buf * Traits::kDqChunkFloats, kBytes);
        bulk_commit();
        if (p.deterministic) {
          bulk_wait();  // the adds are done, not only the reads of sdq
          asm volatile("fence.proxy.async.global;" ::: "memory");
          __threadfence();
          atomicAdd(sem, 1);
        } else {
          bulk_wait_read<kDqStages - 1>();  // block it - kDqStages + 1 has been read
        }
      }
      __syncwarp();
      // Hand back the buffer whose reads are known complete, if a later block uses it: this
      // block's (deterministic mode, or one buffer), else the previous block's.
      if (kDqStages == 1 || p.deterministic) {
        if (it + kDqStages < n_iters) {
          named_barrier_arrive(dq_barrier(NamedBarrier::kDqEmpty, buf), kThreads);
        }
      } else if (it >= 1 && it + 1 < n_iters) {
        named_barrier_arrive(dq_barrier(NamedBarrier::kDqEmpty, buf ^ 1), kThreads);
      }
    }
  }
  if (leader) bulk_wait();
}

// The fp8 kernel's further loads of Q block m of query head qh into `stage`, on bar_full[stage]
// (counted in Traits::kBytesStage): q8^T and dO8^T (TMA; zero-filled past s_q and d), the rows'
// q scale and dK coefficient (1-D bulk copies from row0, the block's first padded row).
template <typename Traits>
__device__ __forceinline__ void load_fp8_stage(Fp8KernelParams<Traits> const& p,
                                               typename Traits::SharedStorage& ss, int stage,
                                               int qh, int bidb, int m, int64_t row0) {
  using namespace cute;
  auto tile = Shape<Int<Traits::kHeadDim>, Int<Traits::kBlockM>>{};
  Tensor mQt = p.tma_qt.get_tma_tensor(p.shape_t);
  Tensor mdOt = p.tma_dot.get_tma_tensor(p.shape_t);
  Tensor gQt = local_tile(mQt(_, _, qh, bidb), tile, make_coord(_0{}, m));
  Tensor gdOt = local_tile(mdOt(_, _, qh, bidb), tile, make_coord(_0{}, m));
  Tensor sQt = make_tensor(make_smem_ptr(ss.qt + stage * Traits::kSizeT8),
                           typename Traits::SmemLayoutT8{});
  Tensor sdOt = make_tensor(make_smem_ptr(ss.doutt + stage * Traits::kSizeT8),
                            typename Traits::SmemLayoutT8{});
  auto [tQtgQt, tQtsQt] = tma_partition(p.tma_qt, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sQt),
                                        group_modes<0, 2>(gQt));
  auto [tdOtgdOt, tdOtsdOt] = tma_partition(p.tma_dot, Int<0>{}, Layout<_1>{},
                                            group_modes<0, 2>(sdOt), group_modes<0, 2>(gdOt));
  copy(p.tma_qt.with(ss.bar_full[stage]), tQtgQt, tQtsQt);
  copy(p.tma_dot.with(ss.bar_full[stage]), tdOtgdOt, tdOtsdOt);
  bulk_copy_g2s(ss.q_scale[stage], p.q_scale + row0, Traits::kBytesRow, &ss.bar_full[stage]);
  bulk_copy_g2s(ss.dk_coef[stage], p.dk_coef + row0, Traits::kBytesRow, &ss.bar_full[stage]);
}

// kSoftcap: the key-major mainloop is compiled once with softcap and once without (one kernel
// each: both loops in one kernel spilled and serialized wgmmas); the row-major one tests
// p.has_softcap itself and is instantiated with kSoftcap = false only.
// kKeyRanges: per-query key ranges (common/key_ranges.h) in place of the window: the Q blocks
// come from the covers, the masks from the ranges, which the producer copies per Q block next to
// LSE and D. A separate instantiation, so that the whole-row kernel keeps its geometry in the
// constant bank (a per-row geometry in registers changed ptxas's schedule of the main loop).
// Traits: BwdTraits, or BwdTraitsFp8 (fp8_traits.cuh: whole rows, no softcap), whose producer
// loads k8 with K~ and V, and q8^T, dO8^T and two more row vectors with each Q block.
template <typename Traits, bool kSoftcap, bool kKeyRanges>
__global__ void __launch_bounds__(Traits::kNumThreads, 1)
    flash_bwd_kernel(CUTE_GRID_CONSTANT KernelParamsOf<Traits> const p) {
  using namespace cute;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kStages = Traits::kStages;
  constexpr uint32_t kMma = Traits::kNumMmaThreads;
  constexpr bool kFp8 = Traits::kFp8;
  static_assert(!kFp8 || (!kSoftcap && !kKeyRanges), "the fp8 kernel takes whole rows, no softcap");
  using Barrier = cutlass::arch::ClusterBarrier;
  using TxBarrier = cutlass::arch::ClusterTransactionBarrier;

  // Used as declared, not realigned at run time: rounding the address through an integer hid
  // that it is shared memory, and the P/dS stores became 64-bit generic stores (ST.E) whose
  // address arithmetic spilled at d = 96. The forward relies on the same 1024-byte alignment.
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  auto& ss = *reinterpret_cast<typename Traits::SharedStorage*>(smem_raw);

  // 80-row Q blocks take no causal mask or window (params.h wide_q_blocks), so always the plain
  // order (launch.cuh checks); decoding the sectioned one there (a division) spilled 16 bytes.
  const TileOrder::Coord tile =
      Traits::kDqTransposed ? TileOrder::Coord{int(blockIdx.x), int(blockIdx.y), int(blockIdx.z)}
                            : p.order.coord(blockIdx.x, blockIdx.y, blockIdx.z);
  const int n_block = tile.n_block;
  const int hk = tile.hk;
  const int bidb = tile.bidb;
  const int group = p.h / p.h_k;
  const BlockGeometry geom = p.geom;
  int m_begin, m_end;
  if constexpr (kKeyRanges) {
    key_range_q_blocks(p, bidb, n_block, m_begin, m_end);  // every warp, converged
  } else {
    geom.m_range(n_block, m_begin, m_end);
  }
  const int n_iters = (m_end - m_begin) * group;
  const int warp_group = threadIdx.x / 128;

  if (threadIdx.x == 0) {
    Barrier::init(&ss.bar_kv, 1);
    CUTE_UNROLL
    for (int s = 0; s < kStages; ++s) {
      Barrier::init(&ss.bar_full[s], 1);
      Barrier::init(&ss.bar_empty[s], kMma);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  if (warp_group == 0) {
    // ---------------------------------------------------------------- producer
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();
    if (n_iters == 0) return;
    if constexpr (Traits::kDqViaSmem) {
      if (threadIdx.x / 32 == 1) {
        dq_writer<Traits, kKeyRanges>(p, ss.dq, group, geom, m_begin, m_end, hk, bidb, n_block);
        return;
      }
    }
    if (threadIdx.x != 0) return;
    cute::prefetch_tma_descriptor(p.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_do.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_v.get_tma_descriptor());
    if constexpr (kFp8) {
      cute::prefetch_tma_descriptor(p.tma_k8.get_tma_descriptor());
      cute::prefetch_tma_descriptor(p.tma_qt.get_tma_descriptor());
      cute::prefetch_tma_descriptor(p.tma_dot.get_tma_descriptor());
    }

    {
      Tensor mK = p.tma_k.get_tma_tensor(p.shape_k);
      Tensor mV = p.tma_v.get_tma_tensor(p.shape_k);
      auto tile = Shape<Int<kBlockN>, Int<kHeadDim>>{};
      Tensor gK = local_tile(mK(_, _, hk, bidb), tile, make_coord(n_block, _0{}));
      Tensor gV = local_tile(mV(_, _, hk, bidb), tile, make_coord(n_block, _0{}));
      Tensor sK = make_tensor(make_smem_ptr(ss.k), typename Traits::SmemLayoutKV{});
      Tensor sV = make_tensor(make_smem_ptr(ss.v), typename Traits::SmemLayoutKV{});
      auto [tKgK, tKsK] = tma_partition(p.tma_k, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sK),
                                        group_modes<0, 2>(gK));
      auto [tVgV, tVsV] = tma_partition(p.tma_v, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sV),
                                        group_modes<0, 2>(gV));
      TxBarrier::arrive_and_expect_tx(&ss.bar_kv, Traits::kBytesKVLoad);
      copy(p.tma_k.with(ss.bar_kv), tKgK, tKsK);
      copy(p.tma_v.with(ss.bar_kv), tVgV, tVsV);
      if constexpr (kFp8) {
        Tensor mK8 = p.tma_k8.get_tma_tensor(p.shape_k);
        Tensor gK8 = local_tile(mK8(_, _, hk, bidb), tile, make_coord(n_block, _0{}));
        Tensor sK8 = make_tensor(make_smem_ptr(ss.k8), typename Traits::SmemLayoutK8{});
        auto [tK8gK8, tK8sK8] = tma_partition(p.tma_k8, Int<0>{}, Layout<_1>{},
                                              group_modes<0, 2>(sK8), group_modes<0, 2>(gK8));
        copy(p.tma_k8.with(ss.bar_kv), tK8gK8, tK8sK8);
      }
    }

    Tensor mQ = p.tma_q.get_tma_tensor(p.shape_q);
    Tensor mdO = p.tma_do.get_tma_tensor(p.shape_q);
    int it = 0;
    // Not unrolled: the producer lives on 24 registers (setmaxnreg), and unrolled copies of this
    // loop spilled.
#pragma unroll 1
    for (int g = 0; g < group; ++g) {
      const int qh = hk * group + g;
      auto tile = Shape<Int<kBlockM>, Int<kHeadDim>>{};
      Tensor gQ = local_tile(mQ(_, _, qh, bidb), tile, make_coord(_, _0{}));   // (M, D, m)
      Tensor gdO = local_tile(mdO(_, _, qh, bidb), tile, make_coord(_, _0{}));
      const int64_t row_base = (int64_t(bidb) * p.h + qh) * p.s_q_pad;
#pragma unroll 1
      for (int m = m_begin; m < m_end; ++m, ++it) {
        const int stage = it % kStages;
        const int use = it / kStages;
        if (use > 0) Barrier::wait(&ss.bar_empty[stage], (use - 1) & 1);
        Tensor sQ = make_tensor(make_smem_ptr(ss.q + stage * Traits::kSizeQs),
                                typename Traits::SmemLayoutQs{});
        Tensor sdO = make_tensor(make_smem_ptr(ss.dout + stage * Traits::kSizeQ),
                                 typename Traits::SmemLayoutQ{});
        auto [tQgQ, tQsQ] = tma_partition(p.tma_q, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sQ),
                                          group_modes<0, 2>(gQ));
        auto [tdOgdO, tdOsdO] = tma_partition(p.tma_do, Int<0>{}, Layout<_1>{},
                                              group_modes<0, 2>(sdO), group_modes<0, 2>(gdO));
        TxBarrier::arrive_and_expect_tx(
            &ss.bar_full[stage],
            Traits::kBytesStage + (kKeyRanges ? Traits::kBytesKeyRanges : 0));
        copy(p.tma_q.with(ss.bar_full[stage]), tQgQ(_, m), tQsQ);
        copy(p.tma_do.with(ss.bar_full[stage]), tdOgdO(_, m), tdOsdO);
        if constexpr (kFp8) {
          load_fp8_stage<Traits>(p, ss, stage, qh, bidb, m, row_base + m * kBlockM);
        }
        bulk_copy_g2s(ss.lse_log2[stage], p.lse_log2 + row_base + m * kBlockM, Traits::kBytesRow,
                      &ss.bar_full[stage]);
        bulk_copy_g2s(ss.dpsum[stage], p.dpsum + row_base + m * kBlockM, Traits::kBytesRow,
                      &ss.bar_full[stage]);
        if constexpr (kKeyRanges) {  // the array has whole 128-row tiles: no bounds test
          const int64_t ranges_row = int64_t(bidb) * key_range_rows(p.s_q) + m * kBlockM;
          bulk_copy_g2s(ss.key_ranges[stage], p.key_ranges + 2 * ranges_row,
                        Traits::kBytesKeyRanges, &ss.bar_full[stage]);
        }
      }
    }
    return;
  }

  // ------------------------------------------------------------------ consumers
  cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegs>();
  if constexpr (Traits::kKeyMajor) {
    run_consumer_key_major<Traits, kSoftcap, kKeyRanges>(p, ss, n_block, hk, bidb, group, geom,
                                                         m_begin, m_end);
  } else {
    run_consumer_row_major<Traits, kKeyRanges>(p, ss, n_block, hk, bidb, group, geom, m_begin,
                                               m_end);
  }
}

}  // namespace jax_fa3::flash_bwd
