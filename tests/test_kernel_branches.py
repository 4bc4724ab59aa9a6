"""The kernel branches of the masked, paged and varlen calls, traced on any machine.

`jax.lax.platform_dependent` lowers only the branch of the platform it compiles for, so on a CPU
the Python that builds a kernel call (key ranges, covers, page tables, result shapes) would run
only on a GPU. Here the kernel checks are forced and `jax.make_jaxpr` traces every branch: each
FFI call must appear with the operand shapes and dtypes its handler checks (cuda/ffi), so a
mistake in them fails on the CPU too.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fa3
from jax_fa3 import _ffi, _key_ranges, _local_attention
from kernel_targets import jaxpr_equations


@pytest.fixture(autouse=True)
def _kernels_forced(monkeypatch):
  monkeypatch.setattr(_ffi, "has_target", lambda name: True)
  monkeypatch.setattr(_local_attention, "_use_kernel", lambda target, q: True)
  monkeypatch.setattr(_local_attention, "_use_masked_kernel", lambda target, q: True)
  monkeypatch.setattr(_local_attention, "masked_kernels_would_run", lambda q: True)
  monkeypatch.setattr(_local_attention, "paged_in_place", lambda q, page_size: True)
  monkeypatch.setattr(_ffi, "flash_bwd_workspace_bytes", lambda *args: 1024)


def _ffi_calls(fn, *args):
  """{target: [operand avals (shape, dtype)]} of every FFI call in fn's jaxpr, nested ones too."""
  calls = {}
  for eqn in jaxpr_equations(fn, *args):
    if eqn.primitive.name == "ffi_call":
      calls.setdefault(eqn.params["target_name"], []).append(
          [(tuple(v.aval.shape), np.dtype(v.aval.dtype)) for v in eqn.invars])
  return calls


def _key_range_operands(b, s_q):
  s_pad = _key_ranges.padded_rows(s_q)
  return [((b, s_pad, 2), np.dtype(np.int32)), ((b, s_pad // 64, 4), np.dtype(np.int32))]


def test_segment_ids_build_the_key_range_calls():
  b, s, h, d = 2, 200, 4, 64
  q = jnp.ones((b, s, h, d), jnp.bfloat16)
  kv = jnp.ones((b, s, 2, d), jnp.bfloat16)
  seg = jnp.zeros((b, s), jnp.int32)

  def loss(q, k, v):
    out = jax_fa3.flash_attention(q, k, v, causal=True, q_segment_ids=seg, kv_segment_ids=seg)
    return jnp.sum(out.astype(jnp.float32))

  calls = _ffi_calls(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv)
  (fwd,) = calls["jax_fa3_flash_fwd_key_ranges"]
  assert fwd[:3] == [(q.shape, q.dtype), (kv.shape, kv.dtype), (kv.shape, kv.dtype)]
  assert fwd[3:] == _key_range_operands(b, s)
  (bwd,) = calls["jax_fa3_flash_bwd_key_ranges"]
  assert bwd[6:] == _key_range_operands(b, s)  # after q, k, v, out, dout, lse


@pytest.mark.parametrize("lens_k", [[100, 156], [30, 300]])
def test_varlen_builds_one_row_of_documents(lens_k):
  lens_q = [100, 156]
  q = jnp.ones((sum(lens_q), 4, 128), jnp.bfloat16)
  kv = jnp.ones((sum(lens_k), 4, 128), jnp.bfloat16)
  cu_q = jnp.asarray(np.cumsum([0] + lens_q), jnp.int32)
  cu_k = jnp.asarray(np.cumsum([0] + lens_k), jnp.int32)

  def loss(q, k, v):
    out = jax_fa3.flash_attention_varlen(q, k, v, cu_q, cu_k, 156, max(lens_k), causal=True)
    return jnp.sum(out.astype(jnp.float32))

  calls = _ffi_calls(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv)
  (fwd,) = calls["jax_fa3_flash_fwd_key_ranges"]
  assert fwd[0] == ((1,) + q.shape, q.dtype) and fwd[1] == ((1,) + kv.shape, kv.dtype)
  assert fwd[3:] == _key_range_operands(1, q.shape[0])
  assert len(calls["jax_fa3_flash_bwd_key_ranges"]) == 1
  # Sequence indices are sorted, so no device-side contiguity check and fallback: a lax.cond
  # on the GPU copies its predicate to the host and stalls the launches behind it; nor a loop
  # of one launch per step (searchsorted's default method).
  eqns = jaxpr_equations(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv)
  platform = {v for eqn in eqns if eqn.primitive.name == "platform_index" for v in eqn.outvars}
  on_data = [eqn.primitive.name for eqn in eqns
             if eqn.primitive.name in ("while", "sort")
             or (eqn.primitive.name == "cond" and eqn.invars[0] not in platform)]
  assert not on_data, on_data


def _row_bounds_operand(b):
  return [((b, 3), np.dtype(np.int32))]


@pytest.mark.parametrize("kv_only", [False, True])
def test_lengths_build_row_bounds_forward_and_key_range_backward(kv_only):
  b, s, h, d = 3, 200, 4, 64
  q = jnp.ones((b, s, h, d), jnp.bfloat16)
  kv = jnp.ones((b, s, 2, d), jnp.bfloat16)
  lengths = jnp.asarray([200, 17, 0], jnp.int32)

  def loss(q, k, v):
    out = jax_fa3.flash_attention(q, k, v, causal=True, key_value_seq_lengths=lengths,
                                  query_seq_lengths=None if kv_only else lengths)
    return jnp.sum(out.astype(jnp.float32))

  calls = _ffi_calls(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv)
  assert "jax_fa3_flash_fwd_key_ranges" not in calls
  (fwd,) = calls["jax_fa3_flash_fwd_row_bounds"]
  assert fwd[:3] == [(q.shape, q.dtype), (kv.shape, kv.dtype), (kv.shape, kv.dtype)]
  assert fwd[3:] == _row_bounds_operand(b)
  (bwd,) = calls["jax_fa3_flash_bwd_key_ranges"]  # the backward reads ranges
  assert bwd[6:] == _key_range_operands(b, s)


def test_lengths_without_the_bounds_target_build_key_ranges(monkeypatch):
  # A kernels library without the row-bound targets (built before them): the forward reads ranges.
  # The choice is made when the partitioned op is traced, and its traces are cached per shape:
  # cleared on both sides, so that neither form reuses the other's.
  b, s, h, d = 2, 130, 4, 128
  q = jnp.ones((b, s, h, d), jnp.bfloat16)
  lengths = jnp.asarray([130, 5], jnp.int32)
  call = lambda q, k, v: jax_fa3.flash_attention(q, k, v, key_value_seq_lengths=lengths)
  jax.clear_caches()
  try:
    with monkeypatch.context() as patch:
      patch.setattr(_ffi, "has_target", lambda name: "row_bounds" not in name)
      calls = _ffi_calls(call, q, q, q)
  finally:
    jax.clear_caches()
  assert "jax_fa3_flash_fwd_row_bounds" not in calls
  (fwd,) = calls["jax_fa3_flash_fwd_key_ranges"]
  assert fwd[3:] == _key_range_operands(b, s)
  # And with the targets, the same shapes take the row bounds.
  assert "jax_fa3_flash_fwd_row_bounds" in _ffi_calls(call, q, q, q)


def test_row_bounds_are_the_masks_per_row():
  masks = (jnp.asarray([3, 0], jnp.int32), jnp.asarray([7, 9], jnp.int32),
           jnp.asarray([-4, 6], jnp.int32))
  bounds = np.asarray(_local_attention._row_bounds(masks))
  np.testing.assert_array_equal(bounds, [[3, 7, -4], [0, 9, 6]])


@pytest.mark.parametrize("splits", [1, 2])
def test_paged_cache_builds_the_paged_call(splits):
  # Two queries per row: the paged row-bound call, the split's pieces as batch rows.
  b, h, h_k, d, page, pages = 2, 8, 2, 128, 128, 4
  q = jnp.ones((b, 2, h, d), jnp.bfloat16)
  pool = jnp.ones((b * pages + 1, page, h_k, d), jnp.bfloat16)
  table = jnp.arange(b * pages, dtype=jnp.int32).reshape(b, pages)
  lengths = jnp.asarray([100, 500], jnp.int32)
  call = lambda q, kp, vp: jax_fa3.flash_attention_with_kvcache(
      q, kp, vp, cache_seqlens=lengths, page_table=table, causal=True, num_splits=splits)
  calls = _ffi_calls(call, q, pool, pool)
  assert "jax_fa3_flash_fwd_paged" not in calls
  (paged,) = calls["jax_fa3_flash_fwd_paged_row_bounds"]
  rows = b * splits
  assert paged[0] == ((rows, 2, h, d), q.dtype)
  assert paged[1:3] == [(pool.shape, pool.dtype)] * 2
  assert paged[3:4] == _row_bounds_operand(rows)
  assert paged[4] == ((rows, pages // splits), np.dtype(np.int32))


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("paged", [False, True])
def test_decode_builds_the_decode_call(splits, paged):
  # One query per row: q, the cache (or pools and the page table) and the cache lengths go to
  # the decode target as they are (GQA, the row bounds and the split are the kernel's), results
  # (b, n, h, d) and (b, n, h). 3 pieces of a 4-block row: 2 blocks each, the third empty.
  b, h, h_k, d, page, pages = 2, 8, 2, 128, 128, 4
  q = jnp.ones((b, 1, h, d), jnp.bfloat16)
  table = jnp.arange(b * pages, dtype=jnp.int32).reshape(b, pages)
  lengths = jnp.asarray([100, 500], jnp.int32)
  if paged:
    cache = jnp.ones((b * pages + 1, page, h_k, d), jnp.bfloat16)
    options = dict(page_table=table)
  else:
    cache = jnp.ones((b, pages * page, h_k, d), jnp.bfloat16)
    options = {}
  call = lambda q, kc, vc: jax_fa3.flash_attention_with_kvcache(
      q, kc, vc, cache_seqlens=lengths, causal=True, num_splits=splits, **options)
  calls = _ffi_calls(call, q, cache, cache)
  target = "jax_fa3_flash_fwd_paged_decode" if paged else "jax_fa3_flash_fwd_decode"
  assert set(calls) - {"jax_fa3_split_kv_combine"} == {target}  # (the merge: its own tests)
  (decode,) = calls[target]
  assert decode[0] == (q.shape, q.dtype)
  assert decode[1:3] == [(cache.shape, cache.dtype)] * 2
  assert decode[3] == ((b,), np.dtype(np.int32))
  if paged:
    assert decode[4] == (table.shape, np.dtype(np.int32))
  eqn = next(e for e in jaxpr_equations(call, q, cache, cache)
             if e.primitive.name == "ffi_call" and e.params["target_name"] == target)
  assert [(tuple(v.aval.shape), np.dtype(v.aval.dtype)) for v in eqn.outvars] == [
      ((b, splits, h, d), q.dtype), ((b, splits, h), np.dtype(np.float32))]


def test_vmapped_paged_calls_fold_or_gather():
  # vmap over the queries folds into the batch (one paged call); vmap over the pools themselves
  # gathers each lane's pages onto the contiguous kernel.
  b, h, h_k, d, page, pages, lanes = 2, 4, 4, 128, 128, 2, 3
  pool = jnp.ones((b * pages, page, h_k, d), jnp.bfloat16)
  table = jnp.arange(b * pages, dtype=jnp.int32).reshape(b, pages)
  lengths = jnp.asarray([100, 200], jnp.int32)
  call = lambda q, kp, vp: jax_fa3.flash_attention_with_kvcache(
      q, kp, vp, cache_seqlens=lengths, page_table=table, num_splits=1)
  pools = jnp.ones((lanes,) + pool.shape, jnp.bfloat16)
  # (Row bounds (rows, 3) for two queries per row, the decode targets' lengths (rows,) for one.)
  for s_q, in_place, contiguous, bounds in [(2, "jax_fa3_flash_fwd_paged_row_bounds",
                                             "jax_fa3_flash_fwd_row_bounds", (3,)),
                                            (1, "jax_fa3_flash_fwd_paged_decode",
                                             "jax_fa3_flash_fwd_decode", ())]:
    q = jnp.ones((lanes, b, s_q, h, d), jnp.bfloat16)
    (paged,) = _ffi_calls(jax.vmap(call, in_axes=(0, None, None)), q, pool, pool)[in_place]
    assert paged[0][0][0] == lanes * b and paged[1][0] == pool.shape
    assert paged[3] == ((lanes * b,) + bounds, np.dtype(np.int32))
    calls = _ffi_calls(jax.vmap(call), q, pools, pools)
    assert in_place not in calls
    (gathered,) = calls[contiguous]
    assert gathered[1] == ((lanes * b, pages * page, h_k, d), pool.dtype)
