// Which (K block, kv head, batch) a backward CTA takes: the grid order.
//
// Causal and right-windowed problems give K block n fewer Q blocks the larger n is (K block 0 is
// seen by every query), so CTAs differ in length by up to num_m_blocks x. In the plain grid
// (n, h_k, b), n fastest, the last wave mixes long and short CTAs and SMs idle while the long
// ones finish. Longest first launches, for a section of S kv heads, every head's K block 0, then
// every head's K block 1, ..., then the next section: grid (S, n, b * h_k / S).
//
// Longest first pays while what the CTAs in flight share fits L2: in the plain order they work on
// one kv head at a time, in longest first on every head of a section, each reading its own
// heads' Q and dO and adding into their fp32 dQ. A section is therefore the most kv heads, a
// divisor of h_k, whose Q + dO (2-byte elements) + fp32 dQ fit kLongestFirstMaxBytes. On the
// H200 (50 MB L2) at width 2048, whole batch rows as sections gained 4-12% at 1k-4k causal (16-64
// MiB of Q + dO + dQ per row) and lost 1-5% at 16k (256 MiB per row); a list-scheduling model of
// 132 SMs (tools/bwd_order_model.py) puts the plain order's tail at 5% of the d = 128 causal
// backward at 8k (2 x 16 heads), none with sections of 8 heads (64 MiB).
//
// Coordinates stay block indices where they can: a decoded (n, hk, b) is three more values to
// keep live in the consumers, which made the d = 64 softcap kernel spill; blockIdx is re-read.
// Sections of fewer than h_k heads cost one division by the section count.
// Deterministic mode needs, for one (kv head, batch), K block n launched before n + 1 (it waits
// on n's dQ adds): every order keeps that, since n only grows with the linear index for a head.
#pragma once

#if defined(__CUDACC__)
#define JAX_FA3_ORDER_HD __host__ __device__ __forceinline__
#else
#define JAX_FA3_ORDER_HD inline
#endif

namespace jax_fa3::flash_bwd {

struct TileOrder {
  // kv heads per section in the longest-first order; 0: the plain order.
  int section_heads;
  // h_k / section_heads (longest first only).
  int num_sections;

  static constexpr long long kLongestFirstMaxBytes = 64ll << 20;

  // The order for a problem: longest first when K blocks differ in length (causal or a right
  // window) and fit grid y (at most 65535 blocks), in sections of the most kv heads, a divisor of
  // h_k, whose query heads' Q, dO and fp32 dQ fit kLongestFirstMaxBytes; the plain order when not
  // even one kv head's do (longest first inside one head is the plain order), or when the b
  // rows' sections would not fit grid z.
  static inline TileOrder for_problem(int window_right, int num_n_blocks, int h, int h_k, int b,
                                      int s_q, int d) {
    if (window_right < 0 || num_n_blocks > 65535 || h_k <= 0 || h % h_k != 0) return {0, 1};
    const long long head_bytes = static_cast<long long>(h / h_k) * s_q * d * (2 + 2 + 4);
    int section = 0;
    for (int s = 1; s <= h_k; ++s) {
      if (h_k % s == 0 && s * head_bytes <= kLongestFirstMaxBytes) section = s;
    }
    if (section <= 1 || static_cast<long long>(b) * (h_k / section) > 65535) return {0, 1};
    return {section, h_k / section};
  }

  JAX_FA3_ORDER_HD bool longest_first() const { return section_heads > 0; }

  struct Dims {
    unsigned x, y, z;
  };
  struct Coord {
    int n_block, hk, bidb;
  };

  // The grid for num_n_blocks K blocks, h_k kv heads, b batch rows.
  JAX_FA3_ORDER_HD Dims grid(int num_n_blocks, int h_k, int b) const {
    return longest_first()
               ? Dims{unsigned(section_heads), unsigned(num_n_blocks), unsigned(b * num_sections)}
               : Dims{unsigned(num_n_blocks), unsigned(h_k), unsigned(b)};
  }
  // The CTA at block index (x, y, z) of that grid.
  JAX_FA3_ORDER_HD Coord coord(int x, int y, int z) const {
    if (!longest_first()) return Coord{x, y, z};
    if (num_sections == 1) return Coord{y, x, z};
    const int bidb = z / num_sections;
    return Coord{y, (z - bidb * num_sections) * section_heads + x, bidb};
  }
};

}  // namespace jax_fa3::flash_bwd
