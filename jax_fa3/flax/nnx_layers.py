"""`MultiHeadAttention`: flax.nnx.MultiHeadAttention running jax_fa3 attention.

A subclass, so its constructor, call, and parameter tree are Flax's (num_kv_heads included):
weights saved from `flax.nnx.MultiHeadAttention` load into it unchanged. Our options are
`causal`, `window_size`, `softcap`, `softmax_scale` and `fp8`.
"""
from __future__ import annotations

import contextvars
import functools
import inspect

import flax
import jax.numpy as jnp
from flax import nnx

from jax_fa3._validation import check_bool, check_fp8_backward, check_softcap, check_window
from jax_fa3.flax.attention_fn import (attend_with_cache, check_no_dropout,
                                       check_no_weights_introspection, dot_product_attention)
from jax_fa3.flax.rotation import random_rotation_signs

_NO_FP8_DECODE = ("jax_fa3.flax.MultiHeadAttention: decode with fp8=True is not supported yet (no "
                  "FP8 KV cache); decode in bf16 with the same parameters (fp8=False)")


_CALL_PADDING: contextvars.ContextVar[dict] = contextvars.ContextVar("jax_fa3_nnx_padding",
                                                                      default={})

# num_kv_heads (GQA) came to flax.nnx.MultiHeadAttention in flax 0.12.6.
_FLAX_HAS_GQA = "num_kv_heads" in inspect.signature(nnx.MultiHeadAttention.__init__).parameters


class Fp8RotationSigns(nnx.Variable):
  """The ±1 signs of an FP8 layer's Hadamard rotation: saved with the model, never trained."""


class MultiHeadAttention(nnx.MultiHeadAttention):
  """flax.nnx.MultiHeadAttention with jax_fa3 flash attention.

  Args (beyond Flax's, which are all accepted except `attention_fn`):
    causal: query i sees keys j <= i + kv_length - q_length (FlashAttention bottom-right).
    window_size: (left, right) sliding window, -1 unbounded.
    softcap: if > 0, scores become softcap * tanh(scores / softcap).
    softmax_scale: defaults to 1/sqrt(head_dim), as in Flax.
    fp8: attention through jax_fa3.flash_attention_fp8 with a Hadamard rotation whose random
      signs are drawn from `rngs.params()` at init and kept as an `Fp8RotationSigns` variable
      (in nnx.state, not an nnx.Param).
    fp8_backward: with fp8, flash_attention_fp8's `backward`: "bf16" (default; from the fp8
      forward's statistics, no second forward), "recompute" (flash_attention's exact gradient) or
      "fp8" (three of the backward's GEMMs in e4m3; its kernel on Hopper for head_dim <= 128).

  decode=True: after Flax's init_cache, each call appends its tokens (one or a chunk) to the
  cache and attends over it (jax_fa3.flash_attention_with_kvcache).

  Mask arrays (padded or packed rows take the call's query_seq_lengths / key_value_seq_lengths /
  q_segment_ids / kv_segment_ids instead), attention dropout, sow_weights and decode with fp8 are
  refused (ValueError/NotImplementedError).
  """

  def __init__(self, num_heads: int, in_features: int, qkv_features: int | None = None,
               out_features: int | None = None, num_kv_heads: int | None = None,
               in_kv_features: int | None = None, *, causal: bool = False,
               window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
               softmax_scale: float | None = None, fp8: bool = False,
               fp8_backward: str = "bf16", rngs: nnx.Rngs, **kwargs):
    if "attention_fn" in kwargs:
      raise TypeError(
          "jax_fa3.flax.MultiHeadAttention always runs jax_fa3 attention; for another "
          "attention_fn use flax.nnx.MultiHeadAttention(attention_fn=...), whose parameter tree "
          "is the same")
    if kwargs.setdefault("decode", False) and fp8:  # Flax's None would demand decode= per call
      raise NotImplementedError(_NO_FP8_DECODE)
    # Static options, read by the attention_fn property at call time.
    self.causal = check_bool("causal", causal)
    self.window_size = check_window(window_size)
    self.softcap = check_softcap(softcap)
    self.softmax_scale = softmax_scale
    self.fp8 = check_bool("fp8", fp8)
    self.fp8_backward = check_fp8_backward(fp8_backward, "fp8_backward")
    if not _FLAX_HAS_GQA:
      raise ImportError(f"jax_fa3.flax.MultiHeadAttention subclasses flax.nnx.MultiHeadAttention "
                        f"with num_kv_heads, which needs flax >= 0.12.6 (found {flax.__version__})")
    super().__init__(num_heads, in_features, qkv_features, out_features, num_kv_heads,
                     in_kv_features, rngs=rngs, **kwargs)
    # Drawn after Flax's parameters, so those equal flax.nnx.MultiHeadAttention's for one seed.
    self.rotation_signs = (Fp8RotationSigns(random_rotation_signs(rngs.params(), self.head_dim))
                           if self.fp8 else nnx.data(None))

  # Flax's __call__ calls self.attention_fn(...); a property lets it see the signs *variable* of
  # this very instance (traced under nnx.jit, restored by nnx.update), which a function fixed at
  # construction could not. Flax's __init__ assigns its default; the setter drops it.
  def __call__(self, inputs_q, inputs_k=None, inputs_v=None, *, query_seq_lengths=None,
               key_value_seq_lengths=None, q_segment_ids=None, kv_segment_ids=None, **kwargs):
    """Flax's call (mask arrays refused), plus padded or packed rows: query_seq_lengths /
    key_value_seq_lengths (int32 (batch...)) and q_segment_ids / kv_segment_ids (int32
    (batch..., length)), as for jax_fa3.flash_attention."""
    padding = {name: x for name, x in (("query_seq_lengths", query_seq_lengths),
                                       ("key_value_seq_lengths", key_value_seq_lengths),
                                       ("q_segment_ids", q_segment_ids),
                                       ("kv_segment_ids", kv_segment_ids)) if x is not None}
    # Flax's call reaches attention_fn with its own fixed arguments; the padding arrays ride in a
    # context variable for this call only (no module state to mutate under nnx transforms).
    decode = kwargs.pop("decode", None)
    if decode if decode is not None else self.decode:
      return self._decode(inputs_q, inputs_k, inputs_v, padding, **kwargs)
    token = _CALL_PADDING.set(padding)
    try:
      return super().__call__(inputs_q, inputs_k, inputs_v, **kwargs)
    finally:
      _CALL_PADDING.reset(token)

  def _decode(self, inputs_q, inputs_k, inputs_v, padding, *, mask=None, deterministic=None,
              rngs=None, sow_weights=False, **unused):
    """decode=True: Flax's projections, then this call's tokens appended to the cache of
    `init_cache` (Flax's variables) at cache_index and attended over it through
    jax_fa3.flash_attention_with_kvcache; one token or a chunk per call."""
    del rngs, unused
    if self.fp8:
      raise NotImplementedError(_NO_FP8_DECODE)
    given = ["mask"] * (mask is not None) + list(padding)
    if given:
      raise ValueError(f"decode=True takes no {given[0]}: each call's queries see the cache up to "
                       f"their own position")
    check_no_weights_introspection(self if sow_weights else None)
    check_no_dropout(self.dropout_rate, deterministic if deterministic is not None
                     else self.deterministic)
    if getattr(self, "cached_key", None) is None:
      raise ValueError("Autoregressive cache not initialized: call init_cache(input_shape) first")
    inputs_k = inputs_q if inputs_k is None else inputs_k
    inputs_v = inputs_k if inputs_v is None else inputs_v
    query, key, value = self.query(inputs_q), self.key(inputs_k), self.value(inputs_v)
    if self.normalize_qk:
      query, key = self.query_ln(query), self.key_ln(key)
    out, self.cached_key[...], self.cached_value[...] = attend_with_cache(
        query, key, value, self.cached_key[...], self.cached_value[...], self.cache_index[...],
        causal=self.causal, window_size=self.window_size, softcap=self.softcap,
        softmax_scale=self.softmax_scale)
    self.cache_index[...] += key.shape[-3]
    return self.out(out)

  @property
  def attention_fn(self):
    options = dict(causal=self.causal, window_size=self.window_size, softcap=self.softcap,
                   softmax_scale=self.softmax_scale, **_CALL_PADDING.get())
    if self.fp8:
      options.update(fp8=True, signs=self.rotation_signs[...], fp8_backward=self.fp8_backward)
    return functools.partial(dot_product_attention, **options)

  @attention_fn.setter
  def attention_fn(self, value):
    del value

  def init_cache(self, input_shape, dtype=None):
    """Flax's cache for decode=True ((batch..., max_length, features) inputs)."""
    if self.fp8:
      raise NotImplementedError(_NO_FP8_DECODE)
    return super().init_cache(input_shape, dtype=jnp.float32 if dtype is None else dtype)
