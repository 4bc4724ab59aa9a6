// Which K/V blocks a query tile visits, and which of them need per-element masking.
//
// Visibility (bottom-right aligned): row i sees column j iff
//   i + off - left <= j <= i + off + right,  off = s_k - s_q,  a bound of -1 being unbounded,
// and j < s_k. Blocks outside [n_min, n_max) are fully masked for every row of the tile and are
// skipped entirely (neither loaded nor computed); producer and consumers call the same function.
#pragma once

namespace jax_fa3::fwd {

struct BlockRange {
  int n_min, n_max;  // visit n_block = n_max - 1 down to n_min; empty when n_min >= n_max
};

__device__ __forceinline__ BlockRange block_range(int m_block, int block_m, int block_n, int s_q,
                                                  int s_k, int left, int right) {
  const int off = s_k - s_q;
  const int row_first = m_block * block_m;
  const int row_last = min(row_first + block_m, s_q) - 1;
  int n_max = (s_k + block_n - 1) / block_n;
  if (right >= 0) {
    const int col_last = row_last + off + right;  // the rightmost column any row sees
    n_max = col_last < 0 ? 0 : min(n_max, col_last / block_n + 1);
  }
  int n_min = 0;
  if (left >= 0) {
    const int col_first = row_first + off - left;  // the leftmost column any row sees
    n_min = col_first <= 0 ? 0 : col_first / block_n;
  }
  return {n_min, n_max};
}

// True when some element of block (m_block, n_block) is invisible: the s_k tail, or a window edge
// crossing the block. Uniform across the tile; blocks strictly inside need no mask.
__device__ __forceinline__ bool block_needs_mask(int m_block, int n_block, int block_m, int block_n,
                                                 int s_q, int s_k, int left, int right) {
  const int off = s_k - s_q;
  const int row_first = m_block * block_m;
  const int row_last = row_first + block_m - 1;
  const int col_first = n_block * block_n;
  const int col_last = col_first + block_n - 1;
  return col_last >= s_k || (right >= 0 && col_last > row_first + off + right) ||
         (left >= 0 && col_first < row_last + off - left);
}

}  // namespace jax_fa3::fwd
