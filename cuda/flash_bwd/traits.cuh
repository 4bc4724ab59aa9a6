// Compile-time configuration of the backward main kernel for one (head-dim bucket, dtype):
// tile sizes, shared-memory layouts (CuTe, GMMA-swizzled), the five wgmma TiledMMAs, the TMA types
// and the shared-memory struct. See README.md for the reasoning behind every number here.
#pragma once
#include "common/cute_config.h"  // first: before any CuTe header
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

// S and dP (key-major: S^T, dP^T) of one warpgroup: (64 keys, kBlockM rows) or (kBlockM rows,
// kNS keys), both operands K-major in shared memory. (A function for the reason below.)
template <typename Element, bool kKeyMajor, int kBlockM, int kNS, int kHeadDim>
auto make_mma_sdp() {
  using namespace cute;
  using Tile = std::conditional_t<kKeyMajor, Shape<_64, Int<kBlockM>, Int<kHeadDim>>,
                                  Shape<Int<kBlockM>, Int<kNS>, Int<kHeadDim>>>;
  return make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Tile, GMMA::Major::K, GMMA::Major::K>());
}

// The dQ GEMM of one warpgroup: (kRows, kCols) = (rows, d columns) of dQ = dS K, A = the dS
// tile (MN-major when key-major), B = K^T (MN-major); transposed, (d columns, rows) of dQ^T =
// K^T dS^T, A = K^T (MN-major), B = the dS tile (K-major). (A function, not std::conditional_t,
// which would instantiate the 80-row M that no wgmma has.)
template <typename Element, bool kTransposed, bool kKeyMajor, int kRows, int kCols, int kBlockN>
auto make_mma_dq() {
  using namespace cute;
  if constexpr (kTransposed) {
    return make_tiled_mma(GMMA::ss_op_selector<Element, Element, float,
                                               Shape<Int<kCols>, Int<kRows>, Int<kBlockN>>,
                                               GMMA::Major::MN, GMMA::Major::K>());
  } else {
    return make_tiled_mma(GMMA::ss_op_selector<Element, Element, float,
                                               Shape<Int<kRows>, Int<kCols>, Int<kBlockN>>,
                                               kKeyMajor ? GMMA::Major::MN : GMMA::Major::K,
                                               GMMA::Major::MN>());
  }
}

// kBlockM_: rows per Q block; the bucket's default (block_m_for_bucket) or, at d = 128 without
// masks, kWideBlockM (80: params.h, wide_q_blocks), which computes dQ transposed (below).
template <int kHeadDim_, typename Element_, int kBlockM_ = block_m_for_bucket(kHeadDim_)>
struct BwdTraits {
  using Element = Element_;  // cutlass::bfloat16_t or cutlass::half_t
  using ElementGrad = Element;  // dq, dk, dv (the fp8 variant, fp8_traits.cuh: float32)
  static constexpr bool kFp8 = false;
  static constexpr int kHeadDim = kHeadDim_;
  // Key-major (d <= 128): each consumer warpgroup owns 64 keys of the K/V block and computes
  // S^T = K Q^T and dP^T = V dO^T with the keys on the wgmma M side. P^T and dS^T then sit in
  // registers in the A-operand layout of dV += P^T dO and dK += dS^T Q (RS wgmma): P never goes
  // to shared memory and those two GEMMs read only B from it. Shared-memory bandwidth, not the
  // tensor cores, bounds this kernel (an SS wgmma with N = 64 needs 128 B/clk/SM, all of it), so
  // every operand read saved counts. Row-major (d = 192, 256): S = Q K^T per warpgroup over
  // half of a 64-key block, dK/dV split along d (both 64 x d accumulators would not fit).
  static constexpr bool kKeyMajor = kHeadDim <= 128;
  static constexpr int kBlockM = kBlockM_;  // query rows per Q block
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
  //  key-major: S^T, dP^T, dK, dV: keys [wg*64, wg*64+64) x all rows / all d.
  //  row-major: S, dP: all rows x keys [wg*kNS, (wg+1)*kNS); dK/dV: all 64 keys x d columns
  //             [wg*d/2, (wg+1)*d/2).
  //  dQ: kBlockM = 128: rows [wg*64, wg*64+64) x all d; kBlockM = 64: all rows x d columns
  //      [wg*d/2, (wg+1)*d/2); kBlockM = 80 (not a multiple of the wgmma M of 64): dQ^T = K^T dS^T,
  //      d columns [wg*64, wg*64+64) on M, all 80 rows on N (d = 128 only). Every GEMM has one
  //      64-row wgmma M per warpgroup.
  static constexpr int kNS = kKeyMajor ? 64 : kBlockN / 2;  // keys per warpgroup in S / S^T
  static constexpr int kWgAlongN = kBlockN / 64;  // 2: dK/dV split along keys, 1: along d
  static constexpr int kDKV = kHeadDim * kWgAlongN / 2;
  static constexpr bool kDqAlongM = kBlockM == 128;
  static constexpr bool kDqTransposed = kBlockM % 64 != 0;
  static constexpr int kDqRows = kDqAlongM ? 64 : kBlockM;
  static constexpr int kDQ = kDqAlongM ? kHeadDim : kHeadDim / 2;
  static_assert(kBlockN / kWgAlongN == 64);
  static_assert(!kKeyMajor || kWgAlongN == 2, "key-major needs 64 keys per warpgroup");
  static_assert(kBlockM == 64 || (kBlockM == 128 && kKeyMajor) ||
                (kBlockM == kWideBlockM && kKeyMajor && kHeadDim == 128));

  // Q, K, V, dO tiles: d contiguous (K-major for S = QK^T and dP = dO V^T). The swizzle width must
  // divide the d-slice a warpgroup takes (d/2 where dQ or dK/dV are split along d) so that the
  // transposed (MN-major) views used by dQ = dS K, dK = dS^T Q, dV = P^T dO can be cut into
  // per-warpgroup slices on swizzle-atom boundaries (a GMMA descriptor cannot start mid-atom).
  static constexpr int kDSlice = kDqAlongM ? kHeadDim : kHeadDim / 2;
  using SmemAtomQKV = std::conditional_t<
      kDSlice % 64 == 0, cute::GMMA::Layout_K_SW128_Atom<Element>,
      std::conditional_t<kDSlice % 32 == 0, cute::GMMA::Layout_K_SW64_Atom<Element>,
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
  // P and dS: a (kBlockM, kBlockN) tile, 128B swizzle. Row-major: key index contiguous (S
  // fragment pairs are adjacent keys), K-major A of dQ = dS K. Key-major: row index contiguous
  // (S^T fragment pairs are adjacent rows), MN-major A of dQ = dS K. Either way the element
  // pairs a thread holds are one 32-bit store, and a warp's stores hit 8 swizzled 16-byte chunks.
  // Transposed dQ (80 rows, which no 64-row MN-major atom tiles): key index contiguous, the
  // K-major B of dQ^T = K^T dS^T, written from the S^T fragments by stmatrix.trans (8 x 8
  // blocks land transposed: a fragment's 8 keys of one row are one 16-byte row of a block).
  using SmemAtomPdS =
      std::conditional_t<kKeyMajor && !kDqTransposed, cute::GMMA::Layout_MN_SW128_Atom<Element>,
                         cute::GMMA::Layout_K_SW128_Atom<Element>>;
  using SmemLayoutPdS = decltype(cute::tile_to_shape(
      SmemAtomPdS{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kBlockN>>{}));
  // (keys, rows) view of the same bytes.
  using SmemLayoutPdSt = decltype(cute::composition(
      SmemLayoutPdS{}, cute::make_layout(cute::Shape<cute::Int<kBlockN>, cute::Int<kBlockM>>{},
                                         cute::Stride<cute::Int<kBlockM>, cute::_1>{})));

  // One warpgroup's GEMMs (128 threads, fp32 accumulators).
  //  S (S^T) and dP (dP^T): both operands from shared memory, K-major.
  using MmaSdP = decltype(make_mma_sdp<Element, kKeyMajor, kBlockM, kNS, kHeadDim>());
  // Whole-width wgmma atoms (one instruction per k-step): a narrower atom, which the selector
  // takes silently without common/cute_config.h, re-reads A from shared memory per atom.
  static_assert(cute::size<1>(typename MmaSdP::AtomShape_MNK{}) == (kKeyMajor ? kBlockM : kNS));
  //  S (S^T) alone: the same GEMM here, e4m3 in the fp8 variant.
  using MmaS = MmaSdP;
  //  dV += P^T dO, dK += dS^T Q: A from registers (key-major) or the transposed P / dS tile.
  using MmadKV = std::conditional_t<
      kKeyMajor,
      decltype(cute::make_tiled_mma(cute::GMMA::rs_op_selector<
               Element, Element, float,
               cute::Shape<cute::_64, cute::Int<kDKV>, cute::Int<kBlockM>>,
               cute::GMMA::Major::K, cute::GMMA::Major::MN>())),
      decltype(cute::make_tiled_mma(cute::GMMA::ss_op_selector<
               Element, Element, float,
               cute::Shape<cute::_64, cute::Int<kDKV>, cute::Int<kBlockM>>,
               cute::GMMA::Major::MN, cute::GMMA::Major::MN>()))>;
  //  dQ = dS K: A = the dS tile (rows x keys), B = the transposed view of K. Transposed:
  //  dQ^T = K^T dS^T, A = the transposed view of K (d x keys, MN-major), B = the dS tile (K-major).
  using MmadQ = decltype(make_mma_dq<Element, kDqTransposed, kKeyMajor, kDqRows, kDQ, kBlockN>());
  static_assert(cute::size<1>(typename MmadQ::AtomShape_MNK{}) == (kDqTransposed ? kBlockM : kDQ));
  // One warpgroup's dQ accumulator tile, (rows, d columns), or (d columns, rows) transposed, and
  // where its coordinate c sits in the (kBlockM, kHeadDim) block.
  using DqTile = std::conditional_t<kDqTransposed, cute::Shape<cute::Int<kDQ>, cute::Int<kBlockM>>,
                                    cute::Shape<cute::Int<kDqRows>, cute::Int<kDQ>>>;
  template <typename C>
  CUTE_HOST_DEVICE static constexpr int dq_row(C const& c, int wg) {
    if constexpr (kDqTransposed) return cute::get<1>(c);
    else return dq_row0(wg) + cute::get<0>(c);
  }
  template <typename C>
  CUTE_HOST_DEVICE static constexpr int dq_col(C const& c, int wg) {
    if constexpr (kDqTransposed) return dq_col0(wg) + cute::get<0>(c);
    else return dq_col0(wg) + cute::get<1>(c);
  }

  // Where accumulator thread `thr` of warpgroup wg writes its S (S^T) fragment into the P / dS
  // tile as 32-bit pair stores (row-major, and the fp8 key-major kernel; the 16-bit key-major one
  // uses stmatrix, below): byte offsets from a 1024-aligned tile base, i.e. the same partition of
  // the same layout over a null base. Element pairs (i, i+1) are adjacent
  // (tests/cuda/check_bwd_layouts.cu).
  template <typename ThrMma>
  CUTE_HOST_DEVICE static auto pds_store_offsets(ThrMma const& thr, int wg) {
    using namespace cute;
    static_assert(!kDqTransposed, "the key-contiguous dS tile takes stmatrix.trans stores");
    if constexpr (kKeyMajor) {
      return thr.partition_C(local_tile(
          make_tensor(make_smem_ptr(static_cast<Element*>(nullptr)), SmemLayoutPdSt{}),
          Shape<_64, Int<kBlockM>>{}, make_coord(wg, _0{})));
    } else {
      return thr.partition_C(local_tile(
          make_tensor(make_smem_ptr(static_cast<Element*>(nullptr)), SmemLayoutPdS{}),
          Shape<Int<kBlockM>, Int<kNS>>{}, make_coord(_0{}, wg)));
    }
  }
  // Key-major: the dS^T fragments go to the dS tile by stmatrix (.x4, four 8 x 8 blocks), x4
  // number x of a thread covering S^T fragment columns (query rows) [16 x, 16 x + 16): block q
  // holds keys 16 (warp in warpgroup) + 8 (q % 2) + [0, 8) of warpgroup wg's 64 and query rows
  // 16 x + 8 (q / 2) + [0, 8), and takes the fragment pair (v, v + 1), v = ds_stmatrix_value(x, q).
  //  - row-contiguous tile (dQ = dS K): plain stmatrix, lane 8 q + i addresses block q's row i,
  //    i.e. key i of the block with its 8 query rows (16 bytes);
  //  - key-contiguous tile (transposed dQ, 80 rows): stmatrix.trans, lane 8 q + i addresses
  //    query row i of the block with its 8 keys.
  // ds_stmatrix_offset: this lane's byte offset at x = 0 from the tile base; ds_stmatrix_at:
  // the offset at x (tests/cuda/check_bwd_layouts.cu checks both against the layout).
  CUTE_HOST_DEVICE static uint32_t ds_stmatrix_offset(int wg, int tid) {
    using namespace cute;
    const int lane = tid % 32, q = lane / 8;
    Tensor t = make_tensor(make_smem_ptr(static_cast<Element*>(nullptr)), SmemLayoutPdS{});
    const int key = wg * 64 + 16 * (tid / 32) + 8 * (q % 2) + (kDqTransposed ? 0 : lane % 8);
    const int row = 8 * (q / 2) + (kDqTransposed ? lane % 8 : 0);
    return static_cast<uint32_t>(reinterpret_cast<uintptr_t>(raw_pointer_cast(&t(row, key))));
  }
  // Transposed: 16 rows are two whole 8-row swizzle atoms (K-major, 128B), so the swizzle repeats.
  // Row-contiguous: 16 rows are 32 bytes inside a 64-row atom row, whose 16-byte chunk index the
  // 128B swizzle XORs with the key's low bits, so the offset moves by XOR; 64 rows are one
  // atom (64 rows x 8 keys, 1 KB).
  CUTE_HOST_DEVICE static constexpr uint32_t ds_stmatrix_at(uint32_t offset0, int x) {
    if constexpr (kDqTransposed) {
      return offset0 + x * (16 * 64 * sizeof(Element));
    } else {
      return (offset0 ^ ((x % 4) << 5)) + (x / 4) * (64 * 8 * sizeof(Element));
    }
  }
  CUTE_HOST_DEVICE static constexpr int ds_stmatrix_value(int x, int q) {
    return 4 * (2 * x + q / 2) + 2 * (q % 2);
  }

  // The S (S^T) accumulator tile of one warpgroup, and which of its modes is the query row.
  using TileS = std::conditional_t<kKeyMajor, cute::Shape<cute::_64, cute::Int<kBlockM>>,
                                   cute::Shape<cute::Int<kBlockM>, cute::Int<kNS>>>;
  static constexpr int kRowMode = kKeyMajor ? 1 : 0;

  using TmaQ = decltype(make_tma_load_sdhb(
      static_cast<Element const*>(nullptr), ShapeSDHB{}, StrideSDHB{}, SmemLayoutQ{},
      cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>{}));
  using TmaKV = decltype(make_tma_load_sdhb(
      static_cast<Element const*>(nullptr), ShapeSDHB{}, StrideSDHB{}, SmemLayoutKV{},
      cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>{}));
  // The Q tile of the S (S^T) GEMM, its TMA and its elements per stage: Q itself here, e4m3 q8 in
  // the fp8 variant (dO keeps SmemLayoutQ / TmaQ / kSizeQ in both).
  using ElementQs = Element;
  using SmemLayoutQs = SmemLayoutQ;
  using TmaQs = TmaQ;

  // dQ partials leave the CTA in "fragment order": per Q block a chunk of kBlockM * kHeadDim
  // floats, warpgroup wg's kDqRows x kDQ part at wg * kDqWgFloats, inside it the four floats
  // (i, ..., i+3) of accumulator thread t at dq_slot(i, t) = (i / 4) * 512 + 4 t. A warp then
  // stores 512 contiguous bytes and the chunk is contiguous, so one bulk reduce adds it to the
  // workspace; the postprocess maps fragments back to (row, column) with the same TiledMMA.
  static constexpr int kDqWgFloats = kDqRows * kDQ;
  static constexpr int kDqChunkFloats = kBlockM * kHeadDim;
  static_assert(2 * kDqWgFloats == kDqChunkFloats);
  // Row and column of warpgroup wg's part inside the (kBlockM, kHeadDim) block.
  CUTE_HOST_DEVICE static constexpr int dq_row0(int wg) { return kDqAlongM ? wg * 64 : 0; }
  CUTE_HOST_DEVICE static constexpr int dq_col0(int wg) { return kDqAlongM ? 0 : wg * kDQ; }
  // Through shared memory + a TMA bulk reduce issued by a dedicated warp when the chunk fits
  // (d <= 192: +16..48 KB); d = 256 (208 KB without it) adds from registers with red.global.v4.
  static constexpr bool kDqViaSmem = kHeadDim <= 192;
  // A thread's partial moves as vectors of kDqVec = 4 consecutive accumulator elements: one
  // st.shared.v4 into sdq, or one red.global.add.v4.f32 at d = 256 (half the instructions of
  // pairs); one vector of every thread of a warpgroup makes 512 contiguous floats, so a warp's
  // 16-byte stores hit 512 contiguous bytes (no bank conflicts) and its atomics whole sectors.
  static constexpr int kDqVec = 4;
  static_assert(kDqWgFloats % (128 * kDqVec) == 0, "whole vector rows per warpgroup part");
  // Where accumulator element i of thread t sits in its warpgroup's part (floats).
  CUTE_HOST_DEVICE static constexpr int dq_slot(int i, int t) {
    return (i / kDqVec) * (128 * kDqVec) + kDqVec * t + i % kDqVec;
  }

  // sdq buffers: two for key-major (d <= 128: 160-208 KB), so the bulk reduce of one Q block's
  // partial reads while the consumers store the next one; one at d >= 192 and with 80-row Q
  // blocks (no room: 245 KB with two).
  static constexpr int kDqStages = kKeyMajor && !kDqTransposed ? 2 : 1;

  static constexpr int kSizeQ = cute::cosize_v<SmemLayoutQ>;     // elements per stage
  static constexpr int kSizeKV = cute::cosize_v<SmemLayoutKV>;
  static constexpr int kSizePdS = cute::cosize_v<SmemLayoutPdS>;
  static constexpr uint32_t kBytesQ = kSizeQ * sizeof(Element);  // TMA always moves the full box
  static constexpr uint32_t kBytesKV = kSizeKV * sizeof(Element);
  static constexpr uint32_t kBytesRow = kBlockM * sizeof(float);  // LSE or D of one Q block
  static constexpr uint32_t kBytesKeyRanges = 2 * kBlockM * sizeof(int);  // (lo, hi) per row
  static constexpr int kSizeQs = kSizeQ;
  // Transaction bytes of bar_kv (K, V) and of one stage of bar_full (Q, dO, LSE, D; the key
  // ranges come on top).
  static constexpr uint32_t kBytesKVLoad = 2 * kBytesKV;
  static constexpr uint32_t kBytesStage = 2 * kBytesQ + 2 * kBytesRow;

  struct SharedStorage {
    alignas(1024) Element k[kSizeKV];
    alignas(1024) Element v[kSizeKV];
    alignas(1024) Element q[kStages * kSizeQ];
    alignas(1024) Element dout[kStages * kSizeQ];
    alignas(1024) Element p[kKeyMajor ? 8 : kSizePdS];  // key-major: P stays in registers
    alignas(1024) Element ds[kSizePdS];
    alignas(128) float dq[kDqViaSmem ? kDqStages * kDqChunkFloats : 4];  // dQ partials
    alignas(16) float lse_log2[kStages][kBlockM];
    alignas(16) float dpsum[kStages][kBlockM];
    alignas(8) uint64_t bar_kv;              // K and V landed (tx barrier, 1 arrival)
    uint64_t bar_full[kStages];              // Q, dO, LSE, D of a stage landed (tx, 1 arrival)
    uint64_t bar_empty[kStages];             // consumers done with a stage (256 arrivals)
    // Key-range kernels: the stage's Q block's (lo, hi) per row (common/key_ranges.h); last, so
    // that the other members keep their offsets in every kernel.
    alignas(16) int key_ranges[kStages][2 * kBlockM];
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage)) + 1024;  // + base alignment slack
  static_assert(kDqStages == 1 || kDqStages == 2);
  static_assert(kSmemBytes <= 227 * 1024, "backward tile does not fit shared memory");
};

// Index of query head qh's Q block m of batch bidb among all (batch, head, Q block) triples: its
// dQ chunk in the workspace and its deterministic-mode semaphore both sit at this index.
__host__ __device__ __forceinline__ int64_t q_block_index(int bidb, int h, int qh, int num_m_blocks,
                                                          int m) {
  return (int64_t(bidb) * h + qh) * num_m_blocks + m;
}

}  // namespace jax_fa3::flash_bwd
