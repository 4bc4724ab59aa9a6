// The list of FFI targets, exported with C linkage so the Python binding needs no kernel headers.
#pragma once
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
