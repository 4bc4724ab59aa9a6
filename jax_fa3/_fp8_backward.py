"""The fp8 attention backward (`flash_attention_fp8(backward="fp8")`) on one device: the Hopper
kernel (`jax_fa3_flash_bwd_fp8`, cuda/flash_bwd/fp8_traits.cuh) where it applies, else the pure-JAX
emulation that defines its numerics (`jax_fa3._fp8_backward_emulation`, announced once on the
`jax_fa3` logger).

The kernel's operands are laid out here, in XLA: the fp8 wgmma reads both shared-memory operands
K-major, so q8 and the quantized dO go to it a second time transposed, (b, h, d, s_q rounded up
to 32) with the rows permuted inside each group of 32 (`_fp8_quantize.kernel_v_layout`, the fp8
forward's V layout), for the dK and dV GEMMs whose K dimension is the query rows; k8 goes
dequantized too, in 16 bits, for the dQ GEMM. The per-row factors (r folded into the LSE, D,
q's scale, the dK operand's w, dq's unscale) come from `backward_rows`, padded to whole query
tiles of the kernel (`backward_tile_q`).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_fa3 import _ffi, _fp8_forward, _local_attention
from jax_fa3._batching import fold_vmap_into_batch
from jax_fa3._config import Fp8Config
from jax_fa3._fp8_backward_emulation import (P_PRESCALE_LOG2, backward_rows, backward_tile_q,
                                             dequantized_keys, emulated_backward, operand_dtype)
from jax_fa3._fp8_quantize import kernel_v_layout

KERNEL_TARGET = "jax_fa3_flash_bwd_fp8"
KERNEL_HEAD_DIM_BUCKETS = (64, 128)  # cuda/flash_bwd/params.h kFp8BwdHeadDimBuckets


def kernel_bucket(d: int) -> int | None:
  """The compiled head-dim bucket of the fp8 backward kernel that runs head dim d, or None."""
  if d % 16 != 0:
    return None
  compiled = _ffi.build_config().get("head_dims", ())
  return next((b for b in KERNEL_HEAD_DIM_BUCKETS if d <= b and str(b) in compiled), None)


def kernel_unavailable_reason(d: int) -> str | None:
  if not _ffi.kernels_available():
    return _ffi.kernels_unavailable_reason()
  if not _local_attention.backward_kernel_enabled():
    return f"{_local_attention.BACKWARD_KERNEL_ENV}=0"
  if not _ffi.has_target(KERNEL_TARGET):
    return f"this build has no {KERNEL_TARGET} kernel"
  if kernel_bucket(d) is None:
    return (f"no fp8 backward kernel for head_dim {d} (needs a multiple of 16 up to a compiled "
            f"bucket of {KERNEL_HEAD_DIM_BUCKETS}; JAX_FA3_HEAD_DIMS at build time)")
  return None


def kernel_operands(q8, k8, v, out, lse, dout, q_rows, k_rows, cfg: Fp8Config, dlse=None):
  """The fourteen inputs of `jax_fa3_flash_bwd_fp8` (cuda/flash_bwd/params.h, FlashBwdFp8Params):
  q8, q8ᵀ, k8, k~, v, dO (16-bit), dO8ᵀ, then per row (b, h, s_q_pad) LSE'·log2(e), D, q's scale
  and w (padded with +inf, 0, 0, 0), dq's factor (b, h, s_q), k's scale per key (b, h_k, s_k)
  and dv's factor s_max / 2^8 (b, h_k)."""
  b, s_q, h, d = q8.shape
  h_k = k8.shape[2]
  f32 = jnp.float32
  op16 = operand_dtype(v.dtype)
  rows = backward_rows(out, lse, dout, h_k, dlse)
  tile = backward_tile_q(d)
  padding = ((0, 0), (0, 0), (0, -(-s_q // tile) * tile - s_q))
  pad = lambda x, value: jnp.pad(x, padding, constant_values=value)
  q_scale = q_rows.astype(f32)
  k_used = dequantized_keys(k8, jnp.swapaxes(k_rows.astype(f32), 1, 2)[..., None], op16)
  # dO8 is materialized before its transposition: fused into the transpose, XLA's quantization
  # read dO in the transposed, strided order (240 us on the H200 at 16k tokens, width 2048; both
  # transposes together now take 57 us on an H100).
  do8 = lax.optimization_barrier(rows.do8)
  return (q8, kernel_v_layout(q8), k8, k_used, v.astype(op16), dout.astype(op16),
          kernel_v_layout(do8), pad(rows.lse2, jnp.inf), pad(rows.delta, 0.0),
          pad(q_scale, 0.0), pad(q_scale * rows.unscale, 0.0),
          rows.unscale * f32(cfg.attention.softmax_scale), k_rows.astype(f32),
          rows.s_max / f32(2.0**P_PRESCALE_LOG2))


def kernel_backward(cfg: Fp8Config):
  """The kernel call on `kernel_operands`: (dq, dk, dv) float32, dq and dk in the rotated basis."""
  att = cfg.attention

  def call(*operands):
    q8, k8 = operands[0], operands[2]
    b, s_q, h, d = q8.shape
    s_k, h_k = k8.shape[1], k8.shape[2]
    workspace = _ffi.flash_bwd_fp8_workspace_bytes(b, h, s_q, d, att.deterministic)
    result_types = (jax.ShapeDtypeStruct((b, s_q, h, d), jnp.float32),
                    jax.ShapeDtypeStruct((b, s_k, h_k, d), jnp.float32),
                    jax.ShapeDtypeStruct((b, s_k, h_k, d), jnp.float32),
                    jax.ShapeDtypeStruct((workspace,), jnp.uint8))
    dq, dk, dv, _ = _ffi.call(
        KERNEL_TARGET, result_types, *operands, softmax_scale=np.float32(att.softmax_scale),
        window_left=np.int32(att.window_left), window_right=np.int32(att.window_right),
        deterministic=np.bool_(att.deterministic))
    return dq, dk, dv

  return fold_vmap_into_batch(call)


def _emulate(q8, k8, v, out, lse, dout, q_rows, k_rows, dlse, cfg: Fp8Config):
  q_scale = _fp8_forward.block_scales(q_rows, cfg.block_size)
  k_scale = _fp8_forward.block_scales(k_rows, cfg.block_size)
  return emulated_backward(q8, q_scale, k8, k_scale, v, out, lse, dout, cfg, dlse=dlse)


def _on_kernel(q8, k8, v, out, lse, dout, q_rows, k_rows, dlse, cfg: Fp8Config):
  operands = kernel_operands(q8, k8, v, out, lse, dout, q_rows, k_rows, cfg, dlse=dlse)
  return kernel_backward(cfg)(*operands)


def fp8_backward(q8, k8, v, out, lse, dout, q_rows, k_rows, cfg: Fp8Config, dlse=None):
  """(dq, dk, dv) float32 of the fp8 backward, dq and dk in the rotated basis: the kernel on
  Hopper, else the emulation. q8, k8: the forward's e4m3 (rotated) q and k; q_rows (b, h, s_q),
  k_rows (b, h_k, s_k): their scales per token; out, lse: the forward's; dout like out."""
  d = q8.shape[-1]
  args = (q8, k8, v, out, lse, dout, q_rows, k_rows, dlse)
  emulate = functools.partial(_emulate, cfg=cfg)
  reason = kernel_unavailable_reason(d)
  if reason is not None:
    _ffi.announce_once(f"fp8-backward:{reason}", "jax_fa3: backward=\"fp8\" runs the pure-JAX "
                       f"emulation of the fp8 backward kernel: {reason}; on a GPU it is much "
                       "slower than backward=\"bf16\" (float32 einsums over query tiles)")
    return emulate(*args)
  _ffi.check_kernel_sizes(q8.shape, k8.shape)
  if dlse is None:  # platform_dependent takes arrays only
    drop = lambda f: lambda *a: f(*a, None)
    return lax.platform_dependent(*args[:-1], cuda=drop(functools.partial(_on_kernel, cfg=cfg)),
                                  default=drop(emulate))
  return lax.platform_dependent(*args, cuda=functools.partial(_on_kernel, cfg=cfg),
                                default=emulate)
