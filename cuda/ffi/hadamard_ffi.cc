// XLA FFI handler for jax_fa3.hadamard_transform.
#include "ffi/ffi_common.h"
#include "ffi/handlers.h"
#include "hadamard/hadamard.h"

namespace jax_fa3 {
namespace {

namespace ffi = xla::ffi;
using ffi_util::invalid;
using ffi_util::shape_str;

ffi::Error hadamard_impl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> signs,
                         bool apply_signs, bool signs_after, ffi::Result<ffi::AnyBuffer> y) {
  const auto dims = x.dimensions();
  if (dims.size() < 1) return invalid("hadamard_transform: x must have rank >= 1, got a scalar");
  const int64_t d = dims.back();
  if (d < 1 || d > kHadamardMaxDim) {
    return invalid("hadamard_transform: last axis of x must be in [1, ", kHadamardMaxDim,
                   "], got ", d);
  }
  const auto dtype = ffi_util::to_dtype(x.element_type());
  if (!dtype || *dtype == DType::kFloat8E4M3) {
    return invalid("hadamard_transform: x must be float32, bfloat16 or float16");
  }
  if (y->element_count() != x.element_count()) {
    return invalid("hadamard_transform: output must match x in shape ", shape_str(dims));
  }
  const auto out_dtype = ffi_util::to_dtype(y->element_type());
  const bool narrowing = *dtype == DType::kFloat32 && out_dtype &&
                         (*out_dtype == DType::kBFloat16 || *out_dtype == DType::kFloat16);
  if (y->element_type() != x.element_type() && !narrowing) {
    return invalid("hadamard_transform: output dtype must be x's, or bfloat16 / float16 for a "
                   "float32 x");
  }
  if (apply_signs) {
    JAX_FA3_RETURN_IF_FFI_ERROR(
        ffi_util::check_shape("hadamard_transform", "signs", "shape", signs.dimensions(), {d}));
  }
  HadamardParams params{x.untyped_data(), apply_signs ? signs.typed_data() : nullptr,
                        signs_after, y->untyped_data(), static_cast<int64_t>(x.element_count() / d),
                        static_cast<int>(d), *dtype, *out_dtype};
  return ffi_util::poison_and_launch(
      "hadamard_transform", stream, [&] { return launch_hadamard(params, stream); }, y);
}

}  // namespace
}  // namespace jax_fa3

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFa3Hadamard, jax_fa3::hadamard_impl,
                              jax_fa3::ffi_util::bind_on_stream()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Attr<bool>("apply_signs")
                                  .Attr<bool>("signs_after")
                                  .Ret<xla::ffi::AnyBuffer>(),
                              {xla::ffi::Traits::kCmdBufferCompatible});
