// XLA FFI handler for the FlashAttention-3 backward (jax_fa3_flash_bwd, docs/CONTRACTS.md):
// validates buffers and attributes, carves the workspace from the scratch allocator, dispatches
// to the compiled (head-dim bucket, dtype) instantiation.
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
using ffi_util::invalid;
using ffi_util::shape_str;
using flash_bwd::FlashBwdParams;

// The compiled (bucket, dtype) entry points (params.h), per bucket that kernels.cmake compiled.
#ifdef JAX_FA3_HAS_BF16
#define JAX_FA3_BF16_CASE(D) \
  if (dtype == DType::kBFloat16) return flash_bwd::run_flash_bwd_hdim##D##_bf16(p, stream);
#else
#define JAX_FA3_BF16_CASE(D)
#endif
#ifdef JAX_FA3_HAS_FP16
#define JAX_FA3_FP16_CASE(D) \
  if (dtype == DType::kFloat16) return flash_bwd::run_flash_bwd_hdim##D##_fp16(p, stream);
#else
#define JAX_FA3_FP16_CASE(D)
#endif
#define JAX_FA3_BUCKET_CASE(D) \
  case D: {                    \
    JAX_FA3_BF16_CASE(D)       \
    JAX_FA3_FP16_CASE(D)       \
    break;                     \
  }

// cudaErrorNotSupported when this (bucket, dtype) is not in the build (the handler checks
// kernel_compiled first to say so).
cudaError_t dispatch(int bucket, DType dtype, const FlashBwdParams& p, cudaStream_t stream) {
  switch (bucket) {
#ifdef JAX_FA3_HAS_HDIM64
    JAX_FA3_BUCKET_CASE(64)
#endif
#ifdef JAX_FA3_HAS_HDIM96
    JAX_FA3_BUCKET_CASE(96)
#endif
#ifdef JAX_FA3_HAS_HDIM128
    JAX_FA3_BUCKET_CASE(128)
#endif
#ifdef JAX_FA3_HAS_HDIM192
    JAX_FA3_BUCKET_CASE(192)
#endif
#ifdef JAX_FA3_HAS_HDIM256
    JAX_FA3_BUCKET_CASE(256)
#endif
    default: break;
  }
  return cudaErrorNotSupported;
}
#undef JAX_FA3_BUCKET_CASE
#undef JAX_FA3_FP16_CASE
#undef JAX_FA3_BF16_CASE

// key_ranges, key_covers: the masked variant's (common/key_ranges.h), else nullptr.
ffi::Error flash_bwd_impl(const char* op, cudaStream_t stream, ffi::AnyBuffer q,
                          ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer out,
                          ffi::AnyBuffer dout, ffi::AnyBuffer lse,
                          const ffi::AnyBuffer* key_ranges, const ffi::AnyBuffer* key_covers,
                          float softmax_scale, float softcap,
                          int32_t window_left, int32_t window_right, bool deterministic,
                          ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                          ffi::Result<ffi::AnyBuffer> dv, ffi::Result<ffi::AnyBuffer> workspace) {
  ffi_util::AttentionDims a{};
  DType dtype{};
  JAX_FA3_RETURN_IF_FFI_ERROR(ffi_util::read_16bit_attention(op, q, k, v, a, dtype));
  const auto qt = q.element_type();
  const std::initializer_list<int64_t> q_shape = {a.b, a.s_q, a.h, a.d};
  const std::initializer_list<int64_t> k_shape = {a.b, a.s_k, a.h_k, a.d};
  using ffi_util::check_buffer;
  JAX_FA3_RETURN_IF_FFI_ERROR(check_buffer(op, "out", out, qt, "q's shape", q_shape));
  JAX_FA3_RETURN_IF_FFI_ERROR(check_buffer(op, "dout", dout, qt, "q's shape", q_shape));
  JAX_FA3_RETURN_IF_FFI_ERROR(
      check_buffer(op, "lse", lse, ffi::DataType::F32, "shape (b, h, s_q) =", {a.b, a.h, a.s_q}));
  JAX_FA3_RETURN_IF_FFI_ERROR(ffi_util::check_attention_scalars(op, softmax_scale, softcap,
                                                                window_left, window_right));
  if (key_ranges != nullptr) {
    JAX_FA3_RETURN_IF_FFI_ERROR(
        ffi_util::check_key_ranges(op, *key_ranges, *key_covers, a.b, a.s_q));
  }
  // Grids: main kernel (key blocks, h_k, b), postprocess (query blocks, h, b); h_k <= h.
  if (a.b > 65535 || a.h > 65535) {
    return invalid(op, ": batch and heads must be at most 65535 (CUDA grid y/z), got q ",
                   shape_str(q.dimensions()));
  }
  JAX_FA3_RETURN_IF_FFI_ERROR(check_buffer(op, "result dq", *dq, qt, "q's shape", q_shape));
  JAX_FA3_RETURN_IF_FFI_ERROR(check_buffer(op, "result dk", *dk, qt, "k's shape", k_shape));
  JAX_FA3_RETURN_IF_FFI_ERROR(check_buffer(op, "result dv", *dv, qt, "k's shape", k_shape));

  const int bucket = head_dim_bucket(static_cast<int>(a.d));
  FlashBwdParams p{};
  p.q = q.untyped_data();
  p.k = k.untyped_data();
  p.v = v.untyped_data();
  p.out = out.untyped_data();
  p.dout = dout.untyped_data();
  p.lse = static_cast<const float*>(lse.untyped_data());
  p.dq = dq->untyped_data();
  p.dk = dk->untyped_data();
  p.dv = dv->untyped_data();
  ffi_util::set_dims(p, a);
  p.softmax_scale = softmax_scale;
  p.softcap = softcap;
  // The same clamp as the forward's make_scalars (common/window.h): the backward's block ranges
  // (block_range.h) compute in int32 too.
  p.window_left = ffi_util::unbounded_past_reach(window_left, a);
  p.window_right = ffi_util::unbounded_past_reach(window_right, a);
  p.deterministic = deterministic;
  p.dtype = dtype;
  if (key_ranges != nullptr) {
    p.key_ranges = static_cast<const int*>(key_ranges->untyped_data());
    p.key_covers = static_cast<const int*>(key_covers->untyped_data());
  }

  if (a.b > 0 && a.h > 0 && a.s_q > 0 && a.s_k > 0) {
    JAX_FA3_RETURN_IF_FFI_ERROR(ffi_util::carve_bwd_workspace(
        op, "jax_fa3_flash_bwd_workspace_bytes",
        flash_bwd::workspace_layout(a.b, a.h, a.s_q, a.d, flash_bwd::block_m_for_call(p),
                                    deterministic),
        *workspace,
        dq->untyped_data(), p));
  }

  if (!kernel_compiled(bucket, dtype)) {
    return invalid(op, ": no kernel compiled for head_dim ", a.d, " (bucket ", bucket,
                   ") and dtype ", dtype_name(dtype), "; this build has ", jax_fa3_build_config(),
                   " (rebuild with JAX_FA3_HEAD_DIMS / JAX_FA3_DTYPES including it)");
  }
  return ffi_util::poison_and_launch(
      op, stream, [&] { return dispatch(bucket, dtype, p, stream); }, dq, dk, dv);
}

ffi::Error flash_bwd_whole(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k,
                           ffi::AnyBuffer v, ffi::AnyBuffer out, ffi::AnyBuffer dout,
                           ffi::AnyBuffer lse, float softmax_scale, float softcap,
                           int32_t window_left, int32_t window_right, bool deterministic,
                           ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                           ffi::Result<ffi::AnyBuffer> dv, ffi::Result<ffi::AnyBuffer> workspace) {
  return flash_bwd_impl("flash_bwd", stream, q, k, v, out, dout, lse, nullptr, nullptr,
                        softmax_scale, softcap, window_left, window_right, deterministic, dq, dk,
                        dv, workspace);
}

// The ranges replace the window: the window attributes are checked, not used.
ffi::Error flash_bwd_key_ranges(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k,
                                ffi::AnyBuffer v, ffi::AnyBuffer out, ffi::AnyBuffer dout,
                                ffi::AnyBuffer lse, ffi::AnyBuffer key_ranges,
                                ffi::AnyBuffer key_covers, float softmax_scale, float softcap,
                                int32_t window_left, int32_t window_right, bool deterministic,
                                ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                                ffi::Result<ffi::AnyBuffer> dv,
                                ffi::Result<ffi::AnyBuffer> workspace) {
  return flash_bwd_impl("flash_bwd_key_ranges", stream, q, k, v, out, dout, lse, &key_ranges,
                        &key_covers, softmax_scale, softcap, window_left, window_right,
                        deterministic, dq, dk, dv, workspace);
}

}  // namespace
}  // namespace jax_fa3

extern "C" size_t jax_fa3_flash_bwd_workspace_bytes(int64_t b, int64_t h, int64_t s_q, int64_t d,
                                                    bool deterministic) {
  return jax_fa3::flash_bwd::workspace_bytes_any_block_m(b, h, s_q, d, deterministic);
}

namespace jax_fa3 {
namespace {

// Both backward handlers bind q, k, v, out, dout, lse (the masked one then key_ranges and
// key_covers: common/key_ranges.h), then these attributes and results.
template <class Binding>
auto bind_bwd_attrs_and_results(Binding inputs) {
  return std::move(inputs).template Attr<float>("softmax_scale")
      .template Attr<float>("softcap")
      .template Attr<int32_t>("window_left")
      .template Attr<int32_t>("window_right")
      .template Attr<bool>("deterministic")
      .template Ret<ffi::AnyBuffer>()   // dq
      .template Ret<ffi::AnyBuffer>()   // dk
      .template Ret<ffi::AnyBuffer>()   // dv
      .template Ret<ffi::AnyBuffer>();  // workspace (uint8)
}

auto bind_bwd_inputs() {
  using ffi::AnyBuffer;
  return ffi_util::bind_on_stream()
      .Arg<AnyBuffer>()    // q
      .Arg<AnyBuffer>()    // k
      .Arg<AnyBuffer>()    // v
      .Arg<AnyBuffer>()    // out
      .Arg<AnyBuffer>()    // dout
      .Arg<AnyBuffer>();   // lse
}

}  // namespace
}  // namespace jax_fa3

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFa3FlashBwd, jax_fa3::flash_bwd_whole,
                              jax_fa3::bind_bwd_attrs_and_results(jax_fa3::bind_bwd_inputs()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxFa3FlashBwdKeyRanges, jax_fa3::flash_bwd_key_ranges,
    jax_fa3::bind_bwd_attrs_and_results(
        jax_fa3::bind_bwd_inputs().Arg<xla::ffi::AnyBuffer>().Arg<xla::ffi::AnyBuffer>()));
