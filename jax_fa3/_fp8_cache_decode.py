"""A decode step over an e4m3 KV cache read in place (`flash_attention_with_kvcache` on
(values, scales) caches, one query per row).

On Hopper the decode kernels' e4m3 variants (`jax_fa3_flash_fwd_decode_fp8_cache`,
`..._paged_decode_fp8_cache`, cuda/flash_fwd/fp8_cache.h) load the cache's e4m3 blocks and convert
them to q's dtype in shared memory, each value times its block's scale (one float32 product, one
rounding): the attention is then exactly that of the 16-bit decode kernel over
`(values.astype(float32) * scale).astype(q.dtype)`, with half the bytes read and no dequantized
copy of the cache. Elsewhere (and as the reference) XLA dequantizes the cache that way and runs
`_cache_attention._decode_pieces_xla`; a vmapped pool is dequantized onto the 16-bit decode
target. The op, its split and merge are the 16-bit decode step's (`_cache_attention.decode_step`).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_fa3 import _cache_attention, _ffi, _local_attention
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


def _dequantized(block_size: int, paged: bool):
  """The e4m3 cache as the 16-bit decode reads it: each value times its block's scale in float32,
  rounded once to q's dtype (what the kernels' converter writes), pages gathered."""
  def dense(dtype, table, k, v, k_scales, v_scales):
    keys = dequantize_fp8(k, k_scales, block_size=block_size, dtype=dtype)
    values = dequantize_fp8(v, v_scales, block_size=block_size, dtype=dtype)
    return (_cache_attention.PAGED_DECODE if paged else _cache_attention.DECODE).dense(
        dtype, table, keys, values)

  return dense


@functools.lru_cache(maxsize=None)
def _target(block_size: int, paged: bool) -> _cache_attention.DecodeTarget:
  """The e4m3 decode target for one scale block: operands q, k, v, k_scales, v_scales, lengths
  (and the page table); pools and their scales are split by heads only."""
  roles = ("pool", "pool", "pool_scales", "pool_scales") if paged else (
      "kv", "kv", "kv_scales", "kv_scales")
  return _cache_attention.DecodeTarget(PAGED_DECODE_TARGET if paged else DECODE_TARGET, paged,
                                       roles, _dequantized(block_size, paged),
                                       (("scale_block", block_size),))


def decode(q, cache: Fp8Cache, block_size: int, lengths, cfg: AttentionConfig, return_lse: bool,
           requested_splits: int):
  """out (b, 1, h, d) in q's dtype (and lse (b, h, 1) with return_lse) of a decode step over an
  e4m3 cache (`applies`), on the kernels' e4m3 decode target."""
  target = _target(block_size, cache.table is not None)
  return _cache_attention.decode_step(target, q, (cache.k, cache.v, cache.k_scales, cache.v_scales),
                                      lengths, cache.table, cfg, return_lse, requested_splits, True)
