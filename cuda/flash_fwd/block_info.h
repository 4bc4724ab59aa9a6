// Which K/V blocks a query tile visits, and which of them need per-element masking.
//
// Whole rows (common/row_bounds.h): row i < q_len sees column j < k_len iff
//   i + diag - left <= j <= i + diag + right,  a bound of -1 being unbounded.
// Key ranges (common/key_ranges.h): row i sees [lo_i, hi_i), and a tile visits its TileKeys.
// Blocks outside [n_min, n_max) are fully masked for every row of the tile and are skipped
// entirely (neither loaded nor computed). Producer and consumers call the same functions (host
// too: tests/cuda/check_key_ranges.cu).
#pragma once

#include "common/key_ranges.h"
#include "common/row_bounds.h"
#include "flash_fwd/params.h"

namespace jax_fa3::fwd {

struct BlockRange {
  int n_min, n_max;  // visit n_block = n_max - 1 down to n_min; empty when n_min >= n_max
};

// kPaddedRows false: the caller knows that the tile's first row is real (whole rows: every
// m_block < ceil(s_q / block_m)), and the test is left out.
template <bool kPaddedRows = true>
JAX_FA3_KR_HD BlockRange block_range(int m_block, int block_m, int block_n, const RowBounds& rb,
                                      int left, int right) {
  const int row_first = m_block * block_m;
  if (kPaddedRows && row_first >= rb.q_len) return {0, 0};
  const int row_last = min(row_first + block_m, rb.q_len) - 1;
  int n_max = (rb.k_len + block_n - 1) / block_n;
  if (right >= 0) {
    const int col_last = row_last + rb.diag + right;  // the rightmost column any row sees
    n_max = col_last < 0 ? 0 : min(n_max, col_last / block_n + 1);
  }
  int n_min = 0;
  if (left >= 0) {
    const int col_first = row_first + rb.diag - left;  // the leftmost column any row sees
    n_min = col_first <= 0 ? 0 : col_first / block_n;
  }
  return {n_min, n_max};
}

// The K/V blocks holding a tile's keys [keys.lo, keys.hi) (none when the range is empty).
JAX_FA3_KR_HD BlockRange key_blocks(const TileKeys& keys, int block_n) {
  if (keys.lo >= keys.hi) return {0, 0};
  return {keys.lo / block_n, (keys.hi + block_n - 1) / block_n};
}

// True when some element of block (m_block, n_block) is invisible to a real row: the k_len tail,
// or a window edge crossing the block. Uniform across the tile; blocks strictly inside need no
// mask. Plain ints rather than a RowBounds: with the struct, the whole-row kernel's
// per-block test compiled longer (SASS, d = 128).
JAX_FA3_KR_HD bool block_needs_mask(int m_block, int n_block, int block_m, int block_n, int k_len,
                                     int diag, int left, int right) {
  const int row_first = m_block * block_m;
  const int row_last = row_first + block_m - 1;
  const int col_first = n_block * block_n;
  const int col_last = col_first + block_n - 1;
  return col_last >= k_len || (right >= 0 && col_last > row_first + diag + right) ||
         (left >= 0 && col_first < row_last + diag - left);
}

// Batch row `batch`'s bounds in a row-bound call: its (b, 3) entry, or built from its length.
JAX_FA3_KR_HD RowBounds batch_row_bounds(const FlashFwdScalars& sc, int batch) {
  return sc.bounds_are_lengths ? load_length_row_bounds(sc.row_bounds, batch, sc.s_q, sc.s_k)
                               : load_row_bounds(sc.row_bounds, batch, sc.s_q, sc.s_k);
}

}  // namespace jax_fa3::fwd
