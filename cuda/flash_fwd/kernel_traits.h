// Compile-time shape of one forward instantiation: tile sizes, shared-memory layouts, wgmma
// tiled MMAs, and the shared-storage struct. Everything a bucket decides lives here.
#pragma once
#include "common/cute_config.h"
#include <cute/tensor.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/atom/copy_atom.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/numeric_types.h>

#include "common/buckets.h"

namespace jax_fa3::fwd {

using namespace cute;

// kBlockN per head-dim bucket (kBlockM is 128 = 2 consumer warpgroups x 64 rows, except d64's
// 192 x 128 tiles for longer problems, launch.h).
// Budget: Q (aliased by O) + 2 stages of K and V must fit in 227 KB (232448 B); the consumer's
// registers hold S (kBlockN/2 fp32), O (d/2 fp32) and P (kBlockN/4 32-bit) per thread below 240.
//   d64 : 128x160 -> 16K + 2*2*20K  =  96 KB   S 80 + O 32 regs  (+ a 16K O buffer: kEarlyQRelease)
//         192x128 -> 24K + 2*2*16K  =  88 KB   S 64 + O 32, 160 regs (+ a 24K O buffer)
//   d96 : 128x144 -> 24K + 2*2*27K  = 132 KB   S 72 + O 48
//   d128: 128x128 -> 32K + 2*2*32K  = 160 KB   S 64 + O 64   (+ a 32K O buffer: kEarlyQRelease;
//         FA3's 176 spilled ~230 B here with the overlapped mainloop: S 88 + P 44 + O 64 live)
//   d192: 128x112 -> 48K + 2*2*42K  = 216 KB   S 56 + O 96
//   d256: 128x80  -> 64K + 2*2*40K  = 224 KB   S 40 + O 128
constexpr int kSmemLimitBytes = 232448;  // 227 KB: the per-block shared-memory limit

template <int kHeadDim> struct BlockN {
  static constexpr int value = forward_key_block(kHeadDim);  // common/buckets.h
};

// The widest GMMA K-major swizzle whose row (in bytes) divides kWidth elements of Element
// (16-bit d96 cannot use 128 B rows).
template <typename Element, int kWidth>
constexpr auto smem_atom_k_major() {
  constexpr int kBytes = kWidth * int(sizeof(Element));
  if constexpr (kBytes % 128 == 0) {
    return GMMA::Layout_K_SW128_Atom<Element>{};
  } else if constexpr (kBytes % 64 == 0) {
    return GMMA::Layout_K_SW64_Atom<Element>{};
  } else {
    return GMMA::Layout_K_SW32_Atom<Element>{};
  }
}

// What every forward kernel shares (16-bit: KernelTraits below; fp8: Fp8KernelTraits,
// fp8/traits.h): the tile, the threads (one producer warpgroup and one consumer warpgroup per 64
// rows), S = Q K^T, the shared-memory layouts of Q and K and the TMA byte counts. The mbarriers
// are declared in each SharedStorage by JAX_FA3_FWD_PIPELINE_BARRIERS (below).
template <int kHeadDim_, typename Element_, int kBlockM_, int kBlockN_, int kStages_ = 2>
struct ForwardTraitsBase {
  using Element = Element_;
  using ElementAccum = float;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStages = kStages_;
  static constexpr int kNumConsumerWarpGroups = kBlockM / 64;
  static constexpr int kNumThreads = 128 * (kNumConsumerWarpGroups + 1);  // + producer WG
  static constexpr int kNumConsumerThreads = 128 * kNumConsumerWarpGroups;
  static constexpr int kProducerRegs = 24;  // setmaxnreg budget of the producer warpgroup
  static constexpr bool kFp8Cache = false;  // K/V from an e4m3 cache (fp8_cache.h)

  using TileShape = Shape<Int<kBlockM>, Int<kBlockN>, Int<kHeadDim>>;

  // S = Q K^T: both operands from shared memory, K-major (d contiguous). One 64-row wgmma atom per
  // consumer warpgroup, stacked along M.
  using TiledMmaQK = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, ElementAccum, Shape<_64, Int<kBlockN>, Int<kHeadDim>>>(),
      Layout<Shape<Int<kNumConsumerWarpGroups>, _1, _1>>{}));

  // A GEMM with A (64 x kK per consumer warpgroup) from registers, K-major, and a kN x kK B
  // operand from shared memory: O += P V (16-bit: V MN-major; fp8: Vt K-major) and fp8's row sums.
  template <int kN, int kK, GMMA::Major kMajorB>
  using TiledMmaRs = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, ElementAccum, Shape<_64, Int<kN>, Int<kK>>,
                           GMMA::Major::K, kMajorB>(),
      Layout<Shape<Int<kNumConsumerWarpGroups>, _1, _1>>{}));

  using SmemAtomQK = decltype(smem_atom_k_major<Element, kHeadDim>());
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtomQK{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  using SmemLayoutK = decltype(tile_to_shape(
      SmemAtomQK{}, Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStages>>{}));

  static constexpr uint32_t kTmaBytesQ = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kTmaBytesKV = kBlockN * kHeadDim * sizeof(Element);
};

// The forward's mbarriers (the protocol: producer.h), declared inside each SharedStorage after its
// buffers. A macro rather than a nested struct: the members keep their names and offsets, and the
// barrier addresses stay immediates in the SASS (a nested struct cost the bf16 d128 kernel three
// uniform-datapath instructions, cuobjdump, 2026-12-04).
#define JAX_FA3_FWD_PIPELINE_BARRIERS(kStages) \
  uint64_t q_full;                             \
  uint64_t q_empty;                            \
  uint64_t k_full[kStages];                    \
  uint64_t k_empty[kStages];                   \
  uint64_t v_full[kStages];                    \
  uint64_t v_empty[kStages];

// kKeyRanges_: the masked variant, reading per-query key ranges (common/key_ranges.h) in place of
// the window; a separate instantiation, so that the whole-row kernel's code stays free of them.
// kBlockN_: the bucket's key block, or a narrower one for short masked problems (launch.h).
// kBlockM_: 128 rows (two consumer warpgroups, 240 registers each) or 192 (three, 160 each), or
// the decode tile: 64 rows (one consumer warpgroup) with kStages_ K/V stages (DecodeStages).
template <int kHeadDim_, typename Element_, bool kKeyRanges_ = false,
          int kBlockN_ = BlockN<kHeadDim_>::value, int kBlockM_ = 128, int kStages_ = 2>
struct KernelTraits : ForwardTraitsBase<kHeadDim_, Element_, kBlockM_, kBlockN_, kStages_> {
  using Base = ForwardTraitsBase<kHeadDim_, Element_, kBlockM_, kBlockN_, kStages_>;
  using typename Base::Element, typename Base::ElementAccum;
  using Base::kBlockM, Base::kBlockN, Base::kHeadDim, Base::kNumConsumerWarpGroups, Base::kStages;
  using ElementOut = Element;  // O is written in the input type (fp8: Fp8KernelTraits)
  static constexpr bool kFp8 = false;
  // Intra-warpgroup overlap keeps S(n) and P(n+1) live together (S + P/2 + O registers). With
  // whole rows it fits every bucket: d192 (S 56 + P 28 + O 96) and d256 (40 + 20 + 128) compile
  // without a spill (ptxas, 2026-12-06), and against the plain order S -> softmax -> PV they ran
  // +7..12% (H100, 2026-12-06, 16k tokens, bf16: d256 non-causal 16k 603/617 -> 657/665 TFLOP/s,
  // causal 588/591 -> 642/644; d192 593/595 -> 667/661, causal 578/579 -> 646/642; 1k +4..8%;
  // benchmarks/RESULTS.md). The key-range kernels keep the plain order at d192/d256: their
  // per-row key ranges take registers too, and d256 spilled 44 bytes with the overlap.
  // 192 rows (three warpgroups at 160 registers) fit only d64 with 128-key blocks and the
  // overlap: S 64 + P 32 + O 32, no spill; 160-key blocks spill 284 bytes (ptxas, 2026-12-05).
  static_assert(kBlockM == 128 || (kBlockM == 192 && kHeadDim == 64 && kBlockN <= 128) ||
                    (kBlockM == 64 && kKeyRanges_),
                "two consumer warpgroups, three at d64 with at most 128-key blocks, or the "
                "decode tile (key ranges)");
  static constexpr bool kIntraWgOverlap = kHeadDim <= 128 || !kKeyRanges_;
  // Skipping O's rescale when no max changed (softmax.h) measured 614-618 TFLOP/s at d256 8k
  // against 632-635 without it (H200, 2026-12-01): always rescale here.
  static constexpr bool kSkipUnchangedRescale = false;
  // Every kExp2FmaPeriod-th softmax exponential on the FMA pipe instead of MUFU (exp2_fma.h):
  // none. Kernel alone, 8k non-causal (H200, 2026-12-01, with an exp2_fma variant one FMUL
  // cheaper): d64 period 4 / 3 / 2 422-425 / 429-431 / 407-410 TFLOP/s vs 462-464 without; d128
  // period 4 581-586 vs 607-612.
  static constexpr int kExp2FmaPeriod = 0;
  // PV issued k-step by k-step under the exp2 pass (fp8/traits.h): d256 606-610 TFLOP/s vs
  // 622-623 without (kernel alone, 8k, H200, 2026-12-01): the ping-pong turns instead.
  static constexpr bool kPipelinedPv = false;
  // One consumer warpgroup (the decode tile) has no one to take turns with.
  static constexpr bool kPingPong = kNumConsumerWarpGroups > 1;
  static constexpr bool kTailSplit = false;  // fp8/tail_split.h: fp8 kernels only
  static constexpr bool kKeyRanges = kKeyRanges_;
  // setmaxnreg budget: 128 * (24 + 2 * 240) = 64512 <= 65536 registers per SM; three
  // warpgroups: 128 * (24 + 3 * 160) = 64512; one (the decode tile): 240 is all its fragments need.
  static constexpr int kConsumerRegs = kNumConsumerWarpGroups == 3 ? 160 : 240;

  static_assert(kBlockN % 16 == 0, "kBlockN is the K of the PV wgmma (k16 steps)");
  static_assert(kHeadDim % 16 == 0, "head dim bucket is the N of the PV wgmma and the stmatrix width");

  // O += P V: P from registers (RS), V^T from shared memory where d (the N of this GEMM) is the
  // contiguous dimension, i.e. an MN-major B operand (wgmma transposes 16-bit B for free).
  using TiledMmaPV = typename Base::template TiledMmaRs<kHeadDim, kBlockN, GMMA::Major::MN>;

  using typename Base::SmemLayoutQ;
  using typename Base::SmemLayoutK;
  using SmemLayoutO = SmemLayoutQ;
  using SmemLayoutV = SmemLayoutK;
  // The same V bytes seen as (d, kBlockN, stage): the B operand of the PV GEMM. With the K-major
  // atom transposed, this is exactly the MN-major canonical GMMA layout.
  using SmemLayoutVt = decltype(composition(
      SmemLayoutV{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockN>, Int<kStages>>{},
                                         Step<_2, _1, _3>{})));

  // Early Q release (consumer.h): O gets its own buffer, so Q's buffer is free once a tile's last
  // S GEMM completed and the next tile's Q loads under this tile's last softmax, PV GEMM and
  // epilogue. H200 kernel alone, same run: d128 (160 + 32 KB of smem; 2026-12-01) 618-619 vs
  // 600-605 TFLOP/s non-causal 8k, 544-551 vs 542-543 causal 8k; d64 (96 + 16 KB; 2026-12-01)
  // 458 vs 455-456 non-causal 8k, 407-408 vs 401 causal 8k. d96 is not measured; d192/d256 have
  // no room for O and stage it in Q's buffer.
  static constexpr bool kEarlyQRelease = kHeadDim == 64 || kHeadDim == 128;
  static constexpr int kOBufferElems = kEarlyQRelease ? int(cosize_v<SmemLayoutO>) : 1;

  struct SharedStorage {
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutQ>, 1024> q;  // also O, or:
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutK>, 1024> k;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutV>, 1024> v;
    alignas(1024) cute::array_aligned<Element, kOBufferElems, 1024> o;  // O (kEarlyQRelease)
    JAX_FA3_FWD_PIPELINE_BARRIERS(kStages)
  };
  // Where the epilogue stages O: its own buffer, or Q's (Q is dead once the tile's last S = QK^T
  // GEMM completed).
  __device__ __forceinline__ static ElementOut* o_smem(SharedStorage& ss) {
    if constexpr (kEarlyQRelease) {
      return ss.o.data();
    } else {
      return ss.q.data();
    }
  }
  static constexpr int kSmemBytes = sizeof(SharedStorage);
  static_assert(kSmemBytes <= kSmemLimitBytes, "shared memory over the 227 KB per-block limit");
};

// The decode tile (launch.h): a decode step's query rows are a kv head's g query heads (usually
// 4-16), so a 128-row tile spends 7/8 or more of its tensor work on zero rows. With 128 rows the
// two GEMMs of a 128-key d128 block take about 2 x 128 x 128 x 128 x 2 / 2048 = 2048 tensor-core
// cycles (~1.1 us) against ~2 us to stream the block's 64 KB at the chip's copy rate shared by
// 132 SMs; 64 rows halve that, so the block's time is its bytes. The shared memory Q and O leave
// goes to K/V stages: as many as fit (at most 4), so the first blocks of a short piece are all
// in flight at once.
template <int kHeadDim, typename Element, int kBlockN = BlockN<kHeadDim>::value>
struct DecodeStages {
  static constexpr int kTile = 64 * kHeadDim * int(sizeof(Element));  // Q, and O's own buffer
  static constexpr int kStage = 2 * kBlockN * kHeadDim * int(sizeof(Element));
  static constexpr int kFit = (kSmemLimitBytes - 2 * kTile - 1024) / kStage;  // 1 KB: barriers, alignment
  static constexpr int value = kFit < 2 ? 2 : (kFit > 4 ? 4 : kFit);
};
template <int kHeadDim, typename Element>
using DecodeKernelTraits = KernelTraits<kHeadDim, Element, true, BlockN<kHeadDim>::value, 64,
                                        DecodeStages<kHeadDim, Element>::value>;

}  // namespace jax_fa3::fwd
