// XLA FFI handler for the fp8 (e4m3) forward kernel (target "jax_fa3_flash_fwd_fp8").
// Contract: docs/CONTRACTS.md; caller: jax_fa3/_fp8_forward.py (kernel_forward). Validates every buffer and
// attribute (errors name the argument), then runs the V transpose pre-pass (or, when V arrives
// transposed, only the k scale expansion) and the kernel.
#include <cstdint>

#include "ffi/attention_dims.h"
#include "ffi/ffi_common.h"
#include "ffi/handlers.h"
#include "ffi/registry.h"
#include "flash_fwd/fp8/flash_fwd_fp8.h"

namespace jax_fa3 {
namespace {

namespace ffi = xla::ffi;
using ffi_util::invalid;
using ffi_util::shape_str;

ffi::Error flash_fwd_fp8_impl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k,
                              ffi::AnyBuffer v, ffi::AnyBuffer q_scale, ffi::AnyBuffer k_scale,
                              ffi::AnyBuffer v_scale, ffi::AnyBuffer v_mean,
                              ffi::Result<ffi::AnyBuffer> out,
                              ffi::Result<ffi::AnyBuffer> lse,
                              ffi::Result<ffi::AnyBuffer> workspace, float softmax_scale,
                              int32_t window_left, int32_t window_right, int32_t block_size,
                              bool v_transposed) {
  constexpr const char* kOp = "flash_fwd_fp8";
  constexpr auto kE4M3 = ffi::DataType::F8E4M3FN;
  constexpr auto kF32 = ffi::DataType::F32;
  using ffi_util::check_buffer;
  JAX_FA3_RETURN_IF_FFI_ERROR(ffi_util::check_dtype(kOp, "q", q.element_type(), kE4M3));
  JAX_FA3_RETURN_IF_FFI_ERROR(ffi_util::check_dtype(kOp, "k", k.element_type(), kE4M3));
  JAX_FA3_RETURN_IF_FFI_ERROR(ffi_util::check_dtype(kOp, "v", v.element_type(), kE4M3));
  ffi_util::AttentionDims a{};
  JAX_FA3_RETURN_IF_FFI_ERROR(ffi_util::read_attention_dims(kOp, q, k, a));
  const int64_t s_pad = flash_fwd_fp8_key_pad(a.s_k);
  if (v_transposed && !ffi_util::dims_equal(v.dimensions(), {a.b, a.h_k, a.d, s_pad})) {
    return invalid(kOp, ": v_transposed: v must be (b, h_k, d, s_k rounded up to 32) = (", a.b,
                   ", ", a.h_k, ", ", a.d, ", ", s_pad, "), got ", shape_str(v.dimensions()));
  }
  if (!v_transposed) {
    JAX_FA3_RETURN_IF_FFI_ERROR(ffi_util::check_shape(kOp, "v", "k's shape", v.dimensions(),
                                                      {a.b, a.s_k, a.h_k, a.d}));
  }
  if (block_size < 1) return invalid(kOp, ": block_size must be >= 1, got ", block_size);
  JAX_FA3_RETURN_IF_FFI_ERROR(
      ffi_util::check_attention_scalars(kOp, softmax_scale, 0.f, window_left, window_right));

  const int64_t nq = (a.s_q + block_size - 1) / block_size;
  const int64_t nk = (a.s_k + block_size - 1) / block_size;
  JAX_FA3_RETURN_IF_FFI_ERROR(check_buffer(kOp, "q_scale", q_scale, kF32,
                                           "shape (b, h, ceil(s_q / block_size)) =",
                                           {a.b, a.h, nq}));
  JAX_FA3_RETURN_IF_FFI_ERROR(check_buffer(kOp, "k_scale", k_scale, kF32,
                                           "shape (b, h_k, ceil(s_k / block_size)) =",
                                           {a.b, a.h_k, nk}));
  JAX_FA3_RETURN_IF_FFI_ERROR(
      check_buffer(kOp, "v_scale", v_scale, kF32, "shape (b, h_k) =", {a.b, a.h_k}));
  JAX_FA3_RETURN_IF_FFI_ERROR(
      check_buffer(kOp, "v_mean", v_mean, kF32, "shape (b, h_k, d) =", {a.b, a.h_k, a.d}));
  JAX_FA3_RETURN_IF_FFI_ERROR(check_buffer(kOp, "out", *out, ffi::DataType::BF16, "q's shape",
                                           {a.b, a.s_q, a.h, a.d}));
  JAX_FA3_RETURN_IF_FFI_ERROR(
      check_buffer(kOp, "lse", *lse, kF32, "shape (b, h, s_q) =", {a.b, a.h, a.s_q}));
  const bool masked = window_left >= 0 || window_right >= 0;
  const size_t ws_bytes =
      flash_fwd_fp8_workspace_bytes(a.b, a.s_q, a.s_k, a.h, a.h_k, a.d, masked, v_transposed);
  if (workspace->element_type() != ffi::DataType::U8 || workspace->dimensions().size() != 1 ||
      workspace->size_bytes() < ws_bytes) {
    return invalid(kOp, ": workspace must be a uint8 vector of at least ", ws_bytes,
                   " bytes (", v_transposed ? "b*h_k*s_pad*4" : "b*h_k*s_pad*(d+4)",
                   " with s_pad = s_k rounded up to 32, plus the tail split's slots: "
                   "flash_fwd_fp8_workspace_bytes), got shape ",
                   shape_str(workspace->dimensions()));
  }

  // After the shape checks, so a malformed call is reported as such first.
  // d is bounded before the narrowing cast (a 64-bit d past INT_MAX must not wrap to a bucket).
  const int bucket = a.d > 0 && a.d <= 256 ? fp8_head_dim_bucket(static_cast<int>(a.d)) : 0;
  if (bucket == 0) {
    return invalid(kOp, ": no fp8 kernel for head dim ", a.d,
                   " (needs a multiple of 16 up to a compiled bucket of 64/128/256; this build "
                   "has JAX_FA3_HEAD_DIMS with ",
#ifdef JAX_FA3_HAS_HDIM64
                   "64 ",
#endif
#ifdef JAX_FA3_HAS_HDIM128
                   "128 ",
#endif
#ifdef JAX_FA3_HAS_HDIM256
                   "256 ",
#endif
                   "of those)");
  }

  // The V transpose pre-pass walks its tiles (128 keys x 128 dims of each (batch, kv head)) with
  // an int32 index plus the grid size (flash_fwd/fp8/launch.h, fp8/vt.h); double: the product of these
  // sizes may not fit in int64.
  if (double(a.b) * double(a.h_k) * double((s_pad + 127) / 128) * double((a.d + 127) / 128) >
      double(int64_t(1) << 30)) {
    return invalid(kOp, ": b * h_k * ceil(s_k / 128) * ceil(d / 128) (the V transpose's tiles) "
                   "must be at most 2^30, got q ", shape_str(q.dimensions()), " and k ",
                   shape_str(k.dimensions()));
  }

  FlashFwdFp8Params params{};
  params.q = q.untyped_data();
  params.k = k.untyped_data();
  params.v = v.untyped_data();
  params.q_scale = static_cast<const float*>(q_scale.untyped_data());
  params.k_scale = static_cast<const float*>(k_scale.untyped_data());
  params.v_scale = static_cast<const float*>(v_scale.untyped_data());
  params.v_mean = static_cast<const float*>(v_mean.untyped_data());
  params.o = out->untyped_data();
  params.lse = static_cast<float*>(lse->untyped_data());
  params.workspace = workspace->untyped_data();
  params.v_transposed = v_transposed;
  ffi_util::set_dims(params, a);
  params.block_size = block_size;
  params.softmax_scale = softmax_scale;
  params.window_left = window_left;
  params.window_right = window_right;
  // JAX_FA3_FP8_TAIL_SPLIT=0 runs the last round's tiles whole (for timing the split's gain;
  // the outputs then differ only in the order the fp8 tensor cores accumulate O).
  params.tail_split = !ffi_util::env_flag_is_zero("JAX_FA3_FP8_TAIL_SPLIT");
  // The workspace is poisoned too: the kernel must not depend on what a previous op left in
  // XLA's scratch (the tail split's tickets are cleared by its pre-kernel, flash_fwd/fp8/tail_split.h).
  return ffi_util::poison_and_launch(
      kOp, stream, [&] { return launch_flash_fwd_fp8(params, stream); }, out, lse, workspace);
}

}  // namespace
}  // namespace jax_fa3

extern "C" size_t jax_fa3_flash_fwd_fp8_workspace_bytes(int64_t b, int64_t s_q, int64_t s_k,
                                                        int64_t h, int64_t h_k, int64_t d,
                                                        bool masked, bool v_transposed) {
  return jax_fa3::flash_fwd_fp8_workspace_bytes(b, s_q, s_k, h, h_k, d, masked, v_transposed);
}

// Graph-capturable: no host synchronization, no allocation, no per-call host state.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFa3FlashFwdFp8, jax_fa3::flash_fwd_fp8_impl,
                              jax_fa3::ffi_util::bind_on_stream()
                                  .Arg<xla::ffi::AnyBuffer>()   // q8
                                  .Arg<xla::ffi::AnyBuffer>()   // k8
                                  .Arg<xla::ffi::AnyBuffer>()   // v8
                                  .Arg<xla::ffi::AnyBuffer>()   // q_scale
                                  .Arg<xla::ffi::AnyBuffer>()   // k_scale
                                  .Arg<xla::ffi::AnyBuffer>()   // v_scale
                                  .Arg<xla::ffi::AnyBuffer>()   // v_mean
                                  .Ret<xla::ffi::AnyBuffer>()   // out bf16
                                  .Ret<xla::ffi::AnyBuffer>()   // lse f32
                                  .Ret<xla::ffi::AnyBuffer>()   // workspace uint8 (discarded)
                                  .Attr<float>("softmax_scale")
                                  .Attr<int32_t>("window_left")
                                  .Attr<int32_t>("window_right")
                                  .Attr<int32_t>("block_size")
                                  .Attr<bool>("v_transposed"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
