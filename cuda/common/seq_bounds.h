// Per-batch-row bounds of a padded batch (flash_attention's sequence lengths, the KV cache's
// lengths, varlen sequences gathered into rows): row b's queries [0, q_len) and keys [0, k_len)
// are real, the rest padding, and its causal / window masks are centred on key i + diag for
// query i. Padded queries see nothing (out 0, lse +inf, dq 0) and padded keys are seen by no one
// (dk = dv = 0); the kernels skip their tiles.
//
// In memory: an int32 (b, 4) array, row b = (q_len, k_len, diag, unused) so that one 16-byte
// load reads it. No array (nullptr) means every row is whole: (s_q, s_k, s_k - s_q), the
// bottom-right alignment of the unpadded kernels.
#pragma once

#if defined(__CUDACC__)
#define JAX_FA3_SEQ_HD __host__ __device__ __forceinline__
#else
#define JAX_FA3_SEQ_HD inline
#endif

namespace jax_fa3 {

struct RowBounds {
  int q_len, k_len, diag;
};

JAX_FA3_SEQ_HD int clamp_int(int x, int lo, int hi) { return x < lo ? lo : (x > hi ? hi : x); }

// Row `batch`'s bounds, clamped: lengths into [0, s], diag into [-s_q, s_k] (every value a
// padded layout produces; the clamp keeps row + diag +- window inside int32, see
// common/window.h, for any input).
JAX_FA3_SEQ_HD RowBounds row_bounds(const int* bounds, int batch, int s_q, int s_k) {
  if (bounds == nullptr) return {s_q, s_k, s_k - s_q};
#if defined(__CUDA_ARCH__)
  const int4 row = __ldg(reinterpret_cast<const int4*>(bounds) + batch);
  const int q_len = row.x, k_len = row.y, diag = row.z;
#else
  const int q_len = bounds[4 * batch], k_len = bounds[4 * batch + 1], diag = bounds[4 * batch + 2];
#endif
  return {clamp_int(q_len, 0, s_q), clamp_int(k_len, 0, s_k), clamp_int(diag, -s_q, s_k)};
}

#if defined(__CUDACC__)
// row_bounds loaded afresh at each use: the volatile load cannot be hoisted, so the three values
// live only where a mask needs them instead of in registers across a main loop that has none to
// spare (the backward's d = 64 softcap kernel spilled inside its loop with them hoisted).
__device__ __forceinline__ RowBounds row_bounds_at_use(const int* bounds, int batch, int s_q,
                                                       int s_k) {
  int4 row;  // (q_len, k_len, diag, unused)
  asm volatile("ld.global.nc.v4.s32 {%0, %1, %2, %3}, [%4];"
               : "=r"(row.x), "=r"(row.y), "=r"(row.z), "=r"(row.w)
               : "l"(bounds + 4 * batch));
  return {clamp_int(row.x, 0, s_q), clamp_int(row.y, 0, s_k), clamp_int(row.z, -s_q, s_k)};
}
#endif

}  // namespace jax_fa3
