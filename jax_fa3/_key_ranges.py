"""Per-query key ranges: the one visibility rule of the masked kernels (cuda/common/key_ranges.h).

Every mask a padded or packed batch carries -- query and key lengths, the causal / window band
around key `i + diagonal`, segment ids whose segments are contiguous runs of keys -- leaves query
row `i` one interval of visible keys `[lo, hi)`. This module folds the masks
`(q_lengths, kv_lengths, diagonals[, q_segment_ids, kv_segment_ids])` (see
`reference.attention_forward`) into those intervals, and summarises them per 64-row granule
(the covers) so that a kernel tile can skip the key blocks none of its rows sees and mask only the
blocks that not all of its rows see.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

ROW_PAD = 128  # rows of the ranges array: s_q rounded up to this (the largest kernel tile)
GRANULE = 64   # rows per cover (the smallest kernel tile)


def padded_rows(s_q: int) -> int:
  return -(-s_q // ROW_PAD) * ROW_PAD


def _segment_runs(q_segment, kv_segment):
  """For one batch row: the keys [lo, hi) from the first to the last key holding query i's
  segment id (lo = hi = 0 when no key has it), and whether every query's segment is exactly
  those keys, one contiguous run (else the caller must not use the ranges). Ids in [0, s_k), the
  usual document numbers, take three scatters; others a sort."""
  s_k = kv_segment.shape[0]
  if s_k == 0:
    zeros = jnp.zeros(q_segment.shape, jnp.int32)
    return zeros, zeros, jnp.bool_(True)
  small = jnp.all((kv_segment >= 0) & (kv_segment < s_k))
  return jax.lax.cond(small, _runs_by_scatter, _runs_by_sort, q_segment, kv_segment)


def _runs(first, last, count, found):
  lo = jnp.where(found, first, 0).astype(jnp.int32)
  hi = jnp.where(found, last, 0).astype(jnp.int32)
  return lo, hi, jnp.all(~found | (count == hi - lo))


def _runs_by_scatter(q_segment, kv_segment):
  """_segment_runs for key ids in [0, s_k): per id its first key, last key + 1 and count."""
  s_k = kv_segment.shape[0]
  key = jnp.arange(s_k, dtype=jnp.int32)
  first = jnp.full((s_k,), s_k, jnp.int32).at[kv_segment].min(key)
  last = jnp.zeros((s_k,), jnp.int32).at[kv_segment].max(key + 1)
  count = jnp.zeros((s_k,), jnp.int32).at[kv_segment].add(1)
  ids = jnp.clip(q_segment, 0, s_k - 1)
  found = (q_segment >= 0) & (q_segment < s_k) & (count[ids] > 0)
  return _runs(first[ids], last[ids], count[ids], found)


def _runs_by_sort(q_segment, kv_segment):
  """_segment_runs for any ids: the keys sorted by id (stably, so equal ids keep key order)."""
  s_k = kv_segment.shape[0]
  order = jnp.argsort(kv_segment, stable=True).astype(jnp.int32)
  sorted_ids = kv_segment[order]
  start = jnp.searchsorted(sorted_ids, q_segment, side="left", method="scan_unrolled")
  count = jnp.searchsorted(sorted_ids, q_segment, side="right", method="scan_unrolled") - start
  found = count > 0
  first = order[jnp.minimum(start, s_k - 1)]
  last = order[jnp.clip(start + count - 1, 0, s_k - 1)] + 1
  return _runs(first, last, count, found)


def _sorted_runs(q_segment, kv_segment):
  """_segment_runs for ids non-decreasing along both axes (always contiguous): binary searches,
  unrolled so that each is one fused kernel rather than a loop of launches."""
  lo = jnp.searchsorted(kv_segment, q_segment, side="left", method="scan_unrolled")
  hi = jnp.searchsorted(kv_segment, q_segment, side="right", method="scan_unrolled")
  return lo.astype(jnp.int32), hi.astype(jnp.int32), jnp.bool_(True)


def row_ranges(masks, s_q: int, s_k: int, window_left: int, window_right: int,
               sorted_segments: bool = False):
  """(lo, hi, exact) of masks (diagonals (b,) or one per query, (b, s_q)):
  int32 (b, s_q) visible keys [lo, hi) per query (lo = hi = 0 for a query
  that sees nothing) and a bool scalar, False when some segment is not one contiguous run of keys
  (then the intervals are not the masks and the caller takes another path). sorted_segments:
  the caller promises segment ids non-decreasing along queries and keys (AttentionConfig)."""
  q_lengths, kv_lengths, diagonals = (jnp.asarray(x, jnp.int32) for x in masks[:3])
  query = jnp.arange(s_q, dtype=jnp.int32)[None]
  # Clamped so that i + diagonal +- window stays in int32 without changing any interval: past
  # 2 (s_q + s_k) a diagonal leaves every row all or none of the keys, and past 4 (s_q + s_k) a
  # window reaches past every key from any such centre.
  reach = s_q + s_k
  diagonals = jnp.clip(diagonals, -2 * reach, 2 * reach)
  centre = query + (diagonals[:, None] if diagonals.ndim == 1 else diagonals)  # per row or query
  lo = jnp.zeros_like(centre)
  hi = jnp.broadcast_to(jnp.clip(kv_lengths, 0, s_k)[:, None], centre.shape)
  if 0 <= window_left:
    lo = jnp.maximum(lo, centre - min(window_left, 4 * reach))
  if 0 <= window_right:
    hi = jnp.minimum(hi, centre + min(window_right, 4 * reach) + 1)
  exact = jnp.bool_(True)
  if len(masks) > 3:
    runs = _sorted_runs if sorted_segments else _segment_runs
    seg_lo, seg_hi, contiguous = jax.vmap(runs)(masks[3], masks[4])
    lo, hi = jnp.maximum(lo, seg_lo), jnp.minimum(hi, seg_hi)
    exact = jnp.all(contiguous)
  lo, hi = jnp.clip(lo, 0, s_k), jnp.clip(hi, 0, s_k)
  sees = (query < q_lengths[:, None]) & (lo < hi)
  return jnp.where(sees, lo, 0), jnp.where(sees, hi, 0), exact


# Up to this many query rows the covers are one max-reduction over (granule, cover, row) rather
# than per-granule reductions and two scans: one kernel launch instead of four or five, which
# is what a decoding call's few rows pay for (its K/V stream takes ~20 us).
ONE_REDUCTION_ROWS = 1024


def _covers_by_one_reduction(lo, hi, s_q: int, s_k: int):
  """kernel_operands' covers from padded lo, hi (b, s_pad), each a max over rows of a masked
  value (a min written as -max(-x)): reach over the rows of the granule's and later (lo) or
  earlier (hi) granules, full over the granule's real rows."""
  s_pad = lo.shape[1]
  granule = jnp.arange(s_pad // GRANULE, dtype=jnp.int32)[:, None]  # (G, 1)
  row = jnp.arange(s_pad, dtype=jnp.int32)[None, :]                 # (1, s_pad)
  first, end = granule * GRANULE, granule * GRANULE + GRANULE
  lo, hi = lo[:, None, :], hi[:, None, :]                           # (b, 1, s_pad)
  sees = lo < hi
  real_in_granule = (row >= first) & (row < end) & (row < s_q)
  by_cover = (
      jnp.where(sees & (row >= first), -lo, -s_k),      # reach_lo = -max(-lo)
      jnp.where(sees & (row < end), hi, 0),             # reach_hi
      jnp.where(real_in_granule, lo, 0),                # full_lo
      jnp.where(real_in_granule, -hi, -s_k),            # full_hi = -max(-hi)
  )
  covers = jnp.max(jnp.stack(by_cover, axis=2), axis=3)  # (b, G, 4)
  cover = jnp.arange(4, dtype=jnp.int32)  # an iota, not a constant (custom_partitioning)
  sign = jnp.where((cover == 0) | (cover == 3), -1, 1)
  return (covers * sign).astype(jnp.int32)


def kernel_operands(lo, hi, s_k: int):
  """The masked kernels' two extra operands from row_ranges' lo, hi (b, s_q): the ranges, int32
  (b, padded_rows(s_q), 2) with padding rows [0, 0), and their covers, int32
  (b, padded_rows(s_q) / 64, 4): per granule (reach_lo, reach_hi, full_lo, full_hi), see
  cuda/common/key_ranges.h."""
  b, s_q = lo.shape
  s_pad = padded_rows(s_q)
  lo = jnp.pad(lo, ((0, 0), (0, s_pad - s_q)))
  hi = jnp.pad(hi, ((0, 0), (0, s_pad - s_q)))
  ranges = jnp.stack([lo, hi], axis=-1).astype(jnp.int32)
  if s_pad <= ONE_REDUCTION_ROWS:
    return ranges, _covers_by_one_reduction(lo, hi, s_q, s_k)
  granules = s_pad // GRANULE
  real = (jnp.arange(s_pad) < s_q).reshape(1, granules, GRANULE)
  lo_g, hi_g = lo.reshape(b, granules, GRANULE), hi.reshape(b, granules, GRANULE)
  sees = lo_g < hi_g
  # Reach: the keys of every later (earlier) row lie at or past (before) it, so both are
  # monotone over granules: a suffix minimum and a prefix maximum.
  reach_lo = jax.lax.cummin(jnp.min(jnp.where(sees, lo_g, s_k), axis=2), axis=1, reverse=True)
  reach_hi = jax.lax.cummax(jnp.max(jnp.where(sees, hi_g, 0), axis=2), axis=1)
  # Full: the keys every real row of the granule sees (rows past s_q are never stored).
  full_lo = jnp.max(jnp.where(real, lo_g, 0), axis=2)
  full_hi = jnp.min(jnp.where(real, hi_g, s_k), axis=2)
  covers = jnp.stack([reach_lo, reach_hi, full_lo, full_hi], axis=-1).astype(jnp.int32)
  return ranges, covers
