// Which (K block, kv head, batch) a backward CTA takes: the grid order.
//
// Causal and right-windowed problems give K block n fewer Q blocks the larger n is (K block 0 is
// seen by every query), so CTAs differ in length by up to num_m_blocks x. In the plain grid
// (n, h_k, b), n fastest, the last wave mixes long and short CTAs and SMs idle while the long
// ones finish. Longest first swaps the first two grid dimensions, (h_k, n, b): inside a batch,
// every kv head's K block 0 is launched, then every head's K block 1, ...
//
// Longest first pays while what the CTAs in flight share fits L2: in the plain order they work on
// one kv head at a time, in longest first on every head of a batch row, each reading its own
// heads' Q and dO and adding into their fp32 dQ. On the H200 (50 MB L2), at width 2048 it gained
// 4-12% at 1k-4k causal (16-64 MiB of Q + dO + dQ per batch row) and lost 1-5% at 16k (256 MiB),
// so it is chosen up to kLongestFirstMaxBytes.
//
// Coordinates stay block indices, with no division: a decoded (n, hk, b) is three more values to
// keep live in the consumers, which made the d = 64 softcap kernel spill; blockIdx is re-read.
// Deterministic mode needs, for one (kv head, batch), K block n launched before n + 1 (it waits
// on n's dQ adds): both orders keep that, since n only grows with the linear index inside a pair.
#pragma once

#if defined(__CUDACC__)
#define JAX_FA3_ORDER_HD __host__ __device__ __forceinline__
#else
#define JAX_FA3_ORDER_HD inline
#endif

namespace jax_fa3::flash_bwd {

struct TileOrder {
  bool longest_first;

  static constexpr long long kLongestFirstMaxBytes = 64ll << 20;

  // The order for a problem: longest first when K blocks differ in length (causal or a right
  // window), one batch row's Q, dO (2-byte elements) and fp32 dQ fit kLongestFirstMaxBytes, and the
  // K blocks fit grid y (at most 65535 blocks).
  static inline TileOrder for_problem(int window_right, int num_n_blocks, int h, int s_q, int d) {
    const long long row_bytes = static_cast<long long>(h) * s_q * d * (2 + 2 + 4);
    return TileOrder{window_right >= 0 && num_n_blocks <= 65535 &&
                     row_bytes <= kLongestFirstMaxBytes};
  }

  struct Dims {
    unsigned x, y, z;
  };
  struct Coord {
    int n_block, hk, bidb;
  };

  // The grid for num_n_blocks K blocks, h_k kv heads, b batch rows.
  JAX_FA3_ORDER_HD Dims grid(int num_n_blocks, int h_k, int b) const {
    return longest_first ? Dims{unsigned(h_k), unsigned(num_n_blocks), unsigned(b)}
                         : Dims{unsigned(num_n_blocks), unsigned(h_k), unsigned(b)};
  }
  // The CTA at block index (x, y, z) of that grid.
  JAX_FA3_ORDER_HD Coord coord(int x, int y, int z) const {
    return longest_first ? Coord{y, x, z} : Coord{x, y, z};
  }
};

}  // namespace jax_fa3::flash_bwd
