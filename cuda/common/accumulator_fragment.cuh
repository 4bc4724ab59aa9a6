// Where a wgmma fp32 accumulator's values sit (m64nNk*, CuTe's CLayout_64xN), the same for every
// operand type and for the forward's S and the backward's S^T, dP^T, dK, dV:
//   thread t of a warpgroup, lane = t % 32, warp = t / 32, holds for every 8-column chunk j of
//   the N columns four values
//     idx = v0 + 2*v1 + 4*j  ->  row 16*warp + lane/4 + 8*v1,  column 8*j + 2*(lane%4) + v0.
// So a thread owns two rows (v1 = 0, 1) and the four lanes of a quad (same lane/4) share a row:
// row reductions are a thread-local loop plus two xor-shuffles (1, 2) across the quad.
#pragma once

namespace jax_fa3 {

struct FragCoord {
  // Row (0..63 inside the warpgroup's 64 rows) of v1 = 0, and this thread's first column.
  int row0, col0;
  __host__ __device__ __forceinline__ static FragCoord of_thread(int thread_in_wg) {
    const int lane = thread_in_wg % 32;
    return {16 * (thread_in_wg / 32) + lane / 4, 2 * (lane % 4)};
  }
};

// v1 of accumulator index idx (which of the thread's two rows), and its column from col0.
__host__ __device__ __forceinline__ int frag_row(int idx) { return (idx >> 1) & 1; }
__host__ __device__ __forceinline__ int frag_col(int idx) { return 8 * (idx >> 2) + (idx & 1); }

#ifdef __CUDACC__
// Reductions over the four lanes that share a row.
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffff, x, 1);
  return x + __shfl_xor_sync(0xffffffff, x, 2);
}
#endif

}  // namespace jax_fa3
