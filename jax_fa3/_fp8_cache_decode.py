"""A decode step over an e4m3 KV cache read in place (`flash_attention_with_kvcache` on
(values, scales) caches, one query per row).

On Hopper the decode kernels' e4m3 variants (`jax_fa3_flash_fwd_decode_fp8_cache`,
`..._paged_decode_fp8_cache`, cuda/flash_fwd/fp8_cache.h) load the cache's e4m3 blocks and convert
them to q's dtype in shared memory, each value times its block's scale (one float32 product, one
rounding): the attention is then exactly that of the 16-bit decode kernel over
`(values.astype(float32) * scale).astype(q.dtype)`, with half the bytes read and no dequantized
copy of the cache. Elsewhere (and as the reference) XLA dequantizes the cache that way and runs
`_cache_attention._decode_pieces_xla`. The pieces are merged as the 16-bit decode's
(`_cache_attention._merge`).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_fa3 import _cache_attention, _ffi, _local_attention, _partitioning
from jax_fa3._batching import fold_vmap_into_batch
from jax_fa3._config import AttentionConfig
from jax_fa3.fp8 import dequantize_fp8

DECODE_TARGET = "jax_fa3_flash_fwd_decode_fp8_cache"
PAGED_DECODE_TARGET = "jax_fa3_flash_fwd_paged_decode_fp8_cache"
MAX_HEAD_DIM = 128  # the e4m3 variants' largest bucket (cuda/flash_fwd/fp8_cache.h)
_QUERY_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))


class Fp8Cache(NamedTuple):
  """An e4m3 cache read in place: values (rows, slots, h_k, d) float8_e4m3fn and their scales
  (rows, h_k, ceil(slots / block_size)) float32 for k and v, as `quantize_fp8` lays them out;
  rows are the batch rows, or pages with `table` int32 (b, pages_per_seq)."""
  k: jax.Array
  v: jax.Array
  k_scales: jax.Array
  v_scales: jax.Array
  table: jax.Array | None


def applies(q, cache: Fp8Cache, cfg: AttentionConfig) -> bool:
  """Whether this call reads its e4m3 cache in place: a decode step of the decode kernels
  (`_cache_attention.decode_applies`), on the kernels, with a head dim they take (a multiple of
  16 up to 128) and, paged, pages of whole key blocks."""
  d = q.shape[-1]
  paged = cache.table is not None
  if d % 16 or d > MAX_HEAD_DIM or np.dtype(q.dtype) not in _QUERY_DTYPES:
    return False
  if not _cache_attention.decode_applies(q, cache.k.shape[2], cfg, paged):
    return False
  target = PAGED_DECODE_TARGET if paged else DECODE_TARGET
  if not (_local_attention.masked_kernels_would_run(q) and _ffi.has_target(target)):
    return False
  return not paged or cache.k.shape[1] % _local_attention.forward_key_block(d) == 0


def _kernel(n: int, cfg: AttentionConfig, block_size: int, paged: bool):
  """The e4m3 decode target over (q, k, v, k_scales, v_scales, lengths[, table]) for n pieces
  per row: out (b, n, h, d) in q's dtype and lse (b, n, h). vmap folds into the batch rows (a
  contiguous cache's rows are batch rows; a vmapped pool is dequantized onto the XLA path)."""
  def call(q, k, v, k_scales, v_scales, lengths, *table):
    b, _, h, d = q.shape
    results = (jax.ShapeDtypeStruct((b, n, h, d), q.dtype),
               jax.ShapeDtypeStruct((b, n, h), jnp.float32))
    operands = (q, k, v, k_scales, v_scales, lengths.astype(jnp.int32))
    operands += tuple(t.astype(jnp.int32) for t in table)
    return tuple(_ffi.call(PAGED_DECODE_TARGET if paged else DECODE_TARGET, results, *operands,
                           num_splits=np.int32(n), scale_block=np.int32(block_size),
                           **_local_attention.window_attrs(cfg)))

  if not paged:
    return fold_vmap_into_batch(call)
  return fold_vmap_into_batch(call, has_batch=(True, False, False, False, False, True, True),
                              unfolded=functools.partial(_xla, n=n, cfg=cfg,
                                                         block_size=block_size, paged=True))


def _xla(q, k, v, k_scales, v_scales, lengths, *table, n, cfg, block_size, paged):
  """The pieces with XLA ops: the cache dequantized (pages gathered), then the 16-bit decode's
  XLA pieces."""
  # (value.astype(float32) * scale).astype(q.dtype): what the kernels' converter writes.
  keys = dequantize_fp8(k, k_scales, block_size=block_size, dtype=q.dtype)
  values = dequantize_fp8(v, v_scales, block_size=block_size, dtype=q.dtype)
  if paged:
    keys = _local_attention.gather_pages(keys, table[0])
    values = _local_attention.gather_pages(values, table[0])
  key_block = _local_attention.forward_key_block(q.shape[-1])
  return _cache_attention._decode_pieces_xla(q, keys, values, lengths, cfg, n, key_block)


def _local(n: int, block_size: int, paged: bool):
  target = PAGED_DECODE_TARGET if paged else DECODE_TARGET

  def local(*arrays_and_cfg):
    *arrays, cfg = arrays_and_cfg
    q = arrays[0]
    xla = functools.partial(_xla, n=n, cfg=cfg, block_size=block_size, paged=paged)
    if not _local_attention.use_decode_kernel(target, q):
      return xla(*arrays)
    k = arrays[1]
    s_k = arrays[6].shape[1] * k.shape[1] if paged else k.shape[1]
    _ffi.check_kernel_sizes(q.shape, (q.shape[0], s_k) + k.shape[2:])
    return jax.lax.platform_dependent(*arrays, cuda=_kernel(n, cfg, block_size, paged),
                                      default=xla)

  return local


@functools.lru_cache(maxsize=None)
def _op(n: int, block_size: int, paged: bool) -> _partitioning.AttentionOp:
  """The decode step as a partitioned op: batch rows and heads stay on their devices, a row's
  pieces together; pools and their scales are split by heads only (any row may read any page)."""
  cache = ("pool", "pool", "pool_scales", "pool_scales") if paged else (
      "kv", "kv", "kv_scales", "kv_scales")
  return _partitioning.AttentionOp(
      "flash_fwd_paged_decode_fp8_cache" if paged else "flash_fwd_decode_fp8_cache",
      ("q",) + cache + ("lens",) + (("table",) if paged else ()), ("pieces", "piece_rows"),
      _local(n, block_size, paged), split_queries=False)


def decode(q, cache: Fp8Cache, block_size: int, lengths, cfg: AttentionConfig, return_lse: bool,
           requested_splits: int):
  """out (b, 1, h, d) in q's dtype (and lse (b, h, 1) with return_lse) of a decode step over an
  e4m3 cache (`applies`): the pieces of the e4m3 decode op, merged. Lengths go to the kernel
  unclamped (it clamps them to [0, capacity]) and to the XLA pieces clamped."""
  b, _, h, d = q.shape
  paged = cache.table is not None
  h_k = cache.k.shape[2]
  capacity = cache.table.shape[1] * cache.k.shape[1] if paged else cache.k.shape[1]
  key_block = _local_attention.forward_key_block(d)
  n = _cache_attention.decode_splits(requested_splits, b, h_k, capacity, key_block, True)
  operands = (q, cache.k, cache.v, cache.k_scales, cache.v_scales, jnp.asarray(lengths, jnp.int32))
  if paged:
    operands += (cache.table.astype(jnp.int32),)
  out, lse = _partitioning.call_partitioned(_op(n, block_size, paged), operands, cfg)
  if n > 1:
    out, lse = _cache_attention._merge(out.reshape(b * n, 1, h, d), lse.reshape(b * n, h, 1), b,
                                       n, q.dtype)
  else:
    out, lse = out.reshape(b, 1, h, d), lse.reshape(b, h, 1)
  return (out, lse) if return_lse else out
