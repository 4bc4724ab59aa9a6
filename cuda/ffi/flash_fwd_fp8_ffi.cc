// XLA FFI handler for the fp8 (e4m3) forward kernel (target "jax_fa3_flash_fwd_fp8").
// Contract: jax_fa3/fp8.py (module docstring, _kernel_forward). Validates every buffer and
// attribute (errors name the argument), then runs the V transpose pre-pass (or, when V arrives
// transposed, only the k scale expansion) and the kernel.
#include <cmath>
#include <cstdint>

#include "ffi/ffi_common.h"
#include "ffi/handlers.h"
#include "ffi/registry.h"
#include "flash_fwd/fp8/flash_fwd_fp8.h"

namespace jax_fa3 {
namespace {

namespace ffi = xla::ffi;
using ffi_util::invalid;
using ffi_util::shape_str;

bool dims_are(ffi::AnyBuffer::Dimensions dims, std::initializer_list<int64_t> expected) {
  if (dims.size() != expected.size()) return false;
  size_t i = 0;
  for (int64_t e : expected) {
    if (dims[i++] != e) return false;
  }
  return true;
}

ffi::Error flash_fwd_fp8_impl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k,
                              ffi::AnyBuffer v, ffi::AnyBuffer q_scale, ffi::AnyBuffer k_scale,
                              ffi::AnyBuffer v_scale, ffi::AnyBuffer v_mean,
                              ffi::Result<ffi::AnyBuffer> out,
                              ffi::Result<ffi::AnyBuffer> lse,
                              ffi::Result<ffi::AnyBuffer> workspace, float softmax_scale,
                              int32_t window_left, int32_t window_right, int32_t block_size,
                              bool v_transposed) {
  constexpr auto kE4M3 = ffi::DataType::F8E4M3FN;
  constexpr auto kF32 = ffi::DataType::F32;
  const auto qd = q.dimensions();
  const auto kd = k.dimensions();
  const auto vd = v.dimensions();
  if (q.element_type() != kE4M3) return invalid("flash_fwd_fp8: q must be float8_e4m3fn");
  if (k.element_type() != kE4M3) return invalid("flash_fwd_fp8: k must be float8_e4m3fn");
  if (v.element_type() != kE4M3) return invalid("flash_fwd_fp8: v must be float8_e4m3fn");
  if (qd.size() != 4) return invalid("flash_fwd_fp8: q must have rank 4 (b, s_q, h, d), got shape ", shape_str(qd));
  if (kd.size() != 4) return invalid("flash_fwd_fp8: k must have rank 4 (b, s_k, h_k, d), got shape ", shape_str(kd));
  if (vd.size() != 4) return invalid("flash_fwd_fp8: v must have rank 4 (b, s_k, h_k, d), got shape ", shape_str(vd));
  const int64_t b = qd[0], s_q = qd[1], h = qd[2], d = qd[3];
  const int64_t s_k = kd[1], h_k = kd[2];
  if (kd[0] != b) return invalid("flash_fwd_fp8: k batch must equal q batch ", b, ", got ", kd[0]);
  if (kd[3] != d) return invalid("flash_fwd_fp8: k head dim must equal q head dim ", d, ", got ", kd[3]);
  if (v_transposed && !dims_are(vd, {kd[0], kd[2], kd[3], flash_fwd_fp8_key_pad(kd[1])})) {
    return invalid("flash_fwd_fp8: v_transposed: v must be (b, h_k, d, s_k rounded up to 32) = (",
                   kd[0], ", ", kd[2], ", ", kd[3], ", ", flash_fwd_fp8_key_pad(kd[1]), "), got ",
                   shape_str(vd));
  }
  if (!v_transposed && !dims_are(vd, {kd[0], kd[1], kd[2], kd[3]})) {
    return invalid("flash_fwd_fp8: v must have k's shape ", shape_str(kd), ", got ", shape_str(vd));
  }
  if (h_k < 1 || h % h_k != 0) {
    return invalid("flash_fwd_fp8: q heads must be a multiple of k/v heads (GQA), got h=", h,
                   ", h_k=", h_k);
  }
  constexpr int64_t kMaxInt = INT32_MAX;
  if (b > kMaxInt || s_q > kMaxInt || s_k > kMaxInt || h > kMaxInt ||
      b * h_k * flash_fwd_fp8_key_pad(s_k) * (d + 4) > int64_t(1) << 46) {
    return invalid("flash_fwd_fp8: every dimension must fit in int32, got q ", shape_str(qd),
                   " and k ", shape_str(kd));
  }
  if (block_size < 1) return invalid("flash_fwd_fp8: block_size must be >= 1, got ", block_size);
  if (!std::isfinite(softmax_scale) || softmax_scale <= 0.f) {
    return invalid("flash_fwd_fp8: softmax_scale must be finite and > 0, got ", softmax_scale);
  }
  if (window_left < -1) return invalid("flash_fwd_fp8: window_left must be >= -1, got ", window_left);
  if (window_right < -1) return invalid("flash_fwd_fp8: window_right must be >= -1, got ", window_right);

  const int64_t nq = (s_q + block_size - 1) / block_size;
  const int64_t nk = (s_k + block_size - 1) / block_size;
  if (q_scale.element_type() != kF32) return invalid("flash_fwd_fp8: q_scale must be float32");
  if (!dims_are(q_scale.dimensions(), {b, h, nq})) {
    return invalid("flash_fwd_fp8: q_scale must have shape (b, h, ceil(s_q / block_size)) = (", b,
                   ", ", h, ", ", nq, "), got ", shape_str(q_scale.dimensions()));
  }
  if (k_scale.element_type() != kF32) return invalid("flash_fwd_fp8: k_scale must be float32");
  if (!dims_are(k_scale.dimensions(), {b, h_k, nk})) {
    return invalid("flash_fwd_fp8: k_scale must have shape (b, h_k, ceil(s_k / block_size)) = (",
                   b, ", ", h_k, ", ", nk, "), got ", shape_str(k_scale.dimensions()));
  }
  if (v_scale.element_type() != kF32) return invalid("flash_fwd_fp8: v_scale must be float32");
  if (!dims_are(v_scale.dimensions(), {b, h_k})) {
    return invalid("flash_fwd_fp8: v_scale must have shape (b, h_k) = (", b, ", ", h_k, "), got ",
                   shape_str(v_scale.dimensions()));
  }
  if (v_mean.element_type() != kF32) return invalid("flash_fwd_fp8: v_mean must be float32");
  if (!dims_are(v_mean.dimensions(), {b, h_k, d})) {
    return invalid("flash_fwd_fp8: v_mean must have shape (b, h_k, d) = (", b, ", ", h_k, ", ", d,
                   "), got ", shape_str(v_mean.dimensions()));
  }
  if (out->element_type() != ffi::DataType::BF16) return invalid("flash_fwd_fp8: out must be bfloat16");
  if (!dims_are(out->dimensions(), {b, s_q, h, d})) {
    return invalid("flash_fwd_fp8: out must have q's shape ", shape_str(qd), ", got ",
                   shape_str(out->dimensions()));
  }
  if (lse->element_type() != kF32) return invalid("flash_fwd_fp8: lse must be float32");
  if (!dims_are(lse->dimensions(), {b, h, s_q})) {
    return invalid("flash_fwd_fp8: lse must have shape (b, h, s_q) = (", b, ", ", h, ", ", s_q,
                   "), got ", shape_str(lse->dimensions()));
  }
  const bool masked = window_left >= 0 || window_right >= 0;
  const size_t ws_bytes =
      flash_fwd_fp8_workspace_bytes(b, s_q, s_k, h, h_k, d, masked, v_transposed);
  if (workspace->element_type() != ffi::DataType::U8 || workspace->dimensions().size() != 1 ||
      workspace->size_bytes() < ws_bytes) {
    return invalid("flash_fwd_fp8: workspace must be a uint8 vector of at least ", ws_bytes,
                   " bytes (", v_transposed ? "b*h_k*s_pad*4" : "b*h_k*s_pad*(d+4)",
                   " with s_pad = s_k rounded up to 32, plus the tail split's slots: "
                   "flash_fwd_fp8_workspace_bytes), got shape ",
                   shape_str(workspace->dimensions()));
  }

  // After the shape checks, so a malformed call is reported as such first.
  const int bucket = fp8_head_dim_bucket(static_cast<int>(d));
  if (bucket == 0) {
    return invalid("flash_fwd_fp8: no fp8 kernel for head dim ", d,
                   " (needs a multiple of 16 up to a compiled bucket of 64/128/256; this build "
                   "has JAX_FA3_HEAD_DIMS with ",
#ifdef JAX_FA3_HAS_HDIM64
                   "64 ",
#endif
#ifdef JAX_FA3_HAS_HDIM128
                   "128 ",
#endif
#ifdef JAX_FA3_HAS_HDIM256
                   "256 ",
#endif
                   "of those)");
  }

  FlashFwdFp8Params params{};
  params.q = q.untyped_data();
  params.k = k.untyped_data();
  params.v = v.untyped_data();
  params.q_scale = static_cast<const float*>(q_scale.untyped_data());
  params.k_scale = static_cast<const float*>(k_scale.untyped_data());
  params.v_scale = static_cast<const float*>(v_scale.untyped_data());
  params.v_mean = static_cast<const float*>(v_mean.untyped_data());
  params.o = out->untyped_data();
  params.lse = static_cast<float*>(lse->untyped_data());
  params.workspace = workspace->untyped_data();
  params.v_transposed = v_transposed;
  params.b = static_cast<int>(b);
  params.s_q = static_cast<int>(s_q);
  params.s_k = static_cast<int>(s_k);
  params.h = static_cast<int>(h);
  params.h_k = static_cast<int>(h_k);
  params.d = static_cast<int>(d);
  params.block_size = block_size;
  params.softmax_scale = softmax_scale;
  params.window_left = window_left;
  params.window_right = window_right;
  // JAX_FA3_FP8_TAIL_SPLIT=0 runs the last round's tiles whole (for timing the split's gain;
  // the outputs then differ only in the order the fp8 tensor cores accumulate O).
  params.tail_split = !ffi_util::env_flag_is_zero("JAX_FA3_FP8_TAIL_SPLIT");
  // The workspace too: the kernel must not depend on what a previous op left in XLA's scratch
  // (the tail split's tickets are cleared by its pre-kernel, tail_split.h).
  if (const cudaError_t err = ffi_util::poison_if_requested(stream, out, lse, workspace);
      err != cudaSuccess) {
    return ffi_util::from_cuda(err, "flash_fwd_fp8 output poisoning (JAX_FA3_DEBUG_POISON_OUTPUTS)");
  }
  return ffi_util::from_cuda(launch_flash_fwd_fp8(params, stream), "flash_fwd_fp8 kernel launch");
}

}  // namespace
}  // namespace jax_fa3

extern "C" size_t jax_fa3_flash_fwd_fp8_workspace_bytes(int64_t b, int64_t s_q, int64_t s_k,
                                                        int64_t h, int64_t h_k, int64_t d,
                                                        bool masked, bool v_transposed) {
  return jax_fa3::flash_fwd_fp8_workspace_bytes(b, s_q, s_k, h, h_k, d, masked, v_transposed);
}

// Graph-capturable: no host synchronization, no allocation, no per-call host state.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFa3FlashFwdFp8, jax_fa3::flash_fwd_fp8_impl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()   // q8
                                  .Arg<xla::ffi::AnyBuffer>()   // k8
                                  .Arg<xla::ffi::AnyBuffer>()   // v8
                                  .Arg<xla::ffi::AnyBuffer>()   // q_scale
                                  .Arg<xla::ffi::AnyBuffer>()   // k_scale
                                  .Arg<xla::ffi::AnyBuffer>()   // v_scale
                                  .Arg<xla::ffi::AnyBuffer>()   // v_mean
                                  .Ret<xla::ffi::AnyBuffer>()   // out bf16
                                  .Ret<xla::ffi::AnyBuffer>()   // lse f32
                                  .Ret<xla::ffi::AnyBuffer>()   // workspace uint8 (discarded)
                                  .Attr<float>("softmax_scale")
                                  .Attr<int32_t>("window_left")
                                  .Attr<int32_t>("window_right")
                                  .Attr<int32_t>("block_size")
                                  .Attr<bool>("v_transposed"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
