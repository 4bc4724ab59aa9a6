// The element types our kernels understand, independent of XLA's enum.
#pragma once

namespace jax_fa3 {

enum class DType { kFloat32, kBFloat16, kFloat16, kFloat8E4M3 };

inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::kFloat32: return "float32";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat16: return "float16";
    case DType::kFloat8E4M3: return "float8_e4m3fn";
  }
  return "unknown";
}

}  // namespace jax_fa3
