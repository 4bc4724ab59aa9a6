// Head-dim buckets shared by every kernel, and which (bucket, dtype) instantiations this build
// compiled (kernels.cmake defines JAX_FA3_HAS_HDIM<D> and JAX_FA3_HAS_<DTYPE> from
// JAX_FA3_HEAD_DIMS / JAX_FA3_DTYPES). Plain C++: the FFI handlers include it.
#pragma once
#include "common/dtype.h"

namespace jax_fa3 {

// A head dim d (a multiple of 8) runs in the smallest bucket >= d; TMA zero-fills the padding.
constexpr int kHeadDimBuckets[] = {64, 96, 128, 192, 256};

// The bucket that runs head dim d, or 0 if none does.
inline int head_dim_bucket(int d) {
  if (d <= 0 || d % 8 != 0) return 0;
  for (int bucket : kHeadDimBuckets) {
    if (d <= bucket) return bucket;
  }
  return 0;
}

// Keys per K/V block of the bf16/fp16 forward kernels of a bucket (flash_fwd/kernel_traits.h,
// BlockN: chosen per bucket for the register and shared-memory budgets). A paged KV cache is read
// in place when its page size is a multiple of it (one TMA box never straddles two pages).
constexpr int forward_key_block(int bucket) {
  return bucket == 64 ? 160 : bucket == 96 ? 144 : bucket == 128 ? 128 : bucket == 192 ? 112 : 80;
}

// Whether the bf16/fp16 kernels of this bucket and dtype are in this build.
inline bool kernel_compiled(int bucket, DType dtype) {
  bool dtype_ok = false;
#ifdef JAX_FA3_HAS_BF16
  dtype_ok |= dtype == DType::kBFloat16;
#endif
#ifdef JAX_FA3_HAS_FP16
  dtype_ok |= dtype == DType::kFloat16;
#endif
  bool bucket_ok = false;
#ifdef JAX_FA3_HAS_HDIM64
  bucket_ok |= bucket == 64;
#endif
#ifdef JAX_FA3_HAS_HDIM96
  bucket_ok |= bucket == 96;
#endif
#ifdef JAX_FA3_HAS_HDIM128
  bucket_ok |= bucket == 128;
#endif
#ifdef JAX_FA3_HAS_HDIM192
  bucket_ok |= bucket == 192;
#endif
#ifdef JAX_FA3_HAS_HDIM256
  bucket_ok |= bucket == 256;
#endif
  return dtype_ok && bucket_ok;
}

}  // namespace jax_fa3
