// Helpers shared by the XLA FFI handlers: dtype mapping, error formatting and the buffer checks.
// Handlers know nothing about Python; kernels know nothing about XLA — this file is the seam.
#pragma once
#include "common/key_ranges.h"
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
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

inline const char* dtype_label(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::U8: return "uint8";
    case ffi::DataType::S8: return "int8";
    case ffi::DataType::S16: return "int16";
    case ffi::DataType::S32: return "int32";
    case ffi::DataType::S64: return "int64";
    case ffi::DataType::U32: return "uint32";
    case ffi::DataType::U64: return "uint64";
    case ffi::DataType::F64: return "float64";
    case ffi::DataType::PRED: return "bool";
    default: break;
  }
  const auto d = to_dtype(t);
  return d ? dtype_name(*d) : "an unsupported dtype";
}

// `op: name must be <want>, got <dtype>`.
inline ffi::Error check_dtype(const char* op, const char* name, ffi::DataType have,
                              ffi::DataType want) {
  if (have == want) return ffi::Error::Success();
  return invalid(op, ": ", name, " must be ", dtype_label(want), ", got ", dtype_label(have));
}

// A dimension the shape checks accept whatever its size (checked elsewhere, or free).
constexpr int64_t kAnyDim = -1;

// Whether dims has want's rank and each dimension equals its entry of want (kAnyDim: any size).
inline bool dims_equal(ffi::AnyBuffer::Dimensions dims, std::initializer_list<int64_t> want) {
  if (dims.size() != want.size()) return false;
  size_t i = 0;
  for (int64_t w : want) {
    if (w != kAnyDim && dims[i] != w) return false;
    ++i;
  }
  return true;
}

inline ffi::Error check_rank(const char* op, const char* name, const char* layout,
                             ffi::AnyBuffer::Dimensions dims, size_t rank) {
  if (dims.size() == rank) return ffi::Error::Success();
  return invalid(op, ": ", name, " must have rank ", rank, " ", layout, ", got shape ",
                 shape_str(dims));
}

// The shape check of every handler: "op: name must have <what> <want>, got <shape>", where what
// says whose shape or which axes, e.g. "shape (b, h, s_q) =" or "q's shape"; a kAnyDim entry of
// want prints as "_".
inline ffi::Error check_shape(const char* op, const char* name, const char* what,
                              ffi::AnyBuffer::Dimensions dims,
                              std::initializer_list<int64_t> want) {
  if (dims_equal(dims, want)) return ffi::Error::Success();
  std::string expected = "(";
  for (int64_t w : want) {
    if (expected.size() > 1) expected += ", ";
    expected += w == kAnyDim ? std::string("_") : std::to_string(w);
  }
  expected += want.size() == 1 ? ",)" : ")";
  return invalid(op, ": ", name, " must have ", what, " ", expected, ", got ", shape_str(dims));
}

// check_dtype, then check_shape.
inline ffi::Error check_buffer(const char* op, const char* name, const ffi::AnyBuffer& buf,
                               ffi::DataType dtype, const char* what,
                               std::initializer_list<int64_t> want) {
  if (auto err = check_dtype(op, name, buf.element_type(), dtype); err.failure()) return err;
  return check_shape(op, name, what, buf.dimensions(), want);
}

// The masked kernels' per-query key ranges and their covers (common/key_ranges.h): int32
// (b, s_pad, 2) and (b, s_pad / 64, 4), s_pad = s_q rounded up to a multiple of 128.
inline ffi::Error check_key_ranges(const char* op, const ffi::AnyBuffer& ranges,
                                   const ffi::AnyBuffer& covers, int64_t b, int64_t s_q) {
  const int64_t s_pad = (s_q + kKeyRangeRowPad - 1) / kKeyRangeRowPad * kKeyRangeRowPad;
  if (auto err = check_buffer(op, "key_ranges", ranges, ffi::DataType::S32,
                              "shape (b, s_q rounded up to 128, 2) =", {b, s_pad, 2});
      err.failure()) {
    return err;
  }
  return check_buffer(op, "key_covers", covers, ffi::DataType::S32,
                      "shape (b, s_q rounded up to 128 / 64, 4) =",
                      {b, s_pad / kKeyRangeGranule, 4});
}

// The forward kernels' per-row bounds (common/key_ranges.h): int32 (b, 3), (q_len, k_len, diag).
inline ffi::Error check_row_bounds(const char* op, const ffi::AnyBuffer& bounds, int64_t b) {
  return check_buffer(op, "row_bounds", bounds, ffi::DataType::S32,
                      "shape (b, 3) of (q_len, k_len, diag) =", {b, 3});
}

// Returns from the enclosing handler with the ffi::Error of `expr` when it is a failure.
#define JAX_FA3_RETURN_IF_FFI_ERROR(expr)                                          \
  do {                                                                             \
    if (auto jax_fa3_ffi_err_ = (expr); jax_fa3_ffi_err_.failure()) {              \
      return jax_fa3_ffi_err_;                                                     \
    }                                                                              \
  } while (0)

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

// The end of every handler: the test hook's poisoning of `results`, then `launch()` (returning a
// cudaError_t), a failure of either reported under the op's name.
template <typename Launch, typename... Results>
ffi::Error poison_and_launch(const char* op, cudaStream_t stream, Launch&& launch,
                             Results&... results) {
  if (const cudaError_t err = poison_if_requested(stream, results...); err != cudaSuccess) {
    const std::string what = std::string(op) + " output poisoning (JAX_FA3_DEBUG_POISON_OUTPUTS)";
    return from_cuda(err, what.c_str());
  }
  const cudaError_t err = launch();
  if (err == cudaSuccess) return ffi::Error::Success();  // no message built on the hot path
  return from_cuda(err, (std::string(op) + " kernel launch").c_str());
}

// The binding every handler starts from: the CUDA stream XLA runs it on.
inline auto bind_on_stream() { return ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>(); }

}  // namespace jax_fa3::ffi_util
