"""jax_fa3.flash_attention_varlen: attention over packed variable-length sequences
(FlashAttention's `flash_attn_varlen_func`).

Sequence r owns the tokens cu_seqlens[r] : cu_seqlens[r + 1] of the packed (total_tokens, heads,
head_dim) arrays. Two routes, one result:

- packed: where the kernels' key-range variants run, the packed arrays are one batch row whose
  segment ids are the sequence indices, each query's mask centred on its own sequence's
  bottom-right diagonal; each query sees one interval of keys, so nothing is copied or padded
  and the kernels skip the tiles between sequences;
- padded: otherwise the call gathers the packed tokens into a (num_seqs, max_seqlen, heads,
  head_dim) batch, sequence r at the start of row r, runs padded-batch attention with the
  sequences' lengths and each row's own mask diagonal (query i sees key j <= i + len_k - len_q,
  as FlashAttention aligns varlen causal masks), and scatters the result back.

`jax.grad` flows through either.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from jax_fa3 import _local_attention
from jax_fa3.attention import masked_attention
from jax_fa3._validation import attention_config, check_array, check_attention_dtypes, concrete


def _check_cu_seqlens(name, cu, total, max_seqlen_name, max_seqlen):
  check_array(name, cu)
  if cu.ndim != 1 or cu.shape[0] < 2:
    raise ValueError(f"{name} must have shape (num_seqs + 1,) with num_seqs >= 1, got "
                     f"{tuple(cu.shape)}")
  if not jnp.issubdtype(cu.dtype, jnp.integer) or cu.dtype == np.dtype(bool):
    raise TypeError(f"{name} must have an integer dtype (int32), got {cu.dtype}")
  if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, (int, np.integer)):
    raise TypeError(f"{max_seqlen_name} must be a Python int (it sets the padded length), got "
                    f"{max_seqlen!r}")
  if max_seqlen < 1:
    raise ValueError(f"{max_seqlen_name} must be >= 1, got {max_seqlen}")
  values = concrete(cu)
  if values is None:  # traced under jit: checked by clamping instead
    return
  if values[0] != 0 or values[-1] != total:
    raise ValueError(f"{name} must start at 0 and end at the number of packed tokens ({total}), "
                     f"got {values[0]} ... {values[-1]}")
  lengths = np.diff(values)
  if np.any(lengths < 0):
    raise ValueError(f"{name} must be non-decreasing (sequence lengths >= 0), got a decrease "
                     f"at index {int(np.argmax(lengths < 0)) + 1}")
  if lengths.max() > max_seqlen:
    raise ValueError(f"{max_seqlen_name} ({max_seqlen}) is below the longest sequence of {name} "
                     f"({lengths.max()})")


def _padded_positions(cu, lengths, max_seqlen, total):
  """For the padded (num_seqs, max_seqlen) layout with each sequence at the start of its row: the
  packed token each slot holds (clamped into range) and whether it holds one."""
  slot = jnp.arange(max_seqlen)[None, :]
  token = cu[:-1, None] + slot
  real = (slot < lengths[:, None]) & (token < total)
  return jnp.clip(token, 0, max(total - 1, 0)), real


def _sequence_of_tokens(cu, total):
  """int32 (total,): the sequence each packed token belongs to (num_seqs past cu[-1])."""
  token = jnp.arange(total, dtype=jnp.int32)
  sequence = jnp.searchsorted(cu[1:], token, side="right", method="scan_unrolled")
  return sequence.astype(jnp.int32)


def _packed_attention(q, k, v, cu_q, cu_k, cfg, return_lse):
  """Attention over packed sequences as one batch row: segment ids are the sequence indices, and
  query i of sequence r is centred on key i + (cu_k[r + 1] - cu_q[r + 1]), its sequence's
  bottom-right alignment (tokens past cu[-1], a traced contract violation, are padding: out 0)."""
  total_q, total_k = q.shape[0], k.shape[0]
  q_sequence = _sequence_of_tokens(cu_q, total_q)
  k_sequence = _sequence_of_tokens(cu_k, total_k)
  ends = jnp.concatenate([cu_k[1:] - cu_q[1:], jnp.zeros((1,), jnp.int32)])
  diagonals = ends[q_sequence][None]
  masks = (jnp.clip(cu_q[-1:], 0, total_q), jnp.clip(cu_k[-1:], 0, total_k), diagonals,
           q_sequence[None], k_sequence[None])
  # Sequence indices never decrease along the tokens (cu_seqlens do not; a traced decreasing
  # one breaks the function's contract and gets in-bounds garbage, not a fallback).
  cfg = dataclasses.replace(cfg, sorted_segments=True)
  result = masked_attention(q[None], k[None], v[None], masks, cfg, return_lse)
  if not return_lse:
    return result[0]
  return result[0][0], result[1][0]


def _gather(x, token):
  return jnp.take(x, token.reshape(-1), axis=0).reshape(token.shape + x.shape[1:])


def flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                           return_lse=False, deterministic=False):
  """Attention over packed sequences of different lengths.

  Args:
    q: (total_q, heads, head_dim); k, v: (total_k, heads_k, head_dim) — the tokens of every
      sequence, one after the other.
    cu_seqlens_q, cu_seqlens_k: int32 (num_seqs + 1,) cumulative lengths: sequence r is
      q[cu_seqlens_q[r]:cu_seqlens_q[r + 1]] against k, v[cu_seqlens_k[r]:cu_seqlens_k[r + 1]].
      Known at trace time they must start at 0, end at the token count and not decrease
      (ValueError); traced ones are taken as given, lengths clamped to [0, max_seqlen].
    max_seqlen_q, max_seqlen_k: Python ints, at least the longest sequence (they set the padded
      shape; a traced sequence longer than this keeps only its first max_seqlen tokens, the others
      get output 0).
    softmax_scale, causal, window_size, softcap, deterministic: as for `flash_attention`;
      causal masks and windows are aligned bottom-right within each sequence (query i of a
      sequence sees key j <= i + len_k - len_q).
    return_lse: also return the natural-log log-sum-exp, float32 (heads, total_q).

  Returns:
    out (total_q, heads, head_dim) in q's dtype, or (out, lse) with return_lse. A query whose
    sequence has no key (len_k = 0, or a window) gets out 0 and lse +inf.

  On a Hopper GPU the call runs on the kernels on the packed arrays in place, as one row of
  documents (see the module docstring; max_seqlen is then not needed, and a traced sequence
  longer than it is attended whole). Elsewhere, or with JAX_FA3_MASKED_KERNELS=0, it runs as a
  padded batch on the pure-JAX path, so memory follows num_seqs × max_seqlen.
  """
  for name, x in (("q", q), ("k", k), ("v", v)):
    check_array(name, x, rank=3)
  check_attention_dtypes(q, k, v)
  if k.shape != v.shape:
    raise ValueError(f"k and v must have the same shape (total_k, heads_k, head_dim), got "
                     f"k {k.shape} and v {v.shape}")
  _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], "max_seqlen_q", max_seqlen_q)
  _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], "max_seqlen_k", max_seqlen_k)
  if cu_seqlens_q.shape != cu_seqlens_k.shape:
    raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe the same number of sequences, "
                     f"got shapes {tuple(cu_seqlens_q.shape)} and {tuple(cu_seqlens_k.shape)}")
  cu_q, cu_k = (jnp.asarray(c, jnp.int32) for c in (cu_seqlens_q, cu_seqlens_k))
  if _local_attention.masked_kernels_would_run(q[None]):
    cfg = attention_config(q[None], k[None], v[None], softmax_scale=softmax_scale, causal=causal,
                           window_size=window_size, softcap=softcap, deterministic=deterministic)
    return _packed_attention(q, k, v, cu_q, cu_k, cfg, return_lse)
  q_len = jnp.clip(cu_q[1:] - cu_q[:-1], 0, max_seqlen_q)
  k_len = jnp.clip(cu_k[1:] - cu_k[:-1], 0, max_seqlen_k)
  q_token, q_real = _padded_positions(cu_q, q_len, max_seqlen_q, q.shape[0])
  k_token, _ = _padded_positions(cu_k, k_len, max_seqlen_k, k.shape[0])
  q_pad, k_pad, v_pad = _gather(q, q_token), _gather(k, k_token), _gather(v, k_token)
  cfg = attention_config(q_pad, k_pad, v_pad, softmax_scale=softmax_scale, causal=causal,
                         window_size=window_size, softcap=softcap, deterministic=deterministic)
  result = masked_attention(q_pad, k_pad, v_pad, (q_len, k_len, k_len - q_len), cfg, return_lse)
  out, lse = result if return_lse else (result, None)
  # Back to packed order: slot (r, p) holds token q_token[r, p] where q_real; the others drop.
  total, heads = q.shape[0], q.shape[1]
  flat_token = jnp.where(q_real, q_token, total).reshape(-1)  # total: out of range, dropped
  packed_out = jnp.zeros((total + 1,) + q.shape[1:], out.dtype).at[flat_token].set(
      out.reshape((-1,) + q.shape[1:]), mode="drop")[:total]
  if not return_lse:
    return packed_out
  per_slot_lse = jnp.moveaxis(lse, 1, 2).reshape(-1, heads)  # (num_seqs * max_q, heads)
  packed_lse = jnp.full((total + 1, heads), jnp.inf, lse.dtype).at[flat_token].set(
      per_slot_lse, mode="drop")[:total]
  return packed_out, packed_lse.T
