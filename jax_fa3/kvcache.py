"""jax_fa3.flash_attention_with_kvcache: attention of new queries against a KV cache, contiguous or
paged, appending new keys and values first (FlashAttention's `flash_attn_with_kvcache`).

The call runs padded-batch attention over the cache: each row's length is its key count and its
mask diagonal its own (query i of s_q new queries sees key j <= i + len - s_q). On the kernels a
contiguous cache is read in place, and so is a paged one whose pages hold whole key blocks; an
FP8 cache is read in place by the e4m3 decode kernels when decoding (one query per row, head dim
a multiple of 16 up to 128: `jax_fa3._fp8_cache_decode`). Other caches are first gathered (and
dequantized) into logical order, a copy per call.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_fa3 import _cache_attention, _fp8_cache_decode, _fp8_quantize, _local_attention
from jax_fa3.fp8 import check_block_size, check_quantized, is_pair
from jax_fa3._config import DEFAULT_BLOCK_SIZE
from jax_fa3._validation import (attention_config, check_array, check_attention_dtypes,
                                 check_int_array)


def _layout(q, k_cache, v_cache, page_table, cache_batch_idx):
  """The capacity (logical slots) of a row, after checking the cache arrays against q."""
  b, _, h, d = q.shape
  check_array("k_cache", k_cache, rank=4)
  if k_cache.shape != v_cache.shape:
    raise ValueError(f"k_cache and v_cache must have the same shape, got {k_cache.shape} and "
                     f"{v_cache.shape}")
  if page_table is not None:
    if cache_batch_idx is not None:
      raise ValueError("cache_batch_idx is for contiguous caches; a paged cache maps rows to "
                       "pages with page_table")
    num_pages, page_size = k_cache.shape[:2]
    check_array("page_table", page_table)
    if page_table.ndim != 2 or page_table.shape[0] != b:
      raise ValueError(f"page_table must have shape ({b}, pages_per_seq), got "
                       f"{tuple(page_table.shape)}")
    pages = check_int_array("page_table", page_table, tuple(page_table.shape),
                            "(batch, pages_per_seq)")
    if pages is not None and pages.size and (pages.min() < 0 or pages.max() >= num_pages):
      raise ValueError(f"page_table must index pages in [0, {num_pages}) (k_cache's first axis), "
                       f"got values from {pages.min()} to {pages.max()}")
    return page_table.shape[1] * page_size
  if cache_batch_idx is not None:
    rows = check_int_array("cache_batch_idx", cache_batch_idx, (b,), "(batch,)")
    if rows is not None and (rows.min() < 0 or rows.max() >= k_cache.shape[0]):
      raise ValueError(f"cache_batch_idx must index cache rows in [0, {k_cache.shape[0]}), got "
                       f"values from {rows.min()} to {rows.max()}")
  elif k_cache.shape[0] != b:
    raise ValueError(f"k_cache must have one row per batch row of q ({b}), got {k_cache.shape[0]}"
                     f" (pass cache_batch_idx to pick rows)")
  return k_cache.shape[1]


def _slots(cache, page_table, cache_batch_idx, b, capacity):
  """(row or page, offset) arrays (b, capacity) of each batch row's logical cache slots."""
  position = jnp.arange(capacity)
  if page_table is not None:
    page_size = cache.shape[1]
    page = jnp.asarray(page_table, jnp.int32)[:, position // page_size]
    return page, jnp.broadcast_to(position % page_size, page.shape)
  rows = jnp.arange(b) if cache_batch_idx is None else jnp.asarray(cache_batch_idx, jnp.int32)
  return (jnp.broadcast_to(rows[:, None], (b, capacity)),
          jnp.broadcast_to(position[None, :], (b, capacity)))


def _append_targets(slots, first, s_new, rows):
  """(row or page, offset, inside), each (b, s_new): where token t of each row lands (logical
  slot first + t); inside is False past the capacity and on a traced page or row out of range."""
  where, offset = slots
  capacity = where.shape[1]
  logical = first[:, None] + jnp.arange(s_new)[None, :]
  clipped = jnp.clip(logical, 0, capacity - 1)
  target = jnp.take_along_axis(where, clipped, axis=1)
  position = jnp.take_along_axis(offset, clipped, axis=1)
  inside = (logical >= 0) & (logical < capacity) & (target >= 0) & (target < rows)
  return target, position, inside


def _append(cache, new, first, slots):
  """cache with new[:, t] written at logical slot first + t of each row; slots past the
  capacity are dropped (never written elsewhere)."""
  target, position, inside = _append_targets(slots, first, new.shape[1], cache.shape[0])
  target = jnp.where(inside, target, cache.shape[0])  # out of range: dropped by the scatter
  return cache.at[target, position].set(new.astype(cache.dtype), mode="drop")


def _check_fp8_cache(name, cache, block_size):
  """(values, scales) of an e4m3 cache: scales (rows or pages, heads_k, ceil(slots / block))."""
  if len(cache) != 2:
    raise TypeError(f"an fp8 {name} must be a (values, scales) pair, got {len(cache)} items")
  values, scales = cache
  return values, check_quantized(name, values, scales, block_size)


def _max_runs(s_new, block_size, slots_per_row):
  """The most blocks s_new consecutive logical slots can touch, blocks being block_size slots of
  one row or page of slots_per_row (the last one short when block_size does not divide it).

  A block never spans two pages, so a new block starts only at a block boundary inside a page: at
  most ceil(l / block_size) of them in a page's stretch of l slots, and the stretches of the P
  pages touched sum to s_new: fewer than s_new / block_size + P, P <= (s_new - 1) //
  slots_per_row + 2. One more for the tail past the capacity (a page boundary too, counted
  generously)."""
  return min(s_new, s_new // block_size + (s_new - 1) // slots_per_row + 4)


def _append_fp8(cache, new, first, slots, block_size):
  """Appends to an e4m3 (values, scales) cache: the blocks the new tokens land in are
  re-quantized (their scale from their new contents, quantize_fp8's rule); the others keep their
  bytes. Only those blocks are read and written: a decode step's append costs one block per row,
  not a pass over the cache.

  A block (block_size slots of one row or page) holds a run of consecutive new tokens of one
  batch row; rows whose appends land in one shared page block (an aliased page) keep one row's
  tokens there."""
  values, scales = cache
  b, s_new = new.shape[:2]
  if s_new == 0:
    return values, scales
  rows, slots_per_row, h_k, d = values.shape
  n_blocks = scales.shape[-1]
  target, position, inside = _append_targets(slots, first, s_new, rows)
  block_id = jnp.where(inside, target * n_blocks + position // block_size, -1)
  # Consecutive tokens of a row in one block form a run; each run is one block to rewrite.
  starts = jnp.concatenate([jnp.ones((b, 1), bool), block_id[:, 1:] != block_id[:, :-1]], axis=1)
  run = jnp.cumsum(starts, axis=1) - 1
  n_runs = _max_runs(s_new, block_size, slots_per_row)
  batch = jnp.arange(b)[:, None]
  run_block = jnp.full((b, n_runs), -1, block_id.dtype).at[batch, run].max(block_id, mode="drop")
  live = run_block >= 0
  run_row = jnp.where(live, run_block // n_blocks, 0)
  run_blk = jnp.where(live, run_block % n_blocks, 0)
  slot = run_blk[..., None] * block_size + jnp.arange(block_size)  # (b, n_runs, block_size)
  in_row = slot < slots_per_row  # the last block of a row or page may be short
  slot = jnp.minimum(slot, slots_per_row - 1)
  old_scales = scales[run_row, :, run_blk]  # (b, n_runs, h_k)
  blocks = values[run_row[..., None], slot].astype(jnp.float32) * old_scales[:, :, None, :, None]
  blocks = jnp.where(in_row[..., None, None], blocks, 0.0)
  blocks = blocks.at[batch, jnp.where(inside, run, n_runs), position % block_size].set(
      new.astype(jnp.float32), mode="drop")
  block_values, block_scales = _fp8_quantize.quantize_blocks(
      blocks.reshape(b * n_runs, block_size, h_k, d), block_size)
  # Runs that wrote nothing, and a short block's slots past its row, go nowhere (mode="drop").
  # The bytes are scattered as uint8: XLA:CPU, which emulates f8, took 4x as long for the same
  # scatter on e4m3 (32k slots x 8 heads x 128: 46 against 11 ms, 2 cores).
  write_row = jnp.where(live[..., None] & in_row, run_row[..., None], rows)
  as_bytes = lambda x: jax.lax.bitcast_convert_type(x, jnp.uint8)
  values = jax.lax.bitcast_convert_type(
      as_bytes(values).at[write_row, slot].set(
          as_bytes(block_values.reshape(b, n_runs, block_size, h_k, d)), mode="drop"),
      values.dtype)
  scales = scales.at[jnp.where(live, run_row, rows), :, run_blk].set(
      block_scales.reshape(b, n_runs, h_k), mode="drop")
  return values, scales


def flash_attention_with_kvcache(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens,
                                 page_table=None, cache_batch_idx=None, softmax_scale=None,
                                 causal=False, window_size=(-1, -1), softcap=0.0, num_splits=0,
                                 return_lse=False, block_size=DEFAULT_BLOCK_SIZE):
  """Attention of q against a KV cache, after appending k and v to it (forward only).

  Args:
    q: (batch, seqlen_q, heads, head_dim): the new queries (seqlen_q = 1 when decoding).
    k_cache, v_cache: contiguous (batch_cache, seqlen_cache, heads_k, head_dim), or with
      `page_table` paged pools (num_pages, page_size, heads_k, head_dim); q's dtype. Or FP8
      caches: (values, scales) pairs from `quantize_fp8(cache, block_size=block_size)`, e4m3
      values of those shapes with one float32 scale per (row or page, kv head, block of
      block_size slots) — half the memory of bf16.
    k, v: optional (batch, seqlen_new, heads_k, head_dim) tokens to write into the cache at
      positions cache_seqlens[r] ... cache_seqlens[r] + seqlen_new - 1 of row r before attending.
    cache_seqlens: int32 (batch,) (or a Python int for all rows): each row's valid tokens before
      the append. Row r then attends over its first cache_seqlens[r] + seqlen_new slots.
    page_table: int32 (batch, pages_per_seq): row r's logical slot p lives in page
      page_table[r, p // page_size] at offset p % page_size.
    cache_batch_idx: int32 (batch,), contiguous caches only: the cache row of each batch row
      (default: row r).
    softmax_scale, causal, window_size, softcap: as for `flash_attention`, aligned bottom-right
      on each row's own length: query i sees key j <= i + length - seqlen_q.
    num_splits: how many pieces to cut each row's cache into, attended in parallel and merged
      by their log-sum-exp (split-KV decoding). 0: chosen to fill the GPU on the kernels (1
      elsewhere). One query per row (decoding): pieces of ceil(key blocks / num_splits) whole
      key blocks of the kernel (at most one piece per block, and 1024), any window. Several
      queries: rounded down to a divisor of the capacity; 1 with a left window or a right
      window > 0. The result depends on it only through rounding.
    return_lse: also return the float32 (batch, heads, seqlen_q) log-sum-exp.
    block_size: FP8 caches: slots per scale (default 64, quantize_fp8's). An append re-quantizes
      the blocks it writes into (their scale from their new contents); the others keep their
      bytes.

  Returns:
    out (batch, seqlen_q, heads, head_dim) in q's dtype (with the lse when return_lse), and when
    k and v are given also the updated (k_cache, v_cache): (out, k_cache, v_cache). Under jit with
    the caches donated (donate_argnums), the update happens in place (input/output aliasing).

  Validation: values known at trace time are checked (ValueError: lengths past the capacity,
  pages out of range) before anything is written. Under jit, where they are not, an append past
  a row's capacity is dropped (never written elsewhere), lengths are clamped to [0, capacity]
  and out-of-range page or row indices are clamped when read.

  Forward only (no gradient). A contiguous bf16/fp16 cache is attended in place, on the kernels'
  key-range variants on a Hopper GPU (JAX_FA3_MASKED_KERNELS=0: on the pure-JAX path), else on
  the pure-JAX path. There, paged and row-indexed (cache_batch_idx) bf16/fp16 caches are
  read in place by the paged kernel when the page size (for cache_batch_idx: the capacity) is a
  multiple of its key block (`jax_fa3._local_attention.FORWARD_KEY_BLOCK`: 128 keys at d = 128);
  otherwise they are gathered first (a copy per call). FP8 caches are read in place, in e4m3, by
  the decode kernels' e4m3 variants when one query per row attends (head dim a multiple of 16 up
  to 128; paged: the same page-size rule), each value converted to q's dtype as
  `(value.astype(float32) * scale).astype(q.dtype)`; otherwise dequantized that way into a copy
  per call. When decoding (one
  query per row) the query heads of a kv head share one query tile, and the split and merge are
  reshapes around the same kernels (`jax_fa3._cache_attention`).
  """
  check_array("q", q, rank=4)
  fp8 = is_pair(k_cache) or is_pair(v_cache)
  if fp8:
    if not (is_pair(k_cache) and is_pair(v_cache)):
      raise TypeError("k_cache and v_cache must both be arrays or both (values, scales) pairs")
    block_size = check_block_size(block_size, allow_none=False)
    k_cache = _check_fp8_cache("k_cache", k_cache, block_size)
    v_cache = _check_fp8_cache("v_cache", v_cache, block_size)
    stored_k, stored_v = k_cache, v_cache
    k_cache, v_cache = k_cache[0], v_cache[0]  # the values carry the layout checked below
    check_attention_dtypes(q, q, q)  # q alone: the cache is e4m3
  else:
    check_array("v_cache", v_cache, rank=4)
    check_attention_dtypes(q, k_cache, v_cache)
  b, s_q, h, d = q.shape
  capacity = _layout(q, k_cache, v_cache, page_table, cache_batch_idx)
  h_k = k_cache.shape[2]
  if k_cache.shape[3] != d or h % h_k:
    raise ValueError(f"k_cache must have head_dim {d} (q's) and heads dividing q's {h}, got shape "
                     f"{tuple(k_cache.shape)}")
  if (k is None) != (v is None):
    raise ValueError("give k and v together (the new tokens to append), or neither")
  s_new = 0
  if k is not None:
    check_array("k", k, rank=4)
    if k.shape != v.shape or k.shape[0] != b or k.shape[2:] != (h_k, d):
      raise ValueError(f"k and v must have shape ({b}, seqlen_new, {h_k}, {d}), got k {k.shape} "
                       f"and v {v.shape}")
    if fp8:  # any float dtype: quantized on the way in
      check_attention_dtypes(k, k, v)
    else:
      check_attention_dtypes(q, k, v)
    s_new = k.shape[1]
  if isinstance(num_splits, bool) or not isinstance(num_splits, (int, np.integer)) or num_splits < 0:
    raise ValueError(f"num_splits must be an int >= 0 (0: chosen by the kernel), got {num_splits!r}")
  if isinstance(cache_seqlens, (int, np.integer)) and not isinstance(cache_seqlens, bool):
    cache_seqlens = jnp.full((b,), int(cache_seqlens), jnp.int32)
  lengths = check_int_array("cache_seqlens", cache_seqlens, (b,), "(batch,)")
  if lengths is not None and (lengths.min() < 0 or lengths.max() + s_new > capacity):
    raise ValueError(f"cache_seqlens + seqlen_new must lie in [0, {capacity}] (the cache's "
                     f"capacity per row), got cache_seqlens from {lengths.min()} to "
                     f"{lengths.max()} with seqlen_new {s_new}")
  first = jnp.clip(jnp.asarray(cache_seqlens, jnp.int32), 0, capacity)
  slots = _slots(k_cache, page_table, cache_batch_idx, b, capacity)
  if fp8:
    if k is not None:
      stored_k = _append_fp8(stored_k, k, first, slots, block_size)
      stored_v = _append_fp8(stored_v, v, first, slots, block_size)
  elif k is not None:
    k_cache = _append(k_cache, k, first, slots)
    v_cache = _append(v_cache, v, first, slots)
  # With no token appended, the lengths reach attend unclamped: the decode kernels clamp them
  # themselves (no XLA op before the kernel), attend clamps them for every other path.
  length = (jnp.asarray(cache_seqlens, jnp.int32) if k is None
            else jnp.clip(first + s_new, 0, capacity))

  # A logical view of the cache for validation: (b, capacity, h_k, d) in the cache's dtype.
  logical = jax.ShapeDtypeStruct((b, capacity) + k_cache.shape[2:], q.dtype)
  # Row r's pages: the page table, or with cache_batch_idx one page of the whole capacity.
  table = page_table if page_table is not None else (
      None if cache_batch_idx is None else jnp.asarray(cache_batch_idx, jnp.int32)[:, None])
  page_size = k_cache.shape[1]
  cfg = attention_config(q, logical, logical, softmax_scale=softmax_scale, causal=causal,
                         window_size=window_size, softcap=softcap, deterministic=False)
  if fp8:
    in_place = _fp8_cache_decode.Fp8Cache(stored_k[0], stored_v[0], stored_k[1], stored_v[1],
                                          None if table is None else table.astype(jnp.int32))
    if _fp8_cache_decode.applies(q, in_place, cfg):
      in_place = jax.lax.stop_gradient(in_place)
      result = _fp8_cache_decode.decode(q, in_place, block_size, length, cfg, bool(return_lse),
                                        int(num_splits))
      return result if k is None else (result, tuple(stored_k), tuple(stored_v))
  if table is None and not fp8:
    # Batch row r is cache row r, its keys in logical order: attended in place.
    keys, values = k_cache, v_cache
  elif not fp8 and _local_attention.paged_in_place(q, page_size):
    # Pages read in place by the paged kernel (page_size a multiple of its key block).
    keys, values = _cache_attention.Pages(k_cache, v_cache, table.astype(jnp.int32)), None
  else:
    # Each row's logical slots gathered into a (batch, capacity) row.
    rows, positions = slots
    rows = jnp.clip(rows, 0, k_cache.shape[0] - 1)
    if fp8:  # gathered, then dequantized
      def gather(stored):
        values, scales = stored
        slot_scales = jnp.swapaxes(scales, 1, 2)[rows, positions // block_size]  # (b, cap, h_k)
        return (values[rows, positions].astype(jnp.float32)
                * slot_scales[..., None]).astype(q.dtype)
      keys, values = gather(stored_k), gather(stored_v)
    else:
      keys, values = k_cache[rows, positions], v_cache[rows, positions]
  keys, values = jax.lax.stop_gradient((keys, values))
  result = _cache_attention.attend(q, keys, values, length, cfg, bool(return_lse),
                                   int(num_splits))
  if k is None:
    return result
  if fp8:
    return result, tuple(stored_k), tuple(stored_v)
  return result, k_cache, v_cache
