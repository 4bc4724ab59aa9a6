// Which (Q block, K block) pairs have at least one visible (query, key) pair. Shared by the main
// kernel (loop bounds) and the deterministic dQ ordering, so both use the same predicate.
//
// Visibility in one batch row (common/seq_bounds.h; whole rows: q_len = s_q, k_len = s_k,
// diag = s_k - s_q): query i < q_len sees key j < k_len iff  i + diag - wl <= j <= i + diag + wr,
// a bound of -1 being unbounded. Block rows [i0, i1], columns [j0, j1] (clipped to the lengths)
// hold a visible pair iff
//   (wr < 0 || i1 + diag + wr >= j0)  and  (wl < 0 || i0 + diag - wl <= j1).
// For fixed n the visible m form one interval, and for fixed m the visible n form one interval.
#pragma once

#include "common/seq_bounds.h"

#if defined(__CUDACC__)
#define JAX_FA3_HD __host__ __device__ __forceinline__
#else
#define JAX_FA3_HD inline
#endif

namespace jax_fa3::flash_bwd {

struct BlockGeometry {
  int block_m, block_n, window_left, window_right;
  // One batch row's bounds: the launch sets whole rows, the kernel its own row's (for_row).
  RowBounds row;

  JAX_FA3_HD BlockGeometry for_row(const RowBounds& bounds) const {
    BlockGeometry g = *this;
    g.row = bounds;
    return g;
  }

  // Q blocks [m_begin, m_end) that K block n must visit (possibly empty). Q blocks past q_len
  // and K blocks past k_len hold padding only and visit nothing.
  JAX_FA3_HD void m_range(int n, int& m_begin, int& m_end) const {
    const int num_m = (row.q_len + block_m - 1) / block_m;
    const int j0 = n * block_n;
    m_begin = 0;
    m_end = 0;
    if (j0 >= row.k_len || num_m == 0) return;
    const int j1 = (j0 + block_n < row.k_len ? j0 + block_n : row.k_len) - 1;
    m_end = num_m;
    if (window_right >= 0) {
      const int t = j0 - row.diag - window_right;  // need last row i1 >= t
      if (t > row.q_len - 1) { m_end = 0; return; }
      m_begin = t <= 0 ? 0 : t / block_m;
    }
    if (window_left >= 0) {
      const int u = j1 - row.diag + window_left;  // need first row i0 <= u
      if (u < 0) { m_end = 0; return; }
      const int last = u / block_m + 1;
      m_end = last < num_m ? last : num_m;
    }
    if (m_end < m_begin) m_end = m_begin;
  }

  // First K block that visits Q block m (meaningful only if some K block visits it).
  JAX_FA3_HD int n_first(int m) const {
    if (window_left < 0) return 0;
    const int t = m * block_m + row.diag - window_left;  // need last key j1 >= t
    return t <= 0 ? 0 : t / block_n;
  }
};

// Whether the piece rows [row0, row0 + rows) x keys [col0, col0 + cols) may hold a hidden
// (query, key) pair: a padded row or key, or a window bound crossing it. False means every pair is
// visible and the kernel skips the per-element mask.
JAX_FA3_HD bool piece_needs_mask(int row0, int rows, int col0, int cols, const RowBounds& row,
                                 int window_left, int window_right) {
  if (row0 + rows > row.q_len || col0 + cols > row.k_len) return true;
  // Key j must satisfy i + diag - wl <= j for every row i: the tightest is the last row.
  if (window_left >= 0 && col0 < row0 + rows - 1 + row.diag - window_left) return true;
  // j <= i + diag + wr for every row: the tightest is the first row against the last key.
  if (window_right >= 0 && col0 + cols - 1 > row0 + row.diag + window_right) return true;
  return false;
}

// Whether query i sees key j in this row (the per-element form of the rule above; branch-free:
// & rather than &&, whose short circuits compile to branches per element).
JAX_FA3_HD bool visible(int i, int j, const RowBounds& row, int window_left, int window_right) {
  return bool((i < row.q_len) & (j < row.k_len) &
              ((window_left < 0) | (j >= i + row.diag - window_left)) &
              ((window_right < 0) | (j <= i + row.diag + window_right)));
}

}  // namespace jax_fa3::flash_bwd
