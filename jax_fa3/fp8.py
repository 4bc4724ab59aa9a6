"""FP8 (e4m3) attention forward, FlashAttention-3 style: `flash_attention_fp8`, `quantize_fp8` and
`dequantize_fp8`, with the validation of their arguments.

The pieces below the API: `jax_fa3._fp8_quantize` (rotation and quantization passes, a fused CUDA
pass on Hopper, XLA elsewhere), `jax_fa3._fp8_forward` (the kernel call, or its emulation off
Hopper) and `jax_fa3._fp8_emulation` (the kernel's numerics, written out in pure JAX). The call
from floats runs as one partitioned op (`jax_fa3._partitioning`). Gradients pass straight
through the quantization: `backward="bf16"` runs the bf16/fp16/fp32 backward kernel
(`jax_fa3.attention`) at the rotated, quantized q and k from the fp8 forward's own output and
log-sum-exp, `"recompute"` recomputes the unquantized forward first so that the gradient is
exactly `flash_attention`'s; `"fp8"` runs the fp8 backward (`jax_fa3._fp8_backward`: its Hopper
kernel, or off Hopper the pure-JAX emulation `jax_fa3._fp8_backward_emulation` that defines its
numerics).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_fa3 import (_fp8_backward, _fp8_forward, _fp8_quantize, _local_attention, _partitioning,
                     attention)
from jax_fa3._config import DEFAULT_BLOCK_SIZE, AttentionConfig, Fp8Config
from jax_fa3._fp8_quantize import E4M3, FP8_INPUT_DTYPES
from jax_fa3.hadamard import hadamard_transform
from jax_fa3._validation import (attention_config, check_array, check_attention_dtypes,
                                 check_attention_shapes, check_bool, check_fp8_backward,
                                 check_softmax_scale, check_window)

DEFAULT_SEED = 0  # key=None means jax.random.PRNGKey(DEFAULT_SEED)


def check_block_size(block_size, allow_none: bool) -> int | None:
  if block_size is None:
    if allow_none:
      return None
    return DEFAULT_BLOCK_SIZE
  if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)):
    raise TypeError(f"block_size must be a positive int{' or None' if allow_none else ''}, "
                    f"got {block_size!r}")
  if block_size < 1:
    raise ValueError(f"block_size must be a positive int, got {block_size}")
  return int(block_size)


@functools.partial(jax.jit, static_argnums=(1,))
def _quantize_jit(x, block_size):
  return _fp8_quantize.rotate_quantize(x, jnp.ones(x.shape[-1:], jnp.float32), False, block_size)


def _check_4d_float(name, x, allowed):
  check_array(name, x, rank=4)
  if not any(x.dtype == np.dtype(t) for t in allowed):
    names = ", ".join(np.dtype(t).name for t in allowed)
    raise TypeError(f"{name} must have a floating dtype in ({names}), got {x.dtype}")


def quantize_fp8(x, *, block_size=DEFAULT_BLOCK_SIZE):
  """Quantizes x to e4m3 with one float32 scale per (batch, head, block of tokens).

  For each block of `block_size` consecutive tokens of one (batch, head) — the last block may be
  shorter — `scale = amax(|block|) · float32(1/448)` (448 = e4m3's largest finite value; an all-zero block
  gets scale 1.0, and no scale is below float32's smallest normal) and
  `values = e4m3(clip(float32(x) · (1/scale), -448, 448))`, rounding to nearest even. Every element of a
  block is therefore represented with e4m3's relative precision (a step of 2^-3 relative to the
  power of two below it, so a rounding error of at most 2^-4 relative) unless it is more than
  2^15 times smaller than the block's largest (e4m3's subnormal range). A NaN gives its block scale
  1.0 (values NaN where x is NaN); an infinity gives an infinite scale (values 0, NaN at the inf).

  Args:
    x: (batch, seqlen, heads, head_dim), float32/bfloat16/float16/float64 (quantized from its
      float32 value).
    block_size: tokens per scale (default 64); None for one scale per (batch, head).

  Returns:
    (values, scales): values float8_e4m3fn with x's shape; scales float32
    (batch, heads, ceil(seqlen / block_size)). `dequantize_fp8(values, scales,
    block_size=block_size)` approximates x.
  """
  _check_4d_float("x", x, FP8_INPUT_DTYPES + (jnp.float64,))
  block_size = check_block_size(block_size, allow_none=True)
  return _quantize_jit(x, block_size)


def check_quantized(name, values, scales, block_size, allow_per_head=False):
  """Validates a (values, scales) pair; returns scales as (b, h, n_blocks)."""
  check_array(f"{name} values", values, rank=4)
  if values.dtype != np.dtype(E4M3):
    raise TypeError(f"{name} values must be float8_e4m3fn, got {values.dtype}")
  check_array(f"{name} scales", scales)
  if scales.dtype != np.dtype(jnp.float32):
    raise TypeError(f"{name} scales must be float32, got {scales.dtype}")
  b, s, h, _ = values.shape
  n = -(-s // (s if block_size is None else block_size))
  expected = (b, h, n)
  if allow_per_head and tuple(scales.shape) == (b, h):
    return scales[..., None]
  if tuple(scales.shape) != expected:
    how = ("one scale per (batch, head): quantize_fp8(v, block_size=None)" if block_size is None
           else f"block_size={block_size}")
    raise ValueError(f"{name} scales must have shape {expected} (batch, heads, blocks) for "
                     f"values of shape {values.shape} with {how}, got {tuple(scales.shape)}")
  return scales


def dequantize_fp8(values, scales, *, block_size=DEFAULT_BLOCK_SIZE, dtype=jnp.float32):
  """The inverse of quantize_fp8: float32(values) * scale of each token's block, cast to dtype.

  Args:
    values: float8_e4m3fn (batch, seqlen, heads, head_dim).
    scales: float32 (batch, heads, ceil(seqlen / block_size)).
    block_size: the block size used to quantize (default 64; None for one block per head).
    dtype: result dtype (default float32).
  """
  block_size = check_block_size(block_size, allow_none=True)
  scales = check_quantized("x", values, scales, block_size)
  block = values.shape[1] if block_size is None else block_size
  per_token = _fp8_quantize.per_token(scales, block, values.shape[1])
  return (values.astype(jnp.float32) * per_token).astype(dtype)


# The call from floats as one partitioned op (jax_fa3._partitioning): under a sharded jit its CUDA
# passes would otherwise be opaque to XLA (operands all-gathered), and the pure-JAX path's
# reshapes do not type-check on Explicit meshes. Batch and heads stay sharded (scales are per
# (batch, head, block), so each shard quantizes exactly as the whole would); a sequence split
# is gathered (blocks of tokens share a scale, and v's scale spans the whole sequence).
FP8_FORWARD = _partitioning.AttentionOp("flash_fwd_fp8", ("q", "kv", "kv", "vec"), ("q", "row"),
                                        _fp8_forward.forward_from_float_local, split_queries=False)
# The same, also returning the rotated q and k as the kernel multiplied them: dequantized (the
# operands of backward="bf16"), or in e4m3 with their scales per token (backward="fp8": one byte
# an element held for the backward instead of two, and no second quantization).
FP8_FORWARD_WITH_OPERANDS = _partitioning.AttentionOp(
    "flash_fwd_fp8_with_operands", ("q", "kv", "kv", "vec"), ("q", "row", "q", "kv"),
    _fp8_forward.forward_from_float_with_operands_local, split_queries=False)
FP8_FORWARD_QUANTIZED = _partitioning.AttentionOp(
    "flash_fwd_fp8_quantized", ("q", "kv", "kv", "vec"), ("q", "row", "q", "row", "kv", "krow"),
    _fp8_forward.forward_from_float_quantized_local, split_queries=False)


def _fp8_from_float(q, k, v, signs, cfg: Fp8Config, op=FP8_FORWARD):
  return _partitioning.call_partitioned(op, (q, k, v, signs),
                                        dataclasses.replace(cfg, return_lse=False))


# ---------------------------------------------------------------------------------------------
# Differentiation: the bf16 backward kernel, at the quantized operands or recomputing
# ---------------------------------------------------------------------------------------------

# "bf16": the bf16/fp16/fp32 backward kernel at the operands the fp8 kernel multiplied — q and k
# rotated and quantized (dequantized to their dtype), v — started from the fp8 forward's out and lse;
# the gradients of the rotated q and k are rotated back. The backward's P = exp(S - lse) then
# rebuilds the forward's scores (up to the bf16 rounding of the operands and the fp8 accumulation),
# so P sums to one as it did in the forward: the gradient of the computed function, up to the
# quantization of P and v (straight through). At the unquantized q and k instead, the fp8 error of
# the scores (~2^-4 relative) would enter P exponentially against the fp8 lse: a model whose
# attention sharpens diverged that way (examples/train_gpt.py).
# "recompute": the unquantized forward runs again first; the gradient is flash_attention's exactly.
# (_validation.FP8_BACKWARDS)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _fp8_attention(q, k, v, signs, cfg: Fp8Config, backward: str):
  return _fp8_from_float(q, k, v, signs, cfg)


def _fp8_attention_fwd(q, k, v, signs, cfg, backward):
  if backward == "recompute":
    out, lse = _fp8_from_float(q, k, v, signs, cfg)
    return (out, lse), (q, k, v, signs, None)
  if backward == "fp8":  # q8 and k8 in place of q and k
    out, lse, q8, q_rows, k8, k_rows = _fp8_from_float(q, k, v, signs, cfg, FP8_FORWARD_QUANTIZED)
    return (out, lse), (q8, k8, v, signs, (out, lse, q_rows, k_rows))
  out, lse, q_used, k_used = _fp8_from_float(q, k, v, signs, cfg, FP8_FORWARD_WITH_OPERANDS)
  return (out, lse), (q_used, k_used, v, signs, (out, lse))


def _rotate_back(x, signs, cfg: Fp8Config, out_dtype=None):
  """The transpose of x -> H·diag(signs)·x (hadamard_transform): diag(signs)·H·x, in out_dtype
  (x's by default; a float32 x rounded once, inside the transform)."""
  if not cfg.incoherent:
    return x if out_dtype is None else x.astype(out_dtype)
  return hadamard_transform(x, signs=signs, inverse=True, out_dtype=out_dtype)


def _backward_at_operands_local(q, k, v, out, lse, dout, signs, cfg: Fp8Config, dlse=None):
  """backward="bf16" on one device's blocks: the bf16 backward at the rotated operands, the
  gradients of q and k rotated back (the CUDA transform runs here, inside the partitioned op,
  where it sees only this device's rows)."""
  dq, dk, dv = _local_attention.backward_local(q, k, v, out, lse, dout, cfg.attention, dlse=dlse)
  return _rotate_back(dq, signs, cfg), _rotate_back(dk, signs, cfg), dv


def _fp8_backward_local(q8, k8, v, out, lse, dout, q_rows, k_rows, signs, cfg: Fp8Config,
                        dlse=None):
  """backward="fp8" on one device's blocks: from the forward's e4m3 q and k and their scales per
  token, the fp8 backward (`jax_fa3._fp8_backward`: the kernel on Hopper, else the emulation),
  dq and dk rotated back, in out's and v's dtype (q's and k's)."""
  dq, dk, dv = _fp8_backward.fp8_backward(q8, k8, v, out, lse, dout, q_rows, k_rows, cfg,
                                          dlse=dlse)
  return (_rotate_back(dq, signs, cfg, out.dtype), _rotate_back(dk, signs, cfg, v.dtype),
          dv.astype(v.dtype))


def _backward_ops(name, local, extra=()):
  """The partitioned ops of one backward, without and with an lse cotangent: like
  jax_fa3.attention's BACKWARD ops, with `extra` operands (layouts) and the rotation's signs; a
  sequence split is gathered, as for the fp8 forward."""
  def local_dlse(q, k, v, out, lse, dout, dlse, *rest):
    *rest, cfg = rest
    return local(q, k, v, out, lse, dout, *rest, cfg, dlse=dlse)

  operands = ("q", "kv", "kv", "q", "row", "q")
  return (_partitioning.AttentionOp(name, operands + extra + ("vec",), ("q", "kv", "kv"), local,
                                    split_queries=False),
          _partitioning.AttentionOp(name + "_dlse", operands + ("row",) + extra + ("vec",),
                                    ("q", "kv", "kv"), local_dlse, split_queries=False))


# (without dlse, with dlse) per backward taking the fp8 forward's out and lse.
BACKWARD_OPS = {"bf16": _backward_ops("flash_bwd_fp8_operands", _backward_at_operands_local),
                "fp8": _backward_ops("flash_bwd_fp8", _fp8_backward_local, ("row", "krow"))}


def _fp8_attention_bwd(cfg, backward, residuals, cotangents):
  # q, k: as given ("recompute"), the rotated, quantized operands ("bf16") or their e4m3 values
  # ("fp8", whose saved tail holds the scales per token).
  q, k, v, signs, saved = residuals
  dout, dlse = cotangents
  dout = dout.astype(v.dtype)  # q's dtype
  dlse = dlse if cfg.return_lse else None
  if saved is None:
    out, lse = attention.partitioned_forward(q, k, v, cfg.attention)
    dq, dk, dv = attention.partitioned_backward(q, k, v, out, lse, dout, cfg.attention, dlse=dlse)
  else:
    out, lse, *scales = saved
    plain, with_dlse = BACKWARD_OPS[backward]
    op, extra = (plain, ()) if dlse is None else (with_dlse, (dlse,))
    dq, dk, dv = _partitioning.call_partitioned(
        op, (q, k, v, out, lse, dout, *extra, *scales, signs), cfg)
  return dq, dk, dv, jnp.zeros_like(signs)


_fp8_attention.defvjp(_fp8_attention_fwd, _fp8_attention_bwd)


def is_pair(x) -> bool:
  return isinstance(x, (tuple, list))


def _random_signs(key, d):
  if key is None:
    key = jax.random.PRNGKey(DEFAULT_SEED)
  try:
    return jax.random.rademacher(key, (d,), dtype=jnp.float32)
  except (TypeError, ValueError) as e:
    raise TypeError(f"key must be a JAX PRNG key (jax.random.key or jax.random.PRNGKey), "
                    f"got {getattr(key, 'dtype', type(key).__name__)} "
                    f"{getattr(key, 'shape', '')}: {e}") from None


def _check_signs(signs, d):
  check_array("signs", signs)
  if tuple(signs.shape) != (d,):
    raise ValueError(f"signs must have shape ({d},) (head_dim), got {tuple(signs.shape)}")
  if not jnp.issubdtype(signs.dtype, jnp.floating) and not jnp.issubdtype(signs.dtype,
                                                                          jnp.integer):
    raise TypeError(f"signs must be a float or int array of ±1, got {signs.dtype}")
  if not isinstance(signs, jax.core.Tracer):
    values = np.asarray(signs)
    if not np.all(np.abs(values) == 1):
      raise ValueError("signs must contain only +1 and -1 (otherwise the rotation is not "
                       "orthogonal and q·k changes)")
  return jnp.asarray(signs, jnp.float32)


def flash_attention_fp8(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1),
                        incoherent=True, block_size=None, key=None, signs=None,
                        return_lse=False, v_mean=None, backward="bf16", deterministic=False):
  """Attention with q, k, v quantized to FP8 (e4m3): FlashAttention-3's FP8 forward.

  q and k are rotated by the same random orthogonal matrix H·diag(signs) (incoherent processing,
  `hadamard_transform`), then q and k are quantized to e4m3 with one float32 scale per (batch,
  head, block of `block_size` tokens) and v, centred by its mean over the keys, with one scale
  per (batch, kv-head); the attention runs on the fp8 values (P quantized as e4m3(2^6·P)),
  accumulates in float32, adds v's mean back and returns bfloat16 from the kernel. See the
  docstring of `jax_fa3._fp8_emulation` for the exact numerics; without a Hopper GPU and the fp8 kernel, a
  pure-JAX path emulates them exactly (announced once on the `jax_fa3` logger).

  Args:
    q: (batch, seqlen_q, heads, head_dim) float32/bfloat16/float16; or a pair (values, scales)
      from `quantize_fp8(q, block_size=block_size)`.
    k, v: (batch, seqlen_k, heads_k, head_dim), like q (heads a multiple of heads_k: GQA/MQA).
      Pre-quantized: k as `quantize_fp8(k, block_size=block_size)`, v as
      `quantize_fp8(v, block_size=None)` (scales (batch, heads_k, 1) or (batch, heads_k)).
      Either all three are arrays or all three are pairs; pairs need `incoherent=False` (rotate
      q and k with `hadamard_transform(x, signs=...)` before quantizing them) and are not
      differentiable.
    softmax_scale, causal, window_size: as for `flash_attention` (default scale 1/sqrt(head_dim)).
    incoherent: rotate q and k before quantizing (default True). `key`/`signs` are ignored when
      False.
    block_size: tokens per q/k scale (default 64). On the GPU kernel, multiples of 32 run its
      fast path (one k scale per 32-key group, folded into the exp2 coefficient); any other size
      is exact too but descales every score separately (slower).
    key: JAX PRNG key for the random ±1 signs (default `jax.random.PRNGKey(0)`, so that calls
      are deterministic; pass your own key to re-draw the rotation).
    signs: (head_dim,) array of ±1 to use instead of drawing them from `key` (e.g. a stored
      model variable); give `key` or `signs`, not both.
    return_lse: also return the float32 (batch, heads, seqlen_q) natural-log log-sum-exp of the
      (fp8) scores.
    v_mean: pre-quantized v only: the (batch, heads_k, head_dim) float32 mean that v was centred
      by before `quantize_fp8` (v quantized as v - v_mean[:, None]); it is added back to every
      output row that sees a key. Centre v whose values share a sign: the fp8 tensor cores
      accumulate P·V with about 13 mantissa bits, so an uncentred V with a large mean comes out
      low at long sequences (docs/CONTRACTS.md). Arrays are centred by the call itself.
    backward: how gradients are computed (arrays only; pairs are not differentiable):
      "bf16" (default): the bf16/fp16/fp32 backward kernel of `flash_attention` runs at the
        rotated, quantized q and k the fp8 kernel multiplied (rotating their gradients back) and
        starts from this call's own output and log-sum-exp, so a training step costs the fp8
        forward plus one backward. It is the gradient of the function computed, with the
        rounding of q, k, P and v passed straight through; it differs from flash_attention's by
        about the output's fp8 error.
      "recompute": the unquantized forward runs again first, and the gradient is exactly that of
        `flash_attention(q, k, v)`, at the cost of a second (bf16) forward.
      "fp8": like "bf16", with three of the backward's five GEMMs in e4m3 (S, dV, dK; numerics in
        `jax_fa3._fp8_backward_emulation`), starting from the forward's own e4m3 q and k. On
        FlashAttention-3's outlier inputs its gradient errors are those of "bf16" times
        0.99-1.01 (dq), 1.03-1.11 (dk) and 1.20-1.39 (dv) (benchmarks/fp8_accuracy.py
        --backward). On Hopper it runs the fp8 backward kernel (head_dim a multiple of 16 up to
        128); elsewhere, and for larger head dims, its pure-JAX emulation (announced once).
    deterministic: make the backward kernels ("bf16", "fp8") bit-reproducible (a fixed order of
      the dq additions; slower). Ignored for pre-quantized inputs (not differentiable).

  Returns:
    out (batch, seqlen_q, heads, head_dim) in q's dtype (bfloat16 for pre-quantized inputs), or
    (out, lse) when return_lse.

  Under a sharded jit (Auto or Explicit meshes) batch and head shards run locally and give the
  unsharded result bit for bit; a sequence split is gathered first (quantization blocks and v's
  per-head scale span the sequence). Inside shard_map / pmap it runs per device as is.
  """
  pairs = [is_pair(x) for x in (q, k, v)]
  backward = check_fp8_backward(backward)
  causal = check_bool("causal", causal)
  incoherent = check_bool("incoherent", incoherent)
  return_lse = check_bool("return_lse", return_lse)
  deterministic = check_bool("deterministic", deterministic)
  if any(pairs):
    return _flash_attention_prequantized(q, k, v, pairs, softmax_scale=softmax_scale,
                                         causal=causal, window_size=window_size,
                                         incoherent=incoherent, block_size=block_size,
                                         return_lse=return_lse, v_mean=v_mean)
  if v_mean is not None:
    raise ValueError("v_mean is for pre-quantized v (a (values, scales) pair); a float v is "
                     "centred by the call itself")
  check_attention_shapes(q, k, v)
  check_attention_dtypes(q, k, v, allowed=FP8_INPUT_DTYPES)
  att = attention_config(q, k, v, softmax_scale=softmax_scale, causal=causal,
                         window_size=window_size, softcap=0.0, deterministic=deterministic)
  cfg = Fp8Config(att, block_size=check_block_size(block_size, allow_none=False),
                  incoherent=incoherent, return_lse=return_lse)
  d = q.shape[-1]
  if incoherent:
    if signs is not None and key is not None:
      raise ValueError("give key (to draw random signs) or signs, not both")
    signs = _check_signs(signs, d) if signs is not None else _random_signs(key, d)
  else:
    signs = jnp.ones((d,), jnp.float32)  # unused
  out, lse = _fp8_attention(q, k, v, signs, cfg, backward)
  return (out, lse) if return_lse else out


def _check_v_mean(v_mean, k8):
  if v_mean is None:
    return None
  b, _, h_k, d = k8.shape
  check_array("v_mean", v_mean)
  if not jnp.issubdtype(v_mean.dtype, jnp.floating):
    raise TypeError(f"v_mean must be a floating array (used as float32), got {v_mean.dtype}")
  if tuple(v_mean.shape) != (b, h_k, d):
    raise ValueError(f"v_mean must have shape {(b, h_k, d)} (batch, heads_k, head_dim), got "
                     f"{tuple(v_mean.shape)}")
  return jnp.asarray(v_mean, jnp.float32)


def _flash_attention_prequantized(q, k, v, pairs, *, softmax_scale, causal, window_size,
                                  incoherent, block_size, return_lse, v_mean):
  if not all(pairs):
    raise TypeError("q, k and v must be all arrays or all (values, scales) pairs from "
                    "quantize_fp8, got " + ", ".join(
                        f"{n}={'pair' if p else 'array'}" for n, p in zip("qkv", pairs)))
  for name, x in (("q", q), ("k", k), ("v", v)):
    if len(x) != 2:
      raise TypeError(f"pre-quantized {name} must be a (values, scales) pair, got {len(x)} items")
  if incoherent:
    raise ValueError("pre-quantized q and k cannot be rotated here: rotate them with "
                     "hadamard_transform(x, signs=...) before quantize_fp8 and pass "
                     "incoherent=False")
  block_size = check_block_size(block_size, allow_none=False)
  (q8, q_scale), (k8, k_scale), (v8, v_scale) = q, k, v
  check_attention_shapes(q8, k8, v8)
  q_scale = check_quantized("q", q8, q_scale, block_size)
  k_scale = check_quantized("k", k8, k_scale, block_size)
  v_scale = check_quantized("v", v8, v_scale, None, allow_per_head=True)
  v_mean = _check_v_mean(v_mean, k8)
  left, right = check_window(window_size)
  if causal:
    if right > 0:
      raise ValueError(f"causal=True means window_size right = 0; got window_size={window_size!r}")
    right = 0
  att = AttentionConfig(softmax_scale=check_softmax_scale(softmax_scale, q8.shape[-1]),
                        window_left=left, window_right=right)
  cfg = Fp8Config(att, block_size=block_size, incoherent=False, return_lse=return_lse)
  out, lse = _fp8_forward.fp8_forward(q8, k8, v8, q_scale, k_scale, v_scale[..., 0], cfg, v_mean=v_mean)
  return (out, lse) if return_lse else out
