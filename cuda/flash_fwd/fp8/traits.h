// Compile-time shape of the fp8 (e4m3) forward: the same member names as KernelTraits
// (kernel_traits.h), so the producer / consumer / epilogue templates run it unchanged except for
// their `if constexpr (Traits::kFp8)` branches.
//
// Differences from the 16-bit traits:
// - Element e4m3, ElementOut bf16; k32 GMMA atoms (QGMMA) for both GEMMs.
// - fp8 wgmma needs both shared-memory operands K-major. For O += P V the K dimension is the keys,
//   so V arrives from a transposed copy Vt (b, h_k, d, s_pad) made by a pre-pass (fp8/vt.h) with
//   the keys permuted inside groups of 32 (fp8/layout.h), and its smem tile is (d, kBlockN)
//   keys-contiguous. P stays in registers (RS form).
// - O (bf16) cannot be staged in Q's fp8 buffer (half the bytes): it has its own buffer.
#pragma once
#include "flash_fwd/fp8/flash_fwd_fp8.h"
#include "flash_fwd/kernel_traits.h"

namespace jax_fa3::fwd {

// kBlockN (kFp8BlockN, fp8/flash_fwd_fp8.h) for every fp8 head dim. Registers per consumer
// thread (fp32 S kBlockN/2, e4m3 P kBlockN/8, fp32 O d/2) and smem (Q kBlockM*d + 2 stages of
// K and Vt kBlockN*d, all 1 byte, + O bf16 kBlockM*d*2):
//   d64 : 192x128  S 64 + P 16 + O  32 (plain)    12K + 2*2*8K  + 24K =  68 KB
//   d128: 128x128  S 64 + P 16 + O  64 (overlap)  16K + 2*2*16K + 32K = 112 KB
//         192x128  S 64 + P 16 + O  64 (plain)    24K + 2*2*16K + 48K = 136 KB
//   d256: 128x128  S 64 + P 16 + O 128 (plain)    32K + 2*2*32K + 64K = 224 KB
// Measured on the H200 (2026-11-30, 8k non-causal, benchmarks/RESULTS.md): d256 128x128 947-958
// TFLOP/s vs 128x96 866-876 (128x128 only fits since the k scales are per 32-key group: ptxas
// 13.0 spills 16 bytes, README); d128 128x160 705 and 128x192 677 (both
// spill) vs 128x128 731, 3 stages 736 (no gain). FA3 uses 192x160 / 128x224 / 128x128.
static_assert(kFp8BlockN == 128, "the table above");

// kBlockM: 128 (two consumer warpgroups, 240 registers each) or 192 (three, 160 registers, so
// no intra-warpgroup overlap); the default per bucket and d128's choice per call are in
// fp8/flash_fwd_fp8.h (fp8_default_block_m, fp8_block_m). Measured on the H200 (kernel alone,
// cuda/flash_fwd/tools/fwd_timeline.cu, benchmarks/RESULTS.md): d64 192x128 444 TFLOP/s vs
// 128x128 380 at 8k (2026-12-01). d128 192x128 in the plain order with the pipelined PV
// (kPipelinedPv; it spills 12 bytes) vs 128x128 with the overlap (2026-12-01, two
// runs): 814-830 vs 789-802 non-causal 8k, 717-735 vs 696-709 causal 8k, but 437-448 vs 466-475
// causal 2k, hence both d128 kernels. Slower at d128 (same runs): 192x96 767, 192x128 with every
// 8th exp2 on the FMA pipe 790-792, 192x128 with 3 K/V stages 816 (no gain); in the plain order
// pipelined at 128 rows: 128x224 791 (240 registers), 128x192 755, 128x128 / 128x192 / 128x224
// with the next S GEMM issued right after the PV k-steps 742 / 773-778 / 747.
template <int kHeadDim_, int kBlockM_ = fp8_default_block_m(kHeadDim_)>
struct Fp8KernelTraits
    : ForwardTraitsBase<kHeadDim_, cutlass::float_e4m3_t, kBlockM_, kFp8BlockN> {
  using Base = ForwardTraitsBase<kHeadDim_, cutlass::float_e4m3_t, kBlockM_, kFp8BlockN>;
  using typename Base::Element, typename Base::ElementAccum;
  using Base::kBlockM, Base::kBlockN, Base::kHeadDim, Base::kNumConsumerWarpGroups, Base::kStages;
  using ElementOut = cutlass::bfloat16_t;
  static constexpr bool kFp8 = true;
  static_assert(kBlockM == 128 || kBlockM == 192, "two or three consumer warpgroups");
  // As for 16-bit: S(n) + P(n+1) + O live together only where O is small enough, and only with
  // two consumer warpgroups (240 registers each; three get 160).
  static constexpr bool kIntraWgOverlap = kHeadDim <= 128 && kNumConsumerWarpGroups == 2;
  // Skip O's rescale when no row max of the warp changed (softmax.h; exact): at d256 128x128 it
  // also lets ptxas keep all but 4 bytes in registers (28 B spilled without it; 947 vs 935
  // TFLOP/s at 8k), and it is neutral at d128.
  static constexpr bool kSkipUnchangedRescale = true;
  // Every kExp2FmaPeriod-th softmax exponential on the FMA pipe instead of MUFU (exp2_fma.h):
  // only at d64, whose GEMMs are short enough for MUFU to pace the loop. Kernel alone, 8k
  // non-causal, same run (H200, 2026-12-01): d64 period 4 455-457 TFLOP/s vs 443-444 without.
  // A variant that adds j to p's bits (one FMUL less, NaN-unsafe; H200, 2026-12-01) measured
  // d64 period 4 / 3 / 2 467-470 / 458-461 / 407-411 vs 441-442; d128 period 8 / 4 / 2 774-775 /
  // 749-755 / 706-710 vs 804-810; d256 period 4 941-946 vs 967-973: the d128 and d256 loops are
  // not MUFU-bound.
  static constexpr int kExp2FmaPeriod = kHeadDim == 64 ? 4 : 0;
  // The row max's quad reduction and O correction only when some row of the warp jumps past the
  // lazy margin (OnlineSoftmax::update_max, softmax.h). Kernel alone, 192-row d128 (H200,
  // 2026-12-02, alternated): 8k +0.9%, causal 8k +2%, 2k +5% (ptxas spills 4 bytes: one LDL per
  // block); d256 even; d64 and d128's 128-row kernel -12% (H200, 2026-12-03).
  static constexpr bool kReduceMaxOnJump = kHeadDim == 128 && kNumConsumerWarpGroups == 3;
  // In the plain order (no intra-warpgroup overlap: three warpgroups, d256), P's k-steps go
  // to the PV GEMM one by one as their exponentials are done (consumer.h), and the warpgroups
  // take no ping-pong turns. Kernel alone, 8k, same runs (H200, 2026-12-01, benchmarks/RESULTS.md):
  // d256 1028-1031 TFLOP/s vs 954 (causal 920-927 vs 870), d64 531 vs 482 (causal 465 vs 434).
  // Kept with the ping-pong turns, the turn is held through the whole exp2 pass: d256 953. Not
  // used at d128 (128x128): the plain order pipelined (729 vs 796 with the overlap), the overlap's
  // PV issued in 2 or 4 pieces between parts of the exp2 pass (736-753), bf16 d256 (606-610 vs 622).
  static constexpr bool kPipelinedPv = !kIntraWgOverlap;
  static constexpr bool kPingPong = !kPipelinedPv;
  // The last round's tiles split in two pieces over two CTAs each (fp8/tail_split.h): only in the
  // plain order (the intra-warpgroup overlap's first block and ping-pong turns assume whole tiles).
  static constexpr bool kTailSplit = kPipelinedPv;
  static constexpr bool kKeyRanges = false;  // whole rows only (the 16-bit kernels take ranges)
  // setmaxnreg budget (65536 registers per SM): at most 128 * 24 + 256 * 240 (two consumer
  // warpgroups; d128 uses less, below) or 128 * 24 + 384 * 160 (three).
  // d128: capped at 208 although 240 fit. With the interval mask (softmax.h) ptxas has registers
  // to spare and issues the exp2 MUFUs back to back; they share the MIO queue with the other
  // warpgroup's QGMMA issue, which then stalls (ncu: MUFU mio stalls 5.9k -> 16k samples, S-wait
  // barrier stalls 6.8k -> 13.9k). The cap makes it space them: 800 vs 727 TFLOP/s (H200, 8k,
  // fwd_timeline.cu, 2026-12-01); 224: 792.
  static constexpr int kConsumerRegs =
      kNumConsumerWarpGroups == 3 ? 160 : (kHeadDim == 128 ? 208 : 240);

  static_assert(kBlockN % 32 == 0, "kBlockN is the K of the fp8 PV wgmma (k32 steps)");
  static_assert(kHeadDim % 32 == 0, "head dim is the K of the fp8 QK wgmma (k32 steps)");

  // O += P Vt: P from registers, Vt (d, keys) K-major (keys contiguous).
  using TiledMmaPV = typename Base::template TiledMmaRs<kHeadDim, kBlockN, GMMA::Major::K>;

  // Row sums = P x selector (fp8/row_sum.h): a 64x8 accumulator per warpgroup.
  using TiledMmaRowSum = typename Base::template TiledMmaRs<8, kBlockN, GMMA::Major::K>;

  using typename Base::SmemLayoutQ;
  using typename Base::SmemLayoutK;
  using SmemAtomVt = decltype(smem_atom_k_major<Element, kBlockN>());
  // (d, kBlockN, stage), keys contiguous: TMA destination and the PV GEMM's B operand.
  using SmemLayoutVt = decltype(tile_to_shape(
      SmemAtomVt{}, Shape<Int<kHeadDim>, Int<kBlockN>, Int<kStages>>{}));
  using SmemLayoutV = SmemLayoutVt;
  using SmemLayoutO = decltype(tile_to_shape(smem_atom_k_major<ElementOut, kHeadDim>(),
                                             Shape<Int<kBlockM>, Int<kHeadDim>>{}));

  using SmemLayoutRowSumSelector =
      decltype(tile_to_shape(SmemAtomVt{}, Shape<_8, Int<kBlockN>>{}));

  struct SharedStorage {
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutQ>, 1024> q;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutK>, 1024> k;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutV>, 1024> v;
    alignas(1024) cute::array_aligned<ElementOut, cosize_v<SmemLayoutO>, 1024> o;
    // The row-sum GEMM's 0/1 B operand (fp8/row_sum.h), written once by kernel.h
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutRowSumSelector>, 1024>
        row_sum_selector;
    JAX_FA3_FWD_PIPELINE_BARRIERS(kStages)
    int tail_ticket;  // the tail split's ticket, broadcast to the consumers (fp8/tail_split.h)
    // The tile's v_mean (fp8/v_mean.h), loaded by cp.async at tile start so that the epilogue
    // reads shared memory instead of waiting on L2. One copy: the consumer warpgroups share the
    // tile, and d256's shared memory is nearly full.
    alignas(16) float v_mean[kHeadDim];
  };
  // O has its own buffer (bf16: twice Q's fp8 bytes), so Q's buffer may be released after a
  // tile's last S GEMM (consumer.h); whether it is, is chosen per call (KernelParams::
  // early_q_release, fp8/flash_fwd_fp8.h: fp8_early_q_release). Otherwise q_empty waits for the TMA
  // store of O, which also keeps the O buffer from being overwritten by the next tile before the
  // store has read it (epilogue.h). kEarlyQReleasePerCall: whether this kernel reads the per-call
  // flag at all.
  static constexpr bool kEarlyQReleasePerCall = fp8_may_release_q_early(kHeadDim, kBlockM);
  __device__ __forceinline__ static ElementOut* o_smem(SharedStorage& ss) { return ss.o.data(); }
  static constexpr int kSmemBytes = sizeof(SharedStorage);
  static_assert(kSmemBytes <= 232448, "shared memory over the 227 KB per-block limit");
};

}  // namespace jax_fa3::fwd
