// Which (Q block, K block) pairs have at least one visible (query, key) pair. Shared by the main
// kernel (loop bounds) and the deterministic dQ ordering, so both use the same predicate.
//
// Visibility: query i sees key j iff  i + off - wl <= j <= i + off + wr,  off = s_k - s_q, a bound
// of -1 being unbounded. Block rows [i0, i1], columns [j0, j1] hold a visible pair iff
//   (wr < 0 || i1 + off + wr >= j0)  and  (wl < 0 || i0 + off - wl <= j1).
// For fixed n the visible m form one interval, and for fixed m the visible n form one interval.
#pragma once

#if defined(__CUDACC__)
#define JAX_FA3_HD __host__ __device__ __forceinline__
#else
#define JAX_FA3_HD inline
#endif

namespace jax_fa3::flash_bwd {

struct BlockGeometry {
  int s_q, s_k, block_m, block_n, window_left, window_right;

  // Q blocks [m_begin, m_end) that K block n must visit (possibly empty).
  JAX_FA3_HD void m_range(int n, int& m_begin, int& m_end) const {
    const int off = s_k - s_q;
    const int num_m = (s_q + block_m - 1) / block_m;
    const int j0 = n * block_n;
    const int j1 = (j0 + block_n < s_k ? j0 + block_n : s_k) - 1;
    m_begin = 0;
    m_end = num_m;
    if (window_right >= 0) {
      const int t = j0 - off - window_right;  // need last row i1 >= t
      if (t > s_q - 1) { m_end = 0; return; }
      m_begin = t <= 0 ? 0 : t / block_m;
    }
    if (window_left >= 0) {
      const int u = j1 - off + window_left;  // need first row i0 <= u
      if (u < 0) { m_end = 0; return; }
      const int last = u / block_m + 1;
      m_end = last < num_m ? last : num_m;
    }
    if (m_end < m_begin) m_end = m_begin;
  }

  // First K block that visits Q block m (meaningful only if some K block visits it).
  JAX_FA3_HD int n_first(int m) const {
    if (window_left < 0) return 0;
    const int off = s_k - s_q;
    const int t = m * block_m + off - window_left;  // need last key j1 >= t
    return t <= 0 ? 0 : t / block_n;
  }
};

// Whether the piece rows [row0, row0 + rows) x keys [col0, col0 + cols) may hold a hidden
// (query, key) pair: a padded row or key, or a window bound crossing it. False means every pair is
// visible and the kernel skips the per-element mask.
JAX_FA3_HD bool piece_needs_mask(int row0, int rows, int col0, int cols, int s_q, int s_k, int off,
                                 int window_left, int window_right) {
  if (row0 + rows > s_q || col0 + cols > s_k) return true;
  // Key j must satisfy i + off - wl <= j for every row i: the tightest is the last row.
  if (window_left >= 0 && col0 < row0 + rows - 1 + off - window_left) return true;
  // j <= i + off + wr for every row: the tightest is the first row against the last key.
  if (window_right >= 0 && col0 + cols - 1 > row0 + off + window_right) return true;
  return false;
}

}  // namespace jax_fa3::flash_bwd
