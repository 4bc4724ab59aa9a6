// Bucket/dtype dispatch for the forward kernel, honouring what kernels.cmake compiled in
// (JAX_FA3_HAS_HDIM<D>, JAX_FA3_HAS_BF16/FP16). Included by the FFI handler only.
#pragma once
#include "flash_fwd/flash_fwd.h"

namespace jax_fa3 {

inline bool flash_fwd_compiled(int bucket, DType dtype) {
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

namespace detail {
template <int kHeadDim>
cudaError_t launch_flash_fwd_bucket(const FlashFwdParams& p, cudaStream_t stream) {
  switch (p.dtype) {
#ifdef JAX_FA3_HAS_BF16
    case DType::kBFloat16: return run_flash_fwd<kHeadDim, DType::kBFloat16>(p, stream);
#endif
#ifdef JAX_FA3_HAS_FP16
    case DType::kFloat16: return run_flash_fwd<kHeadDim, DType::kFloat16>(p, stream);
#endif
    default: return cudaErrorNotSupported;
  }
}
}  // namespace detail

// cudaErrorNotSupported when the bucket/dtype pair was not compiled in (callers check
// flash_fwd_compiled first to give a readable message).
inline cudaError_t launch_flash_fwd(const FlashFwdParams& p, cudaStream_t stream) {
  const int bucket = flash_fwd_bucket(p.d);
  if (!flash_fwd_compiled(bucket, p.dtype)) return cudaErrorNotSupported;
  switch (bucket) {
#ifdef JAX_FA3_HAS_HDIM64
    case 64: return detail::launch_flash_fwd_bucket<64>(p, stream);
#endif
#ifdef JAX_FA3_HAS_HDIM96
    case 96: return detail::launch_flash_fwd_bucket<96>(p, stream);
#endif
#ifdef JAX_FA3_HAS_HDIM128
    case 128: return detail::launch_flash_fwd_bucket<128>(p, stream);
#endif
#ifdef JAX_FA3_HAS_HDIM192
    case 192: return detail::launch_flash_fwd_bucket<192>(p, stream);
#endif
#ifdef JAX_FA3_HAS_HDIM256
    case 256: return detail::launch_flash_fwd_bucket<256>(p, stream);
#endif
    default: return cudaErrorNotSupported;
  }
}

}  // namespace jax_fa3
