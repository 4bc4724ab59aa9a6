// Helpers shared by the XLA FFI handlers: dtype mapping and error formatting. Handlers know
// nothing about Python; kernels know nothing about XLA — this file is the seam.
#pragma once
#include <cuda_runtime.h>

#include <optional>
#include <sstream>
#include <string>

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

inline std::string shape_str(ffi::AnyBuffer::Dimensions dims) {
  std::ostringstream s;
  s << "(";
  for (size_t i = 0; i < dims.size(); ++i) s << (i ? ", " : "") << dims[i];
  s << (dims.size() == 1 ? ",)" : ")");
  return s.str();
}

template <typename... Parts>
ffi::Error invalid(const Parts&... parts) {
  std::ostringstream s;
  (s << ... << parts);
  return ffi::Error::InvalidArgument(s.str());
}

inline ffi::Error from_cuda(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return ffi::Error::Success();
  std::ostringstream s;
  s << what << " failed: " << cudaGetErrorName(err) << ": " << cudaGetErrorString(err);
  return ffi::Error::Internal(s.str());
}

}  // namespace jax_fa3::ffi_util
