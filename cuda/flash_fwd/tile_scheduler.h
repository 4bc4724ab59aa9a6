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
  int split;  // split-KV piece (0 without split-KV)
};

// Which part of its tile a work item computes.
enum TilePiece : int { kWholeTile = 0, kHighPiece = 1, kLowPiece = 2 };

struct WorkItem {
  TileCoord tile;
  TilePiece piece;
};

struct TileScheduler {
  int num_m_blocks, num_heads, num_tiles;
  // Split-KV (key-range kernels, coord<true>): each (batch, head) is num_splits "heads" of the
  // orders below, (batch, head, split) with the split fastest.
  int num_splits;
  // L above (0: no tail split) and the item count, set on the host (set_tail_split): kept as
  // parameters so that the kernel's loops read them from the constant bank instead of holding
  // a computed bound in a register (the 192-row fp8 kernel has none to spare).
  int num_split_tiles = 0;
  int num_work_items = num_tiles;
  // With a causal mask a tile's cost grows linearly with m_block (a sliding window's grows less
  // or not at all), so tiles m and num_m_blocks - 1 - m of one (batch, head) cost the same
  // together as any other such pair: the pair order (coord) gives each pair to one CTA, long tile
  // first. Every CTA then carries the same work, and the pairs of one (batch, head) are
  // consecutive, so the CTAs in flight read the K/V of a few heads, which stays in L2. Handing
  // out m_blocks descending over all heads (longest first) balanced as well but walked every
  // head's K/V in each round: at 1k causal d128 (16 x 16 heads, 134 MB of K/V against a 50 MB
  // L2) every m_block round read it from HBM again. Groups of heads that fit L2, each longest
  // first, ran short problems up to 23% faster on an H100 but lost up to 31% on long ones: the
  // static rounds then give the same CTAs every group's longest tiles (benchmarks/RESULTS.md,
  // 2026-12-05). Without a mask all tiles cost the same and the tiles of one (batch, head) are
  // consecutive.
  bool paired;
  // The pair order's constants for a grid of `grid` CTAs (set_grid, on the host, at launch).
  int grid = 1;
  int pairs_per_head = 0;  // num_m_blocks / 2: pairs (m, num_m_blocks - 1 - m) of one (b, h)
  int num_head_pairs = 0;  // those pairs over all (b, h); then, with an odd num_m_blocks, the
                           // middle tiles of two neighbouring (b, h) pair up, and one may be left
  int round_pairs = 0;     // pairs in whole double rounds: grid * (pairs / grid)
  int tail_pair_ctas = 0;  // CTAs that run a whole pair after them (the rest run one tile)
  // When the tail runs one tile per CTA, the CTA with the long tile of an outer pair (cost up to
  // num_m_blocks) finishes far behind the rest (192-row tiles at 16k: 1.12x the mean work). The
  // tail then takes each head's most central pairs instead, whose two tiles cost about
  // num_m_blocks / 2 each: pairs [num_head_pairs - tail_head_pairs, num_head_pairs) are central
  // pairs dealt one head after another, and head bh keeps its outer pairs (pairs_per_head -
  // tail_quota of them, one fewer for bh < tail_extra) consecutive for the rounds before.
  int num_bh = 0;
  int tail_head_pairs = 0;
  int tail_quota = 0;  // tail_head_pairs / num_bh
  int tail_extra = 0;  // tail_head_pairs % num_bh

  __host__ __device__ TileScheduler(int s_q, int block_m, int h, int b, bool masked,
                                    int splits = 1)
      : num_m_blocks((s_q + block_m - 1) / block_m), num_heads(h),
        num_tiles(num_m_blocks * h * b * splits), num_splits(splits), paired(masked) {}

  __host__ void set_tail_split(int split_tiles) {
    num_split_tiles = split_tiles;
    num_work_items = num_tiles + split_tiles;
  }

  // Called by the launch with the grid it launches (gridDim.x): the pair order depends on it.
  __host__ void set_grid(int num_ctas) {
    grid = num_ctas;
    num_bh = num_tiles / num_m_blocks;
    pairs_per_head = num_m_blocks / 2;
    num_head_pairs = num_bh * pairs_per_head;
    const bool odd = (num_m_blocks & 1) != 0;
    const int pairs = num_head_pairs + (odd ? num_bh / 2 : 0);
    const int lone_tile = odd && (num_bh & 1) != 0 ? 1 : 0;
    round_pairs = pairs / grid * grid;
    const int tail_tiles = 2 * (pairs - round_pairs) + lone_tile;
    tail_pair_ctas = tail_tiles > grid ? tail_tiles - grid : 0;
    // The middle tiles' pairs (odd num_m_blocks) come last and are central already.
    const int tail_pairs = pairs - round_pairs;
    const int middle_pairs = odd ? num_bh / 2 : 0;
    tail_head_pairs = round_pairs > 0 && tail_pair_ctas == 0 && tail_pairs > middle_pairs
                          ? tail_pairs - middle_pairs
                          : 0;
    tail_quota = tail_head_pairs / num_bh;
    tail_extra = tail_head_pairs % num_bh;
  }

  // Item `index` of the sequence above.
  __host__ __device__ __forceinline__ WorkItem item(int index) const {
    const int first_split = num_tiles - num_split_tiles;
    if (index < first_split) return {coord(index), kWholeTile};
    const int piece = index - first_split;
    return {coord(first_split + piece % num_split_tiles),
            piece < num_split_tiles ? kHighPiece : kLowPiece};
  }

  // The tile of work index `tile` (CTA i walks i, i + grid, ...). kSplitKv: the kernel splits
  // keys (num_splits may exceed 1); otherwise num_splits is 1 and no piece index is decoded.
  template <bool kSplitKv = false>
  __host__ __device__ __forceinline__ TileCoord coord(int tile) const {
    TileCoord c;
    int bh;
    if (paired) {
      // Whole double rounds: round 2r gives CTA i the long tile of pair r * grid + i, round
      // 2r + 1 its short one. After them, fewer pairs than CTAs are left: CTAs
      // [0, tail_pair_ctas) take a pair each over two rounds (indices x and grid + x past the
      // double rounds), the other CTAs one tile each.
      int pair, second;
      if (tile < 2 * round_pairs) {
        const int round = tile / grid;
        pair = (round >> 1) * grid + (tile - round * grid);
        second = round & 1;
      } else {
        const int x = tile - 2 * round_pairs;
        if (x < tail_pair_ctas) {
          pair = round_pairs + x;
          second = 0;
        } else if (x >= grid) {
          pair = round_pairs + x - grid;
          second = 1;
        } else {
          const int single = x - tail_pair_ctas;
          pair = round_pairs + tail_pair_ctas + (single >> 1);
          second = single & 1;
        }
      }
      if (pair < num_head_pairs) {
        const int kept_pairs = num_head_pairs - tail_head_pairs;
        const int kept_per_head = pairs_per_head - tail_quota;  // heads >= tail_extra
        const int short_heads_span = tail_extra * (kept_per_head - 1);
        int j;
        if (pair >= kept_pairs) {
          const int t = pair - kept_pairs;
          bh = t % num_bh;
          j = pairs_per_head - 1 - t / num_bh;
        } else if (pair < short_heads_span) {
          bh = pair / (kept_per_head - 1);
          j = pair - bh * (kept_per_head - 1);
        } else {
          const int p = pair - short_heads_span;
          const int k = p / kept_per_head;
          bh = tail_extra + k;
          j = p - k * kept_per_head;
        }
        c.m_block = second ? j : num_m_blocks - 1 - j;
      } else {  // the middle m_block of (b, h) 2i and 2i + 1 (the lone one: second == 0)
        bh = 2 * (pair - num_head_pairs) + second;
        c.m_block = pairs_per_head;
      }
    } else {
      c.m_block = tile % num_m_blocks;
      bh = tile / num_m_blocks;
    }
    if constexpr (kSplitKv) {
      c.split = bh % num_splits;
      bh /= num_splits;
    } else {
      c.split = 0;
    }
    c.head = bh % num_heads;
    c.batch = bh / num_heads;
    return c;
  }
};

}  // namespace jax_fa3::fwd
