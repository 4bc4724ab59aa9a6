// Bucket/dtype dispatch for the forward kernel, honouring what kernels.cmake compiled in
// (common/buckets.h). Included by the FFI handler only.
#pragma once
#include "flash_fwd/flash_fwd.h"

namespace jax_fa3 {

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
// kernel_compiled first to give a readable message).
inline cudaError_t launch_flash_fwd(const FlashFwdParams& p, cudaStream_t stream) {
  const int bucket = head_dim_bucket(p.d);
  if (!kernel_compiled(bucket, p.dtype)) return cudaErrorNotSupported;
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
