// XLA FFI handler for the FlashAttention-3 backward (jax_fa3_flash_bwd, docs/CONTRACTS.md):
// validates buffers and attributes, carves the workspace from the scratch allocator, dispatches
// to the compiled (head-dim bucket, dtype) instantiation.
#include <cmath>
#include <cstdint>

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

cudaError_t dispatch(int bucket, DType dtype, const FlashBwdParams& p, cudaStream_t stream,
                     bool& compiled) {
  compiled = true;
#define JAX_FA3_CASE(D, DT, DTYPE)                                                    \
  if (bucket == D && dtype == DTYPE) return flash_bwd::run_flash_bwd_hdim##D##_##DT(p, stream);
#if defined(JAX_FA3_HAS_BF16)
#if defined(JAX_FA3_HAS_HDIM64)
  JAX_FA3_CASE(64, bf16, DType::kBFloat16)
#endif
#if defined(JAX_FA3_HAS_HDIM96)
  JAX_FA3_CASE(96, bf16, DType::kBFloat16)
#endif
#if defined(JAX_FA3_HAS_HDIM128)
  JAX_FA3_CASE(128, bf16, DType::kBFloat16)
#endif
#if defined(JAX_FA3_HAS_HDIM192)
  JAX_FA3_CASE(192, bf16, DType::kBFloat16)
#endif
#if defined(JAX_FA3_HAS_HDIM256)
  JAX_FA3_CASE(256, bf16, DType::kBFloat16)
#endif
#endif
#if defined(JAX_FA3_HAS_FP16)
#if defined(JAX_FA3_HAS_HDIM64)
  JAX_FA3_CASE(64, fp16, DType::kFloat16)
#endif
#if defined(JAX_FA3_HAS_HDIM96)
  JAX_FA3_CASE(96, fp16, DType::kFloat16)
#endif
#if defined(JAX_FA3_HAS_HDIM128)
  JAX_FA3_CASE(128, fp16, DType::kFloat16)
#endif
#if defined(JAX_FA3_HAS_HDIM192)
  JAX_FA3_CASE(192, fp16, DType::kFloat16)
#endif
#if defined(JAX_FA3_HAS_HDIM256)
  JAX_FA3_CASE(256, fp16, DType::kFloat16)
#endif
#endif
#undef JAX_FA3_CASE
  compiled = false;
  return cudaErrorInvalidValue;
}

ffi::Error check_rank4(const char* name, ffi::AnyBuffer::Dimensions dims) {
  if (dims.size() != 4) {
    return invalid("flash_bwd: ", name, " must have rank 4 (batch, seqlen, heads, head_dim), got shape ",
                   shape_str(dims));
  }
  return ffi::Error::Success();
}

ffi::Error flash_bwd_impl(cudaStream_t stream, ffi::AnyBuffer q,
                          ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer out,
                          ffi::AnyBuffer dout, ffi::AnyBuffer lse, float softmax_scale,
                          float softcap, int32_t window_left, int32_t window_right,
                          bool deterministic, ffi::Result<ffi::AnyBuffer> dq,
                          ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                          ffi::Result<ffi::AnyBuffer> workspace) {
  for (auto [name, buf] : {std::pair<const char*, ffi::AnyBuffer*>{"q", &q}, {"k", &k}, {"v", &v},
                           {"out", &out}, {"dout", &dout}}) {
    if (auto err = check_rank4(name, buf->dimensions()); err.failure()) return err;
  }
  const auto qd = q.dimensions();
  const auto kd = k.dimensions();
  const int64_t b = qd[0], s_q = qd[1], h = qd[2], d = qd[3];
  const int64_t s_k = kd[1], h_k = kd[2];
  const auto dtype = ffi_util::to_dtype(q.element_type());
  if (!dtype || (*dtype != DType::kBFloat16 && *dtype != DType::kFloat16)) {
    return invalid("flash_bwd: q must be bfloat16 or float16, got ",
                   dtype ? dtype_name(*dtype) : "an unsupported dtype");
  }
  for (auto [name, buf] : {std::pair<const char*, ffi::AnyBuffer*>{"k", &k}, {"v", &v},
                           {"out", &out}, {"dout", &dout}}) {
    if (buf->element_type() != q.element_type()) {
      const auto t = ffi_util::to_dtype(buf->element_type());
      return invalid("flash_bwd: ", name, " must have q's dtype ", dtype_name(*dtype), ", got ",
                     t ? dtype_name(*t) : "an unsupported dtype");
    }
  }
  if (kd[0] != b || kd[3] != d) {
    return invalid("flash_bwd: k must have shape (", b, ", s_k, h_k, ", d, ") to match q ",
                   shape_str(qd), ", got ", shape_str(kd));
  }
  const auto vd = v.dimensions();
  if (vd[0] != kd[0] || vd[1] != kd[1] || vd[2] != kd[2] || vd[3] != kd[3]) {
    return invalid("flash_bwd: v must have k's shape ", shape_str(kd), ", got ", shape_str(vd));
  }
  for (auto [name, buf] : {std::pair<const char*, ffi::AnyBuffer*>{"out", &out}, {"dout", &dout}}) {
    const auto od = buf->dimensions();
    if (od[0] != qd[0] || od[1] != qd[1] || od[2] != qd[2] || od[3] != qd[3]) {
      return invalid("flash_bwd: ", name, " must have q's shape ", shape_str(qd), ", got ",
                     shape_str(od));
    }
  }
  const auto ld = lse.dimensions();
  if (lse.element_type() != ffi::DataType::F32) {
    return invalid("flash_bwd: lse must be float32");
  }
  if (ld.size() != 3 || ld[0] != b || ld[1] != h || ld[2] != s_q) {
    return invalid("flash_bwd: lse must have shape (", b, ", ", h, ", ", s_q, ") = (b, h, s_q), got ",
                   shape_str(ld));
  }
  if (h_k < 1 || h % h_k != 0) {
    return invalid("flash_bwd: the number of q heads (", h, ") must be a multiple of the number of k/v heads (",
                   h_k, ")");
  }
  if (d % 8 != 0 || d < 8 || d > 256) {
    return invalid("flash_bwd: head_dim must be a multiple of 8 in [8, 256], got ", d);
  }
  if (!std::isfinite(softmax_scale) || softmax_scale <= 0.f) {
    return invalid("flash_bwd: softmax_scale must be finite and > 0, got ", softmax_scale);
  }
  if (!(softcap >= 0.f) || !std::isfinite(softcap)) {
    return invalid("flash_bwd: softcap must be finite and >= 0 (0 = off), got ", softcap);
  }
  if (window_left < -1) return invalid("flash_bwd: window_left must be >= -1, got ", window_left);
  if (window_right < -1) return invalid("flash_bwd: window_right must be >= -1, got ", window_right);
  if (b > 65535 || h_k > 65535 || s_q > (int64_t(1) << 30) || s_k > (int64_t(1) << 30) || h > (1 << 20)) {
    return invalid("flash_bwd: sizes out of the supported range: q ", shape_str(qd), ", k ", shape_str(kd),
                   " (batch and kv heads <= 65535, sequence lengths <= 2^30)");
  }
  const struct {
    const char* name;
    ffi::Result<ffi::AnyBuffer>* buf;
    ffi::AnyBuffer::Dimensions want;
  } results[] = {{"dq", &dq, qd}, {"dk", &dk, kd}, {"dv", &dv, kd}};
  for (const auto& r : results) {
    const auto rd = (*r.buf)->dimensions();
    bool same = rd.size() == r.want.size() && (*r.buf)->element_type() == q.element_type();
    for (size_t i = 0; same && i < rd.size(); ++i) same = rd[i] == r.want[i];
    if (!same) {
      return invalid("flash_bwd: result ", r.name, " must have dtype ", dtype_name(*dtype),
                     " and shape ", shape_str(r.want), ", got shape ", shape_str(rd));
    }
  }

  const int bucket = head_dim_bucket(static_cast<int>(d));
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
  p.b = static_cast<int>(b);
  p.s_q = static_cast<int>(s_q);
  p.s_k = static_cast<int>(s_k);
  p.h = static_cast<int>(h);
  p.h_k = static_cast<int>(h_k);
  p.d = static_cast<int>(d);
  p.softmax_scale = softmax_scale;
  p.softcap = softcap;
  p.window_left = window_left;
  p.window_right = window_right;
  p.deterministic = deterministic;
  p.dtype = *dtype;

  if (b > 0 && h > 0 && s_q > 0 && s_k > 0) {
    const auto ws = flash_bwd::workspace_layout(b, h, s_q, d, deterministic);
    // The workspace arrives as an extra (discarded) result that XLA allocates with the call's
    // other temporaries: XLA's FFI ScratchAllocator returned nothing on the H200 (JAX 0.11.2).
    if (workspace->size_bytes() < ws.total) {
      return invalid("flash_bwd: workspace must have at least ", ws.total, " bytes (see ",
                     "jax_fa3_flash_bwd_workspace_bytes), got ", workspace->size_bytes());
    }
    char* base = static_cast<char*>(workspace->untyped_data());
    p.dq_accum = reinterpret_cast<float*>(base + ws.dq_accum);
    p.lse_log2 = reinterpret_cast<float*>(base + ws.lse_log2);
    p.dpsum = reinterpret_cast<float*>(base + ws.dpsum);
    p.semaphores = deterministic ? reinterpret_cast<int*>(base + ws.semaphores) : nullptr;
  }

  if (const cudaError_t err = ffi_util::poison_if_requested(stream, dq, dk, dv); err != cudaSuccess) {
    return ffi_util::from_cuda(err, "flash_bwd output poisoning (JAX_FA3_DEBUG_POISON_OUTPUTS)");
  }
  bool compiled = false;
  const cudaError_t err = dispatch(bucket, *dtype, p, stream, compiled);
  if (!compiled) {
    return invalid("flash_bwd: no kernel compiled for head_dim ", d, " (bucket ", bucket, ") and dtype ",
                   dtype_name(*dtype), "; this build has ", jax_fa3_build_config(),
                   " (rebuild with JAX_FA3_HEAD_DIMS / JAX_FA3_DTYPES including it)");
  }
  return ffi_util::from_cuda(err, "flash_bwd kernel launch");
}

}  // namespace
}  // namespace jax_fa3

extern "C" size_t jax_fa3_flash_bwd_workspace_bytes(int64_t b, int64_t h, int64_t s_q, int64_t d,
                                                    bool deterministic) {
  return jax_fa3::flash_bwd::workspace_layout(b, h, s_q, d, deterministic).total;
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFa3FlashBwd, jax_fa3::flash_bwd_impl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()   // q
                                  .Arg<xla::ffi::AnyBuffer>()   // k
                                  .Arg<xla::ffi::AnyBuffer>()   // v
                                  .Arg<xla::ffi::AnyBuffer>()   // out
                                  .Arg<xla::ffi::AnyBuffer>()   // dout
                                  .Arg<xla::ffi::AnyBuffer>()   // lse
                                  .Attr<float>("softmax_scale")
                                  .Attr<float>("softcap")
                                  .Attr<int32_t>("window_left")
                                  .Attr<int32_t>("window_right")
                                  .Attr<bool>("deterministic")
                                  .Ret<xla::ffi::AnyBuffer>()   // dq
                                  .Ret<xla::ffi::AnyBuffer>()   // dk
                                  .Ret<xla::ffi::AnyBuffer>()   // dv
                                  .Ret<xla::ffi::AnyBuffer>()); // workspace (uint8)
