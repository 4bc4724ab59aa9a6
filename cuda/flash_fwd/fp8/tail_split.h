// Tail split of the persistent grid (fp8 kernels in the plain order, no mask): the tiles of the
// last, partial round run as two pieces each on two CTAs; each piece writes its partial O and row
// statistics to the workspace, and the CTA that finishes second merges the two and writes the
// tile's O and LSE (tile_scheduler.h says which items are pieces).
//
// Why: without a mask every tile costs the same, so a last round of L < gridDim.x tiles keeps
// gridDim.x - L CTAs idle for a whole tile time (d128 8k, 16k tokens, 16 heads on 132 SMs: 1376
// tiles of 192 rows = 10.4 rounds, the kernel waits 11 tile times).
//
// Numerics: the fp8 kernel quantizes P as e4m3(2^6 · exp2(s - running max)), so P's rounding
// depends on the running max a block is exponentiated against (jax_fa3/_fp8_emulation.py). The high
// piece visits the top K/V blocks exactly as the whole tile would. The low piece first takes the
// row maxima of the high piece's blocks (the S GEMM and row max only; no exponentials, no PV
// GEMM, V not loaded), so its blocks are exponentiated against the same running max as in the
// whole tile: both pieces quantize every P value as the unsplit kernel does. What differs is the
// order O is accumulated in: the fp8 tensor cores keep ~14 bits of the running sum, and the low
// blocks now start from zero instead of the high ones' sum (H200: 1.2% of the d128 8k outputs
// move, a few by several bf16 steps; float64 row errors the same, benchmarks/RESULTS.md), plus
// float32 rounding (one exp2 rescales the high partial instead of a product of per-block factors).
//
// Where the merge runs: in the main kernel, by whichever CTA finishes its piece second, after its
// persistent loop (merge_if_last_piece). Merged inside the loop's epilogue, ptxas spills 16-20
// bytes of loop invariants of the 192-row d128 kernel into the main loop; a separate merge kernel
// costs as much as the split gains (ncu, H200, 2026-12-02, d128 8k: main kernel 1.21 ms vs 1.24
// ms unsplit, merge kernel 12.5 us plus the launch gap).
#pragma once
#include <cmath>
#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cute/tensor.hpp>

#include "flash_fwd/barriers.h"
#include "flash_fwd/block_info.h"
#include "flash_fwd/fp8/softmax.h"
#include "flash_fwd/params.h"
#include "flash_fwd/softmax.h"
#include "flash_fwd/tile_scheduler.h"

namespace jax_fa3::fwd {

// The high piece takes this many eighths of the tile's K/V blocks. The low piece pays for its
// row-max pass over the high piece's blocks (roughly a third of a whole block each: the S GEMM is
// half of the tensor work and no exponentials run), so equal finishing times need the high piece
// to be the larger one: h = 5/8 of n gives the low piece 5/8 * (about 1/3) + 3/8 of a tile.
constexpr int kTailSplitHighEighths = 5;

// The blocks a work item visits (n_max - 1 down to n_min, as block_range) and the first of them
// that it only takes row maxima of (n_max: none).
struct PieceRange {
  BlockRange visit;
  int max_only_from;
};

__host__ __device__ __forceinline__ PieceRange piece_range(const BlockRange& range,
                                                           TilePiece piece) {
  const int n = range.n_max - range.n_min;
  int high = (n * kTailSplitHighEighths + 4) / 8;
  high = high < 1 ? 1 : (high > n - 1 ? n - 1 : high);
  const int split = range.n_max - high;
  switch (piece) {
    case kHighPiece: return {{split, range.n_max}, range.n_max};
    case kLowPiece: return {range, split};
    default: return {range, range.n_max};
  }
}

// The kernel's loop bound: work items with the split (kTailSplit: Traits::kTailSplit), tiles
// without it (the same number when no tile is split).
template <bool kTailSplit>
__device__ __forceinline__ int num_work_items(const TileScheduler& scheduler) {
  return kTailSplit ? scheduler.num_work_items : scheduler.num_tiles;
}

// Work item `index` of the sequence (producer and consumers walk the same one): its tile, its
// keys (kKeyRanges: the tile's TileKeys from sc.key_covers or sc.row_bounds, common/key_ranges.h,
// cut to its split-KV piece's keys; else unused) and the K/V blocks it visits (block_range or
// key_blocks, cut to the tail-split piece). Without the tail split, the whole tile.
struct ItemBlocks {
  TileCoord tile;
  TileKeys keys;
  PieceRange piece;
};
template <bool kTailSplit, bool kKeyRanges>
__device__ __forceinline__ ItemBlocks item_blocks(const TileScheduler& scheduler, int index,
                                                  int block_m, int block_n,
                                                  const FlashFwdScalars& sc) {
  const WorkItem item = kTailSplit ? scheduler.item(index)
                                    : WorkItem{scheduler.template coord<kKeyRanges>(index),
                                               kWholeTile};
  if constexpr (kKeyRanges) {
    TileKeys keys =
        sc.row_bounds != nullptr
            ? bounded_tile_keys(batch_row_bounds(sc, item.tile.batch),
                                item.tile.m_block * block_m, block_m, sc.s_q, sc.s_k,
                                sc.window_left, sc.window_right)
            : tile_keys(sc.key_covers, item.tile.batch, key_range_rows(sc.s_q) / kKeyRangeGranule,
                        item.tile.m_block * (block_m / kKeyRangeGranule),
                        block_m / kKeyRangeGranule, sc.s_k);
    if (sc.split_keys > 0) {  // split-KV: this piece's whole blocks of the tile's keys
      const int first = item.tile.split * sc.split_keys;
      keys.lo = max(keys.lo, first);
      keys.hi = min(keys.hi, first + sc.split_keys);
    }
    return {item.tile, keys, piece_range(key_blocks(keys, block_n), item.piece)};
  } else {
    const BlockRange whole = block_range<false>(item.tile.m_block, block_m, block_n,
                                                whole_rows(sc.s_q, sc.s_k), sc.window_left,
                                                sc.window_right);
    return {item.tile, TileKeys{}, piece_range(whole, item.piece)};
  }
}

// Tiles to split for num_tiles tiles on grid CTAs (0: none): the last round must leave at least
// half of the grid idle (two CTAs per split tile), each tile must have two K/V blocks to share,
// and the workspace must hold max_tiles slots.
__host__ __device__ __forceinline__ int tail_split_tiles(int num_tiles, int grid, int num_k_blocks,
                                                         int max_tiles) {
  if (num_tiles <= grid || num_k_blocks < 2) return 0;
  const int last_round = num_tiles % grid;
  return last_round > 0 && 2 * last_round <= grid && last_round <= max_tiles ? last_round : 0;
}

// The workspace area of the split tiles (fp8/flash_fwd_fp8.h sizes it): 2L slots, the high pieces'
// (0..L-1) then the low pieces' (L..2L-1), each holding a piece's partial O in float4 vectors
// [vector][consumer thread] (coalesced stores and loads) and then its per-thread row statistics
// (row_max[2], row_sum[2]; row_sum is the thread's partial sum, quad-summed at the end).
template <int kHeadDim, int kBlockM>
struct TailSlotLayout {
  static constexpr int kThreads = 2 * kBlockM;  // 128 consumer threads per 64 rows
  static constexpr int kVectors = kHeadDim / 8;  // O fragment: kHeadDim / 2 floats per thread
  static constexpr int64_t kFloat4s = int64_t(kVectors + 1) * kThreads;
  // T: float (the pieces write) or const float (the merge reads).
  template <class T>
  __host__ __device__ static auto* o(T* partials, int slot) {
    using Vec = std::conditional_t<std::is_const_v<T>, const float4, float4>;
    return reinterpret_cast<Vec*>(partials) + slot * kFloat4s;
  }
  template <class T>
  __host__ __device__ static auto* stats(T* partials, int slot) {
    return o(partials, slot) + kVectors * kThreads;
  }
  // The tickets (one int per split tile) follow the 2L slots of a call with L split tiles, inside
  // the workspace's ticket area (flash_fwd_fp8_workspace_bytes sizes it after the most slots).
  __host__ __device__ static int* tickets(float* partials, int split_tiles) {
    return reinterpret_cast<int*>(o(partials, 2 * split_tiles));
  }
};

// Every consumer thread of a piece, after its last K/V block: its O fragment and row statistics to
// its slot (the item's index past the last whole tile).
template <int kHeadDim, int kBlockM, class FragO, class Softmax>
__device__ __forceinline__ void write_tail_piece(float* partials, int slot, FragO const& o,
                                                 Softmax const& softmax, int thread_idx) {
  using Layout = TailSlotLayout<kHeadDim, kBlockM>;
  static_assert(decltype(cute::size(o))::value == 4 * Layout::kVectors);
  float4* slot_o = Layout::o(partials, slot);
#pragma unroll
  for (int v = 0; v < Layout::kVectors; ++v) {
    slot_o[v * Layout::kThreads + thread_idx] =
        make_float4(o(4 * v), o(4 * v + 1), o(4 * v + 2), o(4 * v + 3));
  }
  Layout::stats(partials, slot)[thread_idx] =
      make_float4(softmax.row_max[0], softmax.row_max[1], softmax.row_sum[0], softmax.row_sum[1]);
}

// a * fa + b * fb as two rounded products and a sum (no contraction): the merge gives the same
// bits whichever of the two CTAs runs it.
__device__ __forceinline__ float merge_terms(float a, float fa, float b, float fb) {
  return __fadd_rn(__fmul_rn(a, fa), __fmul_rn(b, fb));
}

// The merge of split tile `tile` (0..L-1), run by the consumer threads (thread_idx 0..2*kBlockM-1)
// of whichever CTA finished its piece second: thread t takes over what consumer thread t held in
// both pieces (same fragment layout, so the quad sums of finalize() pair the same lanes). O =
// merged O * v_scale / (2^6 * row sum) + v_mean (rows that saw a key: fp8/v_mean.h) in bf16,
// rounded as the epilogue rounds, and the LSE, straight to global memory. The partials are read
// past L1 (__ldcg): the other CTA wrote them.
template <int kHeadDim, int kBlockM, class Params>
__device__ __forceinline__ void merge_tail_tile(const Params& p, int tile, const TileCoord& c,
                                                int thread_idx) {
  using Layout = TailSlotLayout<kHeadDim, kBlockM>;
  const FlashFwdScalars& sc = p.s;
  const int split_tiles = p.scheduler.num_split_tiles;
  const float* partials = p.tail_partials;
  const float4 high = __ldcg(Layout::stats(partials, tile) + thread_idx);
  const float4 low = __ldcg(Layout::stats(partials, split_tiles + tile) + thread_idx);
  const float high_max[2] = {high.x, high.y}, low_max[2] = {low.x, low.y};
  const float high_sum[2] = {high.z, high.w}, low_sum[2] = {low.z, low.w};
  Fp8OnlineSoftmax<1, false> merged;
  float high_factor[2], low_factor[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    merged.row_max[r] = fmaxf(high_max[r], low_max[r]);
    // A row neither piece saw a key of keeps max -inf and sums 0: factors exp2(-inf) = 0.
    const float base = merged.row_max[r] == -INFINITY ? 0.f : merged.row_max[r];
    high_factor[r] = exp2f(high_max[r] - base);
    low_factor[r] = exp2f(low_max[r] - base);
    merged.row_sum[r] = merge_terms(high_sum[r], high_factor[r], low_sum[r], low_factor[r]);
  }
  const int kv_head = c.head / (sc.h / sc.h_k);
  float inv_sum[2], lse[2];
  merged.finalize(sc.scale_log2, __ldg(p.v_scale + int64_t(c.batch) * sc.h_k + kv_head), inv_sum,
                  lse);

  const FragCoord fc = FragCoord::of_thread(thread_idx % 128);
  const int row0 = c.m_block * kBlockM + 64 * (thread_idx / 128) + fc.row0;
  const float4* high_o = Layout::o(partials, tile) + thread_idx;
  const float4* low_o = Layout::o(partials, split_tiles + tile) + thread_idx;
  auto* out = static_cast<__nv_bfloat16*>(p.out);
  const float* mean = p.v_mean + (int64_t(c.batch) * sc.h_k + kv_head) * sc.d;  // fp8/v_mean.h
#pragma unroll 4
  for (int v = 0; v < Layout::kVectors; ++v) {
    const float4 a = __ldcg(high_o + v * Layout::kThreads);
    const float4 b = __ldcg(low_o + v * Layout::kThreads);
    const float hv[4] = {a.x, a.y, a.z, a.w}, lv[4] = {b.x, b.y, b.z, b.w};
    const int col = fc.col0 + 8 * v;  // frag_col of element 4v (and 4v + 1 next to it)
#pragma unroll
    for (int r = 0; r < 2; ++r) {  // elements 4v + 2r, 4v + 2r + 1: row r, columns col, col + 1
      const int row = row0 + 8 * r;
      if (row >= sc.s_q || col >= sc.d) continue;
      const float2 m = inv_sum[r] == 0.f ? make_float2(0.f, 0.f)
                                         : __ldg(reinterpret_cast<const float2*>(mean + col));
      const float o[2] = {
          __fadd_rn(__fmul_rn(merge_terms(hv[2 * r], high_factor[r], lv[2 * r], low_factor[r]),
                              inv_sum[r]), m.x),
          __fadd_rn(__fmul_rn(merge_terms(hv[2 * r + 1], high_factor[r], lv[2 * r + 1],
                                          low_factor[r]), inv_sum[r]), m.y)};
      const int64_t at = ((int64_t(c.batch) * sc.s_q + row) * sc.h + c.head) * sc.d + col;
      *reinterpret_cast<__nv_bfloat162*>(out + at) = __floats2bfloat162_rn(o[0], o[1]);
    }
  }
  if (thread_idx % 4 == 0) {
    float* lse_row = sc.lse + (int64_t(c.batch) * sc.h + c.head) * sc.s_q;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      if (row0 + 8 * r < sc.s_q) lse_row[row0 + 8 * r] = lse[r];
    }
  }
}

// After a CTA's last work item (consumer threads only, thread_idx 0..2*kBlockM-1): if that item
// was a piece of a split tile, the CTA takes the tile's ticket; the CTA that finds the other piece
// already done merges the two. One atomic per piece: no CTA ever waits for another, so the merge
// needs no co-residency. The tickets (TailSlotLayout::tickets) are zeroed by the pre-kernel that
// runs before the main kernel on the stream (fp8/vt.h).
// ticket_smem: one int of shared memory to broadcast the ticket.
// Not inlined: as inlined code after the persistent loop it changed ptxas's register allocation
// of the loop itself (32 bytes spilled in the 192-row d128 kernel: a reload before each S GEMM).
template <class Traits, class Params>
__device__ __noinline__ void merge_if_last_piece(const Params& p, int* ticket_smem,
                                                 int thread_idx) {
  const TileScheduler& sched = p.scheduler;
  const int split_tiles = sched.num_split_tiles;
  if (split_tiles == 0) return;
  const int items = sched.num_work_items;
  if (int(blockIdx.x) >= items) return;
  const int last = blockIdx.x + (items - 1 - blockIdx.x) / gridDim.x * gridDim.x;
  const int first_piece = sched.num_tiles - split_tiles;
  if (last < first_piece) return;
  const int tile = (last - first_piece) % split_tiles;
  constexpr int kThreads = Traits::kNumConsumerThreads;
  // Every thread's partial stores (write_tail_piece) are visible device-wide before the ticket.
  __threadfence();
  named_barrier_sync(kBarrierConsumers, kThreads);
  if (thread_idx == 0) {
    using Layout = TailSlotLayout<Traits::kHeadDim, Traits::kBlockM>;
    *ticket_smem = atomicAdd(Layout::tickets(p.tail_partials, split_tiles) + tile, 1);
  }
  named_barrier_sync(kBarrierConsumers, kThreads);
  if (*ticket_smem != 1) return;
  __threadfence();  // the other piece's stores, published before its ticket, are seen after it
  merge_tail_tile<Traits::kHeadDim, Traits::kBlockM>(
      p, tile, sched.coord(first_piece + tile), thread_idx);
}

}  // namespace jax_fa3::fwd
