// Key-major consumer mainloop (d <= 128: 128-key blocks, warpgroup wg owns keys
// [wg*64, wg*64+64)). Per Q block of kBlockM rows, warpgroup wg:
//   S^T = K_wg Q^T, dP^T = V_wg dO^T (wgmma SS, keys on M, rows on N);
//   P^T = exp2(S^T*scale*log2e - lse*log2e) while dP^T still runs (0 where masked), then
//   dS^T = P^T (dP^T - D) [x (1 - t^2), t = tanh(S^T*scale/cap)];
//   P^T -> Element registers, dV += P^T dO issued at once (RS: A from registers);
//   dS^T -> Element registers and into the shared dS tile (rows contiguous; stmatrix),
//   fence.proxy.async,
//   named barrier (dQ needs both warpgroups' keys; the tile is rewritten once the other
//   warpgroup's dQ wgmma of the previous block finished: a one-way barrier, sync.cuh);
//   dQ = dS K (SS, the dS tile is an MN-major A), dK += dS^T Q (RS); dQ is stored while dK runs.
//   With 80-row Q blocks (Traits::kDqTransposed): dS^T goes to a key-contiguous dS tile by
//   stmatrix.trans and dQ^T = K^T dS^T (SS, the dS tile a K-major B) takes dQ's place.
// P never touches shared memory, and dV / dK read only their B operand from it.
// fp8 (Traits::kFp8, fp8_traits.cuh): S^T = k8 q8^T (e4m3) descaled per (key, row) into the exp2
// argument, which gives P' = 2^8 r P directly (r is folded into the LSE row); dV += P'^T dO8 and
// dK += y^T q8 take e4m3 A operands packed from the accumulators (common/fp8_a_operand.cuh), y
// against the lazy per-key maxima of fp8_dk_operand.cuh; dS' goes to the dS tile for dQ as here.
#pragma once
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "common/accumulator_fragment.cuh"
#include "common/fp8_a_operand.cuh"
#include "flash_bwd/consumer_common.cuh"
#include "flash_bwd/fp8_dk_operand.cuh"

namespace jax_fa3::flash_bwd {

// kSoftcap is a template parameter (one kernel each), not a branch inside the loop: the softcap
// loop accumulates dP^T onto -D (below), and a run-time choice of the dP^T wgmma's initial state
// made ptxas serialize every wgmma of the kernel (C7512).
template <typename Traits, bool kSoftcap, bool kKeyRanges>
__device__ __forceinline__ void run_consumer_key_major(KernelParamsOf<Traits> const& p,
                                                       typename Traits::SharedStorage& ss,
                                                       int n_block, int hk, int bidb, int group,
                                                       const BlockGeometry& geom,
                                                       int m_begin, int m_end) {
  using namespace cute;
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kDQ = Traits::kDQ;
  constexpr int kDqRows = Traits::kDqRows;
  constexpr int kStages = Traits::kStages;
  constexpr uint32_t kMma = Traits::kNumMmaThreads;
  static_assert(Traits::kKeyMajor && Traits::kDKV == kHeadDim);
  constexpr bool kFp8 = Traits::kFp8;
  using Barrier = cutlass::arch::ClusterBarrier;
  const int n_iters = (m_end - m_begin) * group;
  // The one-way P/dS-free barrier (sync.cuh), except where its two barrier ids cost registers the
  // kernel does not have: the 80-row kernel (wg not warp-uniform, 16 bytes spilled) and d = 64
  // with softcap and key ranges (12 bytes). Those keep the two-way rendezvous on kPdSFree.
  constexpr bool kOneWayPdSFree = !Traits::kDqTransposed && !(kSoftcap && kKeyRanges);
  // Warp-uniform by construction (a broadcast from lane 0): the compiler then keeps everything
  // derived from it, the wgmma descriptors of this warpgroup's operand slices above all, on the
  // uniform datapath instead of computing them per thread and moving them over (R2UR; d = 128:
  // 1127 -> 1045 instructions in the loop). Not in the 80-row kernel, which then spilled 12 bytes.
  const int wg = Traits::kDqTransposed ? int(threadIdx.x / 128) - 1
                                       : __shfl_sync(0xffffffffu, threadIdx.x / 128, 0) - 1;
  const int tid = threadIdx.x % 128;        // thread within the warpgroup
  const int ctid = threadIdx.x - 128;       // thread within the consumers

  typename Traits::MmaS mma_s;      // S^T (16-bit: the same GEMM as dP^T)
  typename Traits::MmaSdP mma_sdp;  // dP^T
  typename Traits::MmadKV mma_dkv;
  typename Traits::MmadQ mma_dq;
  auto thr_s = mma_s.get_thread_slice(tid);
  auto thr_sdp = mma_sdp.get_thread_slice(tid);
  auto thr_dkv = mma_dkv.get_thread_slice(tid);
  auto thr_dq = mma_dq.get_thread_slice(tid);

  Tensor sK = make_tensor(make_smem_ptr(ss.k), typename Traits::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(ss.v), typename Traits::SmemLayoutKV{});
  Tensor sKt = make_tensor(make_smem_ptr(ss.k), typename Traits::SmemLayoutKt{});
  Tensor sdS = make_tensor(make_smem_ptr(ss.ds), typename Traits::SmemLayoutPdS{});

  // The keys of S^T: K, or k8 (fp8; sK then holds K~, read by dQ only).
  Tensor sKs = [&] {
    if constexpr (kFp8) {
      return make_tensor(make_smem_ptr(ss.k8), typename Traits::SmemLayoutK8{});
    } else {
      return sK;
    }
  }();

  // This warpgroup's operand slices (all cuts fall on swizzle-atom boundaries, see traits).
  Tensor tSrK = thr_s.partition_fragment_A(
      local_tile(sKs, Shape<_64, Int<kHeadDim>>{}, make_coord(wg, _0{})));
  Tensor tSrV = thr_sdp.partition_fragment_A(
      local_tile(sV, Shape<_64, Int<kHeadDim>>{}, make_coord(wg, _0{})));
  // dQ: rows [dq_row0, +kDqRows) x d columns [dq_col0, +kDQ), all kBlockN keys: A = the dS
  // slice, B = the K^T slice. Transposed (dQ^T): A = the K^T slice (d columns [dq_col0, +kDQ)),
  // B = the whole dS tile.
  auto [tdQrA, tdQrB] = [&] {
    Tensor kt = local_tile(sKt, Shape<Int<kDQ>, Int<kBlockN>>{},
                           make_coord(Traits::dq_col0(wg) / kDQ, _0{}));
    if constexpr (Traits::kDqTransposed) {
      return cute::make_tuple(thr_dq.partition_fragment_A(kt), thr_dq.partition_fragment_B(sdS));
    } else {
      Tensor ds = local_tile(sdS, Shape<Int<kDqRows>, Int<kBlockN>>{},
                             make_coord(Traits::dq_row0(wg) / kDqRows, _0{}));
      return cute::make_tuple(thr_dq.partition_fragment_A(ds), thr_dq.partition_fragment_B(kt));
    }
  }();
  // This lane's stmatrix row address in the dS tile at x4 number 0 (traits: ds_stmatrix_offset).
  const uint32_t ds_lane_offset = Traits::ds_stmatrix_offset(wg, tid);
  // fp8 and softcap: dS^T leaves as 32-bit pair stores at these byte offsets instead
  // (stmatrix's four packed registers at a time made those kernels spill 12-28 bytes).
  constexpr bool kPairStores = kFp8 || kSoftcap;
  [[maybe_unused]] auto tdSoff = [&] {
    if constexpr (kPairStores) {
      return Traits::pds_store_offsets(thr_sdp, wg);
    } else {
      return 0;
    }
  }();
  const uint32_t ds_smem = cute::cast_smem_ptr_to_uint(ss.ds);

  Tensor tSrS = partition_fragment_C(mma_s, Shape<_64, Int<kBlockM>>{});     // S^T, then P^T
  Tensor tSrdP = partition_fragment_C(mma_sdp, Shape<_64, Int<kBlockM>>{});  // dP^T, then dS^T
  Tensor tdVrdV = partition_fragment_C(mma_dkv, Shape<_64, Int<kHeadDim>>{});
  Tensor tdKrdK = partition_fragment_C(mma_dkv, Shape<_64, Int<kHeadDim>>{});
  Tensor tdQrdQ = partition_fragment_C(mma_dq, typename Traits::DqTile{});
  // P^T and dS^T as A operands of dV / dK. For 16-bit types the S^T accumulator order is the
  // A-fragment order (the same fact the forward's P V uses), so conversion is element-wise.
  // fp8: P'^T and y^T in e4m3, packed in place order (common/fp8_a_operand.cuh).
  using ElementA = typename Traits::MmadKV::ValTypeA;
  Tensor tdVrP = make_tensor<ElementA>(partition_shape_A(mma_dkv, Shape<_64, Int<kBlockM>>{}));
  Tensor tdKrdS = make_tensor<ElementA>(partition_shape_A(mma_dkv, Shape<_64, Int<kBlockM>>{}));
  static_assert(decltype(size(tdVrP))::value == decltype(size(tSrS))::value);
  constexpr int kFp8Steps = decltype(size(tSrS))::value / 16;  // k32 steps of the A operands
  clear(tdVrdV);
  clear(tdKrdK);

  // (key, row) of every S^T accumulator element, tile-local; (key, d) of every dK/dV element.
  Tensor tScS = thr_sdp.partition_C(make_identity_tensor(Shape<_64, Int<kBlockM>>{}));
  Tensor tdKVcdKV = thr_dkv.partition_C(make_identity_tensor(Shape<_64, Int<kHeadDim>>{}));

  const int off = p.s_k - p.s_q;  // whole rows' diagonal
  const int wl = geom.window_left;
  const int wr = geom.window_right;
  const int key_base = n_block * kBlockN + wg * 64;

  // fp8: each of the thread's two keys' factor of the exp2 argument, softmax_scale * log2(e) *
  // its k8 scale (0 past s_k: masked anyway), and the dK operand's running maxima.
  [[maybe_unused]] float key_coef[2];
  [[maybe_unused]] Fp8DkOperandScale dk_operand;
  if constexpr (kFp8) {
    const float* k_scale = p.k_scale + (int64_t(bidb) * p.h_k + hk) * p.s_k;
    CUTE_UNROLL
    for (int r = 0; r < 2; ++r) {
      const int key = key_base + get<0>(tScS(2 * r));  // element 2r is on key row r
      key_coef[r] = key < p.s_k ? p.score_log2 * __ldg(k_scale + key) : 0.f;
    }
  }

  if (n_iters > 0) Barrier::wait(&ss.bar_kv, 0);

  int it = 0;
  for (int g = 0; g < group; ++g) {
    const int qh = hk * group + g;
    for (int m = m_begin; m < m_end; ++m, ++it) {
      // The previous block's wgmmas that read the P / dS tiles completed before this warpgroup
      // left it: the other warpgroup may overwrite them. Arriving here, not at the end of that
      // block, needs no "not the last block" test: arrivals and syncs (sync.cuh) both skip it = 0.
      if (kOneWayPdSFree && it > 0) named_barrier_arrive(pds_free_barrier(wg ^ 1), kMma);
      const int stage = it % kStages;
      Barrier::wait(&ss.bar_full[stage], (it / kStages) & 1);

      Tensor sQ = make_tensor(make_smem_ptr(ss.q + stage * Traits::kSizeQs),
                              typename Traits::SmemLayoutQs{});
      Tensor sdO = make_tensor(make_smem_ptr(ss.dout + stage * Traits::kSizeQ),
                               typename Traits::SmemLayoutQ{});
      // The B operands of dK and dV: transposed views of Q and dO, or (fp8) the separately
      // loaded q8^T and dO8^T.
      Tensor sQt = [&] {
        if constexpr (kFp8) {
          return make_tensor(make_smem_ptr(ss.qt + stage * Traits::kSizeT8),
                             typename Traits::SmemLayoutT8{});
        } else {
          return make_tensor(make_smem_ptr(ss.q + stage * Traits::kSizeQ),
                             typename Traits::SmemLayoutQt{});
        }
      }();
      Tensor sdOt = [&] {
        if constexpr (kFp8) {
          return make_tensor(make_smem_ptr(ss.doutt + stage * Traits::kSizeT8),
                             typename Traits::SmemLayoutT8{});
        } else {
          return make_tensor(make_smem_ptr(ss.dout + stage * Traits::kSizeQ),
                             typename Traits::SmemLayoutQt{});
        }
      }();

      // LSE and D belong to the query row, the accumulator's column here: each thread reads
      // them from shared memory per column pair (a warp touches 4 distinct addresses: broadcast).
      const float* lse_s = ss.lse_log2[stage];
      const float* dpsum_s = ss.dpsum[stage];
      // Softcap: dP^T accumulates onto -D, so the GEMM yields dP^T - D and the elementwise code
      // holds no D (with it, that path spilled at d = 64). Filled before any wgmma is in flight:
      // written while S^T ran, ptxas made the dP^T wgmma wait for S^T (C7517).
      if constexpr (kSoftcap) {
        CUTE_UNROLL
        for (int i = 0; i < size(tSrdP); ++i) tSrdP(i) = -dpsum_s[get<1>(tScS(i))];
        warpgroup_fence_operand(tSrdP);  // every copy made here, not sunk past the S^T wgmma
      }
      wg_gemm<true>(mma_s, tSrK, thr_s.partition_fragment_B(sQ), tSrS);
      wg_gemm<!kSoftcap>(mma_sdp, tSrV, thr_sdp.partition_fragment_B(sdO), tSrdP);
      const int row_base = m * kBlockM;
      bool need_mask;
      if constexpr (kKeyRanges) {
        need_mask = keys_need_mask(q_block_keys(p, bidb, m), key_base, 64);
      } else {
        need_mask = piece_needs_mask(row_base, kBlockM, key_base, 64, RowBounds{p.s_q, p.s_k, off},
                                     wl, wr);
      }
      // Key ranges: the query rows' (lo, hi), per column pair like LSE and D.
      [[maybe_unused]] uint32_t ranges_s = 0;
      if constexpr (kKeyRanges) ranges_s = cute::cast_smem_ptr_to_uint(ss.key_ranges[stage]);
      // fp8: the rows' q8 scales, per column pair like LSE.
      [[maybe_unused]] const float* q_scale_s = nullptr;
      if constexpr (kFp8) q_scale_s = ss.q_scale[stage];
      auto p_and_ds = [&](auto mask) {
        constexpr bool kMask = decltype(mask)::value;
        auto visible = [&](int i) {
          const int gi = row_base + get<1>(tScS(i));
          const int gj = key_base + get<0>(tScS(i));
          if constexpr (kKeyRanges) {
            const int2 keys = ld_shared_pair_at_use(ranges_s + 8 * get<1>(tScS(i)));
            return bool((gj >= keys.x) & (gj < keys.y));
          }
          // Whole rows: block_range.h's rule written out over the kernel parameters, the form
          // this loop was tuned with (through a RowBounds ptxas schedules the masked path
          // differently). Branch-free: & rather than &&.
          return bool((gi < p.s_q) & (gj < p.s_k) & ((wl < 0) | (gj >= gi + off - wl)) &
                      ((wr < 0) | (gj <= gi + off + wr)));
        };
        if constexpr (kFp8) {
          // P'^T = exp2(S^T * (q scale * key coefficient) - LSE'), the emulation's order.
          CUTE_UNROLL
          for (int i = 0; i < size(tSrS); ++i) {
            const int row = get<1>(tScS(i));
            const float pv =
                exp2f(tSrS(i) * (q_scale_s[row] * key_coef[frag_row(i)]) - lse_s[row]);
            tSrS(i) = (!kMask || visible(i)) ? pv : 0.f;
          }
        } else if constexpr (!kSoftcap) {
          // P^T while dP^T still runs; 0 where masked: a select, so no inf/NaN reaches the GEMMs.
          CUTE_UNROLL
          for (int i = 0; i < size(tSrS); ++i) {
            const float pv = exp2f(tSrS(i) * p.score_log2 - lse_s[get<1>(tScS(i))]);
            tSrS(i) = (!kMask || visible(i)) ? pv : 0.f;
          }
        }
        // With softcap, P and dS both need t = tanh(S * scale / cap): all of it waits for dP
        // (t computed early and kept in place of S made ptxas spill at d = 64).
        warpgroup_wait<0>();
        warpgroup_fence_operand(tSrdP);
        CUTE_UNROLL
        for (int i = 0; i < size(tSrS); ++i) {
          if constexpr (kSoftcap) {
            const float t = tanh_fast(tSrS(i) * p.tanh_in_scale);
            const float pv = exp2f(t * p.score_log2 - lse_s[get<1>(tScS(i))]);
            const bool vis = !kMask || visible(i);
            tSrS(i) = vis ? pv : 0.f;
            tSrdP(i) = vis ? pv * tSrdP(i) * (1.f - t * t) : 0.f;
          } else {
            // P is already 0 where masked.
            tSrdP(i) = tSrS(i) * (tSrdP(i) - dpsum_s[get<1>(tScS(i))]);
          }
        }
      };
      warpgroup_wait<1>();
      warpgroup_fence_operand(tSrS);
      if (need_mask) {
        p_and_ds(cute::true_type{});
      } else {
        p_and_ds(cute::false_type{});
      }

      // dV += P^T dO straight from registers; it runs while dS^T is converted and shared.
      if constexpr (kFp8) {
        fp8::pack_e4m3_a_operand<0, kFp8Steps>([&](int i) { return tSrS(i); }, tdVrP);
      } else {
        CUTE_UNROLL
        for (int i = 0; i < size(tSrS); ++i) tdVrP(i) = static_cast<Element>(tSrS(i));
      }
      wg_gemm<false>(mma_dkv, tdVrP, thr_dkv.partition_fragment_B(sdOt), tdVrdV);
      if constexpr (!kFp8) {
        CUTE_UNROLL
        for (int i = 0; i < size(tSrdP); ++i) tdKrdS(i) = static_cast<Element>(tSrdP(i));
      }

      // The other warpgroup's dQ wgmma of the previous block has finished reading the dS tile
      // (this warpgroup's own did before it left that block).
      if (it > 0) {
        named_barrier_sync(kOneWayPdSFree ? pds_free_barrier(wg) : NamedBarrier::kPdSFree, kMma);
      }
      if constexpr (kPairStores) {
        CUTE_UNROLL
        for (int i = 0; i < size(tSrdP); i += 2) {
          const uint32_t off_b =
              static_cast<uint32_t>(reinterpret_cast<uintptr_t>(raw_pointer_cast(&tdSoff(i))));
          if constexpr (kFp8) {  // dS' rounded to 16 bits here only (dK takes it through y)
            st_shared_b32(ds_smem + off_b, pack2<Element>(tSrdP(i), tSrdP(i + 1)));
          } else {
            st_shared_b32(ds_smem + off_b, pack2<Element>(tdKrdS(i), tdKrdS(i + 1)));
          }
        }
      } else {
        CUTE_UNROLL
        for (int x = 0; x < kBlockM / 16; ++x) {
          auto pair = [&](int q) {
            const int v = Traits::ds_stmatrix_value(x, q);
            return pack2<Element>(tdKrdS(v), tdKrdS(v + 1));
          };
          stmatrix_x4<Traits::kDqTransposed>(ds_smem + Traits::ds_stmatrix_at(ds_lane_offset, x),
                                             pair(0), pair(1), pair(2), pair(3));
        }
      }
      cutlass::arch::fence_view_async_shared();  // generic-proxy writes -> wgmma (async proxy)
      named_barrier_sync(NamedBarrier::kPdSReady, kMma);

      wg_gemm<true>(mma_dq, tdQrA, tdQrB, tdQrdQ);
      if constexpr (kFp8) {
        // While dQ runs: the block's dK operand maxima (dK is idle: the previous block's dK
        // wgmma completed before its bar_empty arrival), then y^T in e4m3.
        // y^T = dS'^T * w replaces dS'^T in place (the dS tile holds dS' for dQ).
        const float* dk_coef_s = ss.dk_coef[stage];
        CUTE_UNROLL
        for (int i = 0; i < size(tSrdP); ++i) tSrdP(i) *= dk_coef_s[get<1>(tScS(i))];
        dk_operand.update(tSrdP, tdKrdK);
        fp8::pack_e4m3_a_operand<0, kFp8Steps>(
            [&](int i) { return dk_operand.operand(tSrdP(i), i); }, tdKrdS);
      }
      wg_gemm<false>(mma_dkv, tdKrdS, thr_dkv.partition_fragment_B(sQt), tdKrdK);
      warpgroup_wait<1>();  // dV and dQ are done (groups complete in order); dK may still run
      warpgroup_fence_operand(tdQrdQ);
      warpgroup_fence_operand(tdVrdV);

      store_dq_partial<Traits, kKeyRanges>(p, ss, tdQrdQ, wg, tid, ctid, geom, bidb, qh, m, n_block,
                               stage);

      warpgroup_wait<0>();
      warpgroup_fence_operand(tdKrdK);
      Barrier::arrive(&ss.bar_empty[stage]);  // Q, dO, LSE, D of this stage are no longer read
    }
  }

  if constexpr (kFp8) {
    store_dk_dv<Traits>(
        p, tdKrdK, tdVrdV, tdKVcdKV, n_block * kBlockN + wg * 64, 0, hk, bidb,
        [&](int r) { return dk_operand.dk_scale(r, p.softmax_scale); },
        __ldg(p.dv_scale + int64_t(bidb) * p.h_k + hk));
  } else {
    store_dk_dv<Traits>(p, tdKrdK, tdVrdV, tdKVcdKV, n_block * kBlockN + wg * 64, 0, hk, bidb,
                        [&](int) { return p.softmax_scale; });
  }
}

}  // namespace jax_fa3::flash_bwd
