// XLA FFI handler for the fp8 (e4m3) backward (jax_fa3_flash_bwd_fp8; caller:
// jax_fa3/_fp8_backward.py, numerics: jax_fa3/_fp8_backward_emulation.py). Validates every
// buffer and attribute (errors name the argument), carves the workspace, dispatches to the
// compiled (head-dim bucket, 16-bit dtype) instantiation.
#include <cstdint>
#include <utility>

#include "ffi/attention_dims.h"
#include "ffi/bwd_workspace.h"
#include "ffi/ffi_common.h"
#include "ffi/handlers.h"
#include "ffi/registry.h"
#include "flash_bwd/params.h"

namespace jax_fa3 {
namespace {

namespace ffi = xla::ffi;
using ffi::AnyBuffer;
using ffi_util::check_buffer;
using ffi_util::invalid;
using flash_bwd::FlashBwdFp8Params;

constexpr const char* kOp = "flash_bwd_fp8";

// cudaErrorNotSupported when this bucket is not in the build (the handler checks first).
cudaError_t dispatch(int bucket, DType dtype, const FlashBwdFp8Params& p, cudaStream_t stream) {
  const bool bf16 = dtype == DType::kBFloat16;
  switch (bucket) {
#ifdef JAX_FA3_HAS_HDIM64
    case 64:
      return bf16 ? flash_bwd::run_flash_bwd_fp8_hdim64_bf16(p, stream)
                  : flash_bwd::run_flash_bwd_fp8_hdim64_fp16(p, stream);
#endif
#ifdef JAX_FA3_HAS_HDIM128
    case 128:
      return bf16 ? flash_bwd::run_flash_bwd_fp8_hdim128_bf16(p, stream)
                  : flash_bwd::run_flash_bwd_fp8_hdim128_fp16(p, stream);
#endif
    default: return cudaErrorNotSupported;
  }
}

// The head dims this build runs, for the error message.
const char* compiled_fp8_backward_buckets() {
  return ""
#ifdef JAX_FA3_HAS_HDIM64
         "64 "
#endif
#ifdef JAX_FA3_HAS_HDIM128
         "128 "
#endif
      ;
}

// Arguments: jax_fa3/_fp8_backward.py (kernel_operands) and flash_bwd/params.h
// (FlashBwdFp8Params) say what each holds.
ffi::Error flash_bwd_fp8_impl(cudaStream_t stream, AnyBuffer q8, AnyBuffer q8_t, AnyBuffer k8,
                              AnyBuffer k, AnyBuffer v, AnyBuffer dout, AnyBuffer dout8_t,
                              AnyBuffer lse_log2, AnyBuffer delta, AnyBuffer q_scale,
                              AnyBuffer dk_coef, AnyBuffer dq_scale, AnyBuffer k_scale,
                              AnyBuffer dv_scale, float softmax_scale, int32_t window_left,
                              int32_t window_right, bool deterministic,
                              ffi::Result<AnyBuffer> dq, ffi::Result<AnyBuffer> dk,
                              ffi::Result<AnyBuffer> dv, ffi::Result<AnyBuffer> workspace) {
  constexpr auto kE4M3 = ffi::DataType::F8E4M3FN;
  constexpr auto kF32 = ffi::DataType::F32;
  JAX_FA3_RETURN_IF_FFI_ERROR(ffi_util::check_dtype(kOp, "q8", q8.element_type(), kE4M3));
  JAX_FA3_RETURN_IF_FFI_ERROR(ffi_util::check_dtype(kOp, "k8", k8.element_type(), kE4M3));
  ffi_util::AttentionDims a{};
  JAX_FA3_RETURN_IF_FFI_ERROR(ffi_util::read_attention_dims(kOp, q8, k8, a));
  const auto t = ffi_util::to_dtype(k.element_type());
  if (!t || (*t != DType::kBFloat16 && *t != DType::kFloat16)) {
    return invalid(kOp, ": k (k8 dequantized) must be bfloat16 or float16, got ",
                   ffi_util::dtype_label(k.element_type()));
  }
  const DType dtype = *t;
  const auto t16 = k.element_type();
  const std::initializer_list<int64_t> q_shape = {a.b, a.s_q, a.h, a.d};
  const std::initializer_list<int64_t> k_shape = {a.b, a.s_k, a.h_k, a.d};
  JAX_FA3_RETURN_IF_FFI_ERROR(check_buffer(kOp, "k", k, t16, "k8's shape", k_shape));
  JAX_FA3_RETURN_IF_FFI_ERROR(check_buffer(kOp, "v", v, t16, "k8's shape", k_shape));
  JAX_FA3_RETURN_IF_FFI_ERROR(check_buffer(kOp, "dout", dout, t16, "q8's shape", q_shape));

  // d is bounded before the narrowing cast (a 64-bit d past INT_MAX must not wrap to a bucket).
  const int bucket = a.d > 0 && a.d <= 256 ? flash_bwd::fp8_bwd_head_dim_bucket(int(a.d)) : 0;
  if (bucket == 0) {
    return invalid(kOp, ": no fp8 backward kernel for head dim ", a.d,
                   " (needs a multiple of 16 up to a compiled bucket of 64/128; this build has ",
                   compiled_fp8_backward_buckets(), "of those)");
  }
  const int64_t s_t = (a.s_q + 31) / 32 * 32;
  const int64_t block_m = flash_bwd::block_m_for_bucket(bucket);
  const int64_t s_q_pad = (a.s_q + block_m - 1) / block_m * block_m;
  JAX_FA3_RETURN_IF_FFI_ERROR(check_buffer(kOp, "q8_t", q8_t, kE4M3,
                                           "shape (b, h, d, s_q rounded up to 32) =",
                                           {a.b, a.h, a.d, s_t}));
  JAX_FA3_RETURN_IF_FFI_ERROR(check_buffer(kOp, "dout8_t", dout8_t, kE4M3,
                                           "shape (b, h, d, s_q rounded up to 32) =",
                                           {a.b, a.h, a.d, s_t}));
  const char* rows_padded = block_m == 128 ? "shape (b, h, s_q rounded up to 128) ="
                                           : "shape (b, h, s_q rounded up to 64) =";
  for (auto [name, buf] : {std::pair<const char*, AnyBuffer*>{"lse_log2", &lse_log2},
                           {"delta", &delta}, {"q_scale", &q_scale}, {"dk_coef", &dk_coef}}) {
    JAX_FA3_RETURN_IF_FFI_ERROR(
        check_buffer(kOp, name, *buf, kF32, rows_padded, {a.b, a.h, s_q_pad}));
  }
  JAX_FA3_RETURN_IF_FFI_ERROR(
      check_buffer(kOp, "dq_scale", dq_scale, kF32, "shape (b, h, s_q) =", {a.b, a.h, a.s_q}));
  JAX_FA3_RETURN_IF_FFI_ERROR(check_buffer(kOp, "k_scale", k_scale, kF32,
                                           "shape (b, h_k, s_k) =", {a.b, a.h_k, a.s_k}));
  JAX_FA3_RETURN_IF_FFI_ERROR(
      check_buffer(kOp, "dv_scale", dv_scale, kF32, "shape (b, h_k) =", {a.b, a.h_k}));
  JAX_FA3_RETURN_IF_FFI_ERROR(
      ffi_util::check_attention_scalars(kOp, softmax_scale, 0.f, window_left, window_right));
  // Grids: main kernel (key blocks, h_k, b), postprocess (query blocks, h, b); h_k <= h.
  if (a.b > 65535 || a.h > 65535) {
    return invalid(kOp, ": batch and heads must be at most 65535 (CUDA grid y/z), got q8 ",
                   ffi_util::shape_str(q8.dimensions()));
  }
  JAX_FA3_RETURN_IF_FFI_ERROR(check_buffer(kOp, "result dq", *dq, kF32, "q8's shape", q_shape));
  JAX_FA3_RETURN_IF_FFI_ERROR(check_buffer(kOp, "result dk", *dk, kF32, "k8's shape", k_shape));
  JAX_FA3_RETURN_IF_FFI_ERROR(check_buffer(kOp, "result dv", *dv, kF32, "k8's shape", k_shape));

  FlashBwdFp8Params p{};
  p.q = q8.untyped_data();
  p.k = k.untyped_data();
  p.v = v.untyped_data();
  p.dout = dout.untyped_data();
  p.dq = dq->untyped_data();
  p.dk = dk->untyped_data();
  p.dv = dv->untyped_data();
  ffi_util::set_dims(p, a);
  p.softmax_scale = softmax_scale;
  p.softcap = 0.f;
  // The same clamp as the 16-bit handlers (block ranges compute in int32).
  p.window_left = ffi_util::unbounded_past_reach(window_left, a);
  p.window_right = ffi_util::unbounded_past_reach(window_right, a);
  p.deterministic = deterministic;
  p.dtype = dtype;
  p.lse_log2 = static_cast<float*>(lse_log2.untyped_data());
  p.dpsum = static_cast<float*>(delta.untyped_data());
  p.k8 = k8.untyped_data();
  p.q_t = q8_t.untyped_data();
  p.dout_t = dout8_t.untyped_data();
  p.q_scale = static_cast<const float*>(q_scale.untyped_data());
  p.dk_coef = static_cast<const float*>(dk_coef.untyped_data());
  p.dq_scale = static_cast<const float*>(dq_scale.untyped_data());
  p.k_scale = static_cast<const float*>(k_scale.untyped_data());
  p.dv_scale = static_cast<const float*>(dv_scale.untyped_data());
  if (a.b > 0 && a.h > 0 && a.s_q > 0 && a.s_k > 0) {
    JAX_FA3_RETURN_IF_FFI_ERROR(ffi_util::carve_bwd_workspace(
        kOp, "jax_fa3_flash_bwd_fp8_workspace_bytes",
        flash_bwd::fp8_workspace_layout(a.b, a.h, a.s_q, a.d, deterministic), *workspace,
        dq->untyped_data(), p));
  }
  return ffi_util::poison_and_launch(
      kOp, stream, [&] { return dispatch(bucket, dtype, p, stream); }, dq, dk, dv);
}

}  // namespace
}  // namespace jax_fa3

extern "C" size_t jax_fa3_flash_bwd_fp8_workspace_bytes(int64_t b, int64_t h, int64_t s_q,
                                                        int64_t d, bool deterministic) {
  return jax_fa3::flash_bwd::fp8_workspace_layout(b, h, s_q, d, deterministic).total;
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFa3FlashBwdFp8, jax_fa3::flash_bwd_fp8_impl,
                              jax_fa3::ffi_util::bind_on_stream()
                                  .Arg<xla::ffi::AnyBuffer>()   // q8
                                  .Arg<xla::ffi::AnyBuffer>()   // q8_t
                                  .Arg<xla::ffi::AnyBuffer>()   // k8
                                  .Arg<xla::ffi::AnyBuffer>()   // k (k8 dequantized, 16-bit)
                                  .Arg<xla::ffi::AnyBuffer>()   // v
                                  .Arg<xla::ffi::AnyBuffer>()   // dout
                                  .Arg<xla::ffi::AnyBuffer>()   // dout8_t
                                  .Arg<xla::ffi::AnyBuffer>()   // lse_log2
                                  .Arg<xla::ffi::AnyBuffer>()   // delta
                                  .Arg<xla::ffi::AnyBuffer>()   // q_scale
                                  .Arg<xla::ffi::AnyBuffer>()   // dk_coef
                                  .Arg<xla::ffi::AnyBuffer>()   // dq_scale
                                  .Arg<xla::ffi::AnyBuffer>()   // k_scale
                                  .Arg<xla::ffi::AnyBuffer>()   // dv_scale
                                  .Attr<float>("softmax_scale")
                                  .Attr<int32_t>("window_left")
                                  .Attr<int32_t>("window_right")
                                  .Attr<bool>("deterministic")
                                  .Ret<xla::ffi::AnyBuffer>()   // dq f32
                                  .Ret<xla::ffi::AnyBuffer>()   // dk f32
                                  .Ret<xla::ffi::AnyBuffer>()   // dv f32
                                  .Ret<xla::ffi::AnyBuffer>());  // workspace uint8 (discarded)
