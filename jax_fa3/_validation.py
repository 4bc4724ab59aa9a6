"""Argument checks run before anything is traced into XLA.

Every error names the argument, what was expected and what was given.
"""
from __future__ import annotations

import math
from typing import Any

import jax.numpy as jnp
import numpy as np

from jax_fa3._config import AttentionConfig

MAX_HEAD_DIM = 256
ATTENTION_DTYPES = (jnp.float32, jnp.float64, jnp.bfloat16, jnp.float16)


def _shape(x) -> tuple:
  return tuple(getattr(x, "shape", ()))


def check_array(name: str, x: Any, rank: int | None = None) -> None:
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise TypeError(f"{name} must be a JAX or NumPy array, got {type(x).__name__}")
  if rank is not None and x.ndim != rank:
    raise ValueError(
        f"{name} must have rank {rank} with layout (batch, seqlen, heads, head_dim), "
        f"got shape {_shape(x)} (rank {x.ndim})")


def check_attention_dtypes(q, k, v, allowed=ATTENTION_DTYPES) -> None:
  for name, x in (("q", q), ("k", k), ("v", v)):
    if not any(x.dtype == np.dtype(d) for d in allowed):
      names = ", ".join(np.dtype(d).name for d in allowed)
      raise TypeError(f"{name} must have a floating dtype in ({names}), got {x.dtype}")
  if not (q.dtype == k.dtype == v.dtype):
    raise TypeError(f"q, k and v must share one dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}")


def check_attention_shapes(q, k, v) -> None:
  """q (b, s_q, h, d); k, v (b, s_k, h_k, d); h a multiple of h_k; d a multiple of 8, <= 256."""
  for name, x in (("q", q), ("k", k), ("v", v)):
    check_array(name, x, rank=4)
  bq, sq, hq, dq = q.shape
  bk, sk, hk, dk = k.shape
  if k.shape != v.shape:
    raise ValueError(f"k and v must have the same shape (batch, seqlen_k, heads_k, head_dim), "
                     f"got k {k.shape} and v {v.shape}")
  if bk != bq:
    raise ValueError(f"k must have the batch size of q ({bq}), got {bk}")
  if dk != dq:
    raise ValueError(f"k and v must have the head_dim of q ({dq}), got {dk}")
  for name, n in (("q", sq), ("k", sk)):
    if n < 1:
      raise ValueError(f"{name} must have seqlen >= 1, got {n}")
  if hk < 1 or hq % hk != 0:
    raise ValueError(f"the number of heads of q ({hq}) must be a multiple of the number of heads "
                     f"of k and v ({hk}) (GQA/MQA)")
  if dq < 8 or dq > MAX_HEAD_DIM or dq % 8 != 0:
    raise ValueError(f"head_dim must be a multiple of 8 between 8 and {MAX_HEAD_DIM}, got {dq}")


def check_window(window_size: Any) -> tuple[int, int]:
  try:
    left, right = window_size
  except (TypeError, ValueError):
    raise TypeError(f"window_size must be a pair (left, right) of ints, got {window_size!r}") from None
  for side, w in (("left", left), ("right", right)):
    if isinstance(w, bool) or not isinstance(w, (int, np.integer)):
      raise TypeError(f"window_size {side} must be an int (-1 for unbounded), got {w!r}")
    if w < -1:
      raise ValueError(f"window_size {side} must be -1 (unbounded) or >= 0, got {w}")
  return int(left), int(right)


def check_softmax_scale(softmax_scale: Any, head_dim: int) -> float:
  if softmax_scale is None:
    return 1.0 / math.sqrt(head_dim)
  if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float, np.floating,
                                                                      np.integer)):
    raise TypeError(f"softmax_scale must be a Python float or None, got {type(softmax_scale).__name__}")
  scale = float(softmax_scale)
  if not math.isfinite(scale) or scale <= 0:
    raise ValueError(f"softmax_scale must be finite and > 0, got {softmax_scale}")
  return scale


def check_softcap(softcap: Any) -> float:
  if isinstance(softcap, bool) or not isinstance(softcap, (int, float, np.floating, np.integer)):
    raise TypeError(f"softcap must be a Python float (0 disables it), got {type(softcap).__name__}")
  cap = float(softcap)
  if not math.isfinite(cap) or cap < 0:
    raise ValueError(f"softcap must be finite and >= 0 (0 disables it), got {softcap}")
  return cap


def check_bool(name: str, value: Any) -> bool:
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{name} must be a bool, got {value!r}")
  return bool(value)


def attention_config(q, k, v, *, softmax_scale, causal, window_size, softcap,
                     deterministic) -> AttentionConfig:
  """Validates a flash_attention call and returns its static configuration."""
  check_attention_shapes(q, k, v)
  check_attention_dtypes(q, k, v)
  causal = check_bool("causal", causal)
  check_bool("deterministic", deterministic)
  left, right = check_window(window_size)
  if causal:
    if right > 0:
      raise ValueError(f"causal=True means window_size right = 0; got window_size={window_size!r}")
    right = 0
  return AttentionConfig(
      softmax_scale=check_softmax_scale(softmax_scale, q.shape[-1]),
      window_left=left, window_right=right, softcap=check_softcap(softcap),
      deterministic=bool(deterministic))


FP8_BACKWARDS = ("bf16", "recompute", "fp8")  # flash_attention_fp8(backward=...), see jax_fa3.fp8


def check_fp8_backward(backward, name="backward") -> str:
  if not isinstance(backward, str) or backward not in FP8_BACKWARDS:
    raise ValueError(f"{name} must be one of {FP8_BACKWARDS}, got {backward!r}")
  return backward


def concrete(x):
  """x as a NumPy array when its values are known at trace time, else None (a tracer)."""
  try:
    return np.asarray(x)
  except Exception:  # noqa: BLE001 (jax.errors.TracerArrayConversionError and kin)
    return None


def check_int_array(name: str, x: Any, shape: tuple, meaning: str):
  """Checks an integer index/length array's type, dtype and shape; returns its values when known
  at trace time (`concrete`), else None."""
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise TypeError(f"{name} must be a JAX or NumPy integer array {meaning}, got "
                    f"{type(x).__name__}")
  if not jnp.issubdtype(x.dtype, jnp.integer) or x.dtype == np.dtype(bool):
    raise TypeError(f"{name} must have an integer dtype (int32), got {x.dtype}")
  if tuple(x.shape) != shape:
    raise ValueError(f"{name} must have shape {shape} {meaning}, got {tuple(x.shape)}")
  return concrete(x)


def padding_masks(q, k, *, query_seq_lengths=None, key_value_seq_lengths=None,
                  q_segment_ids=None, kv_segment_ids=None):
  """Validates flash_attention's padding arguments; returns None when none is given, else the
  int32 masks of `jax_fa3.attention.masked_attention`: (q_lengths (b,), kv_lengths (b,),
  diagonals (b,)) with missing lengths full and every diagonal seqlen_k - seqlen_q (the arrays'
  bottom-right alignment); with segment ids the diagonals are per query, (b, s_q), followed by
  (q_segment_ids (b, s_q), kv_segment_ids (b, s_k)).
  Lengths known at trace time must lie in [0, seqlen]; traced ones are clamped there."""
  if (q_segment_ids is None) != (kv_segment_ids is None):
    raise ValueError("give q_segment_ids and kv_segment_ids together (the same array twice for "
                     "self-attention), or neither")
  if all(x is None for x in (query_seq_lengths, key_value_seq_lengths, q_segment_ids)):
    return None
  b, s_q, s_k = q.shape[0], q.shape[1], k.shape[1]
  lengths = []
  for name, x, s in (("query_seq_lengths", query_seq_lengths, s_q),
                     ("key_value_seq_lengths", key_value_seq_lengths, s_k)):
    if x is None:
      lengths.append(jnp.full((b,), s, jnp.int32))
      continue
    values = check_int_array(name, x, (b,), "(batch,)")
    if values is not None and (values.min() < 0 or values.max() > s):
      raise ValueError(f"{name} must lie in [0, {s}] (the padded sequence length), got values "
                       f"from {values.min()} to {values.max()}")
    lengths.append(jnp.clip(jnp.asarray(x, jnp.int32), 0, s))
  diagonals = jnp.full((b,), s_k - s_q, jnp.int32)
  if q_segment_ids is None:
    return (*lengths, diagonals)
  check_int_array("q_segment_ids", q_segment_ids, (b, s_q), "(batch, seqlen_q)")
  check_int_array("kv_segment_ids", kv_segment_ids, (b, s_k), "(batch, seqlen_k)")
  return (*lengths, jnp.broadcast_to(diagonals[:, None], (b, s_q)),
          jnp.asarray(q_segment_ids, jnp.int32), jnp.asarray(kv_segment_ids, jnp.int32))
