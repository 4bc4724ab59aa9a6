// Host check of the backward's grid order (cuda/flash_bwd/tile_order.h). Walking each grid in
// launch order (x fastest, then y, then z): every (K block, kv head, batch) comes exactly once;
// inside one (kv head, batch) K block n comes before n + 1 (deterministic mode waits on it); and
// in the longest-first order, inside a batch, the K blocks never decrease.
#include <cstdio>
#include <vector>

#include "flash_bwd/tile_order.h"

int main() {
  using jax_fa3::flash_bwd::TileOrder;
  int failures = 0, cases = 0;
  const int shapes[][3] = {{8, 16, 16}, {128, 16, 1}, {64, 8, 2}, {3, 5, 7}, {1, 1, 1}, {32, 2, 3}};
  for (const auto& sh : shapes) {
    for (bool longest_first : {false, true}) {
      const int num_n = sh[0], h_k = sh[1], b = sh[2];
      const TileOrder order{longest_first};
      const TileOrder::Dims g = order.grid(num_n, h_k, b);
      ++cases;
      bool ok = size_t(g.x) * g.y * g.z == size_t(num_n) * h_k * b;
      std::vector<int> seen(size_t(num_n) * h_k * b, 0), last_n(size_t(h_k) * b, -1);
      int prev_b = -1, prev_n = -1;
      for (unsigned z = 0; ok && z < g.z; ++z) {
        for (unsigned y = 0; y < g.y; ++y) {
          for (unsigned x = 0; x < g.x; ++x) {
            const auto c = order.coord(int(x), int(y), int(z));
            if (c.n_block < 0 || c.n_block >= num_n || c.hk < 0 || c.hk >= h_k || c.bidb < 0 ||
                c.bidb >= b) {
              ok = false;
              continue;
            }
            const size_t pair = size_t(c.bidb) * h_k + c.hk;
            ++seen[pair * num_n + c.n_block];
            ok = ok && c.n_block > last_n[pair];
            last_n[pair] = c.n_block;
            if (longest_first) {
              ok = ok && c.bidb >= prev_b && (c.bidb != prev_b || c.n_block >= prev_n);
              prev_b = c.bidb;
              prev_n = c.n_block;
            }
          }
        }
      }
      for (int s : seen) ok = ok && s == 1;
      if (!ok) {
        ++failures;
        printf("FAILED n=%d h_k=%d b=%d longest_first=%d\n", num_n, h_k, b, int(longest_first));
      }
    }
  }
  // The choice: longest first only for causal / right-windowed problems whose batch row fits the
  // L2 budget (width 2048 at d = 128: h = 16; 4k tokens in, 8k out) and whose K blocks fit grid y.
  struct Choice {
    int window_right, num_n, h, s_q, d;
    bool longest_first;
  };
  const Choice choices[] = {{0, 32, 16, 4096, 128, true},     {0, 64, 16, 8192, 128, false},
                            {-1, 8, 16, 1024, 128, false},    {3, 8, 32, 1024, 64, true},
                            {0, 70000, 1, 128, 64, false},    {0, 128, 16, 16384, 64, false}};
  for (const auto& c : choices) {
    ++cases;
    if (TileOrder::for_problem(c.window_right, c.num_n, c.h, c.s_q, c.d).longest_first !=
        c.longest_first) {
      ++failures;
      printf("FAILED choice window_right=%d num_n=%d h=%d s_q=%d d=%d\n", c.window_right, c.num_n,
             c.h, c.s_q, c.d);
    }
  }
  printf("%d cases, %d failures\n", cases, failures);
  return failures != 0;
}
