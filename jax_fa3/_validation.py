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


FP8_BACKWARDS = ("bf16", "recompute")  # flash_attention_fp8(backward=...), see jax_fa3.fp8


def check_fp8_backward(backward, name="backward") -> str:
  if not isinstance(backward, str) or backward not in FP8_BACKWARDS:
    raise ValueError(f"{name} must be one of {FP8_BACKWARDS}, got {backward!r}")
  return backward
