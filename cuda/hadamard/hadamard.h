// Orthonormal Walsh–Hadamard transform over the last axis, optionally after a ±1 diagonal
// (y = H·diag(signs)·x), or before it: its inverse, y = diag(signs)·H·x.
//
// For a row length d = p·m with p the largest power of two dividing d, the transform is
// block-diagonal: each of the m contiguous blocks of p elements gets H_p / sqrt(p). For powers of
// two (64, 128, 256) this is the full transform; for 96 and 192 it is three blocks of 32 or 64.
#pragma once
#include <cstdint>
#include <cuda_runtime.h>

#include "common/dtype.h"

namespace jax_fa3 {

struct HadamardParams {
  const void* x;        // [rows, d], contiguous, dtype
  const float* signs;   // [d] of ±1 (any values are applied as given), or nullptr
  bool signs_after;     // multiply the transform's output by signs (the inverse), not its input
  void* y;              // [rows, d], out_dtype
  int64_t rows;
  int d;
  DType dtype;          // x's
  DType out_dtype;      // y's: dtype, or bfloat16 / float16 from float32 (rounded once)
};

// Largest row length accepted (d = 32, 64, 128, 256 run a register kernel, a warp per row; other
// lengths a shared-memory kernel).
constexpr int kHadamardMaxDim = 8192;

cudaError_t launch_hadamard(const HadamardParams& params, cudaStream_t stream);

}  // namespace jax_fa3
