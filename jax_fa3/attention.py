"""jax_fa3.flash_attention: the public, differentiable attention entry point.

The forward and backward are partitioned ops (`jax_fa3._partitioning`): on each device's blocks
they run the single-device attention (`jax_fa3._local_attention`), or ring attention
(`jax_fa3.ring`) when the sequence is split over a mesh axis.
"""
from __future__ import annotations

import functools

import jax

from jax_fa3 import _local_attention, _partitioning, ring
from jax_fa3._config import AttentionConfig
from jax_fa3._validation import attention_config


def _local_backward_dlse(q, k, v, out, lse, dout, dlse, cfg):
  return _local_attention.backward_local(q, k, v, out, lse, dout, cfg, dlse=dlse)


def _ring_forward(q, k, v, *, cfg, axis_name):
  return ring.ring_forward(q, k, v, cfg, axis_name, zigzag=False)


def _ring_backward(q, k, v, out, lse, dout, *, cfg, axis_name):
  return ring.ring_backward(q, k, v, out, lse, dout, cfg, axis_name, zigzag=False)


def _ring_backward_dlse(q, k, v, out, lse, dout, dlse, *, cfg, axis_name):
  return ring.ring_backward(q, k, v, out, lse, dout, cfg, axis_name, zigzag=False, dlse=dlse)


FORWARD = _partitioning.AttentionOp(
    "flash_fwd", ("q", "kv", "kv"), ("q", "row"), _local_attention.forward_local, _ring_forward,
    ring.ring_unsupported_reason)
BACKWARD = _partitioning.AttentionOp(
    "flash_bwd", ("q", "kv", "kv", "q", "row", "q"), ("q", "kv", "kv"),
    _local_attention.backward_local, _ring_backward, ring.ring_unsupported_reason)
BACKWARD_DLSE = _partitioning.AttentionOp(
    "flash_bwd_dlse", ("q", "kv", "kv", "q", "row", "q", "row"), ("q", "kv", "kv"),
    _local_backward_dlse, _ring_backward_dlse, ring.ring_unsupported_reason)


def partitioned_forward(q, k, v, cfg: AttentionConfig):
  """(out, lse): out like q, lse (batch, heads, seqlen_q) float32; partitioned under sharding."""
  return _partitioning.call_partitioned(FORWARD, (q, k, v), cfg)


def partitioned_backward(q, k, v, out, lse, dout, cfg: AttentionConfig, dlse=None):
  """(dq, dk, dv) given the forward's out and lse; `dlse` is the cotangent of a returned lse."""
  if dlse is None:
    return _partitioning.call_partitioned(BACKWARD, (q, k, v, out, lse, dout), cfg)
  return _partitioning.call_partitioned(BACKWARD_DLSE, (q, k, v, out, lse, dout, dlse), cfg)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _attention(q, k, v, cfg: AttentionConfig):
  return partitioned_forward(q, k, v, cfg)[0]


def _attention_fwd(q, k, v, cfg):
  out, lse = partitioned_forward(q, k, v, cfg)
  return out, (q, k, v, out, lse)


def _attention_bwd(cfg, residuals, dout):
  q, k, v, out, lse = residuals
  return partitioned_backward(q, k, v, out, lse, dout, cfg)


_attention.defvjp(_attention_fwd, _attention_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _attention_with_lse(q, k, v, cfg: AttentionConfig):
  return partitioned_forward(q, k, v, cfg)


def _attention_with_lse_fwd(q, k, v, cfg):
  out, lse = partitioned_forward(q, k, v, cfg)
  return (out, lse), (q, k, v, out, lse)


def _attention_with_lse_bwd(cfg, residuals, cotangents):
  q, k, v, out, lse = residuals
  dout, dlse = cotangents
  return partitioned_backward(q, k, v, out, lse, dout, cfg, dlse=dlse)


_attention_with_lse.defvjp(_attention_with_lse_fwd, _attention_with_lse_bwd)


def flash_attention(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, return_lse=False, deterministic=False):
  """Scaled dot-product attention with FlashAttention-3 semantics.

  Args:
    q: (batch, seqlen_q, heads, head_dim).
    k, v: (batch, seqlen_k, heads_k, head_dim); heads a multiple of heads_k (GQA/MQA).
    softmax_scale: multiplies q·k; defaults to 1/sqrt(head_dim).
    causal: query i sees keys j <= i + seqlen_k - seqlen_q (bottom-right aligned).
    window_size: (left, right): query i sees keys j with
      i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right; -1 is unbounded.
    softcap: if > 0, scores become softcap * tanh(scores / softcap) after scaling.
    return_lse: also return the natural-log log-sum-exp, float32 (batch, heads, seqlen_q);
      rows that see no key get out 0 and lse +inf.
    deterministic: make the backward bit-reproducible (fixed accumulation order).

  Returns:
    out with q's shape and dtype, or (out, lse) when return_lse.
  """
  cfg = attention_config(q, k, v, softmax_scale=softmax_scale, causal=causal,
                         window_size=window_size, softcap=softcap, deterministic=deterministic)
  if return_lse:
    return _attention_with_lse(q, k, v, cfg)
  return _attention(q, k, v, cfg)
