// Persistent static tile scheduler: gridDim.x = min(#SMs, #tiles) CTAs, CTA i takes tiles
// i, i + gridDim.x, ... (round r of the grid runs tiles r * gridDim.x ...). Producer and consumers
// walk the same sequence, so they agree on every tile (and on how many K/V blocks each one loads)
// without talking to each other.
#pragma once
#include <cstdint>

namespace jax_fa3::fwd {

struct TileCoord {
  int m_block, head, batch;
};

struct TileScheduler {
  int num_m_blocks, num_heads, num_tiles;
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
