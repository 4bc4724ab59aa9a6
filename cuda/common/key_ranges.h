// Per-query key ranges: the visibility rule of the masked kernels (jax_fa3_flash_fwd_key_ranges,
// jax_fa3_flash_bwd_key_ranges). Query row i of batch row b sees exactly the keys [lo, hi) of its
// range; lo >= hi: it sees nothing (out 0, lse +inf, dq 0). The Python side folds every mask into
// the ranges (lengths of a padded batch, causal and window diagonals, contiguous segments,
// packed varlen sequences), so the kernels test one interval per row and know nothing else.
//
// In memory, both int32, rows padded to a multiple of kKeyRangeRowPad (padding rows [0, 0)):
//   ranges (b, s_pad, 2):                 (lo, hi) per query row;
//   covers (b, s_pad / kKeyRangeGranule, 4): per 64-row granule g,
//     reach_lo, reach_hi   every visible key of the rows of granules >= g lies at or past
//                          reach_lo, and of granules <= g before reach_hi: a suffix minimum of the
//                          rows' lo and a prefix maximum of their hi (over rows that see a key), so
//                          both are non-decreasing in g; a tile's keys are [reach_lo of its first
//                          granule, reach_hi of its last);
//     full_lo, full_hi     keys in [full_lo, full_hi) are visible to every row of g (rows < s_q).
// The kernels skip every K/V block outside a tile's reach and mask only blocks not inside its full
// range. Values are clamped to [0, s_k] where read, so no input sends a load or store out of
// bounds; covers that break the contract above (jax_fa3 builds them from the ranges) can only
// lose visible keys or add masked work.
//
// Row bounds, the forward kernels' other form of the same rule when every row's masks are one
// (q_len, k_len, diag) triple (padded rows, cache pieces; no segment ids): int32 (b, 3), and
// row i < q_len of batch row b sees keys j < k_len with i + diag - left <= j <= i + diag + right
// (a window bound of -1 being unbounded), exactly jax_fa3._key_ranges.row_ranges on those masks.
// The kernel derives each row's range and each tile's keys itself, so no ranges or covers are
// built: a decoding call's few rows paid more for building them than for reading them.
#pragma once

#include "common/row_bounds.h"

#if defined(__CUDACC__)
#define JAX_FA3_KR_HD __host__ __device__ __forceinline__
#else
#define JAX_FA3_KR_HD inline
#endif

namespace jax_fa3 {

constexpr int kKeyRangeRowPad = 128;   // the largest query tile of any kernel taking ranges
constexpr int kKeyRangeGranule = 64;   // the smallest one: every tile is whole granules

JAX_FA3_KR_HD int clamp_key(int x, int s_k) { return x < 0 ? 0 : (x > s_k ? s_k : x); }

JAX_FA3_KR_HD int key_range_rows(int s_q) {
  return (s_q + kKeyRangeRowPad - 1) / kKeyRangeRowPad * kKeyRangeRowPad;
}

struct KeyRange {
  int lo, hi;
};

// The keys that a tile of whole granules [granule, granule + granules) can see, and those that
// all of its rows see.
struct TileKeys {
  int lo, hi;            // visit keys [lo, hi): none when lo >= hi
  int full_lo, full_hi;  // no mask needed inside [full_lo, full_hi)
};

// Row `row` (< key_range_rows(s_q)) of batch row `batch`.
JAX_FA3_KR_HD KeyRange key_range(const int* ranges, int batch, int s_pad, int row, int s_k) {
  const int* at = ranges + 2 * (static_cast<long long>(batch) * s_pad + row);
#if defined(__CUDA_ARCH__)
  const int2 r = __ldg(reinterpret_cast<const int2*>(at));
  return {clamp_key(r.x, s_k), clamp_key(r.y, s_k)};
#else
  return {clamp_key(at[0], s_k), clamp_key(at[1], s_k)};
#endif
}

JAX_FA3_KR_HD TileKeys tile_keys(const int* covers, int batch, int num_granules, int granule,
                                 int granules, int s_k) {
  const int* base = covers + 4 * (static_cast<long long>(batch) * num_granules + granule);
  TileKeys t{};
  for (int g = 0; g < granules; ++g) {
#if defined(__CUDA_ARCH__)
    const int4 c = __ldg(reinterpret_cast<const int4*>(base) + g);
#else
    const struct { int x, y, z, w; } c = {base[4 * g], base[4 * g + 1], base[4 * g + 2],
                                          base[4 * g + 3]};
#endif
    const int full_lo = clamp_key(c.z, s_k), full_hi = clamp_key(c.w, s_k);
    if (g == 0) {
      t.lo = clamp_key(c.x, s_k);
      t.full_lo = full_lo;
      t.full_hi = full_hi;
    } else {
      t.full_lo = t.full_lo > full_lo ? t.full_lo : full_lo;
      t.full_hi = t.full_hi < full_hi ? t.full_hi : full_hi;
    }
    if (g == granules - 1) t.hi = clamp_key(c.y, s_k);
  }
  return t;
}

// Batch row `batch`'s bounds, clamped as row_ranges clamps them: q_len to [0, s_q], k_len to
// [0, s_k], diag to +-2 (s_q + s_k) (past that every row sees all or none of the keys, and
// i + diag +- window stays in int32 with windows clamped to 4 (s_q + s_k): bounded_window).
JAX_FA3_KR_HD RowBounds load_row_bounds(const int* bounds, int batch, int s_q, int s_k) {
  const int* at = bounds + 3 * static_cast<long long>(batch);
#if defined(__CUDA_ARCH__)
  const int q_len = __ldg(at), k_len = __ldg(at + 1), diag = __ldg(at + 2);
#else
  const int q_len = at[0], k_len = at[1], diag = at[2];
#endif
  const int reach = 2 * (s_q + s_k);
  return {clamp_key(q_len, s_q), clamp_key(k_len, s_k),
          diag < -reach ? -reach : (diag > reach ? reach : diag)};
}

// A decode step's bounds from its row's cache length alone (FlashFwdParams::row_lengths): every
// one of the s_q rows (a kv head's grouped query heads, all the same newest token) real, keys
// [0, k_len) with k_len the length clamped to [0, s_k], the diagonal k_len - 1 (the clamp first,
// as jax_fa3.flash_attention_with_kvcache clamps a traced length to the capacity).
JAX_FA3_KR_HD RowBounds load_length_row_bounds(const int* lengths, int batch, int s_q, int s_k) {
#if defined(__CUDA_ARCH__)
  const int length = __ldg(lengths + batch);
#else
  const int length = lengths[batch];
#endif
  const int k_len = clamp_key(length, s_k);
  return {s_q, k_len, k_len - 1};  // within load_row_bounds's diagonal clamp
}

// A window bound for the row-bound rule: -1 (unbounded) or at most 4 (s_q + s_k).
JAX_FA3_KR_HD int bounded_window(long long window, long long s_q, long long s_k) {
  if (window < 0) return -1;
  return static_cast<int>(window < 4 * (s_q + s_k) ? window : 4 * (s_q + s_k));
}

// Row `row`'s keys under its bounds before the empty-row rule: [lo, hi) clamped to [0, s_k].
JAX_FA3_KR_HD KeyRange raw_bounded_keys(const RowBounds& rb, int row, int s_k, int left,
                                        int right) {
  const int centre = row + rb.diag;
  const int lo = left >= 0 ? centre - left : 0;
  int hi = rb.k_len;
  if (right >= 0 && centre + right + 1 < hi) hi = centre + right + 1;
  return {clamp_key(lo, s_k), clamp_key(hi, s_k)};
}

// Row `row`'s keys: key_range's value for the ranges row_ranges builds from the same bounds.
JAX_FA3_KR_HD KeyRange bounded_key_range(const RowBounds& rb, int row, int s_k, int left,
                                         int right) {
  const KeyRange r = raw_bounded_keys(rb, row, s_k, left, right);
  return row < rb.q_len && r.lo < r.hi ? r : KeyRange{0, 0};
}

// The keys of the tile of rows [row_first, row_first + rows) (s_q: the problem's rows; rows past
// it are padding). Both ends of a row's raw range grow with the row, so the tile visits
// [lo(first row), hi(last row < q_len)) and every real row sees [lo(last real row), hi(first
// row)); a real row past q_len or one that sees nothing leaves that range empty. The visit may
// hold blocks that only rows seeing nothing border (masked work, never a lost key).
JAX_FA3_KR_HD TileKeys bounded_tile_keys(const RowBounds& rb, int row_first, int rows, int s_q,
                                         int s_k, int left, int right) {
  const int end = row_first + rows < rb.q_len ? row_first + rows : rb.q_len;
  if (end <= row_first) return {0, 0, 0, 0};
  const KeyRange first = raw_bounded_keys(rb, row_first, s_k, left, right);
  const KeyRange last = raw_bounded_keys(rb, end - 1, s_k, left, right);
  const int real_end = row_first + rows < s_q ? row_first + rows : s_q;
  if (real_end > end) return {first.lo, last.hi, 0, 0};
  return {first.lo, last.hi, last.lo, first.hi};
}

// Whether keys [col0, col0 + cols) hold one that some row of the tile does not see.
JAX_FA3_KR_HD bool keys_need_mask(const TileKeys& t, int col0, int cols) {
  return !(t.full_lo <= col0 && col0 + cols <= t.full_hi);
}

}  // namespace jax_fa3
