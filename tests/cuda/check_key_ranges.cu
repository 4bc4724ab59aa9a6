// Host check of the key-range kernels' block logic (common/key_ranges.h, flash_fwd/block_info.h,
// flash_bwd/block_range.h) on ranges and covers built by jax_fa3._key_ranges (the test writes
// them to the file named by argv[1]: a case count, then per case "s_q s_k b bounds left right",
// the ranges (b, s_pad, 2), the covers (b, s_pad / 64, 4) and, when bounds is 1, the row bounds
// (b, 3) of the same masks under window (left, right)), against the per-element rule
// lo_i <= j < hi_i, for every kernel tile shape:
//   forward:  a tile's key_blocks hold every block with a visible pair of its rows, and a block
//             keys_need_mask passes holds no hidden pair of a real row;
//   backward: key_range_m_range pairs K block n with every Q block holding a visible pair; the K
//             blocks paired with a Q block form one run from key_range_n_first (the deterministic
//             dQ order counts from there); a 32- or 64-key piece keys_need_mask passes has no hidden pair;
//   row bounds: bounded_key_range gives every row exactly its range, and bounded_tile_keys passes
//             the forward's two checks for 64-, 128- and 192-row tiles.
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "flash_bwd/block_range.h"
#include "flash_fwd/block_info.h"

namespace {

struct Case {
  int s_q, s_k, b, s_pad, granules, has_bounds, left, right;
  std::vector<int> ranges, covers, bounds;
  bool sees(int batch, int i, int j) const {
    const int* r = &ranges[2 * (batch * s_pad + i)];
    return i < s_q && j < s_k && r[0] <= j && j < r[1];
  }
  bool any_visible(int batch, int i0, int i1, int j0, int j1) const {
    for (int i = i0; i < i1; ++i)
      for (int j = j0; j < j1; ++j)
        if (sees(batch, i, j)) return true;
    return false;
  }
  // Every pair of a real row (i < s_q) visible.
  bool all_visible(int batch, int i0, int i1, int j0, int j1) const {
    for (int i = i0; i < i1 && i < s_q; ++i)
      for (int j = j0; j < j1; ++j)
        if (!sees(batch, i, j)) return false;
    return true;
  }
};

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::printf("usage: check_key_ranges CASES_FILE\n");
    return 2;
  }
  std::FILE* in = std::fopen(argv[1], "r");
  if (in == nullptr) {
    std::printf("FAILED to open %s\n", argv[1]);
    return 2;
  }
  int num_cases = 0, checked = 0, failures = 0;
  if (std::fscanf(in, "%d", &num_cases) != 1) return 2;
  auto fail = [&](int c, const std::string& what, int bm, int bn, int batch, int a, int b) {
    if (++failures <= 20)
      std::printf("FAIL case %d: %s (tile %dx%d, batch row %d, at %d, %d)\n", c, what.c_str(),
                  bm, bn, batch, a, b);
  };
  // A forward tile (rows [m * bm, (m + 1) * bm), bn-key blocks) visiting `keys`: no visible
  // block skipped, none left unmasked that holds a hidden pair of a real row.
  auto check_forward_tile = [&](int c, const Case& k, const std::string& form,
                                const jax_fa3::TileKeys& keys, int bm, int bn, int batch, int m) {
    ++checked;
    const int num_n = (k.s_k + bn - 1) / bn;
    const auto range = jax_fa3::fwd::key_blocks(keys, bn);
    if (range.n_max > num_n) fail(c, form + "key_blocks past the last block", bm, bn, batch, m,
                                  range.n_max);
    for (int n = 0; n < num_n; ++n) {
      const bool visited = n >= range.n_min && n < range.n_max;
      if (!visited && k.any_visible(batch, m * bm, (m + 1) * bm, n * bn, (n + 1) * bn))
        fail(c, form + "key_blocks misses a visible block", bm, bn, batch, m, n);
      if (visited && !jax_fa3::keys_need_mask(keys, n * bn, bn) &&
          !k.all_visible(batch, m * bm, (m + 1) * bm, n * bn, (n + 1) * bn))
        fail(c, form + "keys_need_mask false on a hidden pair", bm, bn, batch, m, n);
    }
  };
  for (int c = 0; c < num_cases; ++c) {
    Case k{};
    if (std::fscanf(in, "%d %d %d %d %d %d", &k.s_q, &k.s_k, &k.b, &k.has_bounds, &k.left,
                    &k.right) != 6)
      return 2;
    k.s_pad = jax_fa3::key_range_rows(k.s_q);
    k.granules = k.s_pad / jax_fa3::kKeyRangeGranule;
    k.ranges.resize(size_t(2) * k.b * k.s_pad);
    k.covers.resize(size_t(4) * k.b * k.granules);
    k.bounds.resize(k.has_bounds ? size_t(3) * k.b : 0);
    for (int& x : k.ranges)
      if (std::fscanf(in, "%d", &x) != 1) return 2;
    for (int& x : k.covers)
      if (std::fscanf(in, "%d", &x) != 1) return 2;
    for (int& x : k.bounds)
      if (std::fscanf(in, "%d", &x) != 1) return 2;
    const int left = jax_fa3::bounded_window(k.left, k.s_q, k.s_k);
    const int right = jax_fa3::bounded_window(k.right, k.s_q, k.s_k);
    for (int batch = 0; batch < k.b && k.has_bounds; ++batch) {
      const auto rb = jax_fa3::load_row_bounds(k.bounds.data(), batch, k.s_q, k.s_k);
      for (int i = 0; i < k.s_pad; ++i) {
        ++checked;
        const auto r = jax_fa3::bounded_key_range(rb, i, k.s_k, left, right);
        const int* want = &k.ranges[2 * (batch * k.s_pad + i)];
        if (r.lo != want[0] || r.hi != want[1])
          fail(c, "bounded_key_range differs from the ranges", 1, 1, batch, i, r.lo);
      }
      for (int bm : {64, 128, 192}) {
        for (int bn : {64, 80, 128, 176}) {
          for (int m = 0; m * bm < k.s_q; ++m) {
            check_forward_tile(
                c, k, "bounds: ",
                jax_fa3::bounded_tile_keys(rb, m * bm, bm, k.s_q, k.s_k, left, right), bm, bn,
                batch, m);
          }
        }
      }
    }
    for (int batch = 0; batch < k.b; ++batch) {
      // Forward: 128-row tiles, the 16-bit kernels' key blocks.
      for (int bn : {64, 80, 112, 128, 176}) {
        const int bm = 128, gpt = bm / jax_fa3::kKeyRangeGranule;
        for (int m = 0; m * bm < k.s_q; ++m) {
          check_forward_tile(
              c, k, "fwd ",
              jax_fa3::tile_keys(k.covers.data(), batch, k.granules, m * gpt, gpt, k.s_k), bm,
              bn, batch, m);
        }
      }
      // Backward: (block_m, block_n) of the d = 64, 96/128, 192/256 kernels.
      const int shapes[][2] = {{128, 128}, {64, 128}, {64, 64}};
      for (const auto& shape : shapes) {
        const int bm = shape[0], bn = shape[1], gpb = bm / jax_fa3::kKeyRangeGranule;
        const int num_m = (k.s_q + bm - 1) / bm, num_n = (k.s_k + bn - 1) / bn;
        std::vector<int> begin(num_n), end(num_n);
        for (int n = 0; n < num_n; ++n) {
          int below = 0, reaching = 0;
          for (int g = 0; g < k.granules; ++g) {
            const int* cov = &k.covers[4 * (batch * k.granules + g)];
            below += jax_fa3::clamp_key(cov[1], k.s_k) <= n * bn;
            reaching += jax_fa3::clamp_key(cov[0], k.s_k) < std::min((n + 1) * bn, k.s_k);
          }
          jax_fa3::flash_bwd::key_range_m_range(below, reaching, gpb, num_m, begin[n], end[n]);
        }
        for (int m = 0; m < num_m; ++m) {
          ++checked;
          int first = -1, last = -1;
          bool contiguous = true;
          for (int n = 0; n < num_n; ++n) {
            const bool paired = m >= begin[n] && m < end[n];
            if (!paired && k.any_visible(batch, m * bm, (m + 1) * bm, n * bn, (n + 1) * bn))
              fail(c, "bwd key_range_m_range misses a visible block", bm, bn, batch, m, n);
            if (paired) {
              if (first < 0) first = n;
              else if (last != n - 1) contiguous = false;
              last = n;
            }
          }
          // Trailing padding (no row from this Q block on sees a key) is paired with nothing.
          if (first >= 0 && !k.any_visible(batch, m * bm, k.s_pad, 0, k.s_k))
            fail(c, "bwd pairs a Q block of trailing padding", bm, bn, batch, m, first);
          if (first >= 0 &&
              (!contiguous || first != jax_fa3::flash_bwd::key_range_n_first(
                                           k.covers.data(), batch, k.granules, m, gpb, bn, k.s_k)))
            fail(c, "bwd paired K blocks are not one run from key_range_n_first", bm, bn, batch, m,
                 first);
          const auto keys =
              jax_fa3::tile_keys(k.covers.data(), batch, k.granules, m * gpb, gpb, k.s_k);
          for (int cols : {32, 64}) {  // a warpgroup's keys: row-major d >= 192, key-major
            for (int j0 = 0; j0 < num_n * bn; j0 += cols) {
              if (!jax_fa3::keys_need_mask(keys, j0, cols) &&
                  !k.all_visible(batch, m * bm, (m + 1) * bm, j0, j0 + cols))
                fail(c, "bwd keys_need_mask false on a hidden pair", bm, bn, batch, m, j0);
            }
          }
        }
      }
    }
  }
  std::fclose(in);
  std::printf("%d cases, %d tiles, %d failures: %s\n", num_cases, checked, failures,
              failures ? "FAILED" : "ok");
  return failures ? 1 : 0;
}
