"""jax_fa3._key_ranges: the masked kernels' per-query key ranges and their 64-row covers
(cuda/common/key_ranges.h), against a numpy oracle of the masks (tests/key_range_cases.py). The
kernels' block logic over these covers is checked on the host in test_cuda_layouts.py."""
import numpy as np
import pytest

from jax_fa3 import _key_ranges
from key_range_cases import cases, visible

CASES = cases()


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-w{c[4]},{c[5]}" for c in CASES])
def test_ranges_are_exactly_the_masks(case):
  _, masks, s_q, s_k, wl, wr, contiguous = case
  lo, hi, exact = _key_ranges.row_ranges(masks, s_q, s_k, wl, wr)
  assert bool(exact) == contiguous
  if not contiguous:
    return
  lo, hi = np.asarray(lo), np.asarray(hi)
  keys = np.arange(s_k)[None, None, :]
  in_range = (keys >= lo[..., None]) & (keys < hi[..., None])
  np.testing.assert_array_equal(in_range, visible(masks, s_q, s_k, wl, wr))
  # A query that sees nothing holds the empty range (0, 0).
  empty = lo >= hi
  assert not lo[empty].any() and not hi[empty].any()


@pytest.mark.parametrize("case", [c for c in CASES if c[6]],
                         ids=[f"{c[0]}-w{c[4]},{c[5]}" for c in CASES if c[6]])
def test_covers_bound_every_granule(case):
  _, masks, s_q, s_k, wl, wr, _ = case
  lo, hi, _ = _key_ranges.row_ranges(masks, s_q, s_k, wl, wr)
  ranges, covers = (np.asarray(x) for x in _key_ranges.kernel_operands(lo, hi, s_k))
  s_pad = _key_ranges.padded_rows(s_q)
  assert ranges.shape == (lo.shape[0], s_pad, 2) and ranges.dtype == np.int32
  assert covers.shape == (lo.shape[0], s_pad // 64, 4) and covers.dtype == np.int32
  assert not ranges[:, s_q:].any()  # padding rows see nothing
  sees = visible(masks, s_q, s_k, wl, wr)
  sees = np.pad(sees, ((0, 0), (0, s_pad - s_q), (0, 0))).reshape(len(lo), -1, 64, s_k)
  reach_lo, reach_hi, full_lo, full_hi = np.moveaxis(covers, -1, 0)
  assert (np.diff(reach_lo, axis=1) >= 0).all() and (np.diff(reach_hi, axis=1) >= 0).all()
  keys = np.arange(s_k)
  for r in range(len(lo)):
    for g in range(s_pad // 64):
      later = sees[r, g:].any(axis=(0, 1))   # keys seen by rows of granules >= g
      earlier = sees[r, :g + 1].any(axis=(0, 1))
      assert (keys[later] >= reach_lo[r, g]).all()
      assert (keys[earlier] < reach_hi[r, g]).all()
      rows = min(64, max(s_q - 64 * g, 0))
      inside = (keys >= full_lo[r, g]) & (keys < full_hi[r, g])
      assert sees[r, g, :rows][:, inside].all()


@pytest.mark.parametrize("case", [c for c in CASES if c[6]],
                         ids=[f"{c[0]}-w{c[4]},{c[5]}" for c in CASES if c[6]])
def test_covers_one_reduction_equals_scans(case, monkeypatch):
  # Few rows (decoding) take one reduction, many rows per-granule reductions and scans: the
  # same covers either way.
  _, masks, s_q, s_k, wl, wr, _ = case
  lo, hi, _ = _key_ranges.row_ranges(masks, s_q, s_k, wl, wr)
  assert _key_ranges.padded_rows(s_q) <= _key_ranges.ONE_REDUCTION_ROWS
  _, by_one = _key_ranges.kernel_operands(lo, hi, s_k)
  monkeypatch.setattr(_key_ranges, "ONE_REDUCTION_ROWS", 0)
  _, by_scans = _key_ranges.kernel_operands(lo, hi, s_k)
  np.testing.assert_array_equal(np.asarray(by_one), np.asarray(by_scans))


@pytest.mark.parametrize("seed", range(4))
def test_scatter_and_sort_paths_agree(seed):
  # Ids in [0, s_k) take the scatter path; the sort path must give the same intervals and the
  # same verdict on them (runs, interleaved ids, ids only the queries or only the keys hold).
  rng = np.random.default_rng(seed)
  s_k = 40
  runs = np.repeat(rng.permutation(8)[:5], rng.multinomial(s_k - 5, [0.2] * 5) + 1)[:s_k]
  kv = runs if seed % 2 else rng.integers(0, 6, s_k)
  q = rng.integers(0, 9, 33)
  scatter = _key_ranges._runs_by_scatter(np.int32(q), np.int32(kv))
  by_sort = _key_ranges._runs_by_sort(np.int32(q), np.int32(kv))
  for a, b in zip(scatter, by_sort):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("seed", range(3))
def test_sorted_ids_path_agrees_with_the_scatter_path(seed):
  # Ids non-decreasing along queries and keys (varlen's sequence indices, cross lengths): the
  # binary-search runs equal the general ones, including ids that only one side holds.
  rng = np.random.default_rng(seed)
  kv = np.sort(rng.integers(0, 9, 50)).astype(np.int32)
  q = np.sort(rng.integers(0, 11, 37)).astype(np.int32)
  scatter = _key_ranges._runs_by_scatter(q, kv)
  by_search = _key_ranges._sorted_runs(q, kv)
  assert bool(by_search[2]) and bool(scatter[2])
  (lo_a, hi_a), (lo_b, hi_b) = (np.asarray(x) for x in scatter[:2]), (
      np.asarray(x) for x in by_search[:2])
  empty = lo_a >= hi_a  # an id the keys lack: empty either way (row_ranges then stores (0, 0))
  np.testing.assert_array_equal(empty, lo_b >= hi_b)
  assert empty.any() and (~empty).any()
  np.testing.assert_array_equal(lo_a[~empty], lo_b[~empty])
  np.testing.assert_array_equal(hi_a[~empty], hi_b[~empty])
