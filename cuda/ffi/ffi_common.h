// Helpers shared by the XLA FFI handlers: dtype mapping and error formatting. Handlers know
// nothing about Python; kernels know nothing about XLA — this file is the seam.
#pragma once
#include <cuda_runtime.h>

#include <cstdio>
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

}  // namespace jax_fa3::ffi_util
