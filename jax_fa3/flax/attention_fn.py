"""`dot_product_attention`: a drop-in `attention_fn` for Flax's attention layers.

It takes the exact call of `flax.linen.dot_product_attention` and `flax.nnx.dot_product_attention`
(as `flax.linen.MultiHeadDotProductAttention` and `flax.nnx.MultiHeadAttention` make it), runs
`jax_fa3.flash_attention` (or `flash_attention_fp8`), and refuses — with a ValueError/TypeError that
names the alternative — what flash attention cannot honour: bias and mask arrays, attention-weight
dropout, sowing attention weights, custom einsums. Our own options are keywords, bound with
`functools.partial(jax_fa3.flax.dot_product_attention, causal=True, ...)`.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import jax.numpy as jnp

from jax_fa3.attention import flash_attention
from jax_fa3.fp8 import flash_attention_fp8
from jax_fa3.kvcache import flash_attention_with_kvcache
from jax_fa3._validation import check_bool, check_fp8_backward, check_softcap, check_window

_PARTIAL_HINT = "functools.partial(jax_fa3.flax.dot_product_attention, causal=True)"


def check_no_dropout(dropout_rate: float, deterministic: bool | None) -> None:
  """Flash attention never forms the attention weights, so it cannot drop them out."""
  if dropout_rate and dropout_rate > 0.0 and not deterministic:
    raise ValueError(
        f"jax_fa3 attention cannot apply attention-weight dropout (dropout_rate={dropout_rate} "
        f"with deterministic=False): flash attention never materializes the weights. Use "
        f"dropout_rate=0.0 (dropout on the layer output or residual instead), or call with "
        f"deterministic=True for inference.")


def check_no_weights_introspection(module: Any) -> None:
  if module is not None:
    raise ValueError(
        "jax_fa3 attention cannot sow attention weights (sow_weights=True / module=...): flash "
        "attention never materializes them. For introspection compute them with "
        "flax.linen.dot_product_attention_weights on the same query and key.")


def _check_unsupported_arrays(bias, mask) -> None:
  if bias is not None:
    raise ValueError(
        "jax_fa3 attention takes no bias array: only causal / sliding-window visibility and "
        "softcap are supported, as keywords, e.g. " + _PARTIAL_HINT + " or "
        "functools.partial(jax_fa3.flax.dot_product_attention, window_size=(256, 0)). For an "
        "arbitrary bias use flax's default dot_product_attention.")
  if mask is not None:
    raise ValueError(
        "jax_fa3 attention takes no mask array (also what decode=True produces): express causal "
        "or sliding-window masks as keywords, e.g. " + _PARTIAL_HINT + " or "
        "window_size=(left, right) (FlashAttention's bottom-right alignment), or layer options "
        "causal=/window_size=; padded or packed rows as query_seq_lengths= / "
        "key_value_seq_lengths= (int32 (batch,)) or q_segment_ids= / kv_segment_ids= (int32 "
        "(batch, length)), keywords of this function and of the linen layer's call. For an "
        "arbitrary mask use flax's default dot_product_attention.")


def _promote(query, key, value, dtype, promote_dtype: Callable | None):
  """Flax's dtype rule: cast q, k, v to `dtype`, or to their common type when it is None."""
  if promote_dtype is not None:  # nnx's hook: takes the tuple and a dtype keyword
    return promote_dtype((query, key, value), dtype=dtype)
  dtype = jnp.result_type(query, key, value) if dtype is None else dtype
  return tuple(jnp.asarray(x, dtype) for x in (query, key, value))


def _to_rank4(x, batch_shape):
  """(batch..., length, heads, head_dim) -> (prod(batch), length, heads, head_dim)."""
  return jnp.reshape(x, (math.prod(batch_shape),) + x.shape[-3:])


def dot_product_attention(
    query, key, value, bias=None, mask=None, broadcast_dropout: bool = True, dropout_rng=None,
    dropout_rate: float = 0.0, deterministic: bool = False, dtype=None, precision=None,
    module=None, *,
    # Passed by flax.linen layers; accepted so the call matches, refused when they ask for more.
    force_fp32_for_softmax: bool = False, einsum_dot_general=None, qk_attn_weights_einsum=None,
    attn_weights_value_einsum=None,
    # Passed by flax.nnx layers.
    promote_dtype: Callable | None = None, is_causal: bool = False,
    # jax_fa3 options (bind them with functools.partial).
    causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
    softmax_scale: float | None = None, deterministic_backward: bool = False,
    fp8: bool = False, incoherent: bool = True, block_size=None, signs=None, rotation_key=None,
    fp8_backward: str = "bf16",
    # Padding (flash_attention's keywords), per call.
    query_seq_lengths=None, key_value_seq_lengths=None, q_segment_ids=None, kv_segment_ids=None):
  """Flash attention with the call signature of Flax's `dot_product_attention`.

  Args:
    query: (batch..., q_length, heads, head_dim); batch dims may be absent or several.
    key, value: (batch..., kv_length, kv_heads, head_dim); heads a multiple of kv_heads (GQA).
    bias, mask: must be None (see causal / window_size).
    broadcast_dropout, dropout_rng: accepted and unused (no dropout is ever applied).
    dropout_rate, deterministic: dropout_rate > 0 with deterministic=False is refused.
      `deterministic` is Flax's "no dropout" flag; see deterministic_backward for ours.
    dtype: compute dtype; None promotes q, k, v to their common dtype, as Flax does.
    precision: accepted and unused: scores and softmax always accumulate in float32 (float64
      for float64 inputs).
    module: must be None (attention weights cannot be sown).
    force_fp32_for_softmax: accepted; the softmax is always float32 here.
    einsum_dot_general, qk_attn_weights_einsum, attn_weights_value_einsum: must be None.
    promote_dtype: nnx's dtype-promotion hook, applied to (query, key, value) if given.
    is_causal: nnx's flag, top-left aligned causal mask (jax.nn.dot_product_attention); the same
      as causal=True when q_length == kv_length and refused otherwise.
    causal: query i sees keys j <= i + kv_length - q_length (FlashAttention bottom-right).
    window_size: (left, right) sliding window, -1 unbounded; see jax_fa3.flash_attention.
    softcap: if > 0, scores become softcap * tanh(scores / softcap).
    softmax_scale: defaults to 1/sqrt(head_dim), Flax's scale.
    deterministic_backward: bit-reproducible gradients (flash_attention's `deterministic`).
    fp8: run jax_fa3.flash_attention_fp8 (e4m3 forward, straight-through gradients).
    incoherent, block_size, signs, rotation_key, fp8_backward: flash_attention_fp8's incoherent,
      block_size, signs, key and backward ("bf16": from the fp8 forward's statistics, no second
      forward; "recompute": flash_attention's exact gradient; "fp8": the fp8 backward's
      numerics); only with fp8=True.
    query_seq_lengths, key_value_seq_lengths: int32 (batch...) valid lengths; q_segment_ids,
      kv_segment_ids: int32 (batch..., length) segment ids (given together): see
      jax_fa3.flash_attention. Not with fp8=True.

  Returns:
    (batch..., q_length, heads, head_dim) in the compute dtype.
  """
  del broadcast_dropout, dropout_rng, precision, force_fp32_for_softmax
  _check_unsupported_arrays(bias, mask)
  check_no_dropout(dropout_rate, deterministic)
  check_no_weights_introspection(module)
  for name, fn in (("einsum_dot_general", einsum_dot_general),
                   ("qk_attn_weights_einsum", qk_attn_weights_einsum),
                   ("attn_weights_value_einsum", attn_weights_value_einsum)):
    if fn is not None:
      raise TypeError(
          f"jax_fa3 attention does not take {name} (custom/quantized einsums, e.g. AQT): it runs "
          f"its own kernels. For low-precision attention use "
          f"functools.partial(jax_fa3.flax.dot_product_attention, fp8=True).")
  fp8 = check_bool("fp8", fp8)
  fp8_backward = check_fp8_backward(fp8_backward, "fp8_backward")
  if not fp8:
    given = [n for n, v in (("block_size", block_size), ("signs", signs),
                            ("rotation_key", rotation_key)) if v is not None]
    if fp8_backward != "bf16":
      given.append("fp8_backward")
    if given:
      raise ValueError(f"{', '.join(given)} only apply with fp8=True")
  elif check_softcap(softcap) > 0.0 or deterministic_backward:
    raise ValueError("fp8=True supports neither softcap > 0 nor deterministic_backward=True")

  query, key, value = _promote(query, key, value, dtype, promote_dtype)
  if not (query.ndim == key.ndim == value.ndim) or query.ndim < 3:
    raise ValueError(
        f"query, key and value must have one rank >= 3, (batch..., length, heads, head_dim); "
        f"got shapes {query.shape}, {key.shape}, {value.shape}")
  batch_shape = query.shape[:-3]
  if not (key.shape[:-3] == value.shape[:-3] == batch_shape):
    raise ValueError(f"query, key and value batch dims must match, got shapes {query.shape}, "
                     f"{key.shape}, {value.shape}")

  causal = check_bool("causal", causal)
  if check_bool("is_causal", is_causal):
    if query.shape[-3] != key.shape[-3]:
      raise ValueError(
          f"is_causal=True is top-left aligned (jax.nn.dot_product_attention) while jax_fa3 is "
          f"bottom-right aligned (FlashAttention); they agree only when q_length == kv_length, "
          f"got {query.shape[-3]} and {key.shape[-3]}. Use {_PARTIAL_HINT} for bottom-right.")
    causal = True
  window_size = check_window(window_size)

  q4, k4, v4 = (_to_rank4(x, batch_shape) for x in (query, key, value))
  padding = _flat_padding(batch_shape, query.shape[-3], key.shape[-3],
                          query_seq_lengths=query_seq_lengths,
                          key_value_seq_lengths=key_value_seq_lengths,
                          q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids)
  if fp8 and padding:
    raise ValueError(f"fp8=True takes no {', '.join(padding)} (the fp8 kernel has no padding "
                     f"masks); use the bf16 attention for padded or packed rows")
  if fp8:
    out = flash_attention_fp8(
        q4, k4, v4, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
        incoherent=check_bool("incoherent", incoherent), block_size=block_size, key=rotation_key,
        signs=signs, backward=fp8_backward)
  else:
    out = flash_attention(q4, k4, v4, softmax_scale=softmax_scale, causal=causal,
                          window_size=window_size, softcap=softcap,
                          deterministic=deterministic_backward, **padding)
  return jnp.reshape(out, query.shape)


def _flat_padding(batch_shape, q_length, kv_length, **padding) -> dict:
  """The given padding arrays with their batch dims flattened like q, k, v (checked here: a
  mis-shaped one cannot be reshaped)."""
  flat = {}
  for name, x in padding.items():
    if x is None:
      continue
    per_row = {"query_seq_lengths": (), "key_value_seq_lengths": (),
               "q_segment_ids": (q_length,), "kv_segment_ids": (kv_length,)}[name]
    expected = tuple(batch_shape) + per_row
    if tuple(getattr(x, "shape", ())) != expected:
      raise ValueError(f"{name} must have shape {expected} (the batch dims of query"
                       f"{', then its length' if per_row else ''}), got "
                       f"{getattr(x, 'shape', type(x).__name__)}")
    flat[name] = jnp.reshape(x, (math.prod(batch_shape),) + per_row)
  return flat


def attend_with_cache(query, key, value, cache_key, cache_value, cache_index, *, causal,
                      window_size, softcap, softmax_scale):
  """The layers' decode step: query/key/value (batch..., length, heads, head_dim) appended to the
  (batch..., max_length, kv_heads, head_dim) caches at cache_index and attended over them
  (jax_fa3.flash_attention_with_kvcache). Returns (out like query, new cache_key, new
  cache_value)."""
  *batch, _, kv_heads, head_dim = cache_key.shape
  if tuple(key.shape[:-3]) != tuple(batch) or key.shape[-2:] != (kv_heads, head_dim):
    raise ValueError(f"decode=True: the inputs' batch dims and heads must match the cache's "
                     f"{tuple(cache_key.shape)} (batch..., max_length, heads, head_dim), got keys "
                     f"of shape {tuple(key.shape)}")
  rows = math.prod(batch)
  flat = lambda x: jnp.reshape(x.astype(cache_key.dtype), (rows,) + x.shape[-3:])
  out, new_key, new_value = flash_attention_with_kvcache(
      flat(query), flat(cache_key), flat(cache_value), flat(key), flat(value),
      cache_seqlens=jnp.full((rows,), cache_index, jnp.int32), causal=causal,
      window_size=window_size, softcap=softcap, softmax_scale=softmax_scale)
  return (jnp.reshape(out, query.shape).astype(query.dtype),
          jnp.reshape(new_key, cache_key.shape), jnp.reshape(new_value, cache_value.shape))
