"""Linen layers: `MultiHeadDotProductAttention` (and its alias `MultiHeadAttention`) on jax_fa3.

Subclasses of Flax's, with the same class names, fields and parameter names ('query', 'key',
'value', 'out', and 'query_ln'/'key_ln' with normalize_qk), so Flax checkpoints load unchanged.
Our fields: causal, window_size, softcap, softmax_scale, num_kv_heads (GQA: key/value project to
num_kv_heads heads; None means num_heads and Flax's exact tree) and fp8 (the rotation signs live
in the 'fp8_rotation' collection, not in 'params').
"""
from __future__ import annotations

import functools

import flax.linen as nn
import jax.numpy as jnp
from flax.linen.attention import dot_product_attention as _flax_default_attention

from jax_fa3._validation import check_softcap, check_window
from jax_fa3.flax.attention_fn import (attend_with_cache, check_no_dropout,
                                       check_no_weights_introspection, dot_product_attention)
from jax_fa3.flax.rotation import ROTATION_COLLECTION, ROTATION_NAME, random_rotation_signs


def _resolve_inputs(inputs_q, inputs_k, inputs_v, inputs_kv):
  """Flax's rules: k defaults to q, v to k; the deprecated inputs_kv sets both."""
  if inputs_kv is not None:
    if inputs_k is not None or inputs_v is not None:
      raise ValueError("pass either inputs_kv or inputs_k/inputs_v, not both")
    return inputs_kv, inputs_kv
  if inputs_k is None:
    if inputs_v is not None:
      raise ValueError("inputs_k cannot be None if inputs_v is given")
    inputs_k = inputs_q
  return inputs_k, inputs_k if inputs_v is None else inputs_v


class MultiHeadDotProductAttention(nn.MultiHeadDotProductAttention):
  """flax.linen.MultiHeadDotProductAttention with jax_fa3 flash attention.

  Attributes (beyond Flax's):
    causal: query i sees keys j <= i + kv_length - q_length (FlashAttention bottom-right).
    window_size: (left, right) sliding window, -1 unbounded.
    softcap: if > 0, scores become softcap * tanh(scores / softcap).
    softmax_scale: defaults to 1/sqrt(head_dim), as in Flax.
    num_kv_heads: heads of the key/value projections (GQA); None: num_heads.
    fp8: attention through jax_fa3.flash_attention_fp8 with a Hadamard rotation whose random
      signs are drawn from the 'params' rng at init into variables['fp8_rotation']['signs'].
    fp8_backward: with fp8, flash_attention_fp8's `backward`: "bf16" (default; from the fp8
      forward's statistics, no second forward), "recompute" (flash_attention's exact gradient) or
      "fp8" (three of the backward's GEMMs in e4m3; its kernel on Hopper for head_dim <= 128).

  decode=True keeps Flax's cache variables ('cache': cached_key, cached_value, cache_index): the
  init call sizes the cache, each later call appends its tokens (one or a chunk) and attends over
  the cache through jax_fa3.flash_attention_with_kvcache.

  Mask arrays (padded or packed rows take the call's query_seq_lengths / key_value_seq_lengths /
  q_segment_ids / kv_segment_ids instead), attention dropout, sow_weights, decode with fp8 and a
  custom attention_fn are refused.
  """

  causal: bool = False
  window_size: tuple[int, int] = (-1, -1)
  softcap: float = 0.0
  softmax_scale: float | None = None
  num_kv_heads: int | None = None
  fp8: bool = False
  fp8_backward: str = "bf16"

  def _check_supported(self, sow_weights: bool) -> None:
    if self.attention_fn is not _flax_default_attention:
      raise TypeError(
          f"{type(self).__name__} always runs jax_fa3 attention; for another attention_fn use "
          f"flax.linen.MultiHeadDotProductAttention(attention_fn=...), whose parameter tree is "
          f"the same")
    if self.decode and self.fp8:
      raise NotImplementedError(
          f"{type(self).__name__}: decode=True with fp8=True is not supported yet (no FP8 KV "
          f"cache); decode in bf16 with the same parameters (fp8=False)")
    if self.qk_attn_weights_einsum_cls or self.attn_weights_value_einsum_cls:
      raise TypeError("jax_fa3 attention takes no qk_attn_weights_einsum_cls / "
                      "attn_weights_value_einsum_cls (custom einsums); for low precision use "
                      "fp8=True")
    check_no_weights_introspection(self if sow_weights else None)

  @nn.compact
  def __call__(self, inputs_q, inputs_k=None, inputs_v=None, *, inputs_kv=None, mask=None,
               deterministic: bool | None = None, dropout_rng=None, sow_weights: bool = False,
               query_seq_lengths=None, key_value_seq_lengths=None, q_segment_ids=None,
               kv_segment_ids=None):
    """Flax's call: (batch..., length, features) in, (batch..., length, out_features) out.

    Padded or packed rows: query_seq_lengths / key_value_seq_lengths (int32 (batch...)) and
    q_segment_ids / kv_segment_ids (int32 (batch..., length)), as for jax_fa3.flash_attention.
    """
    self._check_supported(sow_weights)
    inputs_k, inputs_v = _resolve_inputs(inputs_q, inputs_k, inputs_v, inputs_kv)
    features = self.out_features or inputs_q.shape[-1]
    qkv_features = self.qkv_features or inputs_q.shape[-1]
    num_kv_heads = self.num_kv_heads or self.num_heads
    if qkv_features % self.num_heads != 0:
      raise ValueError(f"qkv_features ({qkv_features}) must be divisible by num_heads "
                       f"({self.num_heads})")
    if self.num_heads % num_kv_heads != 0:
      raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                       f"({num_kv_heads})")
    head_dim = qkv_features // self.num_heads

    dense = functools.partial(
        nn.DenseGeneral, axis=-1, dtype=self.dtype, param_dtype=self.param_dtype,
        kernel_init=self.kernel_init, bias_init=self.bias_init, use_bias=self.use_bias,
        precision=self.precision, dot_general=self.qkv_dot_general,
        dot_general_cls=self.qkv_dot_general_cls)
    query = dense(features=(self.num_heads, head_dim), name="query")(inputs_q)
    key = dense(features=(num_kv_heads, head_dim), name="key")(inputs_k)
    value = dense(features=(num_kv_heads, head_dim), name="value")(inputs_v)
    if self.normalize_qk:
      # As Flax: QK-LayerNorm (ViT-22B) for stability at high learning rates.
      layer_norm = functools.partial(nn.LayerNorm, use_bias=False, dtype=self.dtype,
                                     param_dtype=self.param_dtype)
      query = layer_norm(name="query_ln")(query)
      key = layer_norm(name="key_ln")(key)

    if self.dropout_rate > 0.0:  # Flax requires `deterministic` only when dropout is on.
      deterministic = nn.merge_param("deterministic", self.deterministic, deterministic)
      check_no_dropout(self.dropout_rate, deterministic)

    options = dict(causal=self.causal, window_size=check_window(self.window_size),
                   softcap=check_softcap(self.softcap), softmax_scale=self.softmax_scale)
    if self.fp8:
      signs = self.variable(ROTATION_COLLECTION, ROTATION_NAME,
                            lambda: random_rotation_signs(self.make_rng("params"), head_dim))
      options.update(fp8=True, signs=signs.value, fp8_backward=self.fp8_backward)
    padding = dict(query_seq_lengths=query_seq_lengths,
                   key_value_seq_lengths=key_value_seq_lengths, q_segment_ids=q_segment_ids,
                   kv_segment_ids=kv_segment_ids)
    if self.decode:
      x = self._attend_with_cache(query, key, value, mask, padding, options)
    else:
      x = dot_product_attention(query, key, value, mask=mask, dtype=self.dtype, **padding,
                                **options)

    return nn.DenseGeneral(
        features=features, axis=(-2, -1), kernel_init=self.out_kernel_init or self.kernel_init,
        bias_init=self.out_bias_init or self.bias_init, use_bias=self.use_bias, dtype=self.dtype,
        param_dtype=self.param_dtype, precision=self.precision, dot_general=self.out_dot_general,
        dot_general_cls=self.out_dot_general_cls, name="out")(x)


  def _attend_with_cache(self, query, key, value, mask, padding, options):
    """decode=True, with Flax's cache variables ('cache': cached_key, cached_value, cache_index,
    so Flax's own cache utilities see the same tree). The first call (init) sizes the cache from
    its input and attends as without decode; every later call appends its tokens at
    cache_index and attends over the cache (jax_fa3.flash_attention_with_kvcache)."""
    given = [name for name, x in padding.items() if x is not None]
    if mask is not None or given:
      raise ValueError(f"decode=True takes no {'mask' if mask is not None else given[0]}: each "
                       f"call's queries see the cache up to their own position")
    initialized = self.has_variable("cache", "cached_key")
    cached_key = self.variable("cache", "cached_key", jnp.zeros, key.shape, key.dtype)
    cached_value = self.variable("cache", "cached_value", jnp.zeros, value.shape, value.dtype)
    cache_index = self.variable("cache", "cache_index", lambda: jnp.array(0, dtype=jnp.int32))
    if not initialized:
      return dot_product_attention(query, key, value, dtype=self.dtype, **options)
    options = {k: v for k, v in options.items() if k in ("causal", "window_size", "softcap",
                                                         "softmax_scale")}
    out, cached_key.value, cached_value.value = attend_with_cache(
        query, key, value, cached_key.value, cached_value.value, cache_index.value, **options)
    cache_index.value = cache_index.value + key.shape[-3]
    return out


class MultiHeadAttention(MultiHeadDotProductAttention):
  """Alias of MultiHeadDotProductAttention, auto-named `MultiHeadAttention_<i>` as in Flax."""
