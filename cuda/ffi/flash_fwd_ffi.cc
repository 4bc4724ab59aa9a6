// XLA FFI handler for the FlashAttention-3 forward kernel (target "jax_fa3_flash_fwd").
// Validates every argument again (Python already did) and dispatches to the compiled bucket.
#include <cstdint>
#include <utility>

#include "ffi/attention_dims.h"
#include "ffi/ffi_common.h"
#include "ffi/handlers.h"
#include "flash_fwd/dispatch.h"

namespace jax_fa3 {
namespace {

namespace ffi = xla::ffi;
using ffi_util::invalid;

// key_ranges, key_covers: the masked variant's (common/key_ranges.h), else nullptr.
ffi::Error flash_fwd_impl(const char* op, cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k,
                          ffi::AnyBuffer v, const ffi::AnyBuffer* key_ranges,
                          const ffi::AnyBuffer* key_covers,
                          ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Buffer<ffi::F32>> lse,
                          float softmax_scale, float softcap, int32_t window_left,
                          int32_t window_right) {
  ffi_util::AttentionDims a{};
  DType dtype{};
  JAX_FA3_RETURN_IF_FFI_ERROR(ffi_util::read_16bit_attention(op, q, k, v, a, dtype));
  const auto qt = q.element_type();
  JAX_FA3_RETURN_IF_FFI_ERROR(ffi_util::check_buffer(op, "out", *out, qt, "q's shape",
                                                     {a.b, a.s_q, a.h, a.d}));
  JAX_FA3_RETURN_IF_FFI_ERROR(ffi_util::check_shape(op, "lse", "shape (b, h, s_q) =",
                                                    lse->dimensions(), {a.b, a.h, a.s_q}));
  JAX_FA3_RETURN_IF_FFI_ERROR(ffi_util::check_attention_scalars(op, softmax_scale, softcap,
                                                                window_left, window_right));
  if (key_ranges != nullptr) {
    JAX_FA3_RETURN_IF_FFI_ERROR(
        ffi_util::check_key_ranges(op, *key_ranges, *key_covers, a.b, a.s_q));
  }

  const int bucket = head_dim_bucket(static_cast<int>(a.d));
  if (!kernel_compiled(bucket, dtype)) {
    return invalid(op, ": no kernel compiled for head-dim bucket ", bucket, " (head dim ", a.d,
                   ") and dtype ", dtype_name(dtype),
                   "; rebuild with it in JAX_FA3_HEAD_DIMS / JAX_FA3_DTYPES");
  }

  FlashFwdParams params{};
  params.q = q.untyped_data();
  params.k = k.untyped_data();
  params.v = v.untyped_data();
  params.o = out->untyped_data();
  params.lse = lse->typed_data();
  ffi_util::set_dims(params, a);
  params.dtype = dtype;
  params.softmax_scale = softmax_scale;
  params.softcap = softcap;
  params.window_left = window_left;
  params.window_right = window_right;
  if (key_ranges != nullptr) {
    params.key_ranges = static_cast<const int*>(key_ranges->untyped_data());
    params.key_covers = static_cast<const int*>(key_covers->untyped_data());
  }
  return ffi_util::poison_and_launch(
      op, stream, [&] { return launch_flash_fwd(params, stream); }, out, lse);
}

ffi::Error flash_fwd_whole(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k,
                           ffi::AnyBuffer v, ffi::Result<ffi::AnyBuffer> out,
                           ffi::Result<ffi::Buffer<ffi::F32>> lse, float softmax_scale,
                           float softcap, int32_t window_left, int32_t window_right) {
  return flash_fwd_impl("flash_fwd", stream, q, k, v, nullptr, nullptr, out, lse, softmax_scale,
                        softcap, window_left, window_right);
}

// The ranges replace the window: the window attributes are checked, not used.
ffi::Error flash_fwd_key_ranges(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k,
                                ffi::AnyBuffer v, ffi::AnyBuffer key_ranges,
                                ffi::AnyBuffer key_covers, ffi::Result<ffi::AnyBuffer> out,
                                ffi::Result<ffi::Buffer<ffi::F32>> lse, float softmax_scale,
                                float softcap, int32_t window_left, int32_t window_right) {
  return flash_fwd_impl("flash_fwd_key_ranges", stream, q, k, v, &key_ranges, &key_covers, out,
                        lse, softmax_scale, softcap, window_left, window_right);
}

}  // namespace
}  // namespace jax_fa3

namespace jax_fa3 {
namespace {

// Both forward handlers bind q, k, v (the masked one then key_ranges and key_covers:
// common/key_ranges.h), then these results and attributes.
template <class Binding>
auto bind_fwd_results_and_attrs(Binding inputs) {
  return std::move(inputs).template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::Buffer<ffi::F32>>()
      .template Attr<float>("softmax_scale")
      .template Attr<float>("softcap")
      .template Attr<int32_t>("window_left")
      .template Attr<int32_t>("window_right");
}

auto bind_qkv() {
  using ffi::AnyBuffer;
  return ffi_util::bind_on_stream().Arg<AnyBuffer>().Arg<AnyBuffer>().Arg<AnyBuffer>();
}

}  // namespace
}  // namespace jax_fa3

// Graph-capturable: no host synchronization, no allocation, no per-call host state (the TMA
// descriptors travel inside the kernel parameters).
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFa3FlashFwd, jax_fa3::flash_fwd_whole,
                              jax_fa3::bind_fwd_results_and_attrs(jax_fa3::bind_qkv()),
                              {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxFa3FlashFwdKeyRanges, jax_fa3::flash_fwd_key_ranges,
    jax_fa3::bind_fwd_results_and_attrs(
        jax_fa3::bind_qkv().Arg<xla::ffi::AnyBuffer>().Arg<xla::ffi::AnyBuffer>()),
    {xla::ffi::Traits::kCmdBufferCompatible});
