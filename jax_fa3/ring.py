"""Ring attention: sequence parallelism over a mesh axis, forward and backward.

Inside `shard_map` (or `pmap`) with the sequence axis of q, k and v split over `axis_name`, every
device keeps its query block and passes its key/value block round the ring with `lax.ppermute`;
each (query block, key/value block) pair runs the single-device attention
(`_local_attention.forward_local`, which returns out and LSE) and partial results are merged by
their LSE. The transfer of the next key/value block is issued before the current block is
computed, so XLA can overlap the two.

The backward passes the key/value blocks round again together with their dK/dV accumulators and
runs the single-device backward per pair with the *final* out and LSE, so that P = exp(S - LSE) and
D = rowsum(dO * O) are the global ones and per-pair gradients simply add up.

Causal attention and load balance: with contiguous chunks, device r skips the blocks of devices
after it and the last device does n times the work of the first. In zig-zag order the sequence is
cut into 2n chunks and device r holds chunks r and 2n-1-r (`zigzag_permute`); then every block
pair is either the causal diagonal (own block), the first half of the key/value block against all
queries, or all keys against the second half of the queries: the same work on every device.

Supported visibility: full (no window) and causal (with s_q == s_k); both with soft-capping and GQA.
Sliding windows are not supported by the ring (the sharded-jit wrapper gathers instead).

`ring_attention` runs inside `shard_map`/`pmap`; `sequence_parallel_attention` applies the
`shard_map` itself to global arrays. Under a plain sharded `jit`, `jax_fa3.flash_attention` reaches
the same ring through the partitioning rules (`jax_fa3._partitioning`) on contiguous blocks.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from jax_fa3 import _local_attention, _partitioning
from jax_fa3._config import AttentionConfig
from jax_fa3._validation import attention_config

# ---------------------------------------------------------------------------------------------
# Zig-zag token order
# ---------------------------------------------------------------------------------------------

def zigzag_indices(seqlen: int, num_shards: int) -> np.ndarray:
  """Token positions in zig-zag order: shard r holds chunks r and 2n-1-r of 2n equal chunks."""
  if seqlen % (2 * num_shards):
    raise ValueError(f"zig-zag order needs seqlen divisible by 2 * num_shards = {2 * num_shards}, "
                     f"got seqlen {seqlen}")
  chunks = np.arange(seqlen).reshape(2 * num_shards, -1)
  order = [c for r in range(num_shards) for c in (r, 2 * num_shards - 1 - r)]
  return chunks[order].reshape(-1)


def _take(x, indices, axis):
  index = (slice(None),) * axis + (jnp.asarray(indices),)
  sharding = getattr(getattr(jax, "typeof", lambda _: None)(x), "sharding", None)
  if sharding is not None and any(s is not None for s in getattr(sharding, "spec", ())):
    # Sharding in types (Explicit mesh): the result keeps x's sharding (XLA moves the tokens).
    return x.at[index].get(out_sharding=sharding)
  return x[index]


def zigzag_permute(x, num_shards: int, axis: int = 1):
  """Natural -> zig-zag token order along `axis` (seqlen axis of (b, s, h, d) by default)."""
  return _take(x, zigzag_indices(x.shape[axis], num_shards), axis)


def zigzag_unpermute(x, num_shards: int, axis: int = 1):
  """Zig-zag -> natural token order along `axis`; the inverse of `zigzag_permute`."""
  return _take(x, np.argsort(zigzag_indices(x.shape[axis], num_shards)), axis)


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------

def _axis_size(axis_name) -> int:
  size = getattr(lax, "axis_size", None)
  if size is not None:
    return int(size(axis_name))
  return int(lax.psum(1, axis_name))


def _rotate(x, axis_name, n):
  """Device r sends to r + 1 (so after s rotations device r holds the block of r - s)."""
  if n == 1:
    return x
  return lax.ppermute(x, axis_name, perm=[(i, (i + 1) % n) for i in range(n)])


def ring_unsupported_reason(cfg: AttentionConfig, s_q: int, s_k: int) -> str | None:
  """None if the ring runs this configuration, else the reason it does not."""
  if cfg.window_left >= 0 or cfg.window_right > 0:
    return "ring attention supports full and causal attention, not sliding windows"
  if cfg.is_causal and s_q != s_k:
    return f"causal ring attention needs seqlen_q == seqlen_k, got {s_q} and {s_k}"
  return None


def _full(cfg):
  return AttentionConfig(softmax_scale=cfg.softmax_scale, softcap=cfg.softcap,
                         deterministic=cfg.deterministic)


def _diagonal(cfg):
  return AttentionConfig(softmax_scale=cfg.softmax_scale, window_right=0, softcap=cfg.softcap,
                         deterministic=cfg.deterministic)


def _earlier(step, index, n):
  """Whether the key/value block held at `step` (that of device index - step) precedes ours."""
  return (index - step) % n < index


def _stat_dtype(x):
  return jnp.float64 if x.dtype == jnp.float64 else jnp.float32


# ---------------------------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------------------------

def _merge(out, lse, block_out, block_lse):
  """Merges a block's (out, lse) into the running ones; lse -inf means 'nothing seen yet'."""
  block_lse = block_lse.astype(lse.dtype)
  block_lse = jnp.where(jnp.isposinf(block_lse), -jnp.inf, block_lse)  # our 'no key' is +inf
  new = jnp.logaddexp(lse, block_lse)
  safe = jnp.where(jnp.isneginf(new), 0.0, new)
  to_rows = lambda w: jnp.swapaxes(w, 1, 2)[..., None]  # (b, h, s) -> (b, s, h, 1)
  out = (out * to_rows(jnp.exp(lse - safe))
         + block_out.astype(out.dtype) * to_rows(jnp.exp(block_lse - safe)))
  return out, new


def _ring_setup(q, k, cfg: AttentionConfig, axis_name, zigzag: bool):
  """Checks a ring call; returns (ring size, this device's index, causal)."""
  reason = ring_unsupported_reason(cfg, q.shape[1], k.shape[1])
  if reason:
    raise NotImplementedError(reason)
  _check_zigzag(zigzag, cfg.is_causal, q, k)
  return _axis_size(axis_name), lax.axis_index(axis_name), cfg.is_causal


def ring_forward(q, k, v, cfg: AttentionConfig, axis_name, zigzag: bool = True,
                 block_forward=None):
  """(out, lse) of attention of the local q block against the k/v blocks of the whole ring.

  Call inside shard_map/pmap; q, k, v are this device's (b, s/n, h, d) blocks. lse follows our
  convention (+inf on rows that see no key). `block_forward(q, k, v, cfg) -> (out, lse)` runs one
  pair (default: the single-device op, kernel or reference).
  """
  n, index, causal = _ring_setup(q, k, cfg, axis_name, zigzag)
  if block_forward is None:
    block_forward = _local_attention.forward_local
  b, s_q, h, d = q.shape
  stat = _stat_dtype(q)
  half_q, half_k = s_q // 2, k.shape[1] // 2
  full = _full(cfg)

  def as_stats(o, l):
    return o.astype(stat), l.astype(stat)

  def earlier(k, v):  # the key/value block precedes all our queries
    if zigzag:  # its first chunk precedes both of ours, its second follows both
      return as_stats(*block_forward(q, k[:, :half_k], v[:, :half_k], full))
    return as_stats(*block_forward(q, k, v, full))

  def later(k, v):  # the key/value block follows our (first) query chunk
    if zigzag:  # both its chunks precede our second chunk only
      o, l = as_stats(*block_forward(q[:, half_q:], k, v, full))
      return (jnp.concatenate([jnp.zeros((b, half_q, h, d), stat), o], 1),
              jnp.concatenate([jnp.full((b, h, half_q), -jnp.inf, stat), l], 2))
    return jnp.zeros((b, s_q, h, d), stat), jnp.full((b, h, s_q), -jnp.inf, stat)

  def body(carry, step):
    k, v, out, lse = carry
    next_k, next_v = _rotate((k, v), axis_name, n)  # issued before this block's compute
    if causal:
      block = lax.cond(_earlier(step, index, n), earlier, later, k, v)
    else:
      block = as_stats(*block_forward(q, k, v, full))
    out, lse = _merge(out, lse, *block)
    return (next_k, next_v, out, lse), None

  # Step 0, our own block: the causal diagonal (or full).
  next_k, next_v = _rotate((k, v), axis_name, n)
  out, lse = as_stats(*block_forward(q, k, v, cfg if causal else full))
  lse = jnp.where(jnp.isposinf(lse), -jnp.inf, lse)
  # Steps 1 .. n-1. (The last step's rotation is not needed: one block transfer too many,
  # overlapped with the last compute, for a single copy of the step in the program.)
  (_, _, out, lse), _ = lax.scan(body, (next_k, next_v, out, lse), jnp.arange(1, n))
  lse = jnp.where(jnp.isneginf(lse), jnp.inf, lse)
  return out.astype(q.dtype), lse


def _check_zigzag(zigzag, causal, q, k):
  if zigzag and causal and (q.shape[1] % 2 or k.shape[1] % 2):
    raise ValueError(f"zig-zag ring attention needs even local seqlens (two chunks per device), "
                     f"got {q.shape[1]} and {k.shape[1]}")


# ---------------------------------------------------------------------------------------------
# Backward
# ---------------------------------------------------------------------------------------------

def ring_backward(q, k, v, out, lse, dout, cfg: AttentionConfig, axis_name, zigzag: bool = True,
                  dlse=None, block_backward=None):
  """(dq, dk, dv) for `ring_forward`'s out and lse (the merged, global ones) and cotangent dout.

  K/V blocks go round the ring once more, each with its dK/dV accumulator; the accumulator moves
  on after every step, so after step n-1 it is back on the device that owns the block.
  """
  n, index, causal = _ring_setup(q, k, cfg, axis_name, zigzag)
  if block_backward is None:
    block_backward = _local_attention.backward_local
  stat = _stat_dtype(q)
  half_q, half_k = q.shape[1] // 2, k.shape[1] // 2
  full = _full(cfg)

  def run(q, k, v, out, lse, dout, dlse, c):
    if dlse is None:
      grads = block_backward(q, k, v, out, lse, dout, c)
    else:
      grads = block_backward(q, k, v, out, lse, dout, c, dlse=dlse)
    return tuple(g.astype(stat) for g in grads)

  zeros = lambda x: jnp.zeros(x.shape, stat)

  def earlier(k, v):
    if zigzag:
      dq, dk, dv = run(q, k[:, :half_k], v[:, :half_k], out, lse, dout, dlse, full)
      pad = lambda g: jnp.concatenate([g, jnp.zeros(g.shape, stat)], 1)
      return dq, pad(dk), pad(dv)
    return run(q, k, v, out, lse, dout, dlse, full)

  def later(k, v):
    if zigzag:
      second = lambda x: None if x is None else x[:, half_q:]
      dq, dk, dv = run(second(q), k, v, second(out), lse[..., half_q:], second(dout),
                       None if dlse is None else dlse[..., half_q:], full)
      return jnp.concatenate([jnp.zeros(dq.shape, stat), dq], 1), dk, dv
    return zeros(q), zeros(k), zeros(v)

  def body(carry, step):
    k, v, dq, dk, dv = carry
    next_k, next_v = _rotate((k, v), axis_name, n)  # issued before this block's compute
    if causal:
      g = lax.cond(_earlier(step, index, n), earlier, later, k, v)
    else:
      g = run(q, k, v, out, lse, dout, dlse, full)
    dk, dv = _rotate((dk + g[1], dv + g[2]), axis_name, n)  # accumulators travel with the block
    return (next_k, next_v, dq + g[0], dk, dv), None

  next_k, next_v = _rotate((k, v), axis_name, n)
  dq, dk, dv = run(q, k, v, out, lse, dout, dlse, cfg if causal else full)
  dk, dv = _rotate((dk, dv), axis_name, n)
  (_, _, dq, dk, dv), _ = lax.scan(body, (next_k, next_v, dq, dk, dv), jnp.arange(1, n))
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)

# ---------------------------------------------------------------------------------------------
# Differentiable entry point
# ---------------------------------------------------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _ring_attention(q, k, v, cfg, axis_name, zigzag):
  return ring_forward(q, k, v, cfg, axis_name, zigzag)[0]


def _ring_attention_fwd(q, k, v, cfg, axis_name, zigzag):
  out, lse = ring_forward(q, k, v, cfg, axis_name, zigzag)
  return out, (q, k, v, out, lse)


def _ring_attention_bwd(cfg, axis_name, zigzag, residuals, dout):
  q, k, v, out, lse = residuals
  return ring_backward(q, k, v, out, lse, dout, cfg, axis_name, zigzag)


_ring_attention.defvjp(_ring_attention_fwd, _ring_attention_bwd)


def ring_attention(q, k, v, *, axis_name, causal=False, softmax_scale=None, window_size=(-1, -1),
                   softcap=0.0, zigzag=True, deterministic=False):
  """Sequence-parallel attention; call inside `shard_map`/`pmap` over `axis_name`.

  Args:
    q: this device's (batch, seqlen_q / n, heads, head_dim) block of the queries.
    k, v: this device's (batch, seqlen_k / n, heads_k, head_dim) blocks.
    axis_name: the mesh (or pmap) axis, or tuple of axes, that splits the sequence in n blocks.
    causal, softmax_scale, softcap, deterministic: as `flash_attention`. Causal needs
      seqlen_q == seqlen_k. window_size: only (-1, -1) (the ring has no sliding windows).
    zigzag: for causal attention, the global sequence is in zig-zag order (`zigzag_permute`):
      device r holds chunks r and 2n-1-r, which balances the work. False: contiguous blocks
      (device r holds block r; correct, but device n-1 does n times the work of device 0).

  Returns:
    this device's block of the output, like q.
  """
  cfg = attention_config(q, k, v, softmax_scale=softmax_scale, causal=causal,
                         window_size=window_size, softcap=softcap, deterministic=deterministic)
  reason = ring_unsupported_reason(cfg, q.shape[1], k.shape[1])
  if reason:
    raise NotImplementedError(reason)
  if isinstance(axis_name, list):
    axis_name = tuple(axis_name)
  return _ring_attention(q, k, v, cfg, axis_name, bool(zigzag))


# ---------------------------------------------------------------------------------------------
# Sequence parallelism on global arrays
# ---------------------------------------------------------------------------------------------

def sequence_parallel_attention(q, k, v, *, seq_axis, mesh=None, batch_axis=None, head_axis=None,
                                causal=False, softmax_scale=None, softcap=0.0, zigzag=False,
                                deterministic=False):
  """Ring attention over `seq_axis` for global (b, s, h, d) arrays, usable under plain `jit`.

  Applies `shard_map` with q, k, v split as P(batch_axis, seq_axis, head_axis, None) and runs
  `jax_fa3.ring_attention` inside; differentiable. `zigzag=True` declares that the sequence axis
  of q, k, v is already in zig-zag order (`zigzag_permute(x, mesh.shape[seq_axis])`), which
  balances causal work; the output is then in the same order. `mesh` defaults to the mesh set
  with `jax.set_mesh` / `jax.sharding.use_mesh`.
  """
  if mesh is None:
    get = getattr(jax.sharding, "get_abstract_mesh", None)
    mesh = get() if get is not None else None
    if mesh is None or not getattr(mesh, "axis_names", ()):
      raise ValueError("sequence_parallel_attention needs mesh= (or a mesh set with jax.set_mesh)")
  spec = P(batch_axis, seq_axis, head_axis, None)

  def body(q, k, v):
    return ring_attention(q, k, v, axis_name=seq_axis, causal=causal, softmax_scale=softmax_scale,
                          softcap=softcap, zigzag=zigzag, deterministic=deterministic)

  explicit = _partitioning.explicit_mesh((q, k, v))
  if explicit is not None:  # sharding in types: put the operands where shard_map expects them
    q, k, v = (x if _partitioning.spec_axes(spec, 4) == have
               else _partitioning.reshard(x, explicit[0], spec)
               for x, have in zip((q, k, v), explicit[1]))
  return _partitioning.shard_map(body, mesh, (spec, spec, spec), spec)(q, k, v)
