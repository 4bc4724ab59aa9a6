// XLA FFI handlers of a decode step over an e4m3 KV cache (flash_fwd/fp8_cache.h):
// "jax_fa3_flash_fwd_decode_fp8_cache" (caches (b, s_k, h_k, d)) and
// "jax_fa3_flash_fwd_paged_decode_fp8_cache" (pools (num_pages, page_size, h_k, d) and a page
// table (b, pages_per_seq)). Operands: q (b, 1, h, d) bf16/fp16, the e4m3 k and v, their float32
// scales (rows, h_k, ceil(row length / scale_block)) — rows the batch rows or the pages, row
// length s_k or page_size: `quantize_fp8`'s layout of a cache — then the cache lengths (b,) int32
// [, the page table]. Results and attributes as the 16-bit decode targets (flash_fwd_ffi.cc), plus
// scale_block. Every argument is validated again here (Python already did).
#include <cstdint>

#include "common/buckets.h"
#include "ffi/attention_dims.h"
#include "ffi/decode_checks.h"
#include "ffi/ffi_common.h"
#include "ffi/forward_binding.h"
#include "ffi/handlers.h"
#include "flash_fwd/dispatch.h"

namespace jax_fa3 {
namespace {

namespace ffi = xla::ffi;
using ffi_util::invalid;
using ffi_util::kAnyDim;
using ffi_util::shape_str;

constexpr int64_t kMaxHeadDim = 128;  // Fp8CacheTraits (flash_fwd/fp8_cache.h)

struct CacheOperands {
  const ffi::AnyBuffer& k;
  const ffi::AnyBuffer& v;
  const ffi::AnyBuffer& k_scales;
  const ffi::AnyBuffer& v_scales;
  const ffi::AnyBuffer* kv_pages;  // nullptr: contiguous caches
};

ffi::Error fp8_cache_decode(const char* op, cudaStream_t stream, const ffi::AnyBuffer& q,
                            const CacheOperands& cache, const ffi::AnyBuffer& lengths,
                            ffi::Result<ffi::AnyBuffer>& out,
                            ffi::Result<ffi::Buffer<ffi::F32>>& lse, float softmax_scale,
                            float softcap, int32_t window_left, int32_t window_right,
                            int32_t num_splits, int32_t scale_block) {
  const auto qd = q.dimensions();
  const auto kd = cache.k.dimensions();
  const bool paged = cache.kv_pages != nullptr;
  JAX_FA3_RETURN_IF_FFI_ERROR(ffi_util::check_rank(op, "q", "(b, 1, h, d)", qd, 4));
  const char* k_layout = paged ? "shape (num_pages, page_size, h_k, d) with q's d ="
                               : "shape (b, s_k, h_k, d) with q's b and d =";
  JAX_FA3_RETURN_IF_FFI_ERROR(ffi_util::check_buffer(
      op, "k", cache.k, ffi::DataType::F8E4M3FN, k_layout,
      {paged ? kAnyDim : qd[0], kAnyDim, kAnyDim, qd[3]}));
  JAX_FA3_RETURN_IF_FFI_ERROR(ffi_util::check_buffer(op, "v", cache.v, ffi::DataType::F8E4M3FN,
                                                     "k's shape", {kd[0], kd[1], kd[2], kd[3]}));
  int64_t pages_per_seq = 1;
  if (paged) {
    JAX_FA3_RETURN_IF_FFI_ERROR(ffi_util::check_buffer(op, "kv_pages", *cache.kv_pages,
                                                       ffi::DataType::S32,
                                                       "shape (b, pages_per_seq) =",
                                                       {qd[0], kAnyDim}));
    pages_per_seq = cache.kv_pages->dimensions()[1];
    if (kd[0] < 1 || kd[1] < 1 || pages_per_seq < 1) {
      return invalid(op, ": the pool and the page table must not be empty, got k ", shape_str(kd),
                     " and kv_pages ", shape_str(cache.kv_pages->dimensions()));
    }
    if (kd[0] > INT32_MAX / kd[1]) {
      return invalid(op, ": num_pages * page_size must fit in int32, got k ", shape_str(kd));
    }
  }
  const int64_t row_length = kd[1];  // keys per page, or per batch row
  ffi_util::AttentionDims a{qd[0], qd[1], paged ? pages_per_seq * row_length : row_length,
                            qd[2], kd[2], qd[3]};
  if (paged && pages_per_seq > ffi_util::kMaxSeqLen / row_length) a.s_k = ffi_util::kMaxSeqLen + 1;
  JAX_FA3_RETURN_IF_FFI_ERROR(ffi_util::check_attention_sizes(
      op, a, [&] { return "q " + shape_str(qd) + " and k " + shape_str(kd); }));
  const auto dtype = ffi_util::to_dtype(q.element_type());
  if (!dtype || (*dtype != DType::kBFloat16 && *dtype != DType::kFloat16)) {
    return invalid(op, ": q must be bfloat16 or float16, got ",
                   ffi_util::dtype_label(q.element_type()));
  }
  JAX_FA3_RETURN_IF_FFI_ERROR(ffi_util::check_decode_query(op, a, num_splits));
  if (a.d < 16 || a.d % 16 != 0 || a.d > kMaxHeadDim) {
    return invalid(op, ": head dim must be a multiple of 16 in [16, ", kMaxHeadDim,
                   "] for an e4m3 cache, got ", a.d);
  }
  if (a.s_k < 1) return invalid(op, ": the cache must hold at least one slot per row");
  if (scale_block < 1) return invalid(op, ": scale_block must be >= 1, got ", scale_block);
  const int64_t scale_blocks = (row_length + scale_block - 1) / scale_block;
  const char* scale_layout = paged ? "shape (num_pages, h_k, ceil(page_size / scale_block)) ="
                                   : "shape (b, h_k, ceil(s_k / scale_block)) =";
  JAX_FA3_RETURN_IF_FFI_ERROR(ffi_util::check_buffer(op, "k_scales", cache.k_scales,
                                                     ffi::DataType::F32, scale_layout,
                                                     {kd[0], kd[2], scale_blocks}));
  JAX_FA3_RETURN_IF_FFI_ERROR(ffi_util::check_buffer(op, "v_scales", cache.v_scales,
                                                     ffi::DataType::F32, scale_layout,
                                                     {kd[0], kd[2], scale_blocks}));
  JAX_FA3_RETURN_IF_FFI_ERROR(ffi_util::check_buffer(op, "lengths", lengths, ffi::DataType::S32,
                                                     "shape (b,) =", {a.b}));
  JAX_FA3_RETURN_IF_FFI_ERROR(
      ffi_util::check_decode_results(op, out, lse, q.element_type(), a, num_splits));
  JAX_FA3_RETURN_IF_FFI_ERROR(ffi_util::check_attention_scalars(op, softmax_scale, softcap,
                                                                window_left, window_right));
  JAX_FA3_RETURN_IF_FFI_ERROR(ffi_util::check_compiled(op, a.d, *dtype));
  const int bucket = head_dim_bucket(static_cast<int>(a.d));
  if (paged && row_length % forward_key_block(bucket) != 0) {
    return invalid(op, ": page_size must be a multiple of ", forward_key_block(bucket),
                   " (the kernel's key block at head dim ", a.d, "), got ", row_length);
  }

  // The kernel's view of a decode step: a kv head's g query heads are the rows of its tile.
  FlashFwdParams params{};
  params.q = q.untyped_data();
  params.k = cache.k.untyped_data();
  params.v = cache.v.untyped_data();
  params.o = out->untyped_data();
  params.lse = lse->typed_data();
  a.s_q = a.h / a.h_k;
  a.h = a.h_k;
  ffi_util::set_dims(params, a);
  params.dtype = *dtype;
  params.softmax_scale = softmax_scale;
  params.softcap = softcap;
  params.window_left = window_left;
  params.window_right = window_right;
  params.row_lengths = static_cast<const int*>(lengths.untyped_data());
  params.qo_heads_major = true;
  params.num_splits = num_splits;
  params.k_scales = static_cast<const float*>(cache.k_scales.untyped_data());
  params.v_scales = static_cast<const float*>(cache.v_scales.untyped_data());
  params.scale_block = scale_block;
  params.scale_blocks = static_cast<int>(scale_blocks);
  if (paged) {
    params.kv_pages = static_cast<const int*>(cache.kv_pages->untyped_data());
    params.pages_per_seq = static_cast<int>(pages_per_seq);
    params.page_size = static_cast<int>(row_length);
    params.num_pages = static_cast<int>(kd[0]);
  }
  return ffi_util::poison_and_launch(
      op, stream, [&] { return launch_flash_fwd(params, stream); }, out, lse);
}

ffi::Error decode_fp8_cache(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k,
                            ffi::AnyBuffer v, ffi::AnyBuffer k_scales, ffi::AnyBuffer v_scales,
                            ffi::AnyBuffer lengths, ffi::Result<ffi::AnyBuffer> out,
                            ffi::Result<ffi::Buffer<ffi::F32>> lse, float softmax_scale,
                            float softcap, int32_t window_left, int32_t window_right,
                            int32_t num_splits, int32_t scale_block) {
  return fp8_cache_decode("flash_fwd_decode_fp8_cache", stream, q,
                          CacheOperands{k, v, k_scales, v_scales, nullptr}, lengths, out, lse,
                          softmax_scale, softcap, window_left, window_right, num_splits,
                          scale_block);
}

ffi::Error paged_decode_fp8_cache(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k_pool,
                                  ffi::AnyBuffer v_pool, ffi::AnyBuffer k_scales,
                                  ffi::AnyBuffer v_scales, ffi::AnyBuffer lengths,
                                  ffi::AnyBuffer kv_pages, ffi::Result<ffi::AnyBuffer> out,
                                  ffi::Result<ffi::Buffer<ffi::F32>> lse, float softmax_scale,
                                  float softcap, int32_t window_left, int32_t window_right,
                                  int32_t num_splits, int32_t scale_block) {
  return fp8_cache_decode("flash_fwd_paged_decode_fp8_cache", stream, q,
                          CacheOperands{k_pool, v_pool, k_scales, v_scales, &kv_pages}, lengths,
                          out, lse, softmax_scale, softcap, window_left, window_right, num_splits,
                          scale_block);
}

// q, k, v, k_scales, v_scales, lengths.
auto bind_operands() {
  using ffi::AnyBuffer;
  return ffi_util::bind_on_stream()
      .Arg<AnyBuffer>().Arg<AnyBuffer>().Arg<AnyBuffer>()
      .Arg<AnyBuffer>().Arg<AnyBuffer>().Arg<AnyBuffer>();
}

}  // namespace
}  // namespace jax_fa3

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxFa3FlashFwdDecodeFp8Cache, jax_fa3::decode_fp8_cache,
    jax_fa3::ffi_util::bind_fwd_results_and_attrs(jax_fa3::bind_operands())
        .Attr<int32_t>("num_splits")
        .Attr<int32_t>("scale_block"),
    {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxFa3FlashFwdPagedDecodeFp8Cache, jax_fa3::paged_decode_fp8_cache,
    jax_fa3::ffi_util::bind_fwd_results_and_attrs(
        jax_fa3::bind_operands().Arg<xla::ffi::AnyBuffer>())
        .Attr<int32_t>("num_splits")
        .Attr<int32_t>("scale_block"),
    {xla::ffi::Traits::kCmdBufferCompatible});
