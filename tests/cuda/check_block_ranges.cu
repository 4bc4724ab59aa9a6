// Host check of the whole-row kernels' block ranges (common/row_bounds.h), against the
// per-element visibility rule, for the forward (cuda/flash_fwd/block_info.h) and the backward
// (cuda/flash_bwd/block_range.h), over the general (q_len, k_len, diag) the functions take:
// lengths from 0 past a block, diagonals across their range, causal, sliding windows and none.
//   forward:  every block holding a visible (real row, key) pair lies in the tile's [n_min, n_max),
//             and a block block_needs_mask passes holds no hidden pair;
//   backward: K block n's m_range holds every Q block with a visible pair; the K blocks visiting
//             a Q block form one run starting at n_first(m) (the deterministic dQ order relies on
//             it); a piece piece_needs_mask passes holds no hidden pair.
#include <cstdio>

#include "flash_bwd/block_range.h"
#include "flash_fwd/block_info.h"

using jax_fa3::RowBounds;

namespace {

bool sees(int i, int j, const RowBounds& r, int wl, int wr) {
  return i >= 0 && i < r.q_len && j >= 0 && j < r.k_len && (wl < 0 || j >= i + r.diag - wl) &&
         (wr < 0 || j <= i + r.diag + wr);
}

// Any visible pair among rows [i0, i1) and keys [j0, j1).
bool any_visible(int i0, int i1, int j0, int j1, const RowBounds& r, int wl, int wr) {
  for (int i = i0; i < i1; ++i)
    for (int j = j0; j < j1; ++j)
      if (sees(i, j, r, wl, wr)) return true;
  return false;
}

// Every pair visible, rows and keys past the lengths counted as hidden unless ignore_rows
// (the forward's mask leaves rows past q_len to the epilogue).
bool all_visible(int i0, int i1, int j0, int j1, const RowBounds& r, int wl, int wr,
                 bool ignore_rows) {
  RowBounds rr = r;
  if (ignore_rows) rr.q_len = 1 << 29;
  for (int i = i0; i < i1; ++i)
    for (int j = j0; j < j1; ++j)
      if (!sees(i, j, rr, wl, wr)) return false;
  return true;
}

}  // namespace

int main() {
  int cases = 0, failures = 0;
  auto fail = [&](const char* what, const RowBounds& r, int wl, int wr, int bm, int bn, int a,
                  int b) {
    if (++failures <= 20)
      std::printf("FAIL %s: q_len %d k_len %d diag %d window (%d, %d) blocks %dx%d at %d, %d\n",
                  what, r.q_len, r.k_len, r.diag, wl, wr, bm, bn, a, b);
  };
  const int s_q = 200, s_k = 230;
  const int windows[][2] = {{-1, -1}, {-1, 0}, {0, 0}, {37, 0}, {5, 70}, {-1, 3}, {100, -1}};
  const int blocks[][2] = {{64, 64}, {128, 80}, {128, 128}, {64, 128}};
  for (int q_len : {0, 1, 63, 64, 65, 150, s_q}) {
    for (int k_len : {0, 1, 79, 80, 81, 200, s_k}) {
      for (int diag : {-s_q, -70, -1, 0, 1, 30, s_k - s_q, k_len - q_len, s_k}) {
        const RowBounds bounds{q_len, k_len, diag};
        for (const auto& w : windows) {
          const int wl = w[0], wr = w[1];
          for (const auto& blk : blocks) {
            const int bm = blk[0], bn = blk[1];
            const int num_m = (s_q + bm - 1) / bm, num_n = (s_k + bn - 1) / bn;
            ++cases;
            // Forward.
            for (int m = 0; m < num_m; ++m) {
              const auto range = jax_fa3::fwd::block_range(m, bm, bn, bounds, wl, wr);
              for (int n = 0; n < num_n; ++n) {
                const bool visited = n >= range.n_min && n < range.n_max;
                if (!visited && any_visible(m * bm, (m + 1) * bm, n * bn, (n + 1) * bn, bounds,
                                            wl, wr))
                  fail("fwd block_range misses a visible block", bounds, wl, wr, bm, bn, m, n);
                if (visited &&
                    !jax_fa3::fwd::block_needs_mask(m, n, bm, bn, bounds.k_len, bounds.diag, wl,
                                                    wr) &&
                    !all_visible(m * bm, (m + 1) * bm, n * bn, (n + 1) * bn, bounds, wl, wr,
                                 /*ignore_rows=*/true))
                  fail("fwd block_needs_mask false on a hidden pair", bounds, wl, wr, bm, bn, m, n);
              }
            }
            // Backward.
            const jax_fa3::flash_bwd::BlockGeometry geom{bm, bn, wl, wr, bounds};
            for (int m = 0; m < num_m; ++m) {
              int first = -1, last = -1;
              bool contiguous = true;
              for (int n = 0; n < num_n; ++n) {
                int m_begin, m_end;
                geom.m_range(n, m_begin, m_end);
                const bool visits = m >= m_begin && m < m_end;
                if (!visits && any_visible(m * bm, (m + 1) * bm, n * bn, (n + 1) * bn, bounds,
                                           wl, wr))
                  fail("bwd m_range misses a visible block", bounds, wl, wr, bm, bn, m, n);
                if (visits) {
                  if (first < 0) first = n;
                  else if (last != n - 1) contiguous = false;
                  last = n;
                }
              }
              if (first >= 0 && (!contiguous || first != geom.n_first(m)))
                fail("bwd visiting K blocks are not one run from n_first", bounds, wl, wr, bm, bn,
                     m, first);
              for (int n = 0; n < num_n; ++n) {
                for (int piece = 0; piece < bn; piece += 64) {
                  const int j0 = n * bn + piece, cols = bn - piece < 64 ? bn - piece : 64;
                  if (!jax_fa3::flash_bwd::piece_needs_mask(m * bm, bm, j0, cols, bounds, wl, wr) &&
                      !all_visible(m * bm, (m + 1) * bm, j0, j0 + cols, bounds, wl, wr, false))
                    fail("bwd piece_needs_mask false on a hidden pair", bounds, wl, wr, bm, bn, m,
                         n);
                }
              }
            }
          }
        }
      }
    }
  }
  std::printf("%d cases, %d failures: %s\n", cases, failures, failures ? "FAILED" : "ok");
  return failures ? 1 : 0;
}
