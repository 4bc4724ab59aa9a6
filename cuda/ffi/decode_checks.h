// The checks every forward handler of a decode step makes (the 16-bit decode targets in
// flash_fwd_ffi.cc, the e4m3-cache ones in flash_fwd_fp8_cache_ffi.cc), and the build check of the
// 16-bit forward kernels.
#pragma once
#include <cstdint>

#include "common/buckets.h"
#include "ffi/attention_dims.h"
#include "ffi/ffi_common.h"

namespace jax_fa3::ffi_util {

// Pieces per row: the kernel's scheduler counts b * h_k * num_splits tiles in int32 (and
// splitting finer than a key block per piece only adds empty pieces).
constexpr int64_t kMaxDecodeSplits = 1024;

// One query per row, a split count in [1, kMaxDecodeSplits] and the tiles within int32; checked
// before the results' shapes, which they determine.
inline ffi::Error check_decode_query(const char* op, const AttentionDims& a, int64_t num_splits) {
  if (a.s_q != 1) {
    return invalid(op, ": q must hold one query per row, shape (b, 1, h, d), got s_q=", a.s_q);
  }
  if (num_splits < 1 || num_splits > kMaxDecodeSplits) {
    return invalid(op, ": num_splits must be in [1, ", kMaxDecodeSplits, "], got ", num_splits);
  }
  if (a.b * a.h_k > kMaxQueryTiles / num_splits) {
    return invalid(op, ": b * h_k * num_splits must be at most 2^29 (tiles, counted in int32), "
                   "got b=", a.b, ", h_k=", a.h_k, ", num_splits=", num_splits);
  }
  return ffi::Error::Success();
}

// The split-KV pieces: out (b, num_splits, h, d) of q's dtype, lse (b, num_splits, h).
inline ffi::Error check_decode_results(const char* op, ffi::Result<ffi::AnyBuffer>& out,
                                       ffi::Result<ffi::Buffer<ffi::F32>>& lse,
                                       ffi::DataType element_type, const AttentionDims& a,
                                       int64_t num_splits) {
  JAX_FA3_RETURN_IF_FFI_ERROR(check_buffer(op, "out", *out, element_type,
                                           "shape (b, num_splits, h, d) =",
                                           {a.b, num_splits, a.h, a.d}));
  return check_shape(op, "lse", "shape (b, num_splits, h) =", lse->dimensions(),
                     {a.b, num_splits, a.h});
}

// The 16-bit forward kernels of d's bucket and dtype are in this build.
inline ffi::Error check_compiled(const char* op, int64_t d, DType dtype) {
  const int bucket = head_dim_bucket(static_cast<int>(d));
  if (kernel_compiled(bucket, dtype)) return ffi::Error::Success();
  return invalid(op, ": no kernel compiled for head-dim bucket ", bucket, " (head dim ", d,
                 ") and dtype ", dtype_name(dtype),
                 "; rebuild with it in JAX_FA3_HEAD_DIMS / JAX_FA3_DTYPES");
}

}  // namespace jax_fa3::ffi_util
