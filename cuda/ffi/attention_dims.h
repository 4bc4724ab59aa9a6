// The sizes of an attention call (q (b, s_q, h, d), k (b, s_k, h_k, d)), read and checked once
// for the three attention handlers (flash_fwd, flash_fwd_fp8, flash_bwd), with the limits the
// kernels can address.
#pragma once
#include <cmath>
#include <cstdint>

#include "common/window.h"
#include "ffi/ffi_common.h"

namespace jax_fa3::ffi_util {

struct AttentionDims {
  int64_t b, s_q, s_k, h, h_k, d;
};

// Longest q or k sequence. The kernels keep rows, keys and mask bounds in int32: with a window
// clamped below s_q + s_k (make_scalars, unbounded_past_reach) a bound such as
// row + (s_k - s_q) + window stays below s_q + 2 * s_k plus one tile of padded rows, which fits
// for lengths up to 2^29. Every buffer offset is 64-bit, so the element count has no such limit.
constexpr int64_t kMaxSeqLen = int64_t(1) << 29;
// Query tiles over all batches and heads, counted in int32 by the forward's tile scheduler (in
// tiles of at least 64 rows; up to twice as many work items with the fp8 tail split).
constexpr int64_t kMaxQueryTiles = int64_t(1) << 29;

// Whole GQA groups and sizes within the limits above; shapes() names the arrays in a message
// (called on a failure only: no string is built on the way to a launch).
template <class Shapes>
ffi::Error check_attention_sizes(const char* op, const AttentionDims& a, Shapes&& shapes) {
  if (a.h_k < 1 || a.h % a.h_k != 0) {
    return invalid(op, ": q heads must be a multiple of k/v heads (GQA), got h=", a.h, ", h_k=",
                   a.h_k);
  }
  constexpr int64_t kMaxInt = INT32_MAX;
  if (a.b > kMaxInt || a.h > kMaxInt || a.h_k > kMaxInt) {
    return invalid(op, ": b, h and h_k must fit in int32, got ", shapes());
  }
  if (a.s_q > kMaxSeqLen || a.s_k > kMaxSeqLen) {
    return invalid(op, ": sequence lengths must be at most 2^29 = ", kMaxSeqLen, ", got s_q=",
                   a.s_q, ", s_k=", a.s_k);
  }
  const int64_t tiles = (a.s_q + 63) / 64;
  if (tiles > 0 && a.h > 0 &&
      (a.h > kMaxQueryTiles / tiles || a.b > kMaxQueryTiles / (tiles * a.h))) {
    return invalid(op, ": ceil(s_q / 64) * h * b must be at most 2^29 (query tiles, counted in "
                   "int32), got ", shapes());
  }
  return ffi::Error::Success();
}

// q and k: rank 4, k's batch and head dim equal to q's, whole GQA groups, and sizes within the
// limits above. v, out and the rest are checked by each handler against the returned sizes.
inline ffi::Error read_attention_dims(const char* op, const ffi::AnyBuffer& q,
                                      const ffi::AnyBuffer& k, AttentionDims& a) {
  const auto qd = q.dimensions();
  const auto kd = k.dimensions();
  JAX_FA3_RETURN_IF_FFI_ERROR(check_rank(op, "q", "(b, s_q, h, d)", qd, 4));
  JAX_FA3_RETURN_IF_FFI_ERROR(check_shape(op, "k", "shape (b, s_k, h_k, d) with q's b and d =", kd,
                                          {qd[0], kAnyDim, kAnyDim, qd[3]}));
  a = {qd[0], qd[1], kd[1], qd[2], kd[2], qd[3]};
  return check_attention_sizes(
      op, a, [&] { return "q " + shape_str(qd) + " and k " + shape_str(kd); });
}

// The bf16/fp16 kernels' head dims.
inline ffi::Error check_head_dim(const char* op, int64_t d) {
  if (d < 8 || d % 8 != 0 || d > 256) {
    return invalid(op, ": head dim must be a multiple of 8 in [8, 256], got ", d);
  }
  return ffi::Error::Success();
}

// q, k and v of the bf16/fp16 kernels: read_attention_dims, q bfloat16 or float16 and k and v
// of q's dtype, v of k's shape, a head dim those kernels take.
inline ffi::Error read_16bit_attention(const char* op, const ffi::AnyBuffer& q,
                                       const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                                       AttentionDims& a, DType& dtype) {
  JAX_FA3_RETURN_IF_FFI_ERROR(read_attention_dims(op, q, k, a));
  const auto t = to_dtype(q.element_type());
  if (!t || (*t != DType::kBFloat16 && *t != DType::kFloat16)) {
    return invalid(op, ": q must be bfloat16 or float16, got ", dtype_label(q.element_type()));
  }
  dtype = *t;
  JAX_FA3_RETURN_IF_FFI_ERROR(check_dtype(op, "k", k.element_type(), q.element_type()));
  JAX_FA3_RETURN_IF_FFI_ERROR(check_buffer(op, "v", v, q.element_type(), "k's shape",
                                           {a.b, a.s_k, a.h_k, a.d}));
  return check_head_dim(op, a.d);
}

// The scalar attributes of the attention handlers (the fp8 forward has no softcap: 0).
inline ffi::Error check_attention_scalars(const char* op, float softmax_scale, float softcap,
                                          int32_t window_left, int32_t window_right) {
  if (!std::isfinite(softmax_scale) || softmax_scale <= 0.f) {
    return invalid(op, ": softmax_scale must be finite and > 0, got ", softmax_scale);
  }
  if (!std::isfinite(softcap) || softcap < 0.f) {
    return invalid(op, ": softcap must be finite and >= 0 (0 = off), got ", softcap);
  }
  if (window_left < -1) return invalid(op, ": window_left must be >= -1, got ", window_left);
  if (window_right < -1) return invalid(op, ": window_right must be >= -1, got ", window_right);
  return ffi::Error::Success();
}

// common/window.h's clamp, for a handler that builds kernel parameters itself (see kMaxSeqLen).
inline int32_t unbounded_past_reach(int32_t window, const AttentionDims& a) {
  return clamp_window_past_reach(window, a.s_q, a.s_k);
}

// Copies the sizes into a kernel's parameters (each fits in int32 once read_attention_dims passed
// and the handler checked d).
template <class Params>
void set_dims(Params& p, const AttentionDims& a) {
  p.b = static_cast<int>(a.b);
  p.s_q = static_cast<int>(a.s_q);
  p.s_k = static_cast<int>(a.s_k);
  p.h = static_cast<int>(a.h);
  p.h_k = static_cast<int>(a.h_k);
  p.d = static_cast<int>(a.d);
}

}  // namespace jax_fa3::ffi_util
