#include "hadamard/hadamard.h"

#include "common/cuda_check.h"
#include "common/float_convert.cuh"
#include "common/lane_vector.cuh"

namespace jax_fa3 {
namespace {

constexpr int kThreads = 256;
constexpr int kWarpsPerCta = kThreads / 32;

// Butterfly stage h of the transform pairs elements (j, j + h) inside each block of 2h elements:
// the lower becomes a + b, the upper a - b. Both kernels run the stages in the order h = 1, 2, 4,
// ..., with the same operations, so they agree bit for bit with each other and with
// hadamard_reference's float32 path.

// d = 32 * kPerLane (32, 64, 128, 256): a warp transforms a row in registers, lane l holding
// elements [l * kPerLane, +kPerLane). Stages h < kPerLane stay inside a thread; the others pair
// lane l with lane l ^ (h / kPerLane) by a shuffle. Memory-bound: each warp first issues the loads
// of kRows rows (kPerLane * sizeof(TIn) bytes a lane each), so enough bytes are in flight per SM.
template <typename TIn, typename TOut, int kPerLane, int kRows>
__global__ void __launch_bounds__(kThreads) hadamard_rows_kernel(const TIn* __restrict__ x,
                                                                  const float* __restrict__ signs,
                                                                  bool signs_after,
                                                                  TOut* __restrict__ y,
                                                                  int64_t rows, float scale) {
  constexpr int kD = 32 * kPerLane;
  using LaneIn = LaneVector<TIn, kPerLane>;
  using LaneOut = LaneVector<TOut, kPerLane>;
  const int lane = threadIdx.x % 32;
  const int64_t first_row =
      (int64_t(blockIdx.x) * kWarpsPerCta + threadIdx.x / 32) * kRows;

  float sign[kPerLane];
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) sign[e] = signs != nullptr ? signs[lane * kPerLane + e] : 1.f;

  LaneIn in[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    if (first_row + r < rows) in[r].load(x + (first_row + r) * kD + lane * kPerLane);
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    if (first_row + r >= rows) continue;  // whole warps: the shuffles below stay warp-uniform
    float v[kPerLane];
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) {
      v[e] = to_float(in[r].elem[e]);
      if (!signs_after) v[e] *= sign[e];
    }
#pragma unroll
    for (int h = 1; h < kPerLane; h <<= 1) {
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) {
        if ((e & h) == 0) {
          const float a = v[e], b = v[e + h];
          v[e] = a + b;
          v[e + h] = a - b;
        }
      }
    }
#pragma unroll
    for (int lanes = 1; lanes < 32; lanes <<= 1) {
      const bool upper = (lane & lanes) != 0;
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) {
        const float other = __shfl_xor_sync(0xffffffffu, v[e], lanes);
        v[e] = upper ? other - v[e] : v[e] + other;
      }
    }
    LaneOut out;
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) {
      float w = v[e] * scale;
      if (signs_after) w *= sign[e];
      out.elem[e] = from_float<TOut>(w);
    }
    out.store(y + (first_row + r) * kD + lane * kPerLane);
  }
}

// Any d up to kHadamardMaxDim: one CTA transforms `rows_per_cta` rows staged in shared memory as
// fp32, in blocks of block_pow2 (the block-diagonal transform when d is not a power of two).
template <typename TIn, typename TOut>
__global__ void __launch_bounds__(kThreads) hadamard_smem_kernel(const TIn* __restrict__ x,
                                                                  const float* __restrict__ signs,
                                                                  bool signs_after,
                                                                  TOut* __restrict__ y, int64_t rows,
                                                                  int d, int block_pow2,
                                                                  int rows_per_cta, float scale) {
  extern __shared__ float smem[];
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * rows_per_cta;
  const int n_rows = static_cast<int>(rows - row0 < rows_per_cta ? rows - row0 : rows_per_cta);
  const int n = n_rows * d;
  const TIn* x_tile = x + row0 * d;
  TOut* y_tile = y + row0 * d;

  for (int i = threadIdx.x; i < n; i += kThreads) {
    float v = to_float(x_tile[i]);
    if (signs != nullptr && !signs_after) v *= signs[i % d];
    smem[i] = v;
  }
  __syncthreads();
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
  for (int i = threadIdx.x; i < n; i += kThreads) {
    float w = smem[i] * scale;
    if (signs != nullptr && signs_after) w *= signs[i % d];
    y_tile[i] = from_float<TOut>(w);
  }
}

template <typename TIn, typename TOut, int kPerLane>
cudaError_t launch_rows(const HadamardParams& p, cudaStream_t stream) {
  // About 32 bytes per lane in flight: 4 rows of 8 bytes (bf16 d = 128), 2 of 16, 1 of 32.
  constexpr int kLaneBytes = kPerLane * int(sizeof(TIn));
  constexpr int kRows = kLaneBytes >= 32 ? 1 : 32 / kLaneBytes > 4 ? 4 : 32 / kLaneBytes;
  constexpr int64_t kRowsPerCta = int64_t(kWarpsPerCta) * kRows;
  const int64_t ctas = (p.rows + kRowsPerCta - 1) / kRowsPerCta;
  if (ctas > 0x7fffffff) return cudaErrorInvalidValue;
  const float scale = rsqrtf(static_cast<float>(32 * kPerLane));
  hadamard_rows_kernel<TIn, TOut, kPerLane, kRows>
      <<<static_cast<unsigned>(ctas), kThreads, 0, stream>>>(static_cast<const TIn*>(p.x), p.signs,
                                                              p.signs_after, static_cast<TOut*>(p.y),
                                                              p.rows, scale);
  JAX_FA3_RETURN_IF_LAUNCH_ERROR();
  return cudaSuccess;
}

template <typename TIn, typename TOut>
cudaError_t launch_typed(const HadamardParams& p, cudaStream_t stream) {
  // Vector accesses need 2..16-byte aligned rows: XLA's buffers are at least 16-byte aligned and
  // every row starts at a multiple of d * sizeof(T) >= 64 bytes.
  const bool aligned = reinterpret_cast<uintptr_t>(p.x) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(p.y) % 16 == 0;
  if (aligned) {
    switch (p.d) {
      case 32: return launch_rows<TIn, TOut, 1>(p, stream);
      case 64: return launch_rows<TIn, TOut, 2>(p, stream);
      case 128: return launch_rows<TIn, TOut, 4>(p, stream);
      case 256: return launch_rows<TIn, TOut, 8>(p, stream);
      default: break;
    }
  }
  const int block_pow2 = p.d & (-p.d);
  const int rows_per_cta = p.d >= 1024 ? 1 : 1024 / p.d;  // ~4 KB of fp32 per CTA at least
  const int64_t ctas = (p.rows + rows_per_cta - 1) / rows_per_cta;
  if (ctas > 0x7fffffff) return cudaErrorInvalidValue;
  const size_t smem_bytes = sizeof(float) * static_cast<size_t>(rows_per_cta) * p.d;
  if (smem_bytes > 48 * 1024) {
    JAX_FA3_RETURN_IF_CUDA_ERROR(cudaFuncSetAttribute(hadamard_smem_kernel<TIn, TOut>,
                                                      cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                      static_cast<int>(smem_bytes)));
  }
  const float scale = rsqrtf(static_cast<float>(block_pow2));
  hadamard_smem_kernel<TIn, TOut><<<static_cast<unsigned>(ctas), kThreads, smem_bytes, stream>>>(
      static_cast<const TIn*>(p.x), p.signs, p.signs_after, static_cast<TOut*>(p.y), p.rows, p.d,
      block_pow2, rows_per_cta, scale);
  JAX_FA3_RETURN_IF_LAUNCH_ERROR();
  return cudaSuccess;
}

}  // namespace

cudaError_t launch_hadamard(const HadamardParams& p, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  if (p.d <= 0 || p.d > kHadamardMaxDim) return cudaErrorInvalidValue;
  if (p.out_dtype != p.dtype) {  // float32 in, rounded once to a 16-bit type on the way out
    if (p.dtype != DType::kFloat32) return cudaErrorInvalidValue;
    switch (p.out_dtype) {
      case DType::kBFloat16: return launch_typed<float, __nv_bfloat16>(p, stream);
      case DType::kFloat16: return launch_typed<float, __half>(p, stream);
      default: return cudaErrorInvalidValue;
    }
  }
  switch (p.dtype) {
    case DType::kFloat32: return launch_typed<float, float>(p, stream);
    case DType::kBFloat16: return launch_typed<__nv_bfloat16, __nv_bfloat16>(p, stream);
    case DType::kFloat16: return launch_typed<__half, __half>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace jax_fa3
