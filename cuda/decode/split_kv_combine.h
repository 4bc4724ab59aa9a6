// The merge of split-KV decoding ("flash-decoding"): each batch row's keys were cut into n
// pieces, each attended as its own batch row; the pieces' outputs are merged by their lse.
//
// For output vector (row r, query row i, head h), pieces p = 0..n-1 of row r (batch rows
// r * n + p of the inputs):
//   l_p = lse_p, an lse of +inf (a piece whose query saw no key) read as -inf;
//   top = max_p l_p, or 0 when every l_p is -inf;
//   w_p = exp(l_p - top), total = sum_p w_p;
//   total == 0 (every piece empty): out = 0, lse = +inf;
//   else out = sum_p (w_p / total) * out_p, lse = top + log(total),
// in float32, out rounded once to the pieces' dtype. A piece of weight 0 (empty, or underflowed)
// is skipped: its out values are not read into the sum (the XLA merge multiplies them by 0, so a
// NaN there would stay NaN; the attention kernels write 0 there).
#pragma once
#include <cstdint>
#include <cuda_runtime.h>

#include "common/dtype.h"

namespace jax_fa3 {

struct SplitKvCombineParams {
  const void* out_pieces;   // [b * n, rows, heads, d], dtype, contiguous, 16-byte aligned
  const float* lse_pieces;  // [b * n, heads, rows]
  void* out;                // [b, rows, heads, d], dtype, 16-byte aligned
  float* lse;               // [b, heads, rows]
  int64_t b;
  int64_t rows;
  int64_t heads;
  int d;                    // a multiple of 8, at most kSplitKvCombineMaxDim
  int n;                    // pieces per batch row, >= 1
  DType dtype;              // float32, bfloat16 or float16
};

constexpr int kSplitKvCombineMaxDim = 256;
constexpr int kSplitKvCombineDimMultiple = 8;

// cudaErrorInvalidValue for a dtype, d or n outside the above, cudaErrorMisalignedAddress for
// buffers not 16-byte aligned; otherwise the launch's error, if any.
cudaError_t launch_split_kv_combine(const SplitKvCombineParams& params, cudaStream_t stream);

}  // namespace jax_fa3
