// XLA FFI handlers of the FlashAttention-3 forward kernels: "jax_fa3_flash_fwd" (whole rows),
// "jax_fa3_flash_fwd_key_ranges" (a key range per query), "jax_fa3_flash_fwd_row_bounds" (one
// (q_len, k_len, diag) per batch row) and "jax_fa3_flash_fwd_paged" /
// "jax_fa3_flash_fwd_paged_row_bounds" (the same over a paged KV cache read in place), and the
// decode step's "jax_fa3_flash_fwd_decode" / "jax_fa3_flash_fwd_paged_decode" (one query per row:
// GQA query heads as the rows of their kv head's tile, split-KV pieces in the kernel).
// Validates every argument again (Python already did) and dispatches to the compiled bucket.
#include <cstdint>
#include <utility>

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
using ffi_util::shape_str;

// Which keys a masked call's rows see (common/key_ranges.h): per-query ranges and their covers,
// per-row bounds, or (a decode step) per-row cache lengths; all null for whole rows.
struct KeyOperands {
  const ffi::AnyBuffer* ranges = nullptr;
  const ffi::AnyBuffer* covers = nullptr;
  const ffi::AnyBuffer* bounds = nullptr;
  const ffi::AnyBuffer* lengths = nullptr;
};

// A decode step (params.h: qo_heads_major, num_splits): q (b, 1, h, d) is read as g = h / h_k
// query rows of each of the h_k heads, and the call returns the split-KV pieces: out
// (b, num_splits, h, d) in q's dtype and lse (b, num_splits, h), piece p of row r at [r, p].
// Each row's keys come from its cache length (b,) int32: keys [0, length), the g rows all real
// and sharing the diagonal length - 1 (params.h: row_lengths).
struct Decode {
  bool on = false;
  int64_t num_splits = 1;
};

// The parameters every forward handler fills alike; a paged call adds its pages.
FlashFwdParams forward_params(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                              const ffi::AnyBuffer& v, ffi::Result<ffi::AnyBuffer>& out,
                              ffi::Result<ffi::Buffer<ffi::F32>>& lse,
                              const ffi_util::AttentionDims& a, DType dtype, float softmax_scale,
                              float softcap, int32_t window_left, int32_t window_right,
                              const KeyOperands& keys) {
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
  if (keys.ranges != nullptr) {
    params.key_ranges = static_cast<const int*>(keys.ranges->untyped_data());
    params.key_covers = static_cast<const int*>(keys.covers->untyped_data());
  }
  if (keys.bounds != nullptr) {
    params.row_bounds = static_cast<const int*>(keys.bounds->untyped_data());
  }
  if (keys.lengths != nullptr) {
    params.row_lengths = static_cast<const int*>(keys.lengths->untyped_data());
  }
  return params;
}

// The checks every forward handler makes once its inputs are read into `a` and `dtype`: the
// results' shapes and dtype, the attributes, the key operands (when given) and that this build
// has the kernel.
ffi::Error check_forward_call(const char* op, ffi::Result<ffi::AnyBuffer>& out,
                              ffi::Result<ffi::Buffer<ffi::F32>>& lse,
                              const ffi_util::AttentionDims& a, DType dtype,
                              ffi::DataType element_type, float softmax_scale, float softcap,
                              int32_t window_left, int32_t window_right, const KeyOperands& keys,
                              const Decode& decode = {}) {
  if (decode.on) {
    JAX_FA3_RETURN_IF_FFI_ERROR(
        ffi_util::check_decode_results(op, out, lse, element_type, a, decode.num_splits));
  } else {
    JAX_FA3_RETURN_IF_FFI_ERROR(ffi_util::check_buffer(op, "out", *out, element_type,
                                                       "q's shape", {a.b, a.s_q, a.h, a.d}));
    JAX_FA3_RETURN_IF_FFI_ERROR(ffi_util::check_shape(op, "lse", "shape (b, h, s_q) =",
                                                      lse->dimensions(), {a.b, a.h, a.s_q}));
  }
  JAX_FA3_RETURN_IF_FFI_ERROR(ffi_util::check_attention_scalars(op, softmax_scale, softcap,
                                                                window_left, window_right));
  if (keys.ranges != nullptr) {
    JAX_FA3_RETURN_IF_FFI_ERROR(
        ffi_util::check_key_ranges(op, *keys.ranges, *keys.covers, a.b, a.s_q));
  }
  if (keys.bounds != nullptr) {
    JAX_FA3_RETURN_IF_FFI_ERROR(ffi_util::check_row_bounds(op, *keys.bounds, a.b));
  }
  if (keys.lengths != nullptr) {
    JAX_FA3_RETURN_IF_FFI_ERROR(ffi_util::check_buffer(op, "lengths", *keys.lengths,
                                                       ffi::DataType::S32, "shape (b,) =", {a.b}));
  }
  return ffi_util::check_compiled(op, a.d, dtype);
}

// A decode call's q and split count (Decode above), checked before its results' shapes, which
// they determine.
ffi::Error check_decode(const char* op, const Decode& decode, const ffi_util::AttentionDims& a) {
  if (!decode.on) return ffi::Error::Success();
  return ffi_util::check_decode_query(op, a, decode.num_splits);
}

// The sizes as the kernel sees a decode call: the g = h / h_k query heads of a kv head are the
// rows of its tile.
void to_decode_view(const Decode& decode, ffi_util::AttentionDims& a) {
  if (!decode.on) return;
  a.s_q = a.h / a.h_k;
  a.h = a.h_k;
}

void set_decode(FlashFwdParams& params, const Decode& decode) {
  params.qo_heads_major = decode.on;
  params.num_splits = static_cast<int>(decode.num_splits);
}

ffi::Error flash_fwd_impl(const char* op, cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k,
                          ffi::AnyBuffer v, const KeyOperands& keys,
                          ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Buffer<ffi::F32>> lse,
                          float softmax_scale, float softcap, int32_t window_left,
                          int32_t window_right, const Decode& decode = {}) {
  ffi_util::AttentionDims a{};
  DType dtype{};
  JAX_FA3_RETURN_IF_FFI_ERROR(ffi_util::read_16bit_attention(op, q, k, v, a, dtype));
  JAX_FA3_RETURN_IF_FFI_ERROR(check_decode(op, decode, a));
  JAX_FA3_RETURN_IF_FFI_ERROR(check_forward_call(op, out, lse, a, dtype, q.element_type(),
                                                 softmax_scale, softcap, window_left,
                                                 window_right, keys, decode));
  to_decode_view(decode, a);
  FlashFwdParams params = forward_params(q, k, v, out, lse, a, dtype, softmax_scale, softcap,
                                         window_left, window_right, keys);
  set_decode(params, decode);
  return ffi_util::poison_and_launch(
      op, stream, [&] { return launch_flash_fwd(params, stream); }, out, lse);
}

ffi::Error flash_fwd_whole(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k,
                           ffi::AnyBuffer v, ffi::Result<ffi::AnyBuffer> out,
                           ffi::Result<ffi::Buffer<ffi::F32>> lse, float softmax_scale,
                           float softcap, int32_t window_left, int32_t window_right) {
  return flash_fwd_impl("flash_fwd", stream, q, k, v, KeyOperands{}, out, lse, softmax_scale,
                        softcap, window_left, window_right);
}

// The ranges replace the window: the window attributes are checked, not used.
ffi::Error flash_fwd_key_ranges(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k,
                                ffi::AnyBuffer v, ffi::AnyBuffer key_ranges,
                                ffi::AnyBuffer key_covers, ffi::Result<ffi::AnyBuffer> out,
                                ffi::Result<ffi::Buffer<ffi::F32>> lse, float softmax_scale,
                                float softcap, int32_t window_left, int32_t window_right) {
  return flash_fwd_impl("flash_fwd_key_ranges", stream, q, k, v,
                        KeyOperands{&key_ranges, &key_covers, nullptr}, out, lse, softmax_scale,
                        softcap, window_left, window_right);
}

// The bounds and the window together give each row's keys.
ffi::Error flash_fwd_row_bounds(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k,
                                ffi::AnyBuffer v, ffi::AnyBuffer row_bounds,
                                ffi::Result<ffi::AnyBuffer> out,
                                ffi::Result<ffi::Buffer<ffi::F32>> lse, float softmax_scale,
                                float softcap, int32_t window_left, int32_t window_right) {
  return flash_fwd_impl("flash_fwd_row_bounds", stream, q, k, v,
                        KeyOperands{nullptr, nullptr, &row_bounds}, out, lse, softmax_scale,
                        softcap, window_left, window_right);
}

ffi::Error flash_fwd_decode(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k,
                            ffi::AnyBuffer v, ffi::AnyBuffer lengths,
                            ffi::Result<ffi::AnyBuffer> out,
                            ffi::Result<ffi::Buffer<ffi::F32>> lse, float softmax_scale,
                            float softcap, int32_t window_left, int32_t window_right,
                            int32_t num_splits) {
  return flash_fwd_impl("flash_fwd_decode", stream, q, k, v,
                        KeyOperands{nullptr, nullptr, nullptr, &lengths}, out, lse, softmax_scale,
                        softcap, window_left, window_right, Decode{true, num_splits});
}

// A paged KV cache read in place, on the key-range kernel: k_pool and v_pool (num_pages,
// page_size, h_k, d), kv_pages int32 (b, pages_per_seq); row r's logical key j is row
// j % page_size of page kv_pages[r, j / page_size] (clamped into the pool when read), and the
// key ranges or row bounds are over the logical s_k = pages_per_seq * page_size keys.
ffi::Error flash_fwd_paged_impl(const char* op, cudaStream_t stream, ffi::AnyBuffer q,
                                ffi::AnyBuffer k_pool, ffi::AnyBuffer v_pool,
                                const KeyOperands& keys, ffi::AnyBuffer kv_pages,
                                ffi::Result<ffi::AnyBuffer> out,
                                ffi::Result<ffi::Buffer<ffi::F32>> lse, float softmax_scale,
                                float softcap, int32_t window_left, int32_t window_right,
                                const Decode& decode = {}) {
  const auto qd = q.dimensions();
  const auto kd = k_pool.dimensions();
  const auto pd = kv_pages.dimensions();
  JAX_FA3_RETURN_IF_FFI_ERROR(ffi_util::check_rank(op, "q", "(b, s_q, h, d)", qd, 4));
  JAX_FA3_RETURN_IF_FFI_ERROR(ffi_util::check_shape(
      op, "k_pool", "shape (num_pages, page_size, h_k, d) with q's d =", kd,
      {ffi_util::kAnyDim, ffi_util::kAnyDim, ffi_util::kAnyDim, qd[3]}));
  JAX_FA3_RETURN_IF_FFI_ERROR(ffi_util::check_buffer(op, "kv_pages", kv_pages, ffi::DataType::S32,
                                                     "shape (b, pages_per_seq) =",
                                                     {qd[0], ffi_util::kAnyDim}));
  const int64_t num_pages = kd[0], page_size = kd[1], pages_per_seq = pd[1];
  if (num_pages < 1 || page_size < 1 || pages_per_seq < 1) {
    return invalid(op, ": the pool and the page table must not be empty, got k_pool ",
                   shape_str(kd), " and kv_pages ", shape_str(pd));
  }
  if (num_pages > INT32_MAX / page_size) {
    return invalid(op, ": num_pages * page_size must fit in int32, got k_pool ", shape_str(kd));
  }
  ffi_util::AttentionDims a{qd[0], qd[1], pages_per_seq * page_size, qd[2], kd[2], qd[3]};
  if (pages_per_seq > ffi_util::kMaxSeqLen / page_size) a.s_k = ffi_util::kMaxSeqLen + 1;
  JAX_FA3_RETURN_IF_FFI_ERROR(ffi_util::check_attention_sizes(op, a, [&] {
    return "q " + shape_str(qd) + ", k_pool " + shape_str(kd) +
           " and kv_pages " + shape_str(pd);
  }));
  const auto t = ffi_util::to_dtype(q.element_type());
  if (!t || (*t != DType::kBFloat16 && *t != DType::kFloat16)) {
    return invalid(op, ": q must be bfloat16 or float16, got ",
                   ffi_util::dtype_label(q.element_type()));
  }
  const DType dtype = *t;
  JAX_FA3_RETURN_IF_FFI_ERROR(
      ffi_util::check_dtype(op, "k_pool", k_pool.element_type(), q.element_type()));
  JAX_FA3_RETURN_IF_FFI_ERROR(ffi_util::check_buffer(op, "v_pool", v_pool, q.element_type(),
                                                     "k_pool's shape", {kd[0], kd[1], kd[2], kd[3]}));
  JAX_FA3_RETURN_IF_FFI_ERROR(ffi_util::check_head_dim(op, a.d));
  JAX_FA3_RETURN_IF_FFI_ERROR(check_decode(op, decode, a));
  JAX_FA3_RETURN_IF_FFI_ERROR(check_forward_call(op, out, lse, a, dtype, q.element_type(),
                                                 softmax_scale, softcap, window_left,
                                                 window_right, keys, decode));
  to_decode_view(decode, a);
  const int bucket = head_dim_bucket(static_cast<int>(a.d));
  if (page_size % forward_key_block(bucket) != 0) {
    return invalid(op, ": page_size must be a multiple of ", forward_key_block(bucket),
                   " (the kernel's key block at head dim ", a.d, "), got ", page_size);
  }

  FlashFwdParams params = forward_params(q, k_pool, v_pool, out, lse, a, dtype, softmax_scale,
                                         softcap, window_left, window_right, keys);
  params.kv_pages = static_cast<const int*>(kv_pages.untyped_data());
  params.pages_per_seq = static_cast<int>(pages_per_seq);
  params.page_size = static_cast<int>(page_size);
  params.num_pages = static_cast<int>(num_pages);
  set_decode(params, decode);
  return ffi_util::poison_and_launch(
      op, stream, [&] { return launch_flash_fwd(params, stream); }, out, lse);
}

ffi::Error flash_fwd_paged(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k_pool,
                           ffi::AnyBuffer v_pool, ffi::AnyBuffer key_ranges,
                           ffi::AnyBuffer key_covers, ffi::AnyBuffer kv_pages,
                           ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Buffer<ffi::F32>> lse,
                           float softmax_scale, float softcap, int32_t window_left,
                           int32_t window_right) {
  return flash_fwd_paged_impl("flash_fwd_paged", stream, q, k_pool, v_pool,
                              KeyOperands{&key_ranges, &key_covers, nullptr}, kv_pages, out, lse,
                              softmax_scale, softcap, window_left, window_right);
}

ffi::Error flash_fwd_paged_row_bounds(cudaStream_t stream, ffi::AnyBuffer q,
                                      ffi::AnyBuffer k_pool, ffi::AnyBuffer v_pool,
                                      ffi::AnyBuffer row_bounds, ffi::AnyBuffer kv_pages,
                                      ffi::Result<ffi::AnyBuffer> out,
                                      ffi::Result<ffi::Buffer<ffi::F32>> lse, float softmax_scale,
                                      float softcap, int32_t window_left, int32_t window_right) {
  return flash_fwd_paged_impl("flash_fwd_paged_row_bounds", stream, q, k_pool, v_pool,
                              KeyOperands{nullptr, nullptr, &row_bounds}, kv_pages, out, lse,
                              softmax_scale, softcap, window_left, window_right);
}

ffi::Error flash_fwd_paged_decode(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k_pool,
                                  ffi::AnyBuffer v_pool, ffi::AnyBuffer lengths,
                                  ffi::AnyBuffer kv_pages, ffi::Result<ffi::AnyBuffer> out,
                                  ffi::Result<ffi::Buffer<ffi::F32>> lse, float softmax_scale,
                                  float softcap, int32_t window_left, int32_t window_right,
                                  int32_t num_splits) {
  return flash_fwd_paged_impl("flash_fwd_paged_decode", stream, q, k_pool, v_pool,
                              KeyOperands{nullptr, nullptr, nullptr, &lengths}, kv_pages, out, lse,
                              softmax_scale, softcap, window_left, window_right,
                              Decode{true, num_splits});
}

}  // namespace
}  // namespace jax_fa3

namespace jax_fa3 {
namespace {

auto bind_qkv() {
  using ffi::AnyBuffer;
  return ffi_util::bind_on_stream().Arg<AnyBuffer>().Arg<AnyBuffer>().Arg<AnyBuffer>();
}

}  // namespace
}  // namespace jax_fa3

// Graph-capturable: no host synchronization, no allocation, no per-call host state (the TMA
// descriptors travel inside the kernel parameters).
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFa3FlashFwd, jax_fa3::flash_fwd_whole,
                              jax_fa3::ffi_util::bind_fwd_results_and_attrs(jax_fa3::bind_qkv()),
                              {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxFa3FlashFwdPaged, jax_fa3::flash_fwd_paged,
    jax_fa3::ffi_util::bind_fwd_results_and_attrs(jax_fa3::bind_qkv()
                                            .Arg<xla::ffi::AnyBuffer>()
                                            .Arg<xla::ffi::AnyBuffer>()
                                            .Arg<xla::ffi::AnyBuffer>()),
    {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxFa3FlashFwdPagedRowBounds, jax_fa3::flash_fwd_paged_row_bounds,
    jax_fa3::ffi_util::bind_fwd_results_and_attrs(
        jax_fa3::bind_qkv().Arg<xla::ffi::AnyBuffer>().Arg<xla::ffi::AnyBuffer>()),
    {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxFa3FlashFwdRowBounds, jax_fa3::flash_fwd_row_bounds,
    jax_fa3::ffi_util::bind_fwd_results_and_attrs(jax_fa3::bind_qkv().Arg<xla::ffi::AnyBuffer>()),
    {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxFa3FlashFwdDecode, jax_fa3::flash_fwd_decode,
    jax_fa3::ffi_util::bind_fwd_results_and_attrs(jax_fa3::bind_qkv().Arg<xla::ffi::AnyBuffer>())
        .Attr<int32_t>("num_splits"),
    {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxFa3FlashFwdPagedDecode, jax_fa3::flash_fwd_paged_decode,
    jax_fa3::ffi_util::bind_fwd_results_and_attrs(
        jax_fa3::bind_qkv().Arg<xla::ffi::AnyBuffer>().Arg<xla::ffi::AnyBuffer>())
        .Attr<int32_t>("num_splits"),
    {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxFa3FlashFwdKeyRanges, jax_fa3::flash_fwd_key_ranges,
    jax_fa3::ffi_util::bind_fwd_results_and_attrs(
        jax_fa3::bind_qkv().Arg<xla::ffi::AnyBuffer>().Arg<xla::ffi::AnyBuffer>()),
    {xla::ffi::Traits::kCmdBufferCompatible});
