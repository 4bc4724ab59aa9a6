// Helpers shared by the XLA FFI handlers: dtype mapping and error formatting. Handlers know
// nothing about Python; kernels know nothing about XLA — this file is the seam.
#pragma once
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <type_traits>

#include "common/dtype.h"
#include "xla/ffi/api/ffi.h"

namespace jax_fa3::ffi_util {

namespace ffi = xla::ffi;

inline std::optional<DType> to_dtype(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return DType::kFloat32;
    case ffi::DataType::BF16: return DType::kBFloat16;
    case ffi::DataType::F16: return DType::kFloat16;
    case ffi::DataType::F8E4M3FN: return DType::kFloat8E4M3;
    default: return std::nullopt;
  }
}

// Message building without iostreams: std::ostream inside a handler crashed XLA's process on the
// H200 (2026-11-30: a segfault in ostream::_M_insert<long> during an error return), so plain
// string appends it is.
inline void append(std::string& s, const char* v) { s += v; }
inline void append(std::string& s, const std::string& v) { s += v; }
template <typename T>
inline void append(std::string& s, T v) {
  if constexpr (std::is_same_v<T, bool>) {
    s += v ? "true" : "false";
  } else if constexpr (std::is_integral_v<T>) {
    s += std::to_string(v);
  } else {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%g", static_cast<double>(v));
    s += buf;
  }
}

inline std::string shape_str(ffi::AnyBuffer::Dimensions dims) {
  std::string s = "(";
  for (size_t i = 0; i < dims.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(dims[i]);
  }
  s += dims.size() == 1 ? ",)" : ")";
  return s;
}

template <typename... Parts>
ffi::Error invalid(const Parts&... parts) {
  std::string s;
  (append(s, parts), ...);
  return ffi::Error::InvalidArgument(s);
}

inline ffi::Error from_cuda(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(what) + " failed: " + cudaGetErrorName(err) + ": " +
                              cudaGetErrorString(err));
}

// Test hook: with JAX_FA3_DEBUG_POISON_OUTPUTS=1 in the environment, handlers fill their outputs
// with 0xFF bytes (NaN in bf16, fp16 and fp32) on the stream before the kernel runs, so an element
// the kernel forgets to write shows up as NaN instead of whatever XLA's allocator left there.
// Read per call (getenv is far cheaper than a launch) so a test can switch it on at run time.
inline bool poison_outputs_requested() {
  const char* v = std::getenv("JAX_FA3_DEBUG_POISON_OUTPUTS");
  return v != nullptr && v[0] != '\0' && v[0] != '0';
}

// Whether environment variable `name` is set to "0" (read per call, like the poison hook).
inline bool env_flag_is_zero(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && v[0] == '0' && v[1] == '\0';
}

// Poisons every given result buffer when the test hook is on; returns the first CUDA error.
template <typename... Results>
cudaError_t poison_if_requested(cudaStream_t stream, Results&... results) {
  if (!poison_outputs_requested()) return cudaSuccess;
  cudaError_t err = cudaSuccess;
  auto fill = [&](void* data, size_t bytes) {
    if (err == cudaSuccess && bytes > 0) err = cudaMemsetAsync(data, 0xFF, bytes, stream);
  };
  (fill(results->untyped_data(), results->size_bytes()), ...);
  return err;
}

}  // namespace jax_fa3::ffi_util
