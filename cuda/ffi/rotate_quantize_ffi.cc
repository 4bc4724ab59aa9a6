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
  constexpr const char* kOp = "rotate_quantize_fp8";
  const auto dims = x.dimensions();
  if (dims.size() != 4) {
    return invalid(kOp, ": x must be (batch, seqlen, heads, head_dim), got shape ",
                   shape_str(dims));
  }
  const int64_t b = dims[0], s = dims[1], h = dims[2], d = dims[3];
  if (!rotate_quantize_supports_dim(d)) {
    return invalid(kOp, ": head_dim must be a multiple of 32 in [32, ", kRotateQuantizeMaxDim,
                   "], got ", d);
  }
  const auto dtype = ffi_util::to_dtype(x.element_type());
  if (!dtype || *dtype == DType::kFloat8E4M3) {
    return invalid(kOp, ": x must be float32, bfloat16 or float16");
  }
  if (block_size < 1) return invalid(kOp, ": block_size must be >= 1, got ", block_size);
  if (keys_transposed && block_size < s) {
    return invalid(kOp, ": keys_transposed needs one block per head (block_size >= seqlen ", s,
                   "), got block_size ", block_size);
  }
  const int64_t s_pad = flash_fwd_fp8_key_pad(s);
  const auto value_dims = values->dimensions();
  JAX_FA3_RETURN_IF_FFI_ERROR(
      ffi_util::check_dtype(kOp, "values", values->element_type(), ffi::DataType::F8E4M3FN));
  if (keys_transposed) {
    JAX_FA3_RETURN_IF_FFI_ERROR(ffi_util::check_shape(
        kOp, "keys-transposed values",
        "shape (batch, heads, head_dim, seqlen rounded up to 32) =", value_dims, {b, h, d, s_pad}));
  } else {
    JAX_FA3_RETURN_IF_FFI_ERROR(
        ffi_util::check_shape(kOp, "values", "x's shape", value_dims, {b, s, h, d}));
  }
  const int64_t n_blocks = (s + block_size - 1) / block_size;
  JAX_FA3_RETURN_IF_FFI_ERROR(
      ffi_util::check_shape(kOp, "scales", "shape", scales->dimensions(), {b, h, n_blocks}));
  if (rotate) {
    JAX_FA3_RETURN_IF_FFI_ERROR(
        ffi_util::check_shape(kOp, "signs", "shape", signs.dimensions(), {d}));
  }
  const bool centred = mean.element_count() > 0;
  if (centred && !ffi_util::dims_equal(mean.dimensions(), {b, h, d})) {
    return invalid(kOp, ": mean must have shape (", b, ", ", h, ", ", d, ") (batch, heads, "
                   "head_dim) or be empty, got ", shape_str(mean.dimensions()));
  }
  if (centre) {
    if (centred) return invalid(kOp, ": centre takes no mean operand (it computes its own)");
    if (rotate) return invalid(kOp, ": centre takes rotate = false (v's quantization)");
    if (block_size < s) {
      return invalid(kOp, ": centre needs one block per head (block_size >= seqlen ", s,
                     "), got block_size ", block_size);
    }
    JAX_FA3_RETURN_IF_FFI_ERROR(
        ffi_util::check_shape(kOp, "mean_out", "shape", mean_out->dimensions(), {b, h, d}));
    if (const int64_t need = rotate_quantize_centre_workspace_floats(b, s, h, d);
        workspace->element_count() < need) {
      return invalid(kOp, ": workspace must hold ", need, " float32, got ",
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
    return invalid(kOp, ": x is too large: ", ctas, " CTAs (batch * heads * token blocks) for a ",
                   "grid limit of 2^31 - 1");
  }
  return ffi_util::poison_and_launch(
      kOp, stream, [&] { return launch_rotate_quantize(params, stream); }, values, scales,
      mean_out);
}

}  // namespace
}  // namespace jax_fa3

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFa3RotateQuantizeFp8, jax_fa3::rotate_quantize_impl,
                              jax_fa3::ffi_util::bind_on_stream()
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
