#include "hadamard/hadamard.h"

#include "common/cuda_check.h"
#include "common/float_convert.cuh"

namespace jax_fa3 {
namespace {

constexpr int kThreads = 256;

// One CTA transforms `rows_per_cta` rows staged in shared memory as fp32. Memory-bound: the
// butterflies are cheap next to one read and one write of the row.
template <typename T>
__global__ void __launch_bounds__(kThreads) hadamard_kernel(const T* __restrict__ x,
                                                             const float* __restrict__ signs,
                                                             T* __restrict__ y, int64_t rows, int d,
                                                             int block_pow2, int rows_per_cta,
                                                             float scale) {
  extern __shared__ float smem[];
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * rows_per_cta;
  const int n_rows = static_cast<int>(rows - row0 < rows_per_cta ? rows - row0 : rows_per_cta);
  const int n = n_rows * d;
  const T* x_tile = x + row0 * d;
  T* y_tile = y + row0 * d;

  for (int i = threadIdx.x; i < n; i += kThreads) {
    float v = to_float(x_tile[i]);
    if (signs != nullptr) v *= signs[i % d];
    smem[i] = v;
  }
  __syncthreads();
  // Butterfly stage `h`: pairs (j, j + h) inside each block of 2h elements. Blocks of block_pow2
  // never mix, which gives the block-diagonal transform when d is not a power of two.
  for (int h = 1; h < block_pow2; h <<= 1) {
    for (int pair = threadIdx.x; pair < n / 2; pair += kThreads) {
      const int lo = (pair / h) * 2 * h + (pair % h);
      const float a = smem[lo];
      const float b = smem[lo + h];
      smem[lo] = a + b;
      smem[lo + h] = a - b;
    }
    __syncthreads();
  }
  for (int i = threadIdx.x; i < n; i += kThreads) y_tile[i] = from_float<T>(smem[i] * scale);
}

template <typename T>
cudaError_t launch_typed(const HadamardParams& p, cudaStream_t stream) {
  const int block_pow2 = p.d & (-p.d);
  const int rows_per_cta = p.d >= 1024 ? 1 : 1024 / p.d;  // ~4 KB of fp32 per CTA at least
  const int64_t ctas = (p.rows + rows_per_cta - 1) / rows_per_cta;
  if (ctas > 0x7fffffff) return cudaErrorInvalidValue;
  const size_t smem_bytes = sizeof(float) * static_cast<size_t>(rows_per_cta) * p.d;
  if (smem_bytes > 48 * 1024) {
    JAX_FA3_RETURN_IF_CUDA_ERROR(cudaFuncSetAttribute(
        hadamard_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem_bytes)));
  }
  const float scale = rsqrtf(static_cast<float>(block_pow2));
  hadamard_kernel<T><<<static_cast<unsigned>(ctas), kThreads, smem_bytes, stream>>>(
      static_cast<const T*>(p.x), p.signs, static_cast<T*>(p.y), p.rows, p.d, block_pow2,
      rows_per_cta, scale);
  JAX_FA3_RETURN_IF_LAUNCH_ERROR();
  return cudaSuccess;
}

}  // namespace

cudaError_t launch_hadamard(const HadamardParams& p, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  if (p.d <= 0 || p.d > kHadamardMaxDim) return cudaErrorInvalidValue;
  switch (p.dtype) {
    case DType::kFloat32: return launch_typed<float>(p, stream);
    case DType::kBFloat16: return launch_typed<__nv_bfloat16>(p, stream);
    case DType::kFloat16: return launch_typed<__half>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace jax_fa3
