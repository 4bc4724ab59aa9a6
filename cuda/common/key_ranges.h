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
#pragma once

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

// Whether keys [col0, col0 + cols) hold one that some row of the tile does not see.
JAX_FA3_KR_HD bool keys_need_mask(const TileKeys& t, int col0, int cols) {
  return !(t.full_lo <= col0 && col0 + cols <= t.full_hi);
}

}  // namespace jax_fa3
