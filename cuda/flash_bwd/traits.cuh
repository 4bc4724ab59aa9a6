// Compile-time configuration of the backward main kernel for one (head-dim bucket, dtype):
// tile sizes, shared-memory layouts (CuTe, GMMA-swizzled), the five wgmma TiledMMAs, the TMA types
// and the shared-memory struct. See README.md for the reasoning behind every number here.
#pragma once
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include <cstdint>
#include <type_traits>

#include "flash_bwd/params.h"

namespace jax_fa3::flash_bwd {

// The gmem view every TMA descriptor is built from: (seqlen, d, heads, batch) of a contiguous
// (batch, seqlen, heads, d) array.
using ShapeSDHB = cute::Shape<int32_t, int32_t, int32_t, int32_t>;
using StrideSDHB = cute::Stride<int64_t, cute::_1, int64_t, int64_t>;

template <typename Element, typename SmemLayout, typename Tile>
auto make_tma_load_sdhb(Element const* ptr, ShapeSDHB const& shape, StrideSDHB const& stride,
                        SmemLayout const& smem_layout, Tile const& tile) {
  using namespace cute;
  return make_tma_copy(SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(ptr), shape, stride), smem_layout,
                       tile, _1{});
}

template <int kHeadDim_, typename Element_>
struct BwdTraits {
  using Element = Element_;  // cutlass::bfloat16_t or cutlass::half_t
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = flash_bwd::kBlockM;           // 64 query rows per Q block
  static constexpr int kBlockN = kHeadDim <= 128 ? 128 : 64;   // key rows per CTA
  static constexpr int kStages = 2;                            // Q/dO/LSE/D pipeline depth
  static constexpr int kNumMmaWarpGroups = 2;
  static constexpr int kNumMmaThreads = 128 * kNumMmaWarpGroups;
  static constexpr int kNumThreads = 128 + kNumMmaThreads;     // producer WG + consumer WGs
  // setmaxnreg moves registers within the CTA's own pool, which is what the CTA got at launch:
  // __launch_bounds__(384, 1) makes ptxas allocate 168 registers per thread (65536 / 384 rounded
  // down to the allocation granule of 8), i.e. 168 * 384 = 64512, not 65536. setmaxnreg.inc
  // blocks until the pool can satisfy it, so an over-subscribed split deadlocks at kernel entry
  // (32 / 240: 32*128 + 240*256 = 65536 > 64512 hung on the H200, 2026-11-30).
  // 24*128 + 240*256 = 64512: exactly the pool (FA3's and the forward's split).
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;
  static constexpr int kEntryRegs = 65536 / kNumThreads / 8 * 8;  // 168 for 384 threads
  static_assert(kProducerRegs * 128 + kConsumerRegs * kNumMmaThreads <= kEntryRegs * kNumThreads,
                "setmaxnreg split over-subscribes the CTA register pool: setmaxnreg.inc would hang");
  static_assert(kProducerRegs % 8 == 0 && kConsumerRegs % 8 == 0 && kProducerRegs >= 24 &&
                kConsumerRegs <= 256, "setmaxnreg counts must be multiples of 8 in [24, 256]");

  // Work split between the two consumer warpgroups (wg = 0, 1):
  //  S, dP : all kBlockM rows x columns [wg*kNS, (wg+1)*kNS) of the key block.
  //  dK, dV: kBlockN=128 -> key rows [wg*64, wg*64+64) x all d;  kBlockN=64 -> all 64 key rows x
  //          d columns [wg*d/2, (wg+1)*d/2).  Either way one 64-row wgmma M per warpgroup.
  //  dQ    : all kBlockM rows x d columns [wg*d/2, (wg+1)*d/2).
  static constexpr int kNS = kBlockN / 2;
  static constexpr int kWgAlongN = kBlockN / 64;  // 2: dK/dV split along keys, 1: along d
  static constexpr int kDKV = kHeadDim * kWgAlongN / 2;
  static constexpr int kDQ = kHeadDim / 2;
  static_assert(kBlockN / kWgAlongN == 64);

  // Q, K, V, dO tiles: d contiguous (K-major for S = QK^T and dP = dO V^T). The swizzle width must
  // divide d/2 so that the transposed (MN-major) views used by dQ = dS K, dK = dS^T Q, dV = P^T dO
  // can be cut into per-warpgroup d-halves on swizzle-atom boundaries.
  using SmemAtomQKV = std::conditional_t<
      kDQ % 64 == 0, cute::GMMA::Layout_K_SW128_Atom<Element>,
      std::conditional_t<kDQ % 32 == 0, cute::GMMA::Layout_K_SW64_Atom<Element>,
                         cute::GMMA::Layout_K_SW32_Atom<Element>>>;
  using SmemLayoutQ = decltype(cute::tile_to_shape(
      SmemAtomQKV{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>{}));  // one stage
  using SmemLayoutKV = decltype(cute::tile_to_shape(
      SmemAtomQKV{}, cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>{}));
  // Transposed views of the same bytes: (d, rows), d contiguous = MN-major operands.
  using SmemLayoutQt = decltype(cute::composition(
      SmemLayoutQ{}, cute::make_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockM>>{},
                                       cute::Stride<cute::Int<kBlockM>, cute::_1>{})));
  using SmemLayoutKt = decltype(cute::composition(
      SmemLayoutKV{}, cute::make_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockN>>{},
                                        cute::Stride<cute::Int<kBlockN>, cute::_1>{})));
  // P and dS: (kBlockM, kBlockN), key index contiguous, 128B swizzle (kBlockN is 64 or 128).
  // K-major A operand for dQ = dS K; transposed (keys, rows) = MN-major A for dV and dK.
  using SmemLayoutPdS = decltype(cute::tile_to_shape(
      cute::GMMA::Layout_K_SW128_Atom<Element>{},
      cute::Shape<cute::Int<kBlockM>, cute::Int<kBlockN>>{}));
  using SmemLayoutPdSt = decltype(cute::composition(
      SmemLayoutPdS{}, cute::make_layout(cute::Shape<cute::Int<kBlockN>, cute::Int<kBlockM>>{},
                                         cute::Stride<cute::Int<kBlockM>, cute::_1>{})));

  // One warpgroup's GEMMs (128 threads, fp32 accumulators, both operands from shared memory).
  using MmaSdP = decltype(cute::make_tiled_mma(cute::GMMA::ss_op_selector<
      Element, Element, float, cute::Shape<cute::Int<kBlockM>, cute::Int<kNS>, cute::Int<kHeadDim>>,
      cute::GMMA::Major::K, cute::GMMA::Major::K>()));
  using MmadKV = decltype(cute::make_tiled_mma(cute::GMMA::ss_op_selector<
      Element, Element, float, cute::Shape<cute::_64, cute::Int<kDKV>, cute::Int<kBlockM>>,
      cute::GMMA::Major::MN, cute::GMMA::Major::MN>()));
  using MmadQ = decltype(cute::make_tiled_mma(cute::GMMA::ss_op_selector<
      Element, Element, float, cute::Shape<cute::Int<kBlockM>, cute::Int<kDQ>, cute::Int<kBlockN>>,
      cute::GMMA::Major::K, cute::GMMA::Major::MN>()));

  using TmaQ = decltype(make_tma_load_sdhb(
      static_cast<Element const*>(nullptr), ShapeSDHB{}, StrideSDHB{}, SmemLayoutQ{},
      cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>{}));
  using TmaKV = decltype(make_tma_load_sdhb(
      static_cast<Element const*>(nullptr), ShapeSDHB{}, StrideSDHB{}, SmemLayoutKV{},
      cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>{}));

  // dQ partials leave the CTA in "fragment order": per Q block a chunk of kBlockM * kHeadDim
  // floats, warpgroup wg's 64 x kDQ part at wg * kDqWgFloats, inside it the float pair (i, i+1) of
  // accumulator thread t at (i / 2) * 256 + 2 t. A warp then stores 256 contiguous bytes (no bank
  // conflicts) and the chunk is contiguous, so one bulk reduce adds it to the workspace; the
  // postprocess maps fragments back to (row, column) with the same TiledMMA.
  static constexpr int kDqWgFloats = kBlockM * kDQ;
  static constexpr int kDqChunkFloats = kBlockM * kHeadDim;
  // Distance between one thread's consecutive float pairs in a warpgroup's part: 128 threads x
  // one float2 each.
  static constexpr int kDqPairStride = 128;  // in float2
  static_assert(kDqWgFloats % (2 * kDqPairStride) == 0, "whole pair rows per warpgroup part");
  // Through shared memory + a TMA bulk reduce issued by a dedicated warp when the chunk fits
  // (d <= 192: +16..48 KB); d = 256 (208 KB without it) adds from registers with red.global.v2.
  static constexpr bool kDqViaSmem = kHeadDim <= 192;

  static constexpr int kSizeQ = cute::cosize_v<SmemLayoutQ>;     // elements per stage
  static constexpr int kSizeKV = cute::cosize_v<SmemLayoutKV>;
  static constexpr int kSizePdS = cute::cosize_v<SmemLayoutPdS>;
  static constexpr uint32_t kBytesQ = kSizeQ * sizeof(Element);  // TMA always moves the full box
  static constexpr uint32_t kBytesKV = kSizeKV * sizeof(Element);
  static constexpr uint32_t kBytesRow = kBlockM * sizeof(float);  // LSE or D of one Q block

  struct SharedStorage {
    alignas(1024) Element k[kSizeKV];
    alignas(1024) Element v[kSizeKV];
    alignas(1024) Element q[kStages * kSizeQ];
    alignas(1024) Element dout[kStages * kSizeQ];
    alignas(1024) Element p[kSizePdS];
    alignas(1024) Element ds[kSizePdS];
    alignas(128) float dq[kDqViaSmem ? kDqChunkFloats : 4];  // one Q block's dQ partial
    alignas(16) float lse_log2[kStages][kBlockM];
    alignas(16) float dpsum[kStages][kBlockM];
    alignas(8) uint64_t bar_kv;              // K and V landed (tx barrier, 1 arrival)
    uint64_t bar_full[kStages];              // Q, dO, LSE, D of a stage landed (tx, 1 arrival)
    uint64_t bar_empty[kStages];             // consumers done with a stage (256 arrivals)
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage)) + 1024;  // + base alignment slack
  static_assert(kSmemBytes <= 227 * 1024, "backward tile does not fit shared memory");
};

// Index of query head qh's Q block m of batch bidb among all (batch, head, Q block) triples: its
// dQ chunk in the workspace and its deterministic-mode semaphore both sit at this index.
__host__ __device__ __forceinline__ int64_t q_block_index(int bidb, int h, int qh, int num_m_blocks,
                                                          int m) {
  return (int64_t(bidb) * h + qh) * num_m_blocks + m;
}

}  // namespace jax_fa3::flash_bwd
