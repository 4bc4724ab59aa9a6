// The list of FFI targets, exported with C linkage so the Python binding needs no kernel headers.
#pragma once
#include <cstddef>
#include <cstdint>

#include "common/cuda_check.h"

namespace jax_fa3 {
struct FfiTarget {
  const char* name;   // the name registered with jax.ffi.register_ffi_target
  void* handler;      // XLA_FFI_Handler*
};
}  // namespace jax_fa3

extern "C" JAX_FA3_EXPORT const jax_fa3::FfiTarget* jax_fa3_ffi_targets(int* count);
// Semicolon-separated description of what this library was compiled with (head dims, dtypes).
extern "C" JAX_FA3_EXPORT const char* jax_fa3_build_config();
// Bytes of the uint8 workspace result that jax_fa3_flash_bwd needs for this problem.
extern "C" JAX_FA3_EXPORT size_t jax_fa3_flash_bwd_workspace_bytes(int64_t b, int64_t h,
                                                                   int64_t s_q, int64_t d,
                                                                   bool deterministic);
// Bytes of the uint8 workspace result that jax_fa3_flash_bwd_fp8 needs for this problem.
extern "C" JAX_FA3_EXPORT size_t jax_fa3_flash_bwd_fp8_workspace_bytes(int64_t b, int64_t h,
                                                                       int64_t s_q, int64_t d,
                                                                       bool deterministic);
// Bytes of the uint8 workspace result that jax_fa3_flash_fwd_fp8 needs (masked: a window or
// causal mask is set); jax_fa3/_fp8_forward.py asks for it through the extension.
extern "C" JAX_FA3_EXPORT size_t jax_fa3_flash_fwd_fp8_workspace_bytes(
    int64_t b, int64_t s_q, int64_t s_k, int64_t h, int64_t h_k, int64_t d, bool masked,
    bool v_transposed);
