// Host check of the backward's grid order (cuda/flash_bwd/tile_order.h). Walking each grid in
// launch order (x fastest, then y, then z): every (K block, kv head, batch) comes exactly once;
// inside one (kv head, batch) K block n comes before n + 1 (deterministic mode waits on it); and
// in the longest-first order the CTAs come section by section (a batch row's section of kv heads
// whole before the next) and, inside a section, the K blocks never decrease.
#include <cstdio>
#include <vector>

#include "flash_bwd/tile_order.h"

namespace {

using jax_fa3::flash_bwd::TileOrder;

bool walk(const TileOrder& order, int num_n, int h_k, int b) {
  const TileOrder::Dims g = order.grid(num_n, h_k, b);
  bool ok = size_t(g.x) * g.y * g.z == size_t(num_n) * h_k * b;
  std::vector<int> seen(size_t(num_n) * h_k * b, 0), last_n(size_t(h_k) * b, -1);
  std::vector<int> section_done(size_t(b) * h_k, 0);
  long long prev_section = -1;
  int prev_n = -1;
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
        if (order.longest_first()) {
          const long long section = (long long)c.bidb * h_k + c.hk / order.section_heads;
          if (section != prev_section) {  // a new section starts: the previous one is over
            ok = ok && section > prev_section;
            prev_section = section;
            prev_n = -1;
          }
          ok = ok && c.n_block >= prev_n;
          prev_n = c.n_block;
        }
      }
    }
  }
  for (int s : seen) ok = ok && s == 1;
  return ok;
}

}  // namespace

int main() {
  int failures = 0, cases = 0;
  const int shapes[][3] = {{8, 16, 16}, {128, 16, 1}, {64, 8, 2}, {3, 5, 7},
                           {1, 1, 1},   {32, 2, 3},   {16, 12, 3}};
  for (const auto& sh : shapes) {
    const int num_n = sh[0], h_k = sh[1], b = sh[2];
    std::vector<TileOrder> orders = {TileOrder{0, 1}};
    for (int s = 1; s <= h_k; ++s) {
      if (h_k % s == 0) orders.push_back(TileOrder{s, h_k / s});
    }
    for (const TileOrder& order : orders) {
      ++cases;
      if (!walk(order, num_n, h_k, b)) {
        ++failures;
        printf("FAILED n=%d h_k=%d b=%d section_heads=%d\n", num_n, h_k, b, order.section_heads);
      }
    }
  }
  // The choice: longest first only for causal / right-windowed problems, in sections of the most
  // kv heads (a divisor of h_k) whose Q + dO + dQ fit the L2 budget (64 MiB: width 2048 at
  // d = 128, h = 16: every head at 4k, 8 heads at 8k, 4 at 16k), K blocks within grid y and the
  // rows' sections within grid z; 0 = the plain order.
  struct Choice {
    int window_right, num_n, h, h_k, b, s_q, d;
    int section_heads;
  };
  const Choice choices[] = {
      {0, 32, 16, 16, 4, 4096, 128, 16},    {0, 64, 16, 16, 2, 8192, 128, 8},
      {0, 128, 16, 16, 1, 16384, 128, 4},   {-1, 8, 16, 16, 16, 1024, 128, 0},
      {3, 8, 32, 32, 16, 1024, 64, 32},     {0, 70000, 1, 1, 1, 128, 64, 0},
      {0, 128, 32, 32, 1, 16384, 64, 8},    {0, 64, 32, 4, 2, 8192, 128, 0},
      {0, 64, 12, 12, 2, 8192, 128, 6},     {0, 512, 16, 16, 1, 65536, 128, 0},
      {0, 8, 16, 16, 65535, 1024, 128, 16}, {0, 32, 128, 128, 10000, 4096, 128, 0},
      {0, 64, 8, 8, 2, 8192, 256, 4},       {0, 2, 384, 12, 1, 256, 128, 6},
      {0, 4, 192, 12, 2, 256, 256, 6}};
  for (const auto& c : choices) {
    ++cases;
    const TileOrder order =
        TileOrder::for_problem(c.window_right, c.num_n, c.h, c.h_k, c.b, c.s_q, c.d);
    const bool consistent =
        order.longest_first() ? order.section_heads * order.num_sections == c.h_k : true;
    if (order.section_heads != c.section_heads || !consistent) {
      ++failures;
      printf("FAILED choice window_right=%d num_n=%d h=%d h_k=%d b=%d s_q=%d d=%d: %d heads\n",
             c.window_right, c.num_n, c.h, c.h_k, c.b, c.s_q, c.d, order.section_heads);
    }
  }
  printf("%d cases, %d failures\n", cases, failures);
  return failures != 0;
}
