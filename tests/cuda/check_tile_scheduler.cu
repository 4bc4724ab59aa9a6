// Host check of the forward's tile scheduler (cuda/flash_fwd/tile_scheduler.h): for masked and
// unmasked problems and grid sizes around the tile count, the tiles the CTAs walk (CTA i: tiles
// i, i + grid, ...) map through coord() onto every (m_block, head, batch) exactly once, and with
// a mask each round hands out m_blocks in descending order (longest first) up to the zigzag.
#include <algorithm>
#include <cstdio>
#include <vector>

#include "flash_fwd/tile_scheduler.h"

int main() {
  int failures = 0, cases = 0;
  const int shapes[][4] = {{8192, 128, 16, 2}, {1000, 128, 3, 1}, {128, 128, 1, 1},
                           {2048, 192, 8, 3}, {512, 128, 16, 64}};
  for (const auto& sh : shapes) {
    for (bool masked : {false, true}) {
      for (int grid : {1, 7, 132, 133, 264, 1000}) {
        const jax_fa3::fwd::TileScheduler sched(sh[0], sh[1], sh[2], sh[3], masked);
        if (grid > sched.num_tiles) continue;
        std::vector<int> seen(size_t(sched.num_tiles), 0);
        bool ok = true;
        for (int cta = 0; cta < grid; ++cta) {
          for (int tile = cta; tile < sched.num_tiles; tile += grid) {
            const auto c = sched.coord(tile, grid);
            if (c.m_block < 0 || c.m_block >= sched.num_m_blocks || c.head < 0 ||
                c.head >= sh[2] || c.batch < 0 || c.batch >= sh[3]) {
              ok = false;
              continue;
            }
            ++seen[size_t((c.batch * sh[2] + c.head) * sched.num_m_blocks + c.m_block)];
          }
        }
        for (int s : seen) ok = ok && s == 1;
        // Longest first: a later round never holds a longer tile than an earlier round's.
        if (masked) {
          for (int round = 1; round * grid < sched.num_tiles; ++round) {
            int prev_min = 1 << 30, cur_max = -1;
            for (int t = (round - 1) * grid; t < round * grid; ++t)
              prev_min = std::min(prev_min, sched.coord(t, grid).m_block);
            for (int t = round * grid; t < std::min((round + 1) * grid, sched.num_tiles); ++t)
              cur_max = std::max(cur_max, sched.coord(t, grid).m_block);
            ok = ok && cur_max <= prev_min;
          }
        }
        ++cases;
        if (!ok) {
          ++failures;
          std::printf("s_q=%d block_m=%d h=%d b=%d masked=%d grid=%d: FAILED\n", sh[0], sh[1],
                      sh[2], sh[3], int(masked), grid);
        }
      }
    }
  }
  std::printf("tile scheduler: %d cases, %d failed: %s\n", cases, failures,
              failures ? "FAILED" : "ok");
  return failures ? 1 : 0;
}
