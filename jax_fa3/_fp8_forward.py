"""The fp8 attention forward on one device: the Hopper kernel (`jax_fa3_flash_fwd_fp8`) where it
applies, else its pure-JAX emulation (`jax_fa3._fp8_emulation`, announced once on the `jax_fa3`
logger).

`fp8_forward` takes quantized inputs; `forward_from_float_local` quantizes q, k and v first
(`jax_fa3._fp8_quantize`). On the GPU the latter quantizes v straight into the kernel's V layout
(keys contiguous, permuted inside groups of 32, zero-padded to a multiple of 32), so the kernel
skips the transpose pre-pass it runs on pre-quantized v; the bytes are the same, so is the output.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_fa3 import _ffi, _fp8_quantize
from jax_fa3._batching import fold_vmap_into_batch
from jax_fa3._config import Fp8Config
from jax_fa3._fp8_emulation import emulated_forward

KERNEL_TARGET = "jax_fa3_flash_fwd_fp8"
KERNEL_HEAD_DIM_BUCKETS = (64, 128, 256)  # cuda/flash_fwd/fp8/flash_fwd_fp8.h kFp8HeadDimBuckets


def kernel_forward(cfg: Fp8Config, v_transposed: bool = False):
  """The kernel call; v_transposed: v is already in its layout (b, h_k, d, s_pad)."""
  att = cfg.attention

  def call(q8, k8, v8, q_scale, k_scale, v_scale, v_mean):
    b, s_q, h, d = q8.shape
    s_k, h_k = k8.shape[1], k8.shape[2]
    # V transposed unless v arrives so, the k scales (k_col), the tail split's slots: the size lives
    # in C++ only (flash_fwd_fp8_workspace_bytes), which the handler checks the buffer against.
    masked = att.window_left >= 0 or att.window_right >= 0
    workspace = max(16, _ffi.flash_fwd_fp8_workspace_bytes(b, s_q, s_k, h, h_k, d, masked,
                                                          v_transposed))
    result_types = (jax.ShapeDtypeStruct(q8.shape, jnp.bfloat16),
                    jax.ShapeDtypeStruct((b, h, s_q), jnp.float32),
                    # scratch (transposed V, expanded k scales), dropped: XLA allocates it with
                    # the call's temporaries (the FFI ScratchAllocator gave nothing; H200,
                    # 2026-11-30)
                    jax.ShapeDtypeStruct((workspace,), jnp.uint8))
    out, lse, _ = _ffi.call(
        KERNEL_TARGET, result_types, q8, k8, v8, q_scale, k_scale, v_scale, v_mean,
        softmax_scale=np.float32(att.softmax_scale),
        window_left=np.int32(att.window_left), window_right=np.int32(att.window_right),
        block_size=np.int32(cfg.block_size), v_transposed=np.bool_(v_transposed))
    return out, lse

  return fold_vmap_into_batch(call)


def kernel_bucket(d: int) -> int | None:
  """The compiled fp8 head-dim bucket that runs head dim d (None: no kernel for d)."""
  if d % 16 != 0:
    return None
  compiled = _ffi.build_config().get("head_dims", ())
  for bucket in KERNEL_HEAD_DIM_BUCKETS:
    if d <= bucket and str(bucket) in compiled:
      return bucket
  return None


def kernel_unavailable_reason(d: int | None = None) -> str | None:
  if not _ffi.kernels_available():
    return _ffi.kernels_unavailable_reason()
  if not _ffi.has_target(KERNEL_TARGET):
    return f"this build has no {KERNEL_TARGET} kernel"
  if d is not None and kernel_bucket(d) is None:
    return (f"no fp8 kernel for head_dim {d} in this build (needs a multiple of 16 up to a "
            f"compiled bucket of {KERNEL_HEAD_DIM_BUCKETS}; JAX_FA3_HEAD_DIMS at build time)")
  return None


@functools.partial(jax.jit, static_argnums=(7,))
def _fp8_forward_jit(q8, k8, v8, q_scale, k_scale, v_scale, v_mean, cfg: Fp8Config):
  def emulate(*args):
    return emulated_forward(*args[:6], cfg, v_mean=args[6])
  reason = kernel_unavailable_reason(q8.shape[-1])
  if reason is not None:
    _ffi.announce_once(f"fp8:{reason}", f"jax_fa3: emulating the fp8 attention kernel in pure "
                       f"JAX: {reason}")
    return emulate(q8, k8, v8, q_scale, k_scale, v_scale, v_mean)
  _ffi.check_kernel_sizes(q8.shape, k8.shape)
  return lax.platform_dependent(q8, k8, v8, q_scale, k_scale, v_scale, v_mean,
                                cuda=kernel_forward(cfg), default=emulate)


def fp8_forward(q8, k8, v8, q_scale, k_scale, v_scale, cfg: Fp8Config, v_mean=None):
  """(out bf16, lse f32) from quantized inputs: v_scale (b, h_k), v_mean float32 (b, h_k, d) that
  v was centred by (None: 0). Kernel on Hopper, else emulated."""
  # Only the attention options, block size and tile shape the computation (one compilation for
  # rotated and unrotated inputs, with or without a returned lse).
  cfg = dataclasses.replace(cfg, incoherent=False, return_lse=False)
  if v_mean is None:
    b, _, h_k, d = k8.shape
    v_mean = jnp.zeros((b, h_k, d), jnp.float32)
  return _fp8_forward_jit(q8, k8, v8, q_scale, k_scale, v_scale, v_mean, cfg)


def v_transposed_by_quantize(v, cfg: Fp8Config) -> bool:
  """Whether the user's call from floats runs v's quantization in the kernel's V layout: the
  fp8 kernel and the fused pass both apply, and the config asks for it."""
  return (cfg.transpose_v_in_quantize and kernel_unavailable_reason(v.shape[-1]) is None
          and _fp8_quantize.fused_quantize_supported(v, None))


def dequantized(values, scales, cfg: Fp8Config, dtype):
  """What the kernel multiplies for q or k: the e4m3 values times their block's scale, in the
  inputs' dtype (the bf16 backward's operands, jax_fa3.fp8)."""
  per_token = _fp8_quantize.per_token(scales, cfg.block_size, values.shape[1])
  return (values.astype(jnp.float32) * per_token).astype(dtype)


def kernel_operands_from_float(q, k, v, signs, incoherent: bool, block_size: int):
  """The GPU branch's preparation pass: q and k rotated (when `incoherent`) and quantized per
  `block_size` tokens as everywhere, v centred straight into the kernel's V layout. Returns
  (q8, k8, vt, q_scale, k_scale, v_scale, v_mean), the kernel's operands in its order."""
  q8, q_scale = _fp8_quantize.rotate_quantize(q, signs, incoherent, block_size)
  k8, k_scale = _fp8_quantize.rotate_quantize(k, signs, incoherent, block_size)
  vt, v_scale, v_mean = _fp8_quantize.centre_v_kernel_layout(v)
  return q8, k8, vt, q_scale, k_scale, v_scale, v_mean


def _kernel_from_float(q, k, v, signs, cfg: Fp8Config):
  """The GPU branch: the preparation pass (kernel_operands_from_float), then the kernel on v in
  its layout. Returns (out, lse, q8, q_scale, k8, k_scale)."""
  operands = kernel_operands_from_float(q, k, v, signs, cfg.incoherent, cfg.block_size)
  out, lse = kernel_forward(cfg, v_transposed=True)(*operands)
  q8, k8, _, q_scale, k_scale, _, _ = operands
  return out, lse, q8, q_scale, k8, k_scale


def _float_path(q, k, v, signs, cfg: Fp8Config):
  q8, k8, v8, q_scale, k_scale, v_scale, v_mean = _fp8_quantize.rotate_and_quantize(
      q, k, v, signs, cfg.incoherent, cfg.block_size)
  out, lse = fp8_forward(q8, k8, v8, q_scale, k_scale, v_scale, cfg, v_mean=v_mean)
  return out, lse, q8, q_scale, k8, k_scale


@functools.partial(jax.jit, static_argnums=(4,))
def _kernel_from_float_jit(q, k, v, signs, cfg: Fp8Config):
  return lax.platform_dependent(q, k, v, signs,
                                cuda=functools.partial(_kernel_from_float, cfg=cfg),
                                default=functools.partial(_float_path, cfg=cfg))


def _from_float(q, k, v, signs, cfg: Fp8Config):
  """(out in q's dtype, lse, q8, q_scale, k8, k_scale)."""
  path = _kernel_from_float_jit if v_transposed_by_quantize(v, cfg) else _float_path
  out, lse, q8, q_scale, k8, k_scale = path(q, k, v, signs, cfg)
  return out.astype(q.dtype), lse, q8, q_scale, k8, k_scale


def token_scales(scales, block_size: int, seqlen: int):
  """(b, h, n_blocks) block scales -> (b, h, seqlen): each token's block's scale."""
  return jnp.repeat(scales, block_size, axis=-1)[..., :seqlen]


def block_scales(rows, block_size: int):
  """The inverse of token_scales: (b, h, seqlen) -> (b, h, n_blocks)."""
  return rows[..., ::block_size]


def forward_from_float_local(q, k, v, signs, cfg: Fp8Config):
  """(out in q's dtype, lse) of the call from floats on one device's blocks: the local body of
  the partitioned op `jax_fa3.fp8.FP8_FORWARD` (cfg arrives with return_lse off)."""
  return _from_float(q, k, v, signs, cfg)[:2]


def forward_from_float_with_operands_local(q, k, v, signs, cfg: Fp8Config):
  """(out, lse, q_used, k_used): also the rotated q and k as the kernel saw them (dequantized, in
  q's and k's dtype), which the bf16 backward differentiates at (`jax_fa3.fp8`)."""
  out, lse, q8, q_scale, k8, k_scale = _from_float(q, k, v, signs, cfg)
  return (out, lse, dequantized(q8, q_scale, cfg, q.dtype), dequantized(k8, k_scale, cfg, k.dtype))


def forward_from_float_quantized_local(q, k, v, signs, cfg: Fp8Config):
  """(out, lse, q8, q_rows, k8, k_rows): also the e4m3 q and k the kernel multiplied and their
  scales per token (`token_scales`), which the fp8 backward starts from (`jax_fa3.fp8`)."""
  out, lse, q8, q_scale, k8, k_scale = _from_float(q, k, v, signs, cfg)
  return (out, lse, q8, token_scales(q_scale, cfg.block_size, q.shape[1]), k8,
          token_scales(k_scale, cfg.block_size, k.shape[1]))
