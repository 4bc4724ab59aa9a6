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
from jax_fa3._validation import attention_config, padding_masks


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


# Padded batches (`jax_fa3._local_attention.forward_local_masked`'s masks): no ring body (a
# sequence split is gathered, queries included: the masks depend on absolute positions). One op
# family per mask layout: per-row lengths and diagonals, and per-row lengths with per-query
# diagonals and segment ids.
def _local_backward_masked_dlse(q, k, v, out, lse, dout, dlse, *masks_and_cfg):
  return _local_attention.backward_local_masked(q, k, v, out, lse, dout, *masks_and_cfg,
                                                dlse=dlse)


def _masked_ops(name, masks):
  def op(kind, operands, results, local):
    return _partitioning.AttentionOp(f"flash_{kind}_{name}", operands + masks, results, local,
                                     split_queries=False)
  return (op("fwd", ("q", "kv", "kv"), ("q", "row"), _local_attention.forward_local_masked),
          op("bwd", ("q", "kv", "kv", "q", "row", "q"), ("q", "kv", "kv"),
             _local_attention.backward_local_masked),
          op("bwd_dlse", ("q", "kv", "kv", "q", "row", "q", "row"), ("q", "kv", "kv"),
             _local_backward_masked_dlse))


_ROW_BOUNDS = ("lens", "lens", "lens")  # q_lengths, kv_lengths, diagonals
MASKED_OPS = {3: _masked_ops("padded", _ROW_BOUNDS),
              5: _masked_ops("segmented", ("lens", "lens", "qseg", "qseg", "kseg"))}


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


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _masked_attention(q, k, v, masks, cfg: AttentionConfig, with_lse: bool):
  return _masked_attention_fwd(q, k, v, masks, cfg, with_lse)[0]


def _masked_attention_fwd(q, k, v, masks, cfg, with_lse):
  forward, _, _ = MASKED_OPS[len(masks)]
  out, lse = _partitioning.call_partitioned(forward, (q, k, v, *masks), cfg)
  return ((out, lse) if with_lse else out), (q, k, v, masks, out, lse)


def _masked_attention_bwd(cfg, with_lse, residuals, cotangents):
  q, k, v, masks, out, lse = residuals
  _, backward, backward_dlse = MASKED_OPS[len(masks)]
  if with_lse:
    dout, dlse = cotangents
    grads = _partitioning.call_partitioned(backward_dlse,
                                           (q, k, v, out, lse, dout, dlse, *masks), cfg)
  else:
    grads = _partitioning.call_partitioned(backward, (q, k, v, out, lse, cotangents, *masks),
                                           cfg)
  return (*grads, (None,) * len(masks))  # integer masks: no cotangent


_masked_attention.defvjp(_masked_attention_fwd, _masked_attention_bwd)


def masked_attention(q, k, v, masks, cfg: AttentionConfig, return_lse: bool):
  """Attention over a padded batch, differentiable in q, k, v: masks = int32 (q_lengths (b,),
  kv_lengths (b,), diagonals (b,)), or (q_lengths (b,), kv_lengths (b,), diagonals (b, s_q),
  q_segment_ids (b, s_q), kv_segment_ids (b, s_k)) with one diagonal per query, as
  `jax_fa3.reference.attention_forward` reads them. For the callers that validated their own
  arguments (flash_attention, varlen, the KV cache)."""
  return _masked_attention(q, k, v, tuple(masks), cfg, bool(return_lse))


def flash_attention(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, return_lse=False, deterministic=False, query_seq_lengths=None,
                    key_value_seq_lengths=None, q_segment_ids=None, kv_segment_ids=None):
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
    query_seq_lengths, key_value_seq_lengths: optional int32 (batch,) arrays, as in
      `jax.nn.dot_product_attention`: positions at or past a row's length are padding. Padded
      queries see nothing (out 0, lse +inf, zero gradient) and padded keys are seen by nobody
      (zero gradient). Lengths must lie in [0, seqlen]; under jit, where they are not known,
      they are clamped to it. Causal and window alignment use the arrays' seqlens, not these.
    q_segment_ids, kv_segment_ids: optional int32 (batch, seqlen_q) / (batch, seqlen_k) arrays,
      given together (the same array twice for self-attention on packed rows): query i sees key
      j only when their ids are equal, on top of causal / window / lengths.
      On Hopper they run on the kernels' key-range variants, which skip the tiles no query sees:
      every mask becomes one interval of keys per query, so segment ids qualify when each
      segment is one contiguous run of keys (packed documents); other segment ids are detected
      on the device and take the pure-JAX path. JAX_FA3_MASKED_KERNELS=0 sends these calls to
      the pure-JAX path (announced once on the `jax_fa3` logger). Ring attention gathers a split
      sequence.

  Returns:
    out with q's shape and dtype, or (out, lse) when return_lse.
  """
  cfg = attention_config(q, k, v, softmax_scale=softmax_scale, causal=causal,
                         window_size=window_size, softcap=softcap, deterministic=deterministic)
  masks = padding_masks(q, k, query_seq_lengths=query_seq_lengths,
                        key_value_seq_lengths=key_value_seq_lengths, q_segment_ids=q_segment_ids,
                        kv_segment_ids=kv_segment_ids)
  if masks is not None:
    return masked_attention(q, k, v, masks, cfg, return_lse)
  if return_lse:
    return _attention_with_lse(q, k, v, cfg)
  return _attention(q, k, v, cfg)
