// Error plumbing shared by every kernel launcher: kernels report cudaError_t, FFI handlers turn it
// into ffi::Error. Kept free of XLA so the kernels stay usable outside JAX.
#pragma once
#include <cuda_runtime.h>

#define JAX_FA3_RETURN_IF_CUDA_ERROR(expr)          \
  do {                                              \
    cudaError_t jax_fa3_err_ = (expr);              \
    if (jax_fa3_err_ != cudaSuccess) return jax_fa3_err_; \
  } while (0)

// After a <<<>>> launch: configuration errors surface from cudaGetLastError, not the launch itself.
#define JAX_FA3_RETURN_IF_LAUNCH_ERROR() JAX_FA3_RETURN_IF_CUDA_ERROR(cudaGetLastError())

#define JAX_FA3_EXPORT __attribute__((visibility("default")))
