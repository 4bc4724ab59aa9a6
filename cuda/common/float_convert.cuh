// Device conversions between the 16/32-bit storage types and float32, for the elementwise kernels
// (hadamard, rotate_quantize) that are templated on the storage type.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace jax_fa3 {

template <typename T> __device__ __forceinline__ float to_float(T v) { return static_cast<float>(v); }
template <> __device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
template <> __device__ __forceinline__ float to_float(__half v) { return __half2float(v); }

template <typename T> __device__ __forceinline__ T from_float(float v) { return static_cast<T>(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float(float v) { return __float2bfloat16(v); }
template <> __device__ __forceinline__ __half from_float(float v) { return __float2half(v); }

}  // namespace jax_fa3
