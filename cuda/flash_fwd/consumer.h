// The consumer warpgroups: S = QK^T (wgmma SS), online softmax in registers, O += PV (wgmma RS),
// then the epilogue; intra-warpgroup overlap and ping-pong between the warpgroups. All consumer
// warpgroups (2, or 3 for fp8 d64) work on the same tile, 64 rows each, and walk the same K/V
// blocks (n_max - 1 down to n_min), so every barrier count below is per tile.
#pragma once
#include "common/cute_config.h"
#include <cute/tensor.hpp>
#include <type_traits>
#include <utility>

#include "flash_fwd/barriers.h"
#include "flash_fwd/block_info.h"
#include "flash_fwd/epilogue.h"
#include "flash_fwd/fp8/row_sum.h"
#include "flash_fwd/fp8/v_mean.h"
#include "flash_fwd/fp8/softmax.h"
#include "flash_fwd/kernel_params.h"
#include "flash_fwd/softmax.h"
#include "flash_fwd/fp8/tail_split.h"
#include "flash_fwd/trace.h"
#include "flash_fwd/wgmma.h"

namespace jax_fa3::fwd {

using namespace cute;

// One arrive per consumer warp releases a K or V stage (the empty barriers count 8): each warp
// arrives after its own wgmma.wait, so the stage is free only when all warps are done with it.
__device__ __forceinline__ void release_stage(uint64_t* empty_bar) {
  if (threadIdx.x % 32 == 0) mbar_arrive(empty_bar);
}

// f(integral_constant<int, i>) for i = 0 .. N-1, unrolled at compile time.
template <class F, int... I>
__device__ __forceinline__ void static_for_impl(F&& f, std::integer_sequence<int, I...>) {
  (f(std::integral_constant<int, I>{}), ...);
}
template <int N, class F>
__device__ __forceinline__ void static_for(F&& f) {
  static_for_impl(f, std::make_integer_sequence<int, N>{});
}

// P (fp32 probabilities in the S accumulator) -> Element A-operand registers of the PV wgmma.
// For 16-bit types the accumulator order is the A-fragment order (see softmax.h), so this is an
// element-wise conversion into a tensor with the A-fragment shape.
// [kStepBegin, kStepEnd): the k16 steps to convert (8 elements each).
template <int kStepBegin, int kStepEnd, class FragS, class FragP>
__device__ __forceinline__ void convert_p(FragS const& tSrS, FragP& tOrP) {
  using Element = typename FragP::value_type;
  static_assert(decltype(size(tOrP))::value == decltype(size(tSrS))::value);
  static_assert(decltype(size<0>(tOrP))::value == 8, "8 A elements per thread and k16 step");
#pragma unroll
  for (int i = 8 * kStepBegin; i < 8 * kStepEnd; ++i) tOrP(i) = static_cast<Element>(tSrS(i));
}

// Ping-pong (round robin) between the kNumWarpGroups consumer warpgroups (2, or 3 for 192-row
// tiles; the fp8 ones take no turns today, Traits::kPingPong): named barriers of 256 threads
// each (128 sync + 128 arrive). A warpgroup issues its GEMMs only in its turn and hands the turn
// to the next warpgroup right after issuing, so the tensor cores run one warpgroup's GEMMs while
// the others do their softmax.
// Protocol: the last warpgroup pre-arrives on warpgroup 0's barrier (warpgroup 0 goes first);
// every turn is sync(own) ... arrive(next); all warpgroups take the same number of turns per tile
// (one per K/V block plus one with the overlap, two per block without), so the k-th sync of one
// pairs with the k-th arrive of its predecessor (the (k-1)-th for warpgroup 0, which had the
// pre-arrival), and strict round-robin order means no barrier ever collects a second generation
// of arrivals. The one arrive left over at the end is consumed by warpgroup 0 before exit.
// Code shape: with two warpgroups the compiler cannot prove wg < 2, so pass_turn() keeps three
// arms and becomes branches with one BAR.ARV each instead of two predicated BAR.ARVs. That shape
// measured faster for the fp8 d128 kernel (795-800 vs 727-742 TFLOP/s, H200, 8k, fwd_timeline.cu;
// the SASS differs only there) and is kept; why it is faster is not understood.
template <int kNumWarpGroups>
struct PingPong {
  static_assert(kNumWarpGroups == 2 || kNumWarpGroups == 3);
  int wg;  // consumer warpgroup index
  // Barrier ids stay compile-time constants (a run-time id makes ptxas reserve all 16).
  __device__ __forceinline__ void start() const {
    if (wg == kNumWarpGroups - 1) named_barrier_arrive(kBarrierWarpGroup1, 256);
  }
  __device__ __forceinline__ void wait_turn() const {
    if (wg == 0) {
      named_barrier_sync(kBarrierWarpGroup1, 256);
    } else if (kNumWarpGroups == 2 || wg == 1) {
      named_barrier_sync(kBarrierWarpGroup2, 256);
    } else {
      named_barrier_sync(kBarrierWarpGroup3, 256);
    }
  }
  __device__ __forceinline__ void pass_turn() const {
    if (wg == kNumWarpGroups - 1) {
      named_barrier_arrive(kBarrierWarpGroup1, 256);
    } else if (wg == 0) {
      named_barrier_arrive(kBarrierWarpGroup2, 256);
    } else {
      named_barrier_arrive(kBarrierWarpGroup3, 256);
    }
  }
  __device__ __forceinline__ void finish() const {
    if (wg == 0) named_barrier_sync(kBarrierWarpGroup1, 256);
  }
};

// Traits::kPingPong false: the warpgroups issue their GEMMs whenever they are ready.
struct NoPingPong {
  int wg;
  __device__ __forceinline__ void start() const {}
  __device__ __forceinline__ void wait_turn() const {}
  __device__ __forceinline__ void pass_turn() const {}
  __device__ __forceinline__ void finish() const {}
};

// The fp8 kernel (Traits::kFp8) differs in a few `if constexpr` places only, which the 16-bit
// instantiations do not compile: S is descaled per column (k_scale) and per row (q_scale, folded
// into the exp2 FFMA), P is 2^6-shifted and packed into e4m3 in place (fp8/softmax.h,
// fp8/layout.h), and O is divided by 2^6 * rowsum and multiplied by v_scale.
template <class Traits>
__device__ __forceinline__ void run_consumer(KernelParams<Traits> const& p,
                                             typename Traits::SharedStorage& ss, int thread_idx) {
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kNumWarpGroups = Traits::kNumConsumerWarpGroups;
  const FlashFwdScalars& sc = p.s;

  typename Traits::TiledMmaQK mma_qk;
  typename Traits::TiledMmaPV mma_pv;
  // The S GEMM's shared-memory descriptors depend on the thread's warpgroup only. Slicing by a
  // warpgroup index that ptxas can see is warp-uniform (a shuffle from lane 0) lets it keep them
  // in uniform registers, instead of moving each one over by R2UR before every wgmma. fp8 only:
  // +2% there at d128; the bf16 kernel sliced so measured even at 8k and 1.7% slower causal
  // (H200, 2026-12-03, benchmarks/RESULTS.md).
  const int qk_slice_thread =
      Traits::kFp8 ? 128 * __shfl_sync(0xffffffffu, thread_idx / 128, 0) : thread_idx;
  auto thr_qk = mma_qk.get_thread_slice(qk_slice_thread);
  auto thr_pv = mma_pv.get_thread_slice(thread_idx);

  Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename Traits::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename Traits::SmemLayoutK{});
  Tensor sVt = make_tensor(make_smem_ptr(ss.v.data()), typename Traits::SmemLayoutVt{});
  Tensor tSrQ = thr_qk.partition_fragment_A(sQ);   // smem descriptors (MMA, 1, K)
  Tensor tSrK = thr_qk.partition_fragment_B(sK);   // (MMA, 1, K, stage)
  Tensor tOrV = thr_pv.partition_fragment_B(sVt);  // (MMA, 1, K, stage)
  // P, the A operand of O += PV. Written only after the PV wgmma that read it has completed.
  Tensor tOrP = make_tensor<typename Traits::Element>(
      partition_shape_A(mma_pv, Shape<Int<kBlockM>, Int<kBlockN>>{}));
  constexpr bool kFp8 = Traits::kFp8;
  constexpr int kKeyGroups = kFp8 ? kBlockN / kFp8KeyScaleGroup : 1;

  const int thread_in_wg = thread_idx % 128;
  const FragCoord fc = FragCoord::of_thread(thread_in_wg);
  const int off = sc.s_k - sc.s_q;  // whole rows' diagonal
  const bool use_softcap = sc.softcap > 0.f;
  using Turns = std::conditional_t<Traits::kPingPong, PingPong<kNumWarpGroups>, NoPingPong>;
  const Turns pingpong{thread_idx / 128};
  pingpong.start();

  // p.early_q_release() (kernel_params.h): Q's buffer is dead for a warp once its wait for the S
  // GEMM of the tile's last K/V block (n_min) returned; one arrive per consumer warp (as for the
  // K/V stages) lets the producer load the next tile's Q under this tile's last softmax, PV GEMM
  // and epilogue. Otherwise the epilogue releases Q's buffer after the TMA store of O.
  const bool early_q_release = p.early_q_release();
  // fp8: the row sums' GEMM state (fp8/row_sum.h); empty for 16-bit types.
  TensorRowSum<Traits, kFp8> row_sums(ss, thread_idx);
  auto release_q_after_last_s = [&](int n_block, const BlockRange& range) {
    if (early_q_release && n_block == range.n_min) release_stage(&ss.q_empty);
  };

  PipelineState<Traits::kStages> kv;
  uint32_t q_phase = 0;
  [[maybe_unused]] int trace_step = 0;  // trace.h (no-op unless JAX_FA3_FWD_TRACE)
  static_assert(!Traits::kTailSplit || (!Traits::kIntraWgOverlap && !Traits::kPingPong),
                "tail-split pieces run in the plain order without turns");
  for (int index = blockIdx.x; index < num_work_items<Traits::kTailSplit>(p.scheduler);
       index += gridDim.x) {
    const ItemBlocks work = item_blocks<Traits::kTailSplit, Traits::kKeyRanges>(
        p.scheduler, index, kBlockM, kBlockN, sc);
    const TileCoord c = work.tile;
    // Tail-split pieces (fp8/tail_split.h): the blocks this item visits; those >= max_only_from
    // (the low piece's top blocks) only advance the row maxima.
    const PieceRange piece = work.piece;
    const BlockRange range = piece.visit;
    const int row_g = c.m_block * kBlockM + 64 * (thread_idx / 128) + fc.row0;
    // Key ranges: this thread's two rows' keys, read once per tile (the array has whole tiles of
    // rows, so no row test), or derived from the batch row's bounds.
    [[maybe_unused]] KeyRange row_keys[2];
    if constexpr (Traits::kKeyRanges) {
      if (sc.row_bounds != nullptr) {
        const RowBounds rb = batch_row_bounds(sc, c.batch);
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          row_keys[r] = bounded_key_range(rb, row_g + 8 * r, sc.s_k, sc.window_left,
                                          sc.window_right);
        }
      } else {
        const int s_pad = key_range_rows(sc.s_q);
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          row_keys[r] = key_range(sc.key_ranges, c.batch, s_pad, row_g + 8 * r, sc.s_k);
        }
      }
    }
    // fp8 only: per-row exp2 scales (softmax_scale * log2 e * q_scale of the row's block), this
    // (batch, kv-head)'s per-key k scales and its v scale (1 for 16-bit types, which RowScaling
    // does not read).
    [[maybe_unused]] float row_scale[2];
    [[maybe_unused]] const float* col_scale = nullptr;
    float v_scale = 1.f;
    // fp8 only: k scales of the kKeyGroups 32-key groups of the block being finished (ks_cur)
    // and of the next block (ks_next), loaded one block ahead so that their L2 latency hides
    // behind a whole block; all 1 for generic block sizes (descale_columns instead).
    [[maybe_unused]] float ks_cur[kKeyGroups];
    [[maybe_unused]] float ks_next[kKeyGroups];
    if constexpr (kFp8) {
      const int kv_head = c.head / (sc.h / sc.h_k);
      const int64_t bh_k = int64_t(c.batch) * sc.h_k + kv_head;
      const float* q_scale = p.q_scale + (int64_t(c.batch) * sc.h + c.head) * p.num_q_blocks;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = row_g + 8 * r;
        row_scale[r] = row < sc.s_q ? p.scale_log2 * __ldg(q_scale + row / p.block_size) : 1.f;
      }
      col_scale = p.k_col_scale + bh_k * p.s_pad;
      v_scale = __ldg(p.v_scale + bh_k);
      stage_v_mean(ss.v_mean, p.v_mean + bh_k * sc.d, sc.d, thread_idx);
    }
    // Block n_block's kKeyGroups group scales are slots kKeyGroups * n_block.. of k_col's row,
    // padded with 1 to whole blocks (fp8/vt.h, fp8_k_col_entry): one 16-byte load, no bounds
    // test but the tile's (it replaced four guarded loads: ~30 instructions a block). The
    // look-ahead past the tile's first block reloads that block; a tile that sees no key (s_k = 0:
    // k_col may be empty) loads nothing. Generic block sizes: all 1 (descale_columns).
    auto load_key_group_scales = [&](int n_block, float (&ks)[kKeyGroups]) {
      if constexpr (kFp8) {
        static_assert(kKeyGroups == 4, "a block's group scales are one float4");
        const float4 four = range.n_max > range.n_min
                                ? __ldg(reinterpret_cast<const float4*>(col_scale) +
                                        max(n_block, range.n_min))
                                : make_float4(1.f, 1.f, 1.f, 1.f);
        const bool grouped = p.k_scale_grouped;
        ks[0] = grouped ? four.x : 1.f;
        ks[1] = grouped ? four.y : 1.f;
        ks[2] = grouped ? four.z : 1.f;
        ks[3] = grouped ? four.w : 1.f;
      }
    };
    load_key_group_scales(range.n_max - 1, ks_cur);

    // Raw scores -> capped, masked scores, in place.
    auto finish_scores = [&](auto& tSrS, int n_block) {
      if constexpr (kFp8) {
        if (!p.k_scale_grouped) descale_columns(tSrS, col_scale, n_block * kBlockN + fc.col0, p.s_pad);
      } else {
        if (use_softcap) apply_softcap(tSrS, sc.softcap_pre, sc.softcap);
      }
      if constexpr (Traits::kKeyRanges) {
        if (keys_need_mask(work.keys, n_block * kBlockN, kBlockN)) {
          apply_key_ranges(tSrS, row_keys, n_block * kBlockN + fc.col0);
        }
      } else if (block_needs_mask(c.m_block, n_block, kBlockM, kBlockN, sc.s_k, sc.s_k - sc.s_q,
                                  sc.window_left, sc.window_right)) {
        apply_mask(tSrS, row_g, n_block * kBlockN + fc.col0, sc.s_k, off, sc.window_left,
                   sc.window_right);
      }
    };

    // S = QK^T of the K/V block in stage kv.stage, issued in this warpgroup's ping-pong turn and
    // waited for, then finished (capped, masked); frees the K stage, and Q after the tile's last S.
    auto block_scores = [&](int n_block) {
      Tensor tSrS = partition_fragment_C(mma_qk, Shape<Int<kBlockM>, Int<kBlockN>>{});
      mbar_wait(&ss.k_full[kv.stage], kv.phase);
      pingpong.wait_turn();
      warpgroup_gemm</*zero_init=*/true, /*wait=*/-1>(mma_qk, tSrQ, tSrK(_, _, _, kv.stage), tSrS);
      pingpong.pass_turn();
      warpgroup_wait<0>();
      release_stage(&ss.k_empty[kv.stage]);
      release_q_after_last_s(n_block, range);
      finish_scores(tSrS, n_block);
      return tSrS;
    };

    Tensor tOrO = partition_fragment_C(mma_pv, Shape<Int<kBlockM>, Int<kHeadDim>>{});
    clear(tOrO);
    constexpr bool kReduceMaxOnJump = [] {
      if constexpr (kFp8) return Traits::kReduceMaxOnJump;
      else return false;
    }();
    std::conditional_t<kFp8, Fp8OnlineSoftmax<kKeyGroups, kReduceMaxOnJump>, RowOnlineSoftmax>
        softmax;
    softmax.reset();
    row_sums.clear();
    float correction[2];
    // O *= correction; Traits::kSkipUnchangedRescale: only where a row of the warp changed its max.
    auto rescale_o = [&](const float (&factor)[2]) {
      row_sums.rescale(factor);
      if constexpr (Traits::kSkipUnchangedRescale) {
        rescale_rows_if_changed(tOrO, factor);
      } else {
        rescale_rows(tOrO, factor);
      }
    };
    // One softmax update in two halves, softmax_max() then softmax_exp(), so that the pipelined PV
    // (Traits::kPipelinedPv) can issue GEMM k-steps between parts of the exp2 pass. The exp2
    // argument is s * coef - shift: coef one scalar (16-bit) or per (row, key group) (fp8), shift
    // per row. n_block: the block being finished; fp8 starts the next block's scale loads here,
    // before using this block's.
    [[maybe_unused]] float coef[2][kKeyGroups];
    float shift[2];
    auto softmax_max = [&](auto const& tSrS, int n_block) {
      if constexpr (kFp8) {
        load_key_group_scales(n_block - 1, ks_next);
#pragma unroll
        for (int r = 0; r < 2; ++r) {
#pragma unroll
          for (int g = 0; g < kKeyGroups; ++g) coef[r][g] = row_scale[r] * ks_cur[g];
        }
        softmax.update_max(tSrS, coef, correction, shift);
      } else {
        softmax.update_max(tSrS, sc.scale_log2, correction, shift);
      }
      trace_stamp(pingpong.wg, trace_step, kTraceMaxDone);
    };
    // The flat S elements [begin, end) (compile-time constants); the last part also retires this
    // block's k scales (fp8).
    auto softmax_exp = [&](auto& tSrS, auto begin, auto end) {
      constexpr int kBegin = decltype(begin)::value;
      constexpr int kEnd = decltype(end)::value;
      if constexpr (kFp8) {
        softmax.template exponentiate<Traits::kExp2FmaPeriod, kBegin, kEnd>(tSrS, coef, shift);
        if constexpr (kEnd == decltype(size(tSrS))::value) {
#pragma unroll
          for (int g = 0; g < kKeyGroups; ++g) ks_cur[g] = ks_next[g];
        }
      } else {
        softmax.template exponentiate<Traits::kExp2FmaPeriod, kBegin, kEnd>(tSrS, sc.scale_log2,
                                                                            shift);
      }
    };
    auto softmax_update = [&](auto& tSrS, int n_block) {
      softmax_max(tSrS, n_block);
      softmax_exp(tSrS, Int<0>{}, size(tSrS));
    };
    // P's k-steps [begin, end) of the PV GEMM (compile-time constants).
    auto to_p = [&](auto const& tSrS, auto begin, auto end) {
      if constexpr (kFp8) {
        convert_p_fp8<decltype(begin)::value, decltype(end)::value>(tSrS, tOrP);
      } else {
        convert_p<decltype(begin)::value, decltype(end)::value>(tSrS, tOrP);
      }
    };
    constexpr auto kPvSteps = size<2>(tOrP);

    mbar_wait(&ss.q_full, q_phase);
    q_phase ^= 1;
    int n_block = range.n_max - 1;
    if constexpr (!Traits::kIntraWgOverlap) {
      if constexpr (Traits::kTailSplit) {
        // The low piece of a split tile first takes the row maxima of the high piece's blocks:
        // those the whole tile would have reached here. O and the row sums stay 0; V's stage
        // carries no data (the producer's plain arrive).
        for (; n_block >= piece.max_only_from; --n_block) {
          Tensor tSrS = partition_fragment_C(mma_qk, Shape<Int<kBlockM>, Int<kBlockN>>{});
          mbar_wait(&ss.k_full[kv.stage], kv.phase);
          warpgroup_gemm</*zero_init=*/true, /*wait=*/-1>(mma_qk, tSrQ, tSrK(_, _, _, kv.stage),
                                                          tSrS);
          warpgroup_wait<0>();
          release_stage(&ss.k_empty[kv.stage]);
          finish_scores(tSrS, n_block);
          softmax_max(tSrS, n_block);
#pragma unroll
          for (int g = 0; g < kKeyGroups; ++g) ks_cur[g] = ks_next[g];
          mbar_wait(&ss.v_full[kv.stage], kv.phase);
          release_stage(&ss.v_empty[kv.stage]);
          kv.advance();
        }
      }
      // Plain order: S = QK^T; softmax; O += PV (two ping-pong turns per block where taken).
      for (; n_block >= range.n_min; --n_block) {
        Tensor tSrS = block_scores(n_block);
        if constexpr (Traits::kPipelinedPv) {
          // Each k-step of P is exponentiated, converted and handed to the tensor cores at once,
          // so the PV GEMM runs under the rest of the exp2 pass instead of after it. O must be
          // rescaled before the first k-step accumulates into it.
          softmax_max(tSrS, n_block);
          rescale_o(correction);
          mbar_wait(&ss.v_full[kv.stage], kv.phase);
          pingpong.wait_turn();
          constexpr int kPerStep = decltype(size(tSrS))::value / kPvSteps;
          static_for<kPvSteps>([&](auto step) {
            // Keeps this step's exponentials from drifting past the previous step's GEMM issue.
            warpgroup_fence_operand(tSrS);
            softmax_exp(tSrS, Int<kPerStep * step>{}, Int<kPerStep * (step + 1)>{});
            to_p(tSrS, step, Int<step + 1>{});
            row_sums.template pv_ksteps<step, step + 1>(mma_pv, tOrP, tOrV(_, _, _, kv.stage), tOrO);
          });
          pingpong.pass_turn();
        } else {
          softmax_update(tSrS, n_block);
          rescale_o(correction);
          to_p(tSrS, Int<0>{}, kPvSteps);
          mbar_wait(&ss.v_full[kv.stage], kv.phase);
          pingpong.wait_turn();
          row_sums.template pv_ksteps<0, kPvSteps>(mma_pv, tOrP, tOrV(_, _, _, kv.stage), tOrO);
          pingpong.pass_turn();
        }
        warpgroup_wait<0>();
        release_stage(&ss.v_empty[kv.stage]);
        kv.advance();
      }
    } else if (n_block >= range.n_min) {
      // First block: S only (O is still zero, nothing to rescale).
      {
        Tensor tSrS = block_scores(n_block);
        softmax_update(tSrS, n_block);
        to_p(tSrS, Int<0>{}, kPvSteps);
      }
      // Steady state (intra-warpgroup overlap): issue S(n) = QK^T and O += P(n+1) V(n+1), then do
      // the softmax of S(n) while the PV GEMM is still running; O is rescaled only after it.
      for (--n_block; n_block >= range.n_min; --n_block) {
        const PipelineState<Traits::kStages> prev = kv;
        kv.advance();
        Tensor tSrS = partition_fragment_C(mma_qk, Shape<Int<kBlockM>, Int<kBlockN>>{});
        trace_stamp(pingpong.wg, trace_step, kTraceStart);
        mbar_wait(&ss.k_full[kv.stage], kv.phase);
        mbar_wait(&ss.v_full[prev.stage], prev.phase);
        trace_stamp(pingpong.wg, trace_step, kTraceKvReady);
        pingpong.wait_turn();
        trace_stamp(pingpong.wg, trace_step, kTraceTurn);
        warpgroup_gemm</*zero_init=*/true, /*wait=*/-1>(mma_qk, tSrQ, tSrK(_, _, _, kv.stage), tSrS);
        row_sums.template pv_ksteps<0, kPvSteps>(mma_pv, tOrP, tOrV(_, _, _, prev.stage), tOrO);
        pingpong.pass_turn();
        trace_stamp(pingpong.wg, trace_step, kTraceIssued);
        warpgroup_wait<1>();  // S(n) done (batches complete in order), PV may still run
        trace_stamp(pingpong.wg, trace_step, kTraceScoresReady);
        release_stage(&ss.k_empty[kv.stage]);
        release_q_after_last_s(n_block, range);
        finish_scores(tSrS, n_block);
        softmax_update(tSrS, n_block);
        trace_stamp(pingpong.wg, trace_step, kTraceSoftmaxDone);
        warpgroup_wait<0>();  // PV done: P's registers and V's stage are free, O is final
        trace_stamp(pingpong.wg, trace_step, kTracePvDone);
        release_stage(&ss.v_empty[prev.stage]);
        rescale_o(correction);
        to_p(tSrS, Int<0>{}, kPvSteps);
        trace_stamp(pingpong.wg, trace_step, kTraceEnd);
        ++trace_step;
      }
      // Last PV.
      mbar_wait(&ss.v_full[kv.stage], kv.phase);
      pingpong.wait_turn();
      row_sums.template pv_ksteps<0, kPvSteps>(mma_pv, tOrP, tOrV(_, _, _, kv.stage), tOrO);
      pingpong.pass_turn();
      warpgroup_wait<0>();
      release_stage(&ss.v_empty[kv.stage]);
      kv.advance();
    }

    // A tile with no visible K/V block ran no S GEMM: Q's buffer is released here.
    if (range.n_max <= range.n_min) release_q_after_last_s(range.n_min, range);

    row_sums.hand_over(softmax);
    bool write_out = true;
    if constexpr (Traits::kTailSplit) {
      // Whether the item is a piece, again from its index (not held in registers through the
      // loop: the empty asm hides that it is the same value). A piece leaves its partial in its
      // workspace slot for the merge (merge_if_last_piece, after the loop) and runs the epilogue
      // with its writes off (its barriers and Q-buffer release as usual): a branch that skipped
      // the epilogue made ptxas spill ~230 bytes inside the main loop of the 192-row d128 kernel.
      int index_again = index;
      asm volatile("" : "+r"(index_again));
      const int first_piece = p.scheduler.num_tiles - p.scheduler.num_split_tiles;
      if (index_again >= first_piece) {
        write_tail_piece<kHeadDim, kBlockM>(p.tail_partials, index_again - first_piece, tOrO,
                                            softmax, thread_idx);
        write_out = false;
      }
    }

    float inv_sum[2], lse[2];
    softmax.finalize(sc.scale_log2, v_scale, inv_sum, lse);
    rescale_rows(tOrO, inv_sum);
    // A row that sees no key ran with the tile's other rows, every score masked; only its
    // results are dropped.
    if constexpr (Traits::kKeyRanges) clear_rows_without_keys(tOrO, lse, row_keys);
    if constexpr (kFp8) {
      wait_v_mean<Traits::kNumConsumerThreads>();
      add_v_mean(tOrO, ss.v_mean, fc.col0, sc.d, inv_sum);
    }
    store_tile<Traits>(p, ss, tOrO, lse, c, thread_idx, write_out);
  }
  pingpong.finish();
  // The last tile's TMA store of O must have read shared memory before the CTA exits.
  if (early_q_release && thread_idx == 0) tma_store_wait<0>();
  // Last, so that nothing is live across the (not inlined) call.
  if constexpr (Traits::kTailSplit) merge_if_last_piece<Traits>(p, &ss.tail_ticket, thread_idx);
}

}  // namespace jax_fa3::fwd
