// The one rule for sliding-window bounds that reach past every key: a bound of s_q + s_k or more
// is the same as unbounded (-1). The kernels keep row + (s_k - s_q) +- window in int32, so every
// launch (forward and backward) clamps with this before its masks and block ranges see it.
#pragma once
#include <cstdint>

namespace jax_fa3 {

inline int32_t clamp_window_past_reach(int32_t window, int64_t s_q, int64_t s_k) {
  return window >= s_q + s_k ? -1 : window;
}

}  // namespace jax_fa3
