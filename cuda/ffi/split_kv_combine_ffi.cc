// XLA FFI handler for the merge of split-KV decoding's pieces (jax_fa3/_cache_attention.py).
#include "decode/split_kv_combine.h"
#include "ffi/ffi_common.h"
#include "ffi/handlers.h"

namespace jax_fa3 {
namespace {

namespace ffi = xla::ffi;
using ffi_util::invalid;
using ffi_util::shape_str;

// out_pieces (b * n, rows, heads, d) f32/bf16/f16 and lse_pieces f32 (b * n, heads, rows): batch
// row r's pieces are rows r * n .. r * n + n - 1. Results: out (b, rows, heads, d) in
// out_pieces' dtype, lse f32 (b, heads, rows).
ffi::Error split_kv_combine_impl(cudaStream_t stream, ffi::AnyBuffer out_pieces,
                                 ffi::AnyBuffer lse_pieces, int32_t n,
                                 ffi::Result<ffi::AnyBuffer> out,
                                 ffi::Result<ffi::AnyBuffer> lse) {
  constexpr const char* kOp = "split_kv_combine";
  const auto dims = out_pieces.dimensions();
  JAX_FA3_RETURN_IF_FFI_ERROR(
      ffi_util::check_rank(kOp, "out_pieces", "(batch * n, rows, heads, head_dim)", dims, 4));
  const int64_t pieces = dims[0], rows = dims[1], heads = dims[2], d = dims[3];
  if (n < 1) return invalid(kOp, ": n (pieces per batch row) must be >= 1, got ", n);
  if (pieces % n != 0) {
    return invalid(kOp, ": out_pieces' first axis (batch * n) must be a multiple of n = ", n,
                   ", got shape ", shape_str(dims));
  }
  const int64_t b = pieces / n;
  if (d < kSplitKvCombineDimMultiple || d > kSplitKvCombineMaxDim ||
      d % kSplitKvCombineDimMultiple != 0) {
    return invalid(kOp, ": head_dim (out_pieces' last axis) must be a multiple of ",
                   kSplitKvCombineDimMultiple, " in [", kSplitKvCombineDimMultiple, ", ",
                   kSplitKvCombineMaxDim, "], got ", d);
  }
  const auto dtype = ffi_util::to_dtype(out_pieces.element_type());
  if (!dtype || *dtype == DType::kFloat8E4M3) {
    return invalid(kOp, ": out_pieces must be float32, bfloat16 or float16, got ",
                   ffi_util::dtype_label(out_pieces.element_type()));
  }
  JAX_FA3_RETURN_IF_FFI_ERROR(ffi_util::check_buffer(kOp, "lse_pieces", lse_pieces,
                                                     ffi::DataType::F32,
                                                     "shape (batch * n, heads, rows) =",
                                                     {pieces, heads, rows}));
  JAX_FA3_RETURN_IF_FFI_ERROR(ffi_util::check_buffer(
      kOp, "out", *out, out_pieces.element_type(), "shape (batch, rows, heads, head_dim) =",
      {b, rows, heads, d}));
  JAX_FA3_RETURN_IF_FFI_ERROR(ffi_util::check_buffer(kOp, "lse", *lse, ffi::DataType::F32,
                                                     "shape (batch, heads, rows) =",
                                                     {b, heads, rows}));
  const SplitKvCombineParams params{out_pieces.untyped_data(),
                                    static_cast<const float*>(lse_pieces.untyped_data()),
                                    out->untyped_data(),
                                    static_cast<float*>(lse->untyped_data()),
                                    b, rows, heads, static_cast<int>(d), n, *dtype};
  return ffi_util::poison_and_launch(
      kOp, stream, [&] { return launch_split_kv_combine(params, stream); }, out, lse);
}

}  // namespace
}  // namespace jax_fa3

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFa3SplitKvCombine, jax_fa3::split_kv_combine_impl,
                              jax_fa3::ffi_util::bind_on_stream()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Attr<int32_t>("n")
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>(),
                              {xla::ffi::Traits::kCmdBufferCompatible});
