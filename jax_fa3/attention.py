"""jax_fa3.flash_attention: the public, differentiable attention entry point."""
from __future__ import annotations

import functools

import jax

from jax_fa3 import _ops
from jax_fa3._config import AttentionConfig
from jax_fa3._validation import attention_config


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _attention(q, k, v, cfg: AttentionConfig):
  return _ops.forward(q, k, v, cfg)[0]


def _attention_fwd(q, k, v, cfg):
  out, lse = _ops.forward(q, k, v, cfg)
  return out, (q, k, v, out, lse)


def _attention_bwd(cfg, residuals, dout):
  q, k, v, out, lse = residuals
  return _ops.backward(q, k, v, out, lse, dout, cfg)


_attention.defvjp(_attention_fwd, _attention_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _attention_with_lse(q, k, v, cfg: AttentionConfig):
  return _ops.forward(q, k, v, cfg)


def _attention_with_lse_fwd(q, k, v, cfg):
  out, lse = _ops.forward(q, k, v, cfg)
  return (out, lse), (q, k, v, out, lse)


def _attention_with_lse_bwd(cfg, residuals, cotangents):
  q, k, v, out, lse = residuals
  dout, dlse = cotangents
  return _ops.backward(q, k, v, out, lse, dout, cfg, dlse=dlse)


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
