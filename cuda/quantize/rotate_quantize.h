// Incoherent processing and block quantization in one pass: x (b, s, h, d) -> optional rotation
// H·diag(signs) over d (the transform of hadamard.h) -> e4m3 values with one float32 scale per
// (batch, head, block of `block_size` tokens). The numerics are those of jax_fa3/_fp8_quantize.py
// (`_quantize`): scale = amax · float32(1/448) (1.0 when amax is not > 0, at least float32's
// smallest normal), values = e4m3(x · (1 / scale)) (reciprocal correctly rounded), round to
// nearest even, saturating.
//
// It replaces XLA's passes over float32 copies (cast, rotate, amax, quantize) with one read of x,
// a re-read (from L2 for blocks of up to 256 tokens) and a one-byte write.
#pragma once
#include <cstdint>
#include <cuda_runtime.h>

#include "common/dtype.h"

namespace jax_fa3 {

struct RotateQuantizeParams {
  const void* x;        // (b, s, h, d), contiguous, dtype
  const float* signs;   // (d,) ±1 applied before the transform; nullptr: no rotation
  void* values;         // (b, s, h, d) e4m3; keys_transposed: (b, h, d, s_pad), see below
  float* scales;        // (b, h, ceil(s / block_size))
  int64_t b, s, h;
  int d;
  int block_size;       // tokens per scale, >= 1
  DType dtype;          // kFloat32, kBFloat16 or kFloat16
  // Write the values in the fp8 forward's V layout (flash_fwd/fp8/vt.h): (b, h, d, s_pad), s_pad
  // = s rounded up to 32 (flash_fwd_fp8_key_pad), keys permuted per group of 32
  // (fp8/layout.h), zero past s. The forward then skips its V pre-pass. Needs one block per
  // head (block_size >= s): v's quantization.
  bool keys_transposed;
  // (b, h, d) float32 subtracted from every token of its (batch, head) after the rotation, before
  // the amax and the quantization (v's centring, jax_fa3/_fp8_quantize.py); nullptr: none. Runs the chunked
  // passes (rotate_quantize_chunked).
  const float* mean = nullptr;
  // The centring done by the pass itself (needs one block per head, block_size >= s, and no
  // rotation, signs nullptr: v's quantization): the (b, h, d) float32 mean of each head's tokens
  // goes to mean_out and is subtracted as `mean` would be (which must then be nullptr);
  // `partials` is the workspace (rotate_quantize_centre_workspace_floats). The scale comes from
  // the column extremes, amax = max over columns of max(max_c - mean_c, mean_c - min_c), which is
  // exactly the amax of the rounded differences since float32 subtraction is monotonic. nullptr:
  // no such centring.
  float* mean_out = nullptr;
  float* partials = nullptr;
};

// One warp holds a row in registers, d / 32 elements per lane: d a multiple of 32 up to this.
constexpr int kRotateQuantizeMaxDim = 256;

inline bool rotate_quantize_supports_dim(int64_t d) {
  return d >= 32 && d <= kRotateQuantizeMaxDim && d % 32 == 0;
}

// Blocks of up to kRotateQuantizeMaxCtaBlock tokens are one CTA each (two per CTA where one pass
// covers them: 64 tokens at d <= 128, 16-bit inputs). Larger blocks (v's one scale per head) are
// cut into chunks of kRotateQuantizeChunkTokens whose amax meet in an atomic max, then are
// quantized by a second launch: enough CTAs to fill the GPU either way.
constexpr int64_t kRotateQuantizeMaxCtaBlock = 256;
constexpr int64_t kRotateQuantizeChunkTokens = 128;

// Whether the pass goes through the chunk kernels whatever its block size: the keys-transposed
// mode does (its stores transpose one chunk at a time), and so does a centred pass (only the
// chunk kernels subtract a mean; the others are held to 85 registers).
inline bool rotate_quantize_chunked(const RotateQuantizeParams& p) {
  return p.keys_transposed || p.mean != nullptr || p.mean_out != nullptr;
}

// CTAs per block: 1, or its number of chunks.
inline int64_t rotate_quantize_chunks(const RotateQuantizeParams& p) {
  const int64_t tokens = p.block_size < p.s ? p.block_size : p.s;
  return p.block_size <= kRotateQuantizeMaxCtaBlock && !rotate_quantize_chunked(p)
             ? 1
             : (tokens + kRotateQuantizeChunkTokens - 1) / kRotateQuantizeChunkTokens;
}

// CTAs of the largest launch (must stay below 2^31).
inline int64_t rotate_quantize_ctas(const RotateQuantizeParams& p) {
  return p.b * p.h * ((p.s + p.block_size - 1) / p.block_size) * rotate_quantize_chunks(p);
}

// Floats of RotateQuantizeParams::partials: column sum, max and min per chunk of each head.
inline int64_t rotate_quantize_centre_workspace_floats(int64_t b, int64_t s, int64_t h,
                                                       int64_t d) {
  return b * h * ((s + kRotateQuantizeChunkTokens - 1) / kRotateQuantizeChunkTokens) * 3 * d;
}

cudaError_t launch_rotate_quantize(const RotateQuantizeParams& params, cudaStream_t stream);

}  // namespace jax_fa3
