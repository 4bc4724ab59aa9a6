// Host check of the forward's tile scheduler (cuda/flash_fwd/tile_scheduler.h): for masked and
// unmasked problems and grid sizes around the tile count, the tiles the CTAs walk (CTA i: tiles
// i, i + grid, ...) map through coord() onto every (m_block, head, batch) exactly once. With a
// mask (the pair order), every CTA's work (sum of m_block + 1, a tile's K/V blocks under a
// causal mask with 128-row and 128-key blocks) is within one pair of every other's (within about
// half a pair when the tail runs one central tile per CTA), and each round of the whole double
// rounds (of pairs within one head) reads the K/V of at most grid / (pairs a head keeps for
// them) + 2 heads. With split-KV pieces (coord<true>), every (m_block, head, batch, piece) once.
#include <algorithm>
#include <cstdio>
#include <set>
#include <vector>

#include "flash_fwd/tile_scheduler.h"

int main() {
  int failures = 0, cases = 0;
  // s_q, block_m, h, b: odd and even m_block counts and (b, h) counts, one m_block, fewer tiles
  // than CTAs, the benchmark's 16k-token shapes.
  const int shapes[][4] = {{8192, 128, 16, 2}, {1000, 128, 3, 1}, {128, 128, 1, 1},
                           {2048, 192, 8, 3}, {512, 128, 16, 64}, {1024, 128, 16, 16},
                           {4096, 128, 32, 4}, {16384, 192, 32, 1}, {1152, 128, 5, 3},
                           {128, 128, 7, 9}, {384, 128, 33, 1}, {384, 128, 17, 13},
                           {2560, 128, 5, 3}, {16384, 192, 16, 1}, {4096, 192, 16, 4}};
  for (const auto& sh : shapes) {
    for (bool masked : {false, true}) {
      for (int grid : {1, 2, 7, 132, 133, 264, 1000}) {
        jax_fa3::fwd::TileScheduler sched(sh[0], sh[1], sh[2], sh[3], masked);
        if (grid > sched.num_tiles) continue;
        sched.set_grid(grid);
        const int nm = sched.num_m_blocks;
        std::vector<int> seen(size_t(sched.num_tiles), 0);
        std::vector<long> work(size_t(grid), 0);
        bool ok = true;
        for (int cta = 0; cta < grid; ++cta) {
          for (int tile = cta; tile < sched.num_tiles; tile += grid) {
            const auto c = sched.coord(tile);
            if (c.m_block < 0 || c.m_block >= nm || c.head < 0 || c.head >= sh[2] ||
                c.batch < 0 || c.batch >= sh[3]) {
              ok = false;
              continue;
            }
            ++seen[size_t((c.batch * sh[2] + c.head) * nm + c.m_block)];
            work[size_t(cta)] += c.m_block + 1;
          }
        }
        for (int s : seen) ok = ok && s == 1;
        if (masked) {
          const auto [lo, hi] = std::minmax_element(work.begin(), work.end());
          ok = ok && *hi - *lo <= nm + 1;
          if (sched.tail_head_pairs > 0) {
            // A tail of single tiles from central pairs: the long one costs at most
            // nm - pairs_per_head + tail_quota + 1 blocks (+1 for the heads that give one more).
            const int longest = nm - sched.pairs_per_head + sched.tail_quota + 1 +
                                (sched.tail_extra > 0 ? 1 : 0);
            ok = ok && *hi - *lo <= longest;
          }
          if (sched.pairs_per_head > 0) {
            // Each head keeps at least pairs_per_head - tail_quota - 1 pairs for the rounds.
            const int kept = sched.pairs_per_head - sched.tail_quota - 1;
            const int max_heads = grid / std::max(kept, 1) + 2;
            // Rounds of pairs within one (b, h) (the middle tiles' pairs span two heads each).
            for (int round = 0; (round / 2 + 1) * grid <= sched.num_head_pairs &&
                                (round + 1) * grid <= 2 * sched.round_pairs;
                 ++round) {
              std::set<int> heads;
              for (int t = round * grid; t < (round + 1) * grid; ++t) {
                const auto c = sched.coord(t);
                heads.insert(c.batch * sh[2] + c.head);
              }
              ok = ok && int(heads.size()) <= max_heads;
            }
          }
        }
        ++cases;
        if (masked && grid == 132 && sched.tail_head_pairs > 0) {
          long total = 0, busiest = 0;
          for (long w : work) total += w, busiest = std::max(busiest, w);
          std::printf("s_q=%d block_m=%d h=%d b=%d grid=%d: central tail of %d pairs, busiest "
                      "CTA %.3fx the mean\n", sh[0], sh[1], sh[2], sh[3], grid,
                      sched.tail_head_pairs, double(busiest) * grid / double(total));
        }
        if (!ok) {
          ++failures;
          std::printf("s_q=%d block_m=%d h=%d b=%d masked=%d grid=%d: FAILED\n", sh[0], sh[1],
                      sh[2], sh[3], int(masked), grid);
        }
      }
    }
  }
  // Split-KV (coord<true>): (m_block, head, batch, split) each exactly once, for one-query decode
  // steps (one m_block, masked or not) and longer ones.
  const int split_shapes[][5] = {{1, 128, 4, 1, 32}, {8, 128, 2, 3, 7}, {300, 128, 5, 2, 3},
                                 {1, 64, 1, 64, 2}};
  for (const auto& sh : split_shapes) {
    for (bool masked : {false, true}) {
      for (int grid : {1, 7, 132}) {
        jax_fa3::fwd::TileScheduler sched(sh[0], sh[1], sh[2], sh[3], masked, sh[4]);
        if (grid > sched.num_tiles) continue;
        sched.set_grid(grid);
        const int nm = sched.num_m_blocks, splits = sh[4];
        std::vector<int> seen(size_t(sched.num_tiles), 0);
        bool ok = sched.num_tiles == nm * sh[2] * sh[3] * splits;
        for (int tile = 0; tile < sched.num_tiles; ++tile) {
          const auto c = sched.coord<true>(tile);
          if (c.m_block < 0 || c.m_block >= nm || c.head < 0 || c.head >= sh[2] || c.batch < 0 ||
              c.batch >= sh[3] || c.split < 0 || c.split >= splits) {
            ok = false;
            continue;
          }
          ++seen[size_t(((c.batch * sh[2] + c.head) * splits + c.split) * nm + c.m_block)];
        }
        for (int s : seen) ok = ok && s == 1;
        ++cases;
        if (!ok) {
          ++failures;
          std::printf("split-KV s_q=%d block_m=%d h=%d b=%d splits=%d masked=%d grid=%d: FAILED\n",
                      sh[0], sh[1], sh[2], sh[3], splits, int(masked), grid);
        }
      }
    }
  }
  std::printf("tile scheduler: %d cases, %d failed: %s\n", cases, failures,
              failures ? "FAILED" : "ok");
  return failures ? 1 : 0;
}
