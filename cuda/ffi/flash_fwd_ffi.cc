// XLA FFI handler for the FlashAttention-3 forward kernel (target "jax_fa3_flash_fwd").
// Validates every argument again (Python already did) and dispatches to the compiled bucket.
#include <cmath>
#include <cstdint>

#include "ffi/ffi_common.h"
#include "ffi/handlers.h"
#include "flash_fwd/dispatch.h"

namespace jax_fa3 {
namespace {

namespace ffi = xla::ffi;
using ffi_util::invalid;
using ffi_util::shape_str;

ffi::Error flash_fwd_impl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                          ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Buffer<ffi::F32>> lse,
                          float softmax_scale, float softcap, int32_t window_left,
                          int32_t window_right) {
  const auto qd = q.dimensions();
  const auto kd = k.dimensions();
  const auto vd = v.dimensions();
  if (qd.size() != 4) return invalid("flash_fwd: q must have rank 4 (b, s_q, h, d), got shape ", shape_str(qd));
  if (kd.size() != 4) return invalid("flash_fwd: k must have rank 4 (b, s_k, h_k, d), got shape ", shape_str(kd));
  if (vd.size() != 4) return invalid("flash_fwd: v must have rank 4 (b, s_k, h_k, d), got shape ", shape_str(vd));

  const auto dtype = ffi_util::to_dtype(q.element_type());
  if (!dtype || (*dtype != DType::kBFloat16 && *dtype != DType::kFloat16)) {
    return invalid("flash_fwd: q must be bfloat16 or float16, got ",
                   dtype ? dtype_name(*dtype) : "an unsupported dtype");
  }
  if (k.element_type() != q.element_type() || v.element_type() != q.element_type()) {
    return invalid("flash_fwd: k and v must have q's dtype ", dtype_name(*dtype));
  }

  const int64_t b = qd[0], s_q = qd[1], h = qd[2], d = qd[3];
  const int64_t s_k = kd[1], h_k = kd[2];
  if (kd[0] != b) return invalid("flash_fwd: k batch must equal q batch ", b, ", got ", kd[0]);
  if (kd[3] != d) return invalid("flash_fwd: k head dim must equal q head dim ", d, ", got ", kd[3]);
  for (size_t i = 0; i < 4; ++i) {
    if (vd[i] != kd[i]) {
      return invalid("flash_fwd: v must have k's shape ", shape_str(kd), ", got ", shape_str(vd));
    }
  }
  if (h_k < 1 || h % h_k != 0) {
    return invalid("flash_fwd: q heads must be a multiple of k/v heads (GQA), got h=", h, ", h_k=", h_k);
  }
  if (d < 8 || d % 8 != 0 || d > 256) {
    return invalid("flash_fwd: head dim must be a multiple of 8 in [8, 256], got ", d);
  }
  constexpr int64_t kMaxInt = INT32_MAX;
  if (b > kMaxInt || s_q > kMaxInt || s_k > kMaxInt || h > kMaxInt) {
    return invalid("flash_fwd: every dimension must fit in int32, got q ", shape_str(qd),
                   " and k ", shape_str(kd));
  }
  if (out->element_type() != q.element_type()) {
    return invalid("flash_fwd: out must have q's dtype ", dtype_name(*dtype));
  }
  const auto od = out->dimensions();
  if (od.size() != 4 || od[0] != b || od[1] != s_q || od[2] != h || od[3] != d) {
    return invalid("flash_fwd: out must have q's shape ", shape_str(qd), ", got ", shape_str(od));
  }
  const auto ld = lse->dimensions();
  if (ld.size() != 3 || ld[0] != b || ld[1] != h || ld[2] != s_q) {
    return invalid("flash_fwd: lse must have shape (b, h, s_q) = (", b, ", ", h, ", ", s_q,
                   "), got ", shape_str(ld));
  }
  if (!std::isfinite(softmax_scale) || softmax_scale <= 0.f) {
    return invalid("flash_fwd: softmax_scale must be finite and > 0, got ", softmax_scale);
  }
  if (!std::isfinite(softcap) || softcap < 0.f) {
    return invalid("flash_fwd: softcap must be finite and >= 0 (0 = off), got ", softcap);
  }
  if (window_left < -1) return invalid("flash_fwd: window_left must be >= -1, got ", window_left);
  if (window_right < -1) return invalid("flash_fwd: window_right must be >= -1, got ", window_right);

  const int bucket = head_dim_bucket(static_cast<int>(d));
  if (!kernel_compiled(bucket, *dtype)) {
    return invalid("flash_fwd: no kernel compiled for head-dim bucket ", bucket, " (head dim ", d,
                   ") and dtype ", dtype_name(*dtype),
                   "; rebuild with it in JAX_FA3_HEAD_DIMS / JAX_FA3_DTYPES");
  }

  FlashFwdParams params{};
  params.q = q.untyped_data();
  params.k = k.untyped_data();
  params.v = v.untyped_data();
  params.o = out->untyped_data();
  params.lse = lse->typed_data();
  params.b = static_cast<int>(b);
  params.s_q = static_cast<int>(s_q);
  params.s_k = static_cast<int>(s_k);
  params.h = static_cast<int>(h);
  params.h_k = static_cast<int>(h_k);
  params.d = static_cast<int>(d);
  params.dtype = *dtype;
  params.softmax_scale = softmax_scale;
  params.softcap = softcap;
  params.window_left = window_left;
  params.window_right = window_right;
  if (const cudaError_t err = ffi_util::poison_if_requested(stream, out, lse); err != cudaSuccess) {
    return ffi_util::from_cuda(err, "flash_fwd output poisoning (JAX_FA3_DEBUG_POISON_OUTPUTS)");
  }
  return ffi_util::from_cuda(launch_flash_fwd(params, stream), "flash_fwd kernel launch");
}

}  // namespace
}  // namespace jax_fa3

// Graph-capturable: no host synchronization, no allocation, no per-call host state (the TMA
// descriptors travel inside the kernel parameters).
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFa3FlashFwd, jax_fa3::flash_fwd_impl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Attr<float>("softmax_scale")
                                  .Attr<float>("softcap")
                                  .Attr<int32_t>("window_left")
                                  .Attr<int32_t>("window_right"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
