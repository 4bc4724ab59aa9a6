// Orthonormal Walsh–Hadamard transform over the last axis, optionally after a ±1 diagonal.
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
  void* y;              // [rows, d], same dtype as x
  int64_t rows;
  int d;
  DType dtype;
};

// Largest row length the shared-memory kernel accepts.
constexpr int kHadamardMaxDim = 8192;

cudaError_t launch_hadamard(const HadamardParams& params, cudaStream_t stream);

}  // namespace jax_fa3
