// Row-major consumer mainloop (d = 192, 256: 64-key blocks). Per Q block, warpgroup wg:
//   S = Q K^T, dP = dO V^T (wgmma SS) for keys [wg*32, wg*32+32) of the block, all 64 rows;
//   P = exp2(S*scale*log2e - lse*log2e) (0 where masked), dS = P (dP - D) [x (1 - tanh^2)];
//   P, dS -> shared memory (both warpgroups' halves), fence.proxy.async, named barrier;
//   dQ = dS K (d columns [wg*d/2, ...)), then dV += P^T dO, dK += dS^T Q for d columns
//   [wg*d/2, ...) of all 64 keys (transposed smem views, MN-major); dQ is stored while the dV/dK
//   wgmmas still run.
#pragma once
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "flash_bwd/consumer_common.cuh"

namespace jax_fa3::flash_bwd {

template <typename Traits, bool kKeyRanges>
__device__ __forceinline__ void run_consumer_row_major(KernelParams<Traits> const& p,
                                                       typename Traits::SharedStorage& ss,
                                                       int n_block, int hk, int bidb, int group,
                                                       const BlockGeometry& geom,
                                                       int m_begin, int m_end) {
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
  const int n_iters = (m_end - m_begin) * group;
  // Warp-uniform by construction (a broadcast from lane 0), so that what derives from it, the
  // wgmma descriptors of this warpgroup's operand slices above all, stays on the uniform datapath
  // (d = 256: 103 -> 14 R2UR moves, 112 fewer instructions in the loop, no spills).
  const int wg = __shfl_sync(0xffffffffu, threadIdx.x / 128, 0) - 1;  // 0 or 1
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
  Tensor tPoff = Traits::pds_store_offsets(thr_sdp, wg);
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

  const int off = p.s_k - p.s_q;  // whole rows' diagonal
  const int wl = geom.window_left;
  const int wr = geom.window_right;
  const int col_base = n_block * kBlockN + wg * kNS;

  if (n_iters > 0) Barrier::wait(&ss.bar_kv, 0);

  int it = 0;
  for (int g = 0; g < group; ++g) {
    const int qh = hk * group + g;
    for (int m = m_begin; m < m_end; ++m, ++it) {
      // The previous block's wgmmas that read the P / dS tiles completed before this warpgroup
      // left it: the other warpgroup may overwrite them. Arriving here, not at the end of that
      // block, needs no "not the last block" test: arrivals and syncs (sync.cuh) both skip it = 0.
      if (it > 0) named_barrier_arrive(pds_free_barrier(wg ^ 1), kMma);
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
      bool need_mask;
      if constexpr (kKeyRanges) {
        need_mask = keys_need_mask(q_block_keys(p, bidb, m), col_base, kNS);
      } else {
        need_mask = piece_needs_mask(row_base, kBlockM, col_base, kNS,
                                     RowBounds{p.s_q, p.s_k, off}, wl, wr);
      }
      // Key ranges: the rows' (lo, hi), read per element where a mask needs them.
      [[maybe_unused]] const uint32_t ranges_s =
          cute::cast_smem_ptr_to_uint(ss.key_ranges[stage]);
      auto p_and_ds = [&](auto softcap, auto mask) {
        constexpr bool kSoftcap = decltype(softcap)::value;
        constexpr bool kMask = decltype(mask)::value;
        auto visible = [&](int i) {
          const int gi = row_base + get<0>(tScS(i));
          const int gj = col_base + get<1>(tScS(i));
          if constexpr (kKeyRanges) {
            const int2 keys = ld_shared_pair_at_use(ranges_s + 8 * get<0>(tScS(i)));
            return bool((gj >= keys.x) & (gj < keys.y));
          }
          // Whole rows: block_range.h's rule written out over the kernel parameters, the form
          // this loop was tuned with (through a RowBounds ptxas schedules the masked path
          // differently). Branch-free: & rather than &&.
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

      // The other warpgroup's wgmmas of the previous block have finished reading P and dS (this
      // warpgroup's own did before it left that block).
      if (it > 0) named_barrier_sync(pds_free_barrier(wg), kMma);
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

      store_dq_partial<Traits, kKeyRanges>(p, ss, tdQrdQ, wg, tid, ctid, geom, bidb, qh, m, n_block,
                               stage);

      warpgroup_wait<0>();
      warpgroup_fence_operand(tdVrdV);
      warpgroup_fence_operand(tdKrdK);
      Barrier::arrive(&ss.bar_empty[stage]);  // Q, dO, LSE, D of this stage are no longer read
    }
  }

  store_dk_dv<Traits>(p, tdKrdK, tdVrdV, tdKVcdKV, n_block * kBlockN + wn * 64, wd * kDKV, hk,
                      bidb, [&](int) { return p.softmax_scale; });
}

}  // namespace jax_fa3::flash_bwd
