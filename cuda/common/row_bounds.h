// The whole-row geometry of the unmasked kernels: every query row i < s_q sees keys j < s_k
// inside its window, centred on key i + diag with diag = s_k - s_q (bottom-right alignment).
// The masked kernels take per-query key ranges instead (common/key_ranges.h).
#pragma once

#if defined(__CUDACC__)
#define JAX_FA3_ROWS_HD __host__ __device__ __forceinline__
#else
#define JAX_FA3_ROWS_HD inline
#endif

namespace jax_fa3 {

struct RowBounds {
  int q_len, k_len, diag;
};

JAX_FA3_ROWS_HD RowBounds whole_rows(int s_q, int s_k) { return {s_q, s_k, s_k - s_q}; }

}  // namespace jax_fa3
