"""Partitioning rules for attention ops: how an op on sharded (b, s, h, d) arrays runs on each
device's blocks.

An XLA FFI call is opaque to the SPMD partitioner, which would all-gather its operands. Every
attention op (`AttentionOp`: operands and results are (b, s, h, d) arrays and (b, h, s) row
statistics) is therefore wrapped here:

- Auto-mode meshes (and GSPMD): `jax.experimental.custom_partitioning` with a Shardy
  `sharding_rule` (and the GSPMD `infer_sharding_from_operands` callback for older JAX / Shardy
  off). Its `partition` callback sees the operands' shardings and picks, per axis:
    batch     -> stays sharded, runs locally, no collective;
    heads     -> stays sharded on q and k/v (kv head i // group travels with query head i) when the
                 mesh axes divide both h and h_k; a trailing mesh axis that does not divide h_k
                 is dropped (replicated: gathered). MQA (h_k = 1): query heads stay sharded, the
                 k/v head is replicated, and the backward sums dk/dv over the head shards (psum);
    head_dim  -> replicated (gathered): a score needs the whole of q.k; unavoidable with FA kernels;
    sequence  -> q and k/v split over the same mesh axes: the op's ring body (ring attention,
                 `jax_fa3.ring`, for the bf16 ops) on contiguous blocks, since the data is in
                 natural order: causal work is then unbalanced, the last device doing n times the
                 first's (`sequence_parallel_attention(..., zigzag=True)` on zig-zag-ordered data
                 balances it); q split but k/v not, an op without a ring body, or a configuration
                 its ring does not run (sliding windows, causal with s_q != s_k): non-windowed
                 attention keeps q split and gathers k/v; windowed attention gathers the sequence.
  The same wrapper serves the kernel and the pure-JAX path, so CPU tests exercise it.
- Explicit-mode meshes (`jax.make_mesh` default in current JAX): shardings are in the types, so the
  same per-axis plan is applied at trace time with `shard_map` (resharding operands first if the
  plan differs from their type).
- Inside `shard_map`/`pmap` (all mesh axes manual) and on one device the op runs as is.

The ops themselves are declared by their users: the bf16 forward and backward in
`jax_fa3.attention`, the fp8 call from floats in `jax_fa3.fp8` (with `split_queries=False`: batch
and heads stay local, a sequence split is gathered, since its quantization blocks and v's per-head
scale span the sequence), the forward over a paged KV cache in `jax_fa3._cache_attention` (its
pools, LAYOUTS "pool", keep only their heads split) and the decode step there (its results are
a row's split-KV pieces, LAYOUTS "pieces", whose piece axis stays whole).

vmap composes: the partitioned op is wrapped in `_batching.fold_vmap_into_batch`.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_fa3._batching import fold_vmap_into_batch
from jax_fa3._config import AttentionConfig

# Logical factors: b batch, q query positions, k key positions, n kv heads, g query heads per kv
# head (query heads = (n g)), d head_dim.
LAYOUTS = {
    "q": ("b", "q", "h", "d"),    # (batch, seqlen_q, heads, head_dim): q, out, dout, dq
    "kv": ("b", "k", "n", "d"),   # (batch, seqlen_k, heads_k, head_dim): k, v, dk, dv
    "row": ("b", "h", "q"),       # (batch, heads, seqlen_q): lse, dlse, q's fp8 scale per token
    "krow": ("b", "n", "k"),      # (batch, heads_k, seqlen_k): k's fp8 scale per token
    "kvhead": ("b", "n"),         # (batch, heads_k): per-(batch, kv head) scales (fp8)
    "vec": ("d",),                # (head_dim,): the fp8 rotation's signs (replicated)
    "lens": ("b",),               # (batch,): sequence lengths
    "qseg": ("b", "q"),           # (batch, seqlen_q): query segment ids, per-query diagonals
    "kseg": ("b", "k"),           # (batch, seqlen_k): key segment ids
    # A paged KV cache: pools (num_pages, page_size, heads_k, head_dim), whose pages any batch row
    # may read (replicated but for the heads), and the rows' page tables (batch, pages_per_seq).
    "pool": ("pg", "ps", "n", "d"),
    "table": ("b", "pt"),
    # An e4m3 cache's scales, one per block of slots: (batch, heads_k, blocks) beside "kv"
    # caches, (num_pages, heads_k, blocks) beside "pool" ones.
    "kv_scales": ("b", "n", "sb"),
    "pool_scales": ("pg", "n", "sb"),
    # A decode step's split-KV pieces (batch, pieces, heads, head_dim) and their lse.
    "pieces": ("b", "sp", "h", "d"),
    "piece_rows": ("b", "sp", "h"),
}
# The factors of LAYOUTS that are never split (the pages of a pool, a page's slots, a table's
# entries, a row's split-KV pieces, a cache's scale blocks) besides head_dim.
_REPLICATED_FACTORS = ("pg", "ps", "pt", "sp", "sb")


@dataclasses.dataclass(frozen=True, eq=False)
class AttentionOp:
  """An attention op to partition.

  operands/results: layout names of LAYOUTS, one per array. `local(*arrays, cfg)` runs the op on
  one device's blocks. `ring(*arrays, cfg, axis_name)`, if given, runs it on sequence blocks split
  over `axis_name` (contiguous order) for the calls where `ring_unsupported_reason(cfg, s_q, s_k)`
  is None (given with `ring`); otherwise a sequence split falls back to gathering.
  """
  name: str
  operands: tuple
  results: tuple
  local: Callable
  ring: Callable | None = None
  ring_unsupported_reason: Callable | None = None
  # Whether the gathering fallback may keep queries split along the sequence (unmasked calls).
  # False for ops whose numerics depend on where the sequence is cut (fp8: blocks of tokens
  # share a quantization scale): they gather the sequence instead.
  split_queries: bool = True


@dataclasses.dataclass(frozen=True)
class Plan:
  """Mesh axes per logical factor (tuples of axis names; () = replicated)."""
  batch: tuple = ()
  heads: tuple = ()
  seq_q: tuple = ()
  seq_k: tuple = ()
  ring_axes: tuple = ()
  kv_heads: tuple = ()  # = heads, or () for MQA with sharded query heads (k/v replicated)

  def spec(self, layout: str) -> P:
    axes = {"b": self.batch, "q": self.seq_q, "k": self.seq_k, "h": self.heads,
            "n": self.kv_heads, "d": (), **{f: () for f in _REPLICATED_FACTORS}}
    return P(*(_entry(axes[f]) for f in LAYOUTS[layout]))


def _entry(axes: tuple):
  if not axes:
    return None
  return axes[0] if len(axes) == 1 else tuple(axes)


def _axes(entry) -> tuple:
  if entry is None or entry is P.UNCONSTRAINED:
    return ()
  if isinstance(entry, str):
    return (entry,)
  return tuple(a for a in entry if isinstance(a, str))


def spec_axes(spec, ndim) -> tuple:
  entries = tuple(spec) + (None,) * (ndim - len(tuple(spec)))
  return tuple(_axes(e) for e in entries[:ndim])


def _divisible_prefix(axes, sizes, *dims) -> tuple:
  """The longest prefix of `axes` whose total size divides every one of `dims`."""
  out = []
  for a in axes:
    m = math.prod(sizes[x] for x in out + [a])
    if any(d % m for d in dims):
      break
    out.append(a)
  return tuple(out)


def _kv_index(op: AttentionOp) -> int:
  """The operand that carries the kv heads: k (or a paged pool, whose keys are not a sequence)."""
  return op.operands.index("kv" if "kv" in op.operands else "pool")


def plan_partition(op: AttentionOp, shapes, specs, axis_sizes, cfg: AttentionConfig) -> Plan:
  """Per-factor mesh axes for `op` given its operands' shapes and per-dimension mesh axes."""
  qi, ki = op.operands.index("q"), _kv_index(op)
  b, s_q, h, _ = shapes[qi]
  s_k, h_k = shapes[ki][1], shapes[ki][2]
  q_axes, k_axes = specs[qi], specs[ki]
  batch = _divisible_prefix(q_axes[0], axis_sizes, b)
  head_axes = tuple(a for a in q_axes[2] if a not in batch)
  if h_k == 1:  # MQA: query heads split freely, the single k/v head is replicated
    heads = _divisible_prefix(head_axes, axis_sizes, h)
    kv_heads = ()
  else:  # GQA/MHA: kv head i // group stays with query head i
    heads = kv_heads = _divisible_prefix(head_axes, axis_sizes, h, h_k)
  used = set(batch) | set(heads)
  seq_q = tuple(a for a in q_axes[1] if a not in used)
  seq_k = tuple(a for a in k_axes[1] if a not in used)
  n = math.prod(axis_sizes[a] for a in seq_q)
  if (op.ring is not None and seq_q and seq_q == seq_k and s_q % n == 0 and s_k % n == 0
      and op.ring_unsupported_reason(cfg, s_q, s_k) is None):
    return Plan(batch, heads, seq_q, seq_k, ring_axes=seq_q, kv_heads=kv_heads)
  # Fallback: gather k/v; queries stay split only when no mask depends on their position.
  unmasked = op.split_queries and cfg.window_left < 0 and cfg.window_right < 0
  seq_q = _divisible_prefix(seq_q, axis_sizes, s_q) if unmasked else ()
  return Plan(batch, heads, seq_q, (), kv_heads=kv_heads)


def _run(op: AttentionOp, plan: Plan, cfg, arrays):
  if plan.ring_axes:
    axis = plan.ring_axes[0] if len(plan.ring_axes) == 1 else plan.ring_axes
    results = tuple(op.ring(*arrays, cfg=cfg, axis_name=axis))
  else:
    results = tuple(op.local(*arrays, cfg))
  if plan.heads and not plan.kv_heads:  # MQA: k/v-shaped results are partial over query heads
    results = tuple(jax.lax.psum(r, plan.heads) if l in ("kv", "kvhead") else r
                    for r, l in zip(results, op.results))
  return results


# ---------------------------------------------------------------------------------------------
# custom_partitioning (Auto meshes, GSPMD)
# ---------------------------------------------------------------------------------------------

def _sharding_rule(op: AttentionOp, group: int, kv_heads: int):
  """Einsum-like Shardy rule; query heads are the compound factor (n g) of kv heads n, group g."""
  if group == 1:
    names, sizes = {"h": "n"}, {}
  elif kv_heads == 1:  # MQA: Shardy refuses a size-1 factor in a compound; keep them apart
    names, sizes = {"h": "g"}, {}
  else:
    names, sizes = {"h": "(n g)"}, {"g": group}

  def factors(layout):
    return " ".join(names.get(f, f) for f in LAYOUTS[layout])
  rule = (", ".join(factors(l) for l in op.operands) + " -> "
          + ", ".join(factors(l) for l in op.results))
  return rule, sizes


def _named_specs(arg_shapes):
  specs = []
  for a in arg_shapes:
    sharding = a.sharding
    ndim = len(a.shape)
    if isinstance(sharding, NamedSharding):
      specs.append(spec_axes(sharding.spec, ndim))
    else:  # not expressible on the mesh: treat as replicated (the partitioner reshards)
      specs.append(((),) * ndim)
  return specs


def _plan_from_shapes(op, cfg, mesh, arg_shapes):
  sizes = dict(zip(mesh.axis_names, mesh.devices.shape))
  return plan_partition(op, [tuple(a.shape) for a in arg_shapes], _named_specs(arg_shapes), sizes,
                        cfg)


@functools.lru_cache(maxsize=None)
def _custom_partitioned(op: AttentionOp, group: int, kv_heads: int):
  from jax.experimental.custom_partitioning import custom_partitioning

  num = len(op.operands)

  def fn(*args):
    *arrays, cfg = args
    return tuple(op.local(*arrays, cfg))

  cp = custom_partitioning(fn, static_argnums=(num,))

  def partition(cfg, mesh, arg_shapes, result_shape):
    plan = _plan_from_shapes(op, cfg, mesh, arg_shapes)
    arg_shardings = tuple(NamedSharding(mesh, plan.spec(l)) for l in op.operands)
    result_shardings = tuple(NamedSharding(mesh, plan.spec(l)) for l in op.results)

    def lower(*arrays):
      return _run(op, plan, cfg, arrays)

    return mesh, lower, result_shardings, arg_shardings

  def infer(cfg, mesh, arg_shapes, result_shape):
    plan = _plan_from_shapes(op, cfg, mesh, arg_shapes)
    return tuple(NamedSharding(mesh, plan.spec(l)) for l in op.results)

  rule, sizes = _sharding_rule(op, group, kv_heads)
  def_partition(cp, partition, infer, rule, sizes)
  jitted = jax.jit(cp, static_argnums=(num,))
  return jitted


def def_partition(cp, partition, infer, rule: str, sizes: dict) -> None:
  """cp.def_partition with a Shardy rule in which the head dim `d` is never sharded, across the
  JAX versions we support (the keywords moved)."""
  try:
    cp.def_partition(partition, infer_sharding_from_operands=infer, sharding_rule=rule,
                     need_replication_factors=("d",), **sizes)
  except TypeError:  # older JAX: no need_replication_factors keyword (d is still replicated)
    try:
      cp.def_partition(partition, infer_sharding_from_operands=infer, sharding_rule=rule, **sizes)
    except TypeError:  # JAX 0.6: factor sizes go into the rule object, not def_partition
      from jax._src.custom_partitioning_sharding_rule import (  # noqa: PLC0415
          str_to_sdy_sharding_rule)
      cp.def_partition(partition, infer_sharding_from_operands=infer,
                       sharding_rule=str_to_sdy_sharding_rule(rule, **sizes))


@functools.lru_cache(maxsize=None)
def _vmappable(op: AttentionOp, group: int, kv_heads: int, cfg):
  jitted = _custom_partitioned(op, group, kv_heads)
  has_batch = tuple(LAYOUTS[l][0] == "b" for l in op.operands)
  # A vmap over a batch-less operand (fp8: per-lane rotation signs) runs the local body under
  # vmap, unpartitioned: the lanes cannot share one call.
  return fold_vmap_into_batch(lambda *arrays: jitted(*arrays, cfg), has_batch=has_batch,
                              unfolded=lambda *arrays: tuple(op.local(*arrays, cfg)))


# ---------------------------------------------------------------------------------------------
# Explicit meshes (sharding in types): shard_map with the same plan
# ---------------------------------------------------------------------------------------------

def shard_map(f, mesh, in_specs, out_specs):
  """`jax.shard_map` (JAX >= 0.7) or `jax.experimental.shard_map.shard_map`, unchecked."""
  if hasattr(jax, "shard_map"):
    return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
  from jax.experimental.shard_map import shard_map as legacy  # JAX < 0.7
  return legacy(f, mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


def explicit_mesh(arrays):
  """(abstract mesh, per-array per-dim axes) if the arrays carry Explicit mesh axes, else None."""
  axis_type = getattr(getattr(jax.sharding, "AxisType", None), "Explicit", None)
  typeof = getattr(jax, "typeof", None)
  if axis_type is None or typeof is None:
    return None
  avals = [typeof(x) for x in arrays]
  sharding = getattr(avals[0], "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  if mesh is None or not getattr(mesh, "axis_names", ()):
    return None
  if not any(t == axis_type for t in mesh.axis_types):
    return None
  specs = [spec_axes(a.sharding.spec, a.ndim) for a in avals]
  return mesh, specs


def _call_explicit(op, arrays, cfg, mesh, specs):
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
  plan = plan_partition(op, [tuple(x.shape) for x in arrays], specs, sizes, cfg)
  in_specs = tuple(plan.spec(l) for l in op.operands)
  arrays = [x if spec_axes(s, x.ndim) == have else reshard(x, mesh, s)
            for x, s, have in zip(arrays, in_specs, specs)]
  body = lambda *a: _run(op, plan, cfg, a)
  out_specs = tuple(plan.spec(l) for l in op.results)
  return shard_map(body, mesh, in_specs, out_specs)(*arrays)


def reshard(x, mesh, spec):
  if hasattr(jax.sharding, "reshard"):
    return jax.sharding.reshard(x, NamedSharding(mesh, spec))
  from jax.experimental.shard import reshard as legacy  # JAX < 0.7
  return legacy(x, NamedSharding(mesh, spec))


# ---------------------------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------------------------

def call_partitioned(op: AttentionOp, arrays, cfg: AttentionConfig):
  """Runs `op` on `arrays` with the partitioning rules above; returns its results (a tuple)."""
  explicit = explicit_mesh(arrays)
  if explicit is not None:
    return _call_explicit(op, list(arrays), cfg, *explicit)
  qi, ki = op.operands.index("q"), _kv_index(op)
  kv_heads = arrays[ki].shape[2]
  return tuple(_vmappable(op, arrays[qi].shape[2] // kv_heads, kv_heads, cfg)(*arrays))


__all__ = ["LAYOUTS", "AttentionOp", "Plan", "plan_partition", "call_partitioned", "shard_map",
           "explicit_mesh", "reshard", "spec_axes"]
