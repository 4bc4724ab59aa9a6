// XLA FFI handler for the fused rotate + quantize pass of jax_fa3.fp8 (quantize/rotate_quantize.h).
#include "ffi/ffi_common.h"
#include "ffi/handlers.h"
#include "flash_fwd/fp8/flash_fwd_fp8.h"
#include "quantize/rotate_quantize.h"

namespace jax_fa3 {
namespace {

namespace ffi = xla::ffi;
using ffi_util::invalid;
using ffi_util::shape_str;

// mean: (b, h, d) to subtract before quantizing (v's centring), or an empty array for none.
// centre: the pass takes each head's mean itself (one block per head, mean empty, no rotation),
// writes it to mean_out (b, h, d) and subtracts it; workspace:
// rotate_quantize_centre_workspace_floats floats. Without centre both are empty arrays.
ffi::Error rotate_quantize_impl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> signs,
                                ffi::Buffer<ffi::F32> mean, bool rotate, int32_t block_size,
                                bool keys_transposed, bool centre,
                                ffi::Result<ffi::AnyBuffer> values,
                                ffi::Result<ffi::Buffer<ffi::F32>> scales,
                                ffi::Result<ffi::Buffer<ffi::F32>> mean_out,
                                ffi::Result<ffi::Buffer<ffi::F32>> workspace) {
  constexpr const char* kWhat = "rotate_quantize_fp8: ";
  const auto dims = x.dimensions();
  if (dims.size() != 4) {
    return invalid(kWhat, "x must be (batch, seqlen, heads, head_dim), got shape ", shape_str(dims));
  }
  const int64_t b = dims[0], s = dims[1], h = dims[2], d = dims[3];
  if (!rotate_quantize_supports_dim(d)) {
    return invalid(kWhat, "head_dim must be a multiple of 32 in [32, ", kRotateQuantizeMaxDim,
                   "], got ", d);
  }
  const auto dtype = ffi_util::to_dtype(x.element_type());
  if (!dtype || *dtype == DType::kFloat8E4M3) {
    return invalid(kWhat, "x must be float32, bfloat16 or float16");
  }
  if (block_size < 1) return invalid(kWhat, "block_size must be >= 1, got ", block_size);
  if (keys_transposed && block_size < s) {
    return invalid(kWhat, "keys_transposed needs one block per head (block_size >= seqlen ", s,
                   "), got block_size ", block_size);
  }
  const int64_t s_pad = flash_fwd_fp8_key_pad(s);
  const auto value_dims = values->dimensions();
  if (values->element_type() != ffi::DataType::F8E4M3FN || value_dims.size() != 4) {
    return invalid(kWhat, "values must be a rank-4 float8_e4m3fn array");
  }
  if (keys_transposed && (value_dims[0] != b || value_dims[1] != h || value_dims[2] != d ||
                          value_dims[3] != s_pad)) {
    return invalid(kWhat, "keys-transposed values must have shape (batch, heads, head_dim, "
                   "seqlen rounded up to 32) = (", b, ", ", h, ", ", d, ", ", s_pad, "), got ",
                   shape_str(value_dims));
  }
  if (!keys_transposed && values->element_count() != x.element_count()) {
    return invalid(kWhat, "values must be float8_e4m3fn of x's shape ", shape_str(dims));
  }
  const int64_t n_blocks = (s + block_size - 1) / block_size;
  const auto scale_dims = scales->dimensions();
  if (scale_dims.size() != 3 || scale_dims[0] != b || scale_dims[1] != h ||
      scale_dims[2] != n_blocks) {
    return invalid(kWhat, "scales must have shape (", b, ", ", h, ", ", n_blocks, "), got ",
                   shape_str(scale_dims));
  }
  if (rotate && (signs.dimensions().size() != 1 || signs.dimensions()[0] != d)) {
    return invalid(kWhat, "signs must have shape (", d, ",), got ", shape_str(signs.dimensions()));
  }
  const bool centred = mean.element_count() > 0;
  if (centred && (mean.dimensions().size() != 3 || mean.dimensions()[0] != b ||
                  mean.dimensions()[1] != h || mean.dimensions()[2] != d)) {
    return invalid(kWhat, "mean must have shape (", b, ", ", h, ", ", d, ") (batch, heads, "
                   "head_dim) or be empty, got ", shape_str(mean.dimensions()));
  }
  if (centre) {
    if (centred) return invalid(kWhat, "centre takes no mean operand (it computes its own)");
    if (rotate) return invalid(kWhat, "centre takes rotate = false (v's quantization)");
    if (block_size < s) {
      return invalid(kWhat, "centre needs one block per head (block_size >= seqlen ", s,
                     "), got block_size ", block_size);
    }
    const auto mean_dims = mean_out->dimensions();
    if (mean_dims.size() != 3 || mean_dims[0] != b || mean_dims[1] != h || mean_dims[2] != d) {
      return invalid(kWhat, "mean_out must have shape (", b, ", ", h, ", ", d, "), got ",
                     shape_str(mean_dims));
    }
    if (const int64_t need = rotate_quantize_centre_workspace_floats(b, s, h, d);
        workspace->element_count() < need) {
      return invalid(kWhat, "workspace must hold ", need, " float32, got ",
                     workspace->element_count());
    }
  }
  RotateQuantizeParams params{x.untyped_data(), rotate ? signs.typed_data() : nullptr,
                              values->untyped_data(), scales->typed_data(), b, s, h,
                              static_cast<int>(d), block_size, *dtype, keys_transposed,
                              centred ? mean.typed_data() : nullptr};
  if (centre) {
    params.mean_out = mean_out->typed_data();
    params.partials = workspace->typed_data();
  }
  if (const int64_t ctas = rotate_quantize_ctas(params); ctas > 0x7fffffff) {
    return invalid(kWhat, "x is too large: ", ctas, " CTAs (batch * heads * token blocks) for a ",
                   "grid limit of 2^31 - 1");
  }
  if (auto err = ffi_util::poison_if_requested(stream, values, scales, mean_out);
      err != cudaSuccess) {
    return ffi_util::from_cuda(err, "output poisoning");
  }
  return ffi_util::from_cuda(launch_rotate_quantize(params, stream), "rotate_quantize kernel launch");
}

}  // namespace
}  // namespace jax_fa3

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFa3RotateQuantizeFp8, jax_fa3::rotate_quantize_impl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // signs
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // mean
                                  .Attr<bool>("rotate")
                                  .Attr<int32_t>("block_size")
                                  .Attr<bool>("keys_transposed")
                                  .Attr<bool>("centre")
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // scales
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // mean_out
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>(),  // workspace
                              {xla::ffi::Traits::kCmdBufferCompatible});
