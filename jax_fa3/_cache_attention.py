"""Attention of a few new queries over a KV cache laid out as a padded batch (row r holds
lengths[r] keys), shaped for the kernels: GQA query heads packed into the query tile when
decoding, and the keys split across CTAs (split-KV, "flash-decoding") with the partial results
merged by their log-sum-exp.

A decode step (one query per row) runs as one op (`decode_step` on a `DecodeTarget`: the 16-bit
cache's, or an e4m3 cache's from jax_fa3._fp8_cache_decode): on Hopper the kernels' decode
targets read q in place with a kv head's query heads as the rows of its tile and make the
split-KV pieces in their scheduler, each piece a run of whole key blocks of the row; elsewhere
XLA ops compute the same pieces (`_decode_pieces_xla`) over the dense cache. The pieces are then
merged as below.

Other calls (several queries, or a library without the decode targets) reshape around
padded-batch attention (`jax_fa3.attention.masked_attention`), so they hold on every path: the
reference computes the same split and merge as the kernels.
- GQA packing (one query per row, query heads per kv head `group` > 1, no left window): the
  group's query heads become `group` query rows of one head, so one tile reads each K/V block
  once for the whole group instead of once per query head.
- Split-KV (no left window, right window 0 or none: each split's mask is then exact): the cache
  axis is cut into `num_splits` equal pieces (a free reshape of a contiguous cache, or of a paged
  cache's page table), the queries repeated per piece, each piece attended as its own batch row
  with its own length and diagonal, and the pieces merged: out = sum_i w_i out_i,
  w_i = exp(lse_i - lse), lse = logsumexp_i lse_i. On a Hopper GPU the merge is one CUDA kernel
  (`jax_fa3_split_kv_combine`, cuda/decode/), a partitioned op (batch rows, query rows and heads
  stay on their devices); elsewhere, and as its reference, XLA ops (`_merge_xla`).
- Paged caches (`Pages`) whose page size is a multiple of the forward kernel's key block are read
  in place by the paged kernel (`_local_attention.forward_paged`): each K/V block is fetched
  from its page, nothing is gathered.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_fa3 import _ffi, _local_attention, _partitioning, reference
from jax_fa3._batching import fold_vmap_into_batch
from jax_fa3._config import AttentionConfig
from jax_fa3.attention import masked_attention

# Split-KV: pieces of at least this many keys (shorter ones cost more in the merge and in
# repeated query loads than they gain in parallelism).
MIN_KEYS_PER_SPLIT = 512
# A tile's fixed cost (launch on its CTA, Q load, filling the K/V pipeline, epilogue) in keys
# streamed. Decoding b = 1, 32k keys, 4 kv heads on the H200 (2026-12-05): 64 pieces of 512 keys
# (256 tiles, two rounds of the 132 CTAs) took 22.5 us where streaming alone needs ~16 us.
TILE_OVERHEAD_KEYS = 256
_QUERY_ROWS_PER_TILE = 128  # the forward kernels' query tile


def _sm_count() -> int:
  device = jax.devices()[0]
  return int(getattr(device, "core_count", 0) or 132)


class Pages(NamedTuple):
  """A paged KV cache read in place: pools (num_pages, page_size, h_k, d) and the batch rows'
  page tables int32 (b, pages_per_seq); row r's slot p is row p % page_size of page
  table[r, p // page_size]."""
  k_pool: jax.Array
  v_pool: jax.Array
  table: jax.Array

  @property
  def page_size(self) -> int:
    return self.k_pool.shape[1]


def _fewest_rounds(tiles: int, candidates, piece_keys, num_ctas: int) -> int:
  """The piece count n among `candidates` that minimises the forward kernel's time: its
  persistent grid (one CTA per SM) runs tiles * n tiles in rounds of num_ctas, each round as
  long as a tile, piece_keys(n) keys plus TILE_OVERHEAD_KEYS; ties go to fewer pieces (less to
  merge)."""
  def cost(n):
    rounds = -(-tiles * n // num_ctas)
    return rounds * (piece_keys(n) + TILE_OVERHEAD_KEYS)

  return min(candidates, key=lambda n: (cost(n), n))


def _fastest_split(tiles: int, capacity: int, units: int, num_ctas: int) -> int:
  """_fewest_rounds over the divisors n of `units` (pieces of capacity / n keys, at least
  MIN_KEYS_PER_SPLIT)."""
  most = max(1, min(units, capacity // MIN_KEYS_PER_SPLIT))
  candidates = [n for n in range(1, most + 1) if units % n == 0]
  return _fewest_rounds(tiles, candidates, lambda n: capacity / n, num_ctas)


def num_splits(requested: int, b: int, rows: int, heads: int, capacity: int,
               cfg: AttentionConfig, on_kernels: bool, unit: int = 1) -> int:
  """How many pieces to cut each row's keys into: `requested` rounded down to a divisor of
  `capacity / unit` (the pieces are a reshape; a paged cache splits whole pages, `unit` keys
  each), or with 0 the fastest such count on the kernels (`_fastest_split`; 1 elsewhere); 1
  where a split mask would not be exact (a left window, a right window > 0)."""
  if cfg.window_left >= 0 or cfg.window_right > 0 or capacity < 2:
    return 1
  units = capacity // unit
  if requested == 0:
    if not on_kernels:
      return 1
    tiles = b * heads * -(-rows // _QUERY_ROWS_PER_TILE)
    return _fastest_split(tiles, capacity, units, _sm_count())
  n = max(1, min(requested, units))
  while units % n:
    n -= 1
  return n


def _merge_xla(out, lse, b, n, out_dtype):
  """Pieces (b * n, rows, heads, d) and their lse (b * n, heads, rows) -> the rows' out, merged in
  float32 and rounded once to out_dtype, and lse. An empty piece (lse +inf) weighs 0; a row whose
  every piece is empty gets out 0 and lse +inf."""
  out = out.reshape((b, n) + out.shape[1:]).astype(jnp.float32)
  lse = lse.reshape((b, n) + lse.shape[1:])
  lse = jnp.where(jnp.isposinf(lse), -jnp.inf, lse)
  top = lse.max(axis=1)
  top = jnp.where(jnp.isneginf(top), 0.0, top)
  weight = jnp.exp(lse - top[:, None])  # (b, n, heads, rows)
  total = weight.sum(axis=1)
  empty = total == 0
  total = jnp.where(empty, 1.0, total)
  merged_lse = jnp.where(empty, jnp.inf, top + jnp.log(total))
  weight = jnp.swapaxes(weight / total[:, None], 2, 3)[..., None]  # (b, n, rows, heads, 1)
  return (weight * out).sum(axis=1).astype(out_dtype), merged_lse


# The merge on the GPU: cuda/decode/split_kv_combine.h (pieces f32/bf16/f16, lse f32, d a
# multiple of 8 up to 256; out in the pieces' dtype). Its numerics are _merge_xla's (float32,
# one rounding) up to float32 rounding: the sums run in another order, exp is the GPU's fast one,
# and a piece of weight 0 is skipped rather than multiplied by 0.
COMBINE_TARGET = "jax_fa3_split_kv_combine"
_COMBINE_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
COMBINE_MAX_HEAD_DIM = 256


def combine_kernel_applies(out, lse, out_dtype) -> bool:
  """Whether the merge of these pieces runs on the CUDA kernel (on a GPU; any other platform
  lowers _merge_xla): the kernels load here, the dtypes and head dim suit it, and no Explicit
  mesh axis is in the types (there the XLA merge partitions by itself)."""
  d = out.shape[-1]
  return (np.dtype(out.dtype) in _COMBINE_DTYPES and np.dtype(out_dtype) == np.dtype(out.dtype)
          and np.dtype(lse.dtype) == np.dtype(jnp.float32) and d % 8 == 0 and d > 0
          and d <= COMBINE_MAX_HEAD_DIM and _partitioning.explicit_mesh((out, lse)) is None
          and _ffi.kernels_available() and _ffi.has_target(COMBINE_TARGET))


def _combine_local(n: int):
  """(pieces, lse) -> (out, lse) on one device: the kernel on CUDA, _merge_xla elsewhere."""
  def kernel(out, lse):
    rows, heads, d = out.shape[1:]
    b = out.shape[0] // n
    results = (jax.ShapeDtypeStruct((b, rows, heads, d), out.dtype),
               jax.ShapeDtypeStruct((b, heads, rows), jnp.float32))
    return tuple(_ffi.call(COMBINE_TARGET, results, out, lse, n=np.int32(n)))

  def xla(out, lse):
    return _merge_xla(out, lse, out.shape[0] // n, n, out.dtype)

  return lambda out, lse: tuple(jax.lax.platform_dependent(out, lse, cuda=kernel, default=xla))


def _divisible_axes(axes, sizes, dim) -> tuple:
  """The longest prefix of mesh `axes` whose total size divides dim."""
  kept = []
  for a in axes:
    if dim % int(np.prod([sizes[x] for x in kept + [a]])):
      break
    kept.append(a)
  return tuple(kept)


def _combine_shardings(n, mesh, arg_shapes):
  """The (out, lse) shardings of the pieces and of the results alike: batch rows (whole rows of
  n pieces), query rows and heads keep the mesh axes of the pieces' sharding that divide them;
  head_dim is replicated."""
  shape, sharding = arg_shapes[0].shape, arg_shapes[0].sharding
  axes = (_partitioning.spec_axes(sharding.spec, 4) if isinstance(sharding, NamedSharding)
          else ((),) * 4)
  sizes = dict(zip(mesh.axis_names, mesh.devices.shape))
  batch = _divisible_axes(axes[0], sizes, shape[0] // n)
  rows = _divisible_axes(tuple(a for a in axes[1] if a not in batch), sizes, shape[1])
  heads = _divisible_axes(tuple(a for a in axes[2] if a not in batch + rows), sizes, shape[2])
  entry = lambda a: None if not a else a[0] if len(a) == 1 else a
  return (NamedSharding(mesh, P(entry(batch), entry(rows), entry(heads), None)),
          NamedSharding(mesh, P(entry(batch), entry(heads), entry(rows))))


@functools.lru_cache(maxsize=None)
def _combine(n: int):
  """The merge of n pieces per row as a partitioned op (an FFI call is opaque to the SPMD
  partitioner, which would gather its operands): each device merges its blocks. vmap folds into
  the batch rows: the pieces' leading axis, b * n, is batch-major."""
  from jax.experimental.custom_partitioning import custom_partitioning  # noqa: PLC0415

  local = _combine_local(n)
  cp = custom_partitioning(local)

  def partition(mesh, arg_shapes, result_shape):
    shardings = _combine_shardings(n, mesh, arg_shapes)
    return mesh, local, shardings, shardings

  def infer(mesh, arg_shapes, result_shape):
    return _combine_shardings(n, mesh, arg_shapes)

  # Shardy refuses a size-1 factor in a compound: one piece per row is the batch axis itself.
  pieces, sizes = ("(b n)", {"n": n}) if n > 1 else ("b", {})
  rule = f"{pieces} r h d, {pieces} h r -> b r h d, b h r"
  _partitioning.def_partition(cp, partition, infer, rule, sizes)
  jitted = jax.jit(cp)
  return fold_vmap_into_batch(lambda out, lse: jitted(out, lse))


def _merge(out, lse, b, n, out_dtype):
  """The rows' out (b, rows, heads, d) in out_dtype and lse (b, heads, rows) from the pieces
  (b * n, rows, heads, d) and their lse (b * n, heads, rows): the CUDA kernel where
  `combine_kernel_applies`, else _merge_xla."""
  if not combine_kernel_applies(out, lse, out_dtype):
    return _merge_xla(out, lse, b, n, out_dtype)
  return _combine(n)(out, lse)


# The decode step on the kernels (cuda/ffi/flash_fwd_ffi.cc): q (b, 1, h, d), the row bounds
# in the grouped view (g = h / h_k query rows per kv head), results (b, n, h, d) and (b, n, h).
DECODE_TARGET = "jax_fa3_flash_fwd_decode"
PAGED_DECODE_TARGET = "jax_fa3_flash_fwd_paged_decode"
MAX_DECODE_SPLITS = 1024  # the decode handlers' limit (kMaxDecodeSplits, cuda/ffi/flash_fwd_ffi.cc)


def decode_applies(q, h_k: int, cfg: AttentionConfig, paged: bool) -> bool:
  """Whether this call is a decode step for `_decode`: one query per row; a GQA group's query
  heads share their row's mask, which with a left window they would not (each grouped row would
  have its own diagonal); no Explicit mesh axis (the pieces' reshape for the merge would need
  their sharding spelled out); and the kernels, where they run, have the decode targets (an
  older library keeps the reshapes)."""
  b, s_q, h, _ = q.shape
  if s_q != 1 or (h != h_k and cfg.window_left >= 0):
    return False
  if _partitioning.explicit_mesh((q,)) is not None:
    return False
  target = PAGED_DECODE_TARGET if paged else DECODE_TARGET
  return not _local_attention.masked_kernels_would_run(q) or _ffi.has_target(target)


def decode_splits(requested: int, b: int, kv_heads: int, capacity: int, key_block: int,
                  on_kernels: bool) -> int:
  """Pieces per row for a decode step: each is ceil(key blocks / n) whole blocks of
  `key_block` keys, so any count up to the row's key blocks (and MAX_DECODE_SPLITS) works.
  `requested` 0: on the kernels, the count with the fewest rounds of the longest pieces on the
  persistent grid (tiles b * kv_heads * n, each its piece's keys plus TILE_OVERHEAD_KEYS; pieces
  of at least MIN_KEYS_PER_SPLIT keys; ties to fewer pieces), elsewhere 1."""
  blocks = max(1, -(-capacity // key_block))
  if requested > 0:
    return min(requested, blocks, MAX_DECODE_SPLITS)
  if not on_kernels:
    return 1
  most = max(1, min(blocks, MAX_DECODE_SPLITS, capacity // MIN_KEYS_PER_SPLIT))
  return _fewest_rounds(b * kv_heads, range(1, most + 1),
                        lambda n: _decode_piece_keys(capacity, key_block, n), _sm_count())


def _decode_piece_keys(capacity: int, key_block: int, n: int) -> int:
  """Keys per piece when a row of `capacity` keys is cut into n pieces of whole key blocks (the
  decode kernels' split_keys, cuda/flash_fwd/launch.h)."""
  blocks = max(1, -(-capacity // key_block))
  return -(-blocks // n) * key_block


def _decode_pieces_xla(q, keys, values, lengths, cfg: AttentionConfig, n: int, key_block: int):
  """The decode targets' results with XLA ops: q (b, 1, h, d), the newest token of each row, over
  the first lengths[r] keys of keys / values (b, capacity, h_k, d), cut into n pieces of
  ceil(blocks / n) whole key blocks (the kernels' cut), each attended with the row's own mask
  (diagonal lengths - 1), lengths clamped to [0, capacity] first as the kernels clamp them:
  out (b, n, h, d) in q's dtype, lse (b, n, h)."""
  b, _, h, d = q.shape
  capacity = keys.shape[1]
  lengths = jnp.clip(lengths, 0, capacity)
  diagonal = lengths - 1
  piece = _decode_piece_keys(capacity, key_block, n)
  pad = ((0, 0), (0, n * piece - capacity), (0, 0), (0, 0))
  keys = jnp.pad(keys, pad).reshape((b * n, piece) + keys.shape[2:])
  values = jnp.pad(values, pad).reshape((b * n, piece) + values.shape[2:])
  first = jnp.arange(n, dtype=jnp.int32) * piece
  k_len = jnp.clip(lengths[:, None] - first, 0, piece).reshape(-1)
  piece_diagonal = (diagonal[:, None] - first).reshape(-1)
  masks = (jnp.ones((b * n,), jnp.int32), k_len, piece_diagonal)
  out, lse = reference.attention_forward(jnp.repeat(q, n, axis=0), keys, values, masks=masks,
                                         **cfg.kwargs())
  return out.reshape(b, n, h, d), lse.reshape(b, n, h)


@dataclasses.dataclass(frozen=True)
class DecodeTarget:
  """A decode kernel target and what its decode op needs around it. Its operands are q, the
  cache arrays (`cache_roles`, their partitioning roles), the lengths int32 (b,) and, when
  `paged`, the page table int32 (b, pages_per_seq); its results the pieces (b, n, h, d) in q's
  dtype and their lse (b, n, h). `dense(dtype, table, *cache)` is the cache as contiguous
  (b, capacity, h_k, d) keys and values in `dtype` (pages gathered, e4m3 dequantized): what the
  XLA pieces attend, and, for a vmapped pool, what the contiguous 16-bit target reads."""
  name: str
  paged: bool
  cache_roles: tuple
  dense: Callable
  attrs: tuple = ()  # more static attributes: (name, int32 value) pairs

  @property
  def op_name(self) -> str:
    return self.name.removeprefix("jax_fa3_")

  def capacity(self, cache, table) -> int:
    return table.shape[1] * cache[0].shape[1] if self.paged else cache[0].shape[1]


def _split_operands(target: DecodeTarget, rest):
  """(cache arrays, lengths, table or None) of the operands after q."""
  if target.paged:
    *cache, lengths, table = rest
    return cache, lengths, table
  *cache, lengths = rest
  return cache, lengths, None


def _contiguous_cache(dtype, table, k, v):
  return k, v


def _gathered_pages(dtype, table, k_pool, v_pool):
  return (_local_attention.gather_pages(k_pool, table),
          _local_attention.gather_pages(v_pool, table))


DECODE = DecodeTarget(DECODE_TARGET, False, ("kv", "kv"), _contiguous_cache)
PAGED_DECODE = DecodeTarget(PAGED_DECODE_TARGET, True, ("pool", "pool"), _gathered_pages)


def _decode_kernel(target: DecodeTarget, n: int, cfg: AttentionConfig):
  """The target's call for n pieces per row; vmap folds into the batch rows (a vmapped pool:
  each lane's cache made dense onto the contiguous 16-bit target). The kernel takes the lengths
  as they are: a row's bounds in the grouped view (its g query heads as the tile's rows, all
  sharing the diagonal length - 1) are made in the kernel."""
  def call(q, *rest):
    b, _, h, d = q.shape
    results = (jax.ShapeDtypeStruct((b, n, h, d), q.dtype),
               jax.ShapeDtypeStruct((b, n, h), jnp.float32))
    attrs = {name: np.int32(value) for name, value in target.attrs}
    return tuple(_ffi.call(target.name, results, q, *rest, num_splits=np.int32(n), **attrs,
                           **_local_attention.window_attrs(cfg)))

  if not target.paged:
    return fold_vmap_into_batch(call)
  contiguous = _decode_kernel(DECODE, n, cfg)

  def dense(q, *rest):
    cache, lengths, table = _split_operands(target, rest)
    return contiguous(q, *target.dense(q.dtype, table, *cache), lengths)

  has_batch = (True,) + (False,) * len(target.cache_roles) + (True, True)
  return fold_vmap_into_batch(call, has_batch=has_batch, unfolded=dense)


def _decode_local(target: DecodeTarget, n: int):
  """One device's decode step over (q, *cache, lengths[, table]): the target where the kernels
  run, else _decode_pieces_xla over the dense cache."""
  def local(*arrays_and_cfg):
    *arrays, cfg = arrays_and_cfg
    q = arrays[0]
    key_block = _local_attention.forward_key_block(q.shape[-1])

    def xla(q, *rest):
      cache, lengths, table = _split_operands(target, rest)
      return _decode_pieces_xla(q, *target.dense(q.dtype, table, *cache), lengths, cfg, n,
                                key_block)

    if not _local_attention.use_decode_kernel(target.name, q):
      return xla(*arrays)
    cache, _, table = _split_operands(target, arrays[1:])
    s_k = target.capacity(cache, table)
    _ffi.check_kernel_sizes(q.shape, (q.shape[0], s_k) + cache[0].shape[2:])
    return jax.lax.platform_dependent(*arrays, cuda=_decode_kernel(target, n, cfg), default=xla)

  return local


@functools.lru_cache(maxsize=None)
def _decode_op(target: DecodeTarget, n: int) -> _partitioning.AttentionOp:
  """The decode step as a partitioned op: batch rows and heads stay on their devices, a row's
  pieces together; a paged cache's pools are split by heads only (any row may read any page)."""
  roles = ("q",) + target.cache_roles + ("lens",) + (("table",) if target.paged else ())
  return _partitioning.AttentionOp(target.op_name, roles, ("pieces", "piece_rows"),
                                   _decode_local(target, n), split_queries=False)


def decode_step(target: DecodeTarget, q, cache, lengths, table, cfg: AttentionConfig,
                return_lse: bool, requested_splits: int, on_kernels: bool):
  """out (b, 1, h, d) in q's dtype (and lse (b, h, 1) with return_lse) of a decode step on
  `target` over its cache arrays: the decode op's pieces, merged. The lengths go to the kernels
  unclamped (they clamp them to [0, capacity]), and to the XLA pieces clamped."""
  b, _, h, d = q.shape
  key_block = _local_attention.forward_key_block(d)
  n = decode_splits(requested_splits, b, cache[0].shape[2], target.capacity(cache, table),
                    key_block, on_kernels)
  operands = (q, *cache, jnp.asarray(lengths, jnp.int32))
  if target.paged:
    operands += (table.astype(jnp.int32),)
  out, lse = _partitioning.call_partitioned(_decode_op(target, n), operands, cfg)
  if n > 1:
    out, lse = _merge(out.reshape(b * n, 1, h, d), lse.reshape(b * n, h, 1), b, n, q.dtype)
  else:
    out, lse = out.reshape(b, 1, h, d), lse.reshape(b, h, 1)
  return (out, lse) if return_lse else out


def _decode(q, keys, values, lengths, cfg: AttentionConfig, return_lse: bool,
            requested_splits: int):
  """`attend` for a decode step (`decode_applies`) over a contiguous cache or `Pages`."""
  paged = isinstance(keys, Pages)
  target = PAGED_DECODE if paged else DECODE
  cache, table = ((keys.k_pool, keys.v_pool), keys.table) if paged else ((keys, values), None)
  on_kernels = _local_attention.masked_kernels_would_run(q) and _ffi.has_target(target.name)
  return decode_step(target, q, cache, lengths, table, cfg, return_lse, requested_splits,
                     on_kernels)


def _forward_paged_local(q, k_pool, v_pool, table, *masks_and_cfg):
  *masks, cfg = masks_and_cfg
  return _local_attention.forward_paged(q, k_pool, v_pool, table, tuple(masks), cfg)


# The paged forward as a partitioned op: batch rows (q, tables, masks) and heads stay sharded and
# run locally; the pools are replicated but for their heads (any row may read any page).
PAGED_FORWARD = _partitioning.AttentionOp(
    "flash_fwd_paged", ("q", "pool", "pool", "table", "lens", "lens", "lens"), ("q", "row"),
    _forward_paged_local, split_queries=False)


def _attend_rows(q, keys, values, masks, cfg: AttentionConfig, return_lse: bool):
  """Padded-batch attention of q's rows over contiguous keys / values, or over `keys`, a `Pages`
  (values None), on the paged kernel."""
  if isinstance(keys, Pages):
    out, lse = _partitioning.call_partitioned(
        PAGED_FORWARD, (q, keys.k_pool, keys.v_pool, keys.table, *masks), cfg)
    return (out, lse) if return_lse else out
  return masked_attention(q, keys, values, masks, cfg, return_lse)


def attend(q, keys, values, lengths, cfg: AttentionConfig, return_lse: bool,
           requested_splits: int):
  """out (b, s_q, h, d) in q's dtype (and the float32 lse (b, h, s_q) with return_lse) of q
  against keys / values (b, capacity, h_k, d), or against `keys`, a `Pages` read in place on the
  kernel (values None), row r's first lengths[r] slots being its keys and query i's mask centred
  on key i + lengths[r] - s_q; lengths are clamped to [0, capacity] first."""
  b, s_q, h, d = q.shape
  paged = isinstance(keys, Pages)
  if paged:
    capacity, h_k, unit = keys.table.shape[1] * keys.page_size, keys.k_pool.shape[2], keys.page_size
  else:
    capacity, h_k, unit = keys.shape[1], keys.shape[2], 1
  if decode_applies(q, h_k, cfg, paged):
    return _decode(q, keys, values, lengths, cfg, return_lse, requested_splits)
  lengths = jnp.clip(jnp.asarray(lengths, jnp.int32), 0, capacity)
  group = h // h_k
  diagonal = lengths - s_q
  # (Not on Explicit meshes: splitting a sharded head axis needs the output's sharding spelled
  # out, which JAX 0.6's reshape cannot take; the heads are then attended unpacked.)
  packed = (s_q == 1 and group > 1 and cfg.window_left < 0
            and _partitioning.explicit_mesh((q,)) is None)
  if packed:
    # Query head kh * group + g -> row g of kv head kh. Every row sees the row's whole length
    # (one query: a right window only reaches past it), so the shared diagonal is exact.
    q = jnp.swapaxes(q.reshape(b, h_k, group, d), 1, 2)
  rows, heads = q.shape[1], q.shape[2]
  on_kernels = _local_attention.masked_kernels_would_run(q)
  n = num_splits(requested_splits, b, rows, heads, capacity, cfg, on_kernels or paged, unit)
  if n > 1:
    chunk = capacity // n
    first = jnp.arange(n, dtype=jnp.int32) * chunk  # each piece's first slot
    if paged:
      keys = keys._replace(table=keys.table.reshape(b * n, -1))
    else:
      keys = keys.reshape((b * n, chunk) + keys.shape[2:])
      values = values.reshape((b * n, chunk) + values.shape[2:])
    q = jnp.repeat(q, n, axis=0)
    k_len = jnp.clip(lengths[:, None] - first, 0, chunk).reshape(-1)
    # Pieces past the queries' reach are empty under a causal mask (their keys all lie right of
    # every diagonal); the clip keeps the diagonal in the kernels' range [-rows, chunk] without
    # changing what an unbounded or causal window admits.
    piece_diagonal = jnp.clip(diagonal[:, None] - first, -rows, chunk).reshape(-1)
    masks = (jnp.full((b * n,), rows, jnp.int32), k_len, piece_diagonal)
    out, lse = _attend_rows(q, keys, values, masks, cfg, True)
    out, lse = _merge(out, lse, b, n, q.dtype)
  else:
    masks = (jnp.full((b,), rows, jnp.int32), lengths, diagonal)
    result = _attend_rows(q, keys, values, masks, cfg, return_lse)
    out, lse = result if return_lse else (result, None)
  if packed:
    out = jnp.swapaxes(out, 1, 2).reshape(b, 1, h, d)
    lse = None if lse is None else lse.reshape(b, h, 1)
  return (out, lse) if return_lse else out
