// Persistent static tile scheduler: gridDim.x = min(#SMs, #tiles) CTAs, CTA i takes work items
// i, i + gridDim.x, ... (round r of the grid runs items r * gridDim.x ...). Producer and consumers
// walk the same sequence, so they agree on every tile (and on how many K/V blocks each one loads)
// without talking to each other.
//
// Tail split (fp8 kernels without a mask, fp8/tail_split.h): when the last round holds L tiles and
// 2L <= gridDim.x, so that all but L CTAs would idle through it, each of those L tiles runs as two
// pieces on two CTAs (the high piece takes the top K/V blocks, the low piece the rest), and the
// CTA that finishes its piece second merges the two partials. Items [num_tiles - L,
// num_tiles + L) are the pieces, in workspace slot order: high pieces first (CTAs 0..L-1 of the
// last round), then low (L..2L-1).
#pragma once
#include <cstdint>

namespace jax_fa3::fwd {

struct TileCoord {
  int m_block, head, batch;
};

// Which part of its tile a work item computes.
enum TilePiece : int { kWholeTile = 0, kHighPiece = 1, kLowPiece = 2 };

struct WorkItem {
  TileCoord tile;
  TilePiece piece;
};

struct TileScheduler {
  int num_m_blocks, num_heads, num_tiles;
  // L above (0: no tail split) and the item count, set on the host (set_tail_split): kept as
  // parameters so that the kernel's loops read them from the constant bank instead of holding
  // a computed bound in a register (the 192-row fp8 kernel has none to spare).
  int num_split_tiles = 0;
  int num_work_items = num_tiles;

  __host__ void set_tail_split(int split_tiles) {
    num_split_tiles = split_tiles;
    num_work_items = num_tiles + split_tiles;
  }
  // With a causal or sliding-window mask the bottom rows (large m_block) see the most keys in
  // bottom-right alignment, so tiles are handed out by m_block descending over all heads:
  // longest first, short tiles fill the tail. Without a mask all tiles cost the same and the
  // tiles of one (batch, head) are consecutive, so CTAs running together share K/V in L2.
  bool longest_first;

  __host__ __device__ TileScheduler(int s_q, int block_m, int h, int b, bool masked)
      : num_m_blocks((s_q + block_m - 1) / block_m), num_heads(h),
        num_tiles(num_m_blocks * h * b), longest_first(masked) {}

  // Masked: odd rounds run backwards over the CTAs (zigzag), so the CTA that had the longest tile
  // of one round gets the shortest of the next and the per-CTA sums stay even. Simulated for
  // causal 8k on 132 CTAs (8-32 heads x batches): the busiest CTA carries 1.06-1.12x the mean
  // work in plain order, 1.00-1.01x zigzag; the wait for it is the kernel's tail. A bijection on
  // [0, num_tiles): the last, partial round is reversed over its own CTAs.
  __host__ __device__ __forceinline__ int zigzag(int tile, int num_ctas) const {
    const int round = tile / num_ctas;
    if ((round & 1) == 0) return tile;
    const int left = num_tiles - round * num_ctas;
    const int in_round = left < num_ctas ? left : num_ctas;
    return round * num_ctas + in_round - 1 - (tile - round * num_ctas);
  }

  // Item `index` of the sequence above; num_ctas: the grid size.
  __host__ __device__ __forceinline__ WorkItem item(int index, int num_ctas) const {
    const int first_split = num_tiles - num_split_tiles;
    if (index < first_split) return {coord(index, num_ctas), kWholeTile};
    const int piece = index - first_split;
    return {coord(first_split + piece % num_split_tiles, num_ctas),
            piece < num_split_tiles ? kHighPiece : kLowPiece};
  }

  // num_ctas: the grid size (the round length of the zigzag).
  __host__ __device__ __forceinline__ TileCoord coord(int tile, int num_ctas) const {
    TileCoord c;
    int bh;
    if (longest_first) {
      tile = zigzag(tile, num_ctas);
      const int num_bh = num_tiles / num_m_blocks;
      c.m_block = num_m_blocks - 1 - tile / num_bh;
      bh = tile % num_bh;
    } else {
      c.m_block = tile % num_m_blocks;
      bh = tile / num_m_blocks;
    }
    c.head = bh % num_heads;
    c.batch = bh / num_heads;
    return c;
  }
};

}  // namespace jax_fa3::fwd
