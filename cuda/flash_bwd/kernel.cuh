// The backward main kernel: one CTA per (K/V block, kv head, batch), looping over the query heads
// of its kv head (GQA) and, for each, over the Q blocks that can see the K/V block.
//
// Warpgroup 0 (producer, 24 registers): thread 0 issues TMA loads of K and V once, then of Q and dO
// (plus 1-D bulk copies of LSE*log2e and D) through a 2-stage mbarrier pipeline. Warp 1 is the
// dQ writer (d <= 192): per Q block it bulk-reduces the consumers' dQ partial from shared memory
// into the fp32 workspace, so the consumers never wait on global atomics.
// Warpgroups 1, 2 (consumers, 240 registers), per Q block:
//   S = Q K^T, dP = dO V^T (wgmma, smem x smem)         -> each WG: 64 rows x kNS keys
//   P = exp2(S*scale*log2e - lse*log2e) (0 where masked), dS = P (dP - D) [x (1 - tanh^2)]
//   P, dS -> shared memory (bf16/fp16), fence.proxy.async, named barrier
//   dQ = dS K, then dV += P^T dO, dK += dS^T Q (transposed smem views, MN-major), all wgmma;
//   dQ is stored (shared memory for the writer warp, or red.global.add.v2.f32 at d = 256)
//   while the dV/dK wgmmas still run.
// dK (times softmax_scale) and dV leave registers once, at the end, with masked stores.
#pragma once
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

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
  float* dq_accum;        // (b, h, s_q, d)
  int* semaphores;        // (b, h, num_m_blocks), deterministic only
  void* dk;               // (b, s_k, h_k, d)
  void* dv;
  int b, s_q, s_k, h, h_k, d, s_q_pad, num_m_blocks;
  float softmax_scale;
  float score_log2;       // multiplies S (no softcap) or tanh(...) (softcap) before exp2
  float tanh_in_scale;    // softmax_scale / softcap
  bool has_softcap;
  bool deterministic;
  BlockGeometry geom;
};

// Issue one warpgroup GEMM (all k-blocks) and commit it as one wgmma group; the caller waits.
template <bool kZeroInit, typename TiledMma, typename TA, typename TB, typename TC>
__device__ __forceinline__ void wg_gemm(TiledMma& mma, TA const& a, TB const& b, TC& c) {
  using namespace cute;
  warpgroup_fence_operand(c);
  warpgroup_arrive();
  mma.accumulate_ = kZeroInit ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
  CUTE_UNROLL
  for (int kb = 0; kb < size<2>(a); ++kb) {
    cute::gemm(mma, a(_, _, kb), b(_, _, kb), c);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
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
__device__ __forceinline__ int* wait_dq_turn(KernelParams<Traits> const& p, int bidb, int qh, int m,
                                             int n_block) {
  int* sem = p.semaphores + q_block_index(bidb, p.h, qh, p.num_m_blocks, m);
  const int target = n_block - p.geom.n_first(m);
  while (ld_acquire_gpu(sem) != target) {
  }
  return sem;
}

// The dQ writer warp: walks the same (query head, Q block) sequence as the consumers. For each
// block it waits for the partial in sdq (kDqFull), lane 0 bulk-reduces it into the workspace and
// waits until the bulk unit has read it, then hands sdq back (kDqEmpty). The first kDqEmpty is
// given up front (sdq starts free) and the last one is never given, so arrivals and waits match
// one for one. Deterministic mode: lane 0 first waits for its turn on the block's semaphore and
// releases the next K block only once its adds are complete.
template <typename Traits>
__device__ __forceinline__ void dq_writer(KernelParams<Traits> const& p, const float* sdq, int group,
                                          int m_begin, int m_end, int hk, int bidb, int n_block) {
  constexpr uint32_t kThreads = Traits::kNumMmaThreads + 32;
  constexpr uint32_t kBytes = Traits::kDqChunkFloats * sizeof(float);
  const bool leader = threadIdx.x % 32 == 0;
  named_barrier_arrive(NamedBarrier::kDqEmpty, kThreads);
  const int n_iters = (m_end - m_begin) * group;
  int it = 0;
#pragma unroll 1
  for (int g = 0; g < group; ++g) {
    const int qh = hk * group + g;
#pragma unroll 1
    for (int m = m_begin; m < m_end; ++m, ++it) {
      named_barrier_sync(NamedBarrier::kDqFull, kThreads);
      if (leader) {
        int* sem = p.deterministic ? wait_dq_turn(p, bidb, qh, m, n_block) : nullptr;
        bulk_reduce_add_s2g(dq_chunk(p, bidb, qh, m), sdq, kBytes);
        bulk_commit();
        if (p.deterministic) {
          bulk_wait();  // the adds are done, not only the reads of sdq
          asm volatile("fence.proxy.async.global;" ::: "memory");
          __threadfence();
          atomicAdd(sem, 1);
        } else {
          bulk_wait_read();
        }
      }
      __syncwarp();
      if (it + 1 < n_iters) named_barrier_arrive(NamedBarrier::kDqEmpty, kThreads);
    }
  }
  if (leader) bulk_wait();
}

template <typename Element>
__device__ __forceinline__ uint32_t pack2(float x, float y) {
  const Element a(x), b(y);
  return uint32_t(a.raw()) | (uint32_t(b.raw()) << 16);
}

template <typename Traits>
__global__ void __launch_bounds__(Traits::kNumThreads, 1)
    flash_bwd_kernel(CUTE_GRID_CONSTANT KernelParams<Traits> const p) {
  using namespace cute;
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kNS = Traits::kNS;
  constexpr int kDKV = Traits::kDKV;
  constexpr int kDQ = Traits::kDQ;
  constexpr int kStages = Traits::kStages;
  constexpr uint32_t kMma = Traits::kNumMmaThreads;
  using Barrier = cutlass::arch::ClusterBarrier;
  using TxBarrier = cutlass::arch::ClusterTransactionBarrier;

  // Used as declared, not realigned at run time: rounding the address through an integer hid
  // that it is shared memory, and the P/dS stores became 64-bit generic stores (ST.E) whose
  // address arithmetic spilled at d = 96. The forward relies on the same 1024-byte alignment.
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  auto& ss = *reinterpret_cast<typename Traits::SharedStorage*>(smem_raw);

  const int n_block = blockIdx.x;
  const int hk = blockIdx.y;
  const int bidb = blockIdx.z;
  const int group = p.h / p.h_k;
  int m_begin, m_end;
  p.geom.m_range(n_block, m_begin, m_end);
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
        dq_writer<Traits>(p, ss.dq, group, m_begin, m_end, hk, bidb, n_block);
        return;
      }
    }
    if (threadIdx.x != 0) return;
    cute::prefetch_tma_descriptor(p.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_do.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_v.get_tma_descriptor());

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
      TxBarrier::arrive_and_expect_tx(&ss.bar_kv, 2 * Traits::kBytesKV);
      copy(p.tma_k.with(ss.bar_kv), tKgK, tKsK);
      copy(p.tma_v.with(ss.bar_kv), tVgV, tVsV);
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
        Tensor sQ = make_tensor(make_smem_ptr(ss.q + stage * Traits::kSizeQ),
                                typename Traits::SmemLayoutQ{});
        Tensor sdO = make_tensor(make_smem_ptr(ss.dout + stage * Traits::kSizeQ),
                                 typename Traits::SmemLayoutQ{});
        auto [tQgQ, tQsQ] = tma_partition(p.tma_q, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sQ),
                                          group_modes<0, 2>(gQ));
        auto [tdOgdO, tdOsdO] = tma_partition(p.tma_do, Int<0>{}, Layout<_1>{},
                                              group_modes<0, 2>(sdO), group_modes<0, 2>(gdO));
        TxBarrier::arrive_and_expect_tx(&ss.bar_full[stage],
                                        2 * Traits::kBytesQ + 2 * Traits::kBytesRow);
        copy(p.tma_q.with(ss.bar_full[stage]), tQgQ(_, m), tQsQ);
        copy(p.tma_do.with(ss.bar_full[stage]), tdOgdO(_, m), tdOsdO);
        bulk_copy_g2s(ss.lse_log2[stage], p.lse_log2 + row_base + m * kBlockM, Traits::kBytesRow,
                      &ss.bar_full[stage]);
        bulk_copy_g2s(ss.dpsum[stage], p.dpsum + row_base + m * kBlockM, Traits::kBytesRow,
                      &ss.bar_full[stage]);
      }
    }
    return;
  }

  // ------------------------------------------------------------------ consumers
  cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegs>();
  const int wg = warp_group - 1;            // 0 or 1
  const int tid = threadIdx.x % 128;        // thread within the warpgroup
  const int ctid = threadIdx.x - 128;       // thread within the consumers
  const int wn = Traits::kWgAlongN == 2 ? wg : 0;  // dK/dV: key-row slice
  const int wd = Traits::kWgAlongN == 2 ? 0 : wg;  // dK/dV: d-column slice

  typename Traits::MmaSdP mma_sdp;
  typename Traits::MmadKV mma_dkv;
  typename Traits::MmadQ mma_dq;
  auto thr_sdp = mma_sdp.get_thread_slice(tid);
  auto thr_dkv = mma_dkv.get_thread_slice(tid);
  auto thr_dq = mma_dq.get_thread_slice(tid);

  Tensor sK = make_tensor(make_smem_ptr(ss.k), typename Traits::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(ss.v), typename Traits::SmemLayoutKV{});
  Tensor sKt = make_tensor(make_smem_ptr(ss.k), typename Traits::SmemLayoutKt{});
  Tensor sP = make_tensor(make_smem_ptr(ss.p), typename Traits::SmemLayoutPdS{});
  Tensor sdS = make_tensor(make_smem_ptr(ss.ds), typename Traits::SmemLayoutPdS{});
  Tensor sPt = make_tensor(make_smem_ptr(ss.p), typename Traits::SmemLayoutPdSt{});
  Tensor sdSt = make_tensor(make_smem_ptr(ss.ds), typename Traits::SmemLayoutPdSt{});

  // This warpgroup's operand slices (all cuts fall on swizzle-atom boundaries, see traits).
  Tensor tSrK = thr_sdp.partition_fragment_B(
      local_tile(sK, Shape<Int<kNS>, Int<kHeadDim>>{}, make_coord(wg, _0{})));
  Tensor tSrV = thr_sdp.partition_fragment_B(
      local_tile(sV, Shape<Int<kNS>, Int<kHeadDim>>{}, make_coord(wg, _0{})));
  Tensor tdQrdS = thr_dq.partition_fragment_A(sdS);
  Tensor tdQrKt = thr_dq.partition_fragment_B(
      local_tile(sKt, Shape<Int<kDQ>, Int<kBlockN>>{}, make_coord(wg, _0{})));
  Tensor tdVrPt = thr_dkv.partition_fragment_A(
      local_tile(sPt, Shape<_64, Int<kBlockM>>{}, make_coord(wn, _0{})));
  Tensor tdKrdSt = thr_dkv.partition_fragment_A(
      local_tile(sdSt, Shape<_64, Int<kBlockM>>{}, make_coord(wn, _0{})));
  // Where this thread writes its S/dP fragment into the (kBlockM, kBlockN) P / dS tiles, as
  // swizzled byte offsets from a 1024-aligned tile base: the same partition of the same layout
  // over a null base. Writing through CuTe's swizzled smem pointers instead compiled to 16-bit
  // generic stores (ST.E.U16) with 64-bit address arithmetic; these are 32-bit st.shared of
  // element pairs (a pair is adjacent: even column, one 16-byte swizzle chunk).
  Tensor tPoff = thr_sdp.partition_C(local_tile(
      make_tensor(make_smem_ptr(static_cast<Element*>(nullptr)), typename Traits::SmemLayoutPdS{}),
      Shape<Int<kBlockM>, Int<kNS>>{}, make_coord(_0{}, wg)));
  const uint32_t p_smem = cute::cast_smem_ptr_to_uint(ss.p);
  const uint32_t ds_smem = cute::cast_smem_ptr_to_uint(ss.ds);

  Tensor tSrS = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kNS>>{});
  Tensor tSrdP = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kNS>>{});
  Tensor tdVrdV = partition_fragment_C(mma_dkv, Shape<_64, Int<kDKV>>{});
  Tensor tdKrdK = partition_fragment_C(mma_dkv, Shape<_64, Int<kDKV>>{});
  Tensor tdQrdQ = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kDQ>>{});
  clear(tdVrdV);
  clear(tdKrdK);

  // (row, col) of every accumulator element, tile-local.
  Tensor tScS = thr_sdp.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kNS>>{}));
  Tensor tdKVcdKV = thr_dkv.partition_C(make_identity_tensor(Shape<_64, Int<kDKV>>{}));

  const int off = p.s_k - p.s_q;
  const int wl = p.geom.window_left;
  const int wr = p.geom.window_right;
  const int col_base = n_block * kBlockN + wg * kNS;

  if (n_iters > 0) Barrier::wait(&ss.bar_kv, 0);

  int it = 0;
  for (int g = 0; g < group; ++g) {
    const int qh = hk * group + g;
    for (int m = m_begin; m < m_end; ++m, ++it) {
      const int stage = it % kStages;
      Barrier::wait(&ss.bar_full[stage], (it / kStages) & 1);

      Tensor sQ = make_tensor(make_smem_ptr(ss.q + stage * Traits::kSizeQ),
                              typename Traits::SmemLayoutQ{});
      Tensor sdO = make_tensor(make_smem_ptr(ss.dout + stage * Traits::kSizeQ),
                               typename Traits::SmemLayoutQ{});
      Tensor sQt = make_tensor(make_smem_ptr(ss.q + stage * Traits::kSizeQ),
                               typename Traits::SmemLayoutQt{});
      Tensor sdOt = make_tensor(make_smem_ptr(ss.dout + stage * Traits::kSizeQ),
                                typename Traits::SmemLayoutQt{});

      // S = Q K^T and dP = dO V^T for this warpgroup's kNS keys.
      wg_gemm<true>(mma_sdp, thr_sdp.partition_fragment_A(sQ), tSrK, tSrS);
      wg_gemm<true>(mma_sdp, thr_sdp.partition_fragment_A(sdO), tSrV, tSrdP);
      // P = exp2(S * scale * log2e - lse * log2e) while the dP wgmma still runs, then
      // dS = P (dP - D) [x (1 - t^2)] in place of dP. Specialised on softcap and on whether this
      // (64-row, kNS-key) piece can hold a hidden pair at all: the per-element branches of one
      // generic loop cost more issue slots than the GEMMs they sat between (SASS: ~1500
      // instructions per warp per Q block, 5 branches per element).
      const float* lse_s = ss.lse_log2[stage];
      const float* dpsum_s = ss.dpsum[stage];
      const int row_base = m * kBlockM;
      // Each thread's S/dP accumulators cover two rows: element i is on the row of element
      // 2 * ((i >> 1) & 1) (the GMMA C layout; checked on the host by tests/cuda/check_bwd_layouts.cu).
      float lse_r[2], dd_r[2];
      CUTE_UNROLL
      for (int r = 0; r < 2; ++r) {
        lse_r[r] = lse_s[get<0>(tScS(2 * r))];
        dd_r[r] = dpsum_s[get<0>(tScS(2 * r))];
      }
      const bool need_mask = piece_needs_mask(row_base, kBlockM, col_base, kNS, p.s_q, p.s_k, off,
                                              wl, wr);
      auto p_and_ds = [&](auto softcap, auto mask) {
        constexpr bool kSoftcap = decltype(softcap)::value;
        constexpr bool kMask = decltype(mask)::value;
        // Branch-free: & rather than && (short-circuits compiled to branches per element).
        auto visible = [&](int i) {
          const int gi = row_base + get<0>(tScS(i));
          const int gj = col_base + get<1>(tScS(i));
          return bool((gi < p.s_q) & (gj < p.s_k) & ((wl < 0) | (gj >= gi + off - wl)) &
                      ((wr < 0) | (gj <= gi + off + wr)));
        };
        if constexpr (!kSoftcap) {
          // 0 where masked: a select, so no inf/NaN reaches the GEMMs.
          CUTE_UNROLL
          for (int i = 0; i < size(tSrS); ++i) {
            const float pv = exp2f(tSrS(i) * p.score_log2 - lse_r[(i >> 1) & 1]);
            tSrS(i) = (!kMask || visible(i)) ? pv : 0.f;
          }
        }
        // With softcap, P and dS both need t = tanh(S * scale / cap): all of it waits for dP
        // (keeping t would cost 32 more registers).
        warpgroup_wait<0>();
        warpgroup_fence_operand(tSrdP);
        CUTE_UNROLL
        for (int i = 0; i < size(tSrS); ++i) {
          const float dd = dd_r[(i >> 1) & 1];
          if constexpr (kSoftcap) {
            const float t = tanh_fast(tSrS(i) * p.tanh_in_scale);
            const float pv = exp2f(t * p.score_log2 - lse_r[(i >> 1) & 1]);
            const bool vis = !kMask || visible(i);
            tSrS(i) = vis ? pv : 0.f;
            tSrdP(i) = vis ? pv * (tSrdP(i) - dd) * (1.f - t * t) : 0.f;
          } else {
            tSrdP(i) = tSrS(i) * (tSrdP(i) - dd);  // P is already 0 where masked
          }
        }
      };
      warpgroup_wait<1>();
      warpgroup_fence_operand(tSrS);
      if (p.has_softcap) {
        if (need_mask) {
          p_and_ds(cute::true_type{}, cute::true_type{});
        } else {
          p_and_ds(cute::true_type{}, cute::false_type{});
        }
      } else if (need_mask) {
        p_and_ds(cute::false_type{}, cute::true_type{});
      } else {
        p_and_ds(cute::false_type{}, cute::false_type{});
      }

      // Both warpgroups' wgmmas of the previous block have finished reading P and dS.
      if (it > 0) named_barrier_sync(NamedBarrier::kPdSFree, kMma);
      CUTE_UNROLL
      for (int i = 0; i < size(tSrS); i += 2) {
        const uint32_t off =
            static_cast<uint32_t>(reinterpret_cast<uintptr_t>(raw_pointer_cast(&tPoff(i))));
        st_shared_b32(p_smem + off, pack2<Element>(tSrS(i), tSrS(i + 1)));
        st_shared_b32(ds_smem + off, pack2<Element>(tSrdP(i), tSrdP(i + 1)));
      }
      cutlass::arch::fence_view_async_shared();  // generic-proxy writes -> wgmma (async proxy)
      named_barrier_sync(NamedBarrier::kPdSReady, kMma);

      // dQ = dS K first: its partial is stored while dV += P^T dO and dK += dS^T Q still run.
      wg_gemm<true>(mma_dq, tdQrdS, tdQrKt, tdQrdQ);
      wg_gemm<false>(mma_dkv, tdVrPt,
                     thr_dkv.partition_fragment_B(local_tile(
                         sdOt, Shape<Int<kDKV>, Int<kBlockM>>{}, make_coord(wd, _0{}))),
                     tdVrdV);
      wg_gemm<false>(mma_dkv, tdKrdSt,
                     thr_dkv.partition_fragment_B(local_tile(
                         sQt, Shape<Int<kDKV>, Int<kBlockM>>{}, make_coord(wd, _0{}))),
                     tdKrdK);
      warpgroup_wait<2>();  // the dQ group is done; the dV and dK groups may still run
      warpgroup_fence_operand(tdQrdQ);

      // Fragment order (see Traits::kDqWgFloats): this thread's pairs are kDqPairStride apart.
      constexpr int kPairStride = Traits::kDqPairStride;  // in float2
      if constexpr (Traits::kDqViaSmem) {
        // The writer warp adds the chunk to global memory (and orders the deterministic mode).
        named_barrier_sync(NamedBarrier::kDqEmpty, kMma + 32);
        // 32-bit shared-window address: a generic 64-bit pointer here cost a register spill.
        const uint32_t sdq = cute::cast_smem_ptr_to_uint(ss.dq + wg * Traits::kDqWgFloats) + tid * 8;
        CUTE_UNROLL
        for (int i = 0; i < size(tdQrdQ); i += 2) {
          st_shared_f32x2(sdq + (i / 2) * kPairStride * 8, tdQrdQ(i), tdQrdQ(i + 1));
        }
        cutlass::arch::fence_view_async_shared();  // generic-proxy writes -> bulk reduce
        named_barrier_arrive(NamedBarrier::kDqFull, kMma + 32);
      } else {
        // d = 256: add from registers. Padded rows and columns hold exact zeros (dS is 0 past
        // s_q, K is zero-filled past d), so the whole chunk is added without masks.
        int* sem = nullptr;
        if (p.deterministic) {  // K blocks add in increasing order
          if (ctid == 0) sem = wait_dq_turn(p, bidb, qh, m, n_block);
          named_barrier_sync(NamedBarrier::kDeterministic, kMma);
        }
        float2* gdq = reinterpret_cast<float2*>(
            dq_chunk(p, bidb, qh, m) + wg * Traits::kDqWgFloats) + tid;
        CUTE_UNROLL
        for (int i = 0; i < size(tdQrdQ); i += 2) {
          atomicAdd(gdq + (i / 2) * kPairStride, make_float2(tdQrdQ(i), tdQrdQ(i + 1)));
        }
        if (p.deterministic) {
          named_barrier_sync(NamedBarrier::kDeterministic, kMma);
          if (ctid == 0) {
            __threadfence();
            atomicAdd(sem, 1);
          }
        }
      }

      warpgroup_wait<0>();
      warpgroup_fence_operand(tdVrdV);
      warpgroup_fence_operand(tdKrdK);
      Barrier::arrive(&ss.bar_empty[stage]);  // Q, dO, LSE, D of this stage are no longer read
    }
  }

  // Epilogue: dK = softmax_scale * sum dS^T Q, dV = sum P^T dO, masked pair stores.
  const int row0 = n_block * kBlockN + wn * 64;
  const int col0 = wd * kDKV;
  const int64_t kv_row_stride = int64_t(p.h_k) * p.d;
  const int64_t kv_base = int64_t(bidb) * p.s_k * kv_row_stride + int64_t(hk) * p.d;
  uint32_t* dk = reinterpret_cast<uint32_t*>(static_cast<Element*>(p.dk) + kv_base);
  uint32_t* dv = reinterpret_cast<uint32_t*>(static_cast<Element*>(p.dv) + kv_base);
  CUTE_UNROLL
  for (int i = 0; i < size(tdKrdK); i += 2) {
    const int j = row0 + get<0>(tdKVcdKV(i));
    const int c = col0 + get<1>(tdKVcdKV(i));
    if (j < p.s_k && c < p.d) {
      const int64_t idx = (int64_t(j) * kv_row_stride + c) / 2;
      dk[idx] = pack2<Element>(tdKrdK(i) * p.softmax_scale, tdKrdK(i + 1) * p.softmax_scale);
      dv[idx] = pack2<Element>(tdVrdV(i), tdVrdV(i + 1));
    }
  }
}

}  // namespace jax_fa3::flash_bwd
