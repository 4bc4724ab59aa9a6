// Which (Q block, K block) pairs have at least one visible (query, key) pair. Shared by the main
// kernel (loop bounds) and the deterministic dQ ordering, so both use the same predicate.
//
// Whole rows (common/row_bounds.h; q_len = s_q, k_len = s_k, diag = s_k - s_q): query i sees
// key j iff  i + diag - wl <= j <= i + diag + wr, a bound of -1 being unbounded. Block rows
// [i0, i1], columns [j0, j1] hold a visible pair iff
//   (wr < 0 || i1 + diag + wr >= j0)  and  (wl < 0 || i0 + diag - wl <= j1).
// Key ranges (common/key_ranges.h): Q block M (granules [M*gpb, M*gpb + gpb), gpb = block_m / 64)
// and K block n (keys [n0, n1), n1 cut to s_k) are paired iff  reach_lo(first granule) < n1  and
// reach_hi(last granule) > n0; both reaches are non-decreasing over granules, so this needs only
// two counts per K block (key_range_m_range). Cut to s_k, n1 leaves out the granules of rows that
// see nothing (reach_lo = s_k): their Q blocks (padding, possibly NaN) never meet the last K block.
// Either way, for fixed n the paired m form one interval, and for fixed m the paired n form one
// interval starting at n_first: the deterministic dQ order counts from there.
#pragma once

#include "common/key_ranges.h"
#include "common/row_bounds.h"

#if defined(__CUDACC__)
#define JAX_FA3_HD __host__ __device__ __forceinline__
#else
#define JAX_FA3_HD inline
#endif

namespace jax_fa3::flash_bwd {

struct BlockGeometry {
  int block_m, block_n, window_left, window_right;
  RowBounds row;  // whole rows

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

// Key ranges: Q blocks [m_begin, m_end) paired with K block n, from `below`, the number of
// granules whose reach_hi <= n0, and `reaching`, the number whose reach_lo < n1 (a prefix each:
// the reaches are monotone), over num_m Q blocks of gpb granules.
JAX_FA3_HD void key_range_m_range(int below, int reaching, int gpb, int num_m, int& m_begin,
                                  int& m_end) {
  m_begin = below / gpb;
  m_end = (reaching + gpb - 1) / gpb;
  if (m_end > num_m) m_end = num_m;
  if (m_end < m_begin) m_end = m_begin;
}

// Key ranges: the first K block paired with Q block m (meaningful only if some K block is).
JAX_FA3_HD int key_range_n_first(const int* covers, int batch, int num_granules, int m, int gpb,
                                 int block_n, int s_k) {
  const int* c = covers + 4 * (static_cast<long long>(batch) * num_granules + m * gpb);
#if defined(__CUDA_ARCH__)
  return clamp_key(__ldg(c), s_k) / block_n;
#else
  return clamp_key(c[0], s_k) / block_n;
#endif
}

}  // namespace jax_fa3::flash_bwd
