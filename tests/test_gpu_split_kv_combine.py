"""The split-KV merge kernel (jax_fa3_split_kv_combine, cuda/decode/) against the XLA merge
(jax_fa3._cache_attention._merge_xla) in float32, and the decode steps that use it (GPU only).

The pieces hold empty pieces (lse +inf), a (row, head) whose pieces are all empty, and lse values
tens apart (weights from 1 down to underflow). Every output is poisoned first (NaN), so an element
the kernel does not write fails the comparison. The kernel's float32 sums run in another order
than XLA's and use the GPU's fast exp, so float32 results agree to ~1e-6 relative; 16-bit results
are the float32 merge rounded once, equal to the XLA merge's rounding but where the two float32
values straddle a rounding boundary (one ulp, rarely).
"""
import os

os.environ["JAX_FA3_DEBUG_POISON_OUTPUTS"] = "1"

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fa3
from jax_fa3 import _cache_attention
from ffi_probe import ffi_error_message
from kernel_build import skip_unless_compiled
from kernel_targets import (FLASH_FWD_DECODE, FLASH_FWD_ROW_BOUNDS, SPLIT_KV_COMBINE, compiled_text, kernel_targets,
                            run_on_kernels)

pytestmark = pytest.mark.gpu

B, ROWS, HEADS = 3, 4, 5  # 60 output vectors: not a multiple of any team's vectors per CTA


def _pieces(seed, n, d, dtype, b=B, rows=ROWS, heads=HEADS):
  rng = np.random.default_rng(seed)
  out = rng.standard_normal((b * n, rows, heads, d))
  lse = rng.standard_normal((b * n, heads, rows)) * 20
  lse[rng.random(lse.shape) < 0.25] = np.inf  # empty pieces
  lse[:n, 0, 0] = np.inf  # batch row 0, head 0, query row 0: every piece empty
  out[np.isinf(lse).transpose(0, 2, 1)] = 0.0  # what the attention kernels write for no key
  return jnp.asarray(out, dtype), jnp.asarray(lse, jnp.float32)


def _kernel_merge(b, n, dtype):
  return jax.jit(lambda out, lse: _cache_attention._merge(out, lse, b, n, dtype))


def _xla_merge(b, n):
  return jax.jit(lambda out, lse: _cache_attention._merge_xla(out, lse, b, n, jnp.float32))


def _check_out(got, want32, dtype):
  """got (dtype) against the XLA merge in float32."""
  got32 = np.asarray(got, np.float32)
  want32 = np.asarray(want32, np.float32)
  assert not np.isnan(got32).any()
  if np.dtype(dtype) == np.float32:
    np.testing.assert_allclose(got32, want32, rtol=1e-5, atol=1e-5)
    return
  rounded = np.asarray(jnp.asarray(want32).astype(dtype), np.float32)
  np.testing.assert_allclose(got32, rounded, rtol=float(jnp.finfo(dtype).eps), atol=2e-5)
  assert np.mean(got32 != rounded) < 0.01  # rounded once from float32, not from a 16-bit sum


def _check_lse(got, want):
  got, want = np.asarray(got), np.asarray(want)
  np.testing.assert_array_equal(np.isposinf(got), np.isposinf(want))
  finite = np.isfinite(want)
  np.testing.assert_allclose(got[finite], want[finite], rtol=1e-6, atol=2e-5)


@pytest.mark.parametrize("n", [1, 2, 3, 37, 64, 300])
@pytest.mark.parametrize("d", [64, 128, 256, 96])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_kernel_matches_the_xla_merge(n, d, dtype):
  out, lse = _pieces(n * 1000 + d, n, d, dtype)
  got, got_lse = run_on_kernels(_kernel_merge(B, n, dtype), out, lse, expected=SPLIT_KV_COMBINE)
  want, want_lse = _xla_merge(B, n)(out, lse)
  assert got.shape == (B, ROWS, HEADS, d) and got.dtype == dtype
  assert got_lse.shape == (B, HEADS, ROWS) and got_lse.dtype == jnp.float32
  _check_out(got, want, dtype)
  _check_lse(got_lse, want_lse)
  assert np.isposinf(np.asarray(got_lse)[0, 0, 0])
  assert not np.asarray(got[0, 0, 0], np.float32).any()  # exact zeros, not left-over poison


@pytest.mark.parametrize("d", [8, 24, 200])  # 32, 10 and 1 pieces per warp at a time
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_other_head_dims(d, dtype):
  n = 45
  out, lse = _pieces(d, n, d, dtype)
  got, got_lse = run_on_kernels(_kernel_merge(B, n, dtype), out, lse, expected=SPLIT_KV_COMBINE)
  want, want_lse = _xla_merge(B, n)(out, lse)
  _check_out(got, want, dtype)
  _check_lse(got_lse, want_lse)


def test_one_dominant_piece_and_ties():
  # A piece 100 above the others takes all the weight (the others underflow to 0); equal lse
  # split it evenly: out is the mean of the pieces.
  n, d = 6, 128
  out, _ = _pieces(1, n, d, jnp.float32)
  lse = np.zeros((B * n, HEADS, ROWS), np.float32)
  lse[2::n] = 100.0  # piece 2 of every row
  got, got_lse = run_on_kernels(_kernel_merge(B, n, jnp.float32), out, jnp.asarray(lse),
                                expected=SPLIT_KV_COMBINE)
  np.testing.assert_allclose(np.asarray(got), np.asarray(out)[2::n], rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(np.asarray(got_lse), 100.0, rtol=1e-7)
  got, got_lse = run_on_kernels(_kernel_merge(B, n, jnp.float32), out,
                                jnp.full((B * n, HEADS, ROWS), -3.0, jnp.float32),
                                expected=SPLIT_KV_COMBINE)
  mean = np.asarray(out).reshape((B, n, ROWS, HEADS, d)).mean(axis=1)
  np.testing.assert_allclose(np.asarray(got), mean, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(got_lse), -3.0 + np.log(n), rtol=1e-6)


def test_empty_pieces_are_not_read():
  # A piece of weight 0 is skipped: NaN in its values changes nothing (the XLA merge would
  # multiply them by 0 and get NaN).
  n, d = 37, 128
  out, lse = _pieces(2, n, d, jnp.bfloat16)
  empty = np.isinf(np.asarray(lse)).transpose(0, 2, 1)
  dirty = jnp.asarray(np.where(empty[..., None], np.nan, np.asarray(out, np.float32)),
                      jnp.bfloat16)
  merge = _kernel_merge(B, n, jnp.bfloat16)
  clean = run_on_kernels(merge, out, lse, expected=SPLIT_KV_COMBINE)
  got = merge(dirty, lse)
  for g, c in zip(got, clean):
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(c, np.float32))


def test_vmap_folds_into_one_call():
  n, d, lanes = 5, 64, 3
  pieces = [_pieces(10 + i, n, d, jnp.bfloat16) for i in range(lanes)]
  out = jnp.stack([p[0] for p in pieces])
  lse = jnp.stack([p[1] for p in pieces])
  batched = jax.jit(jax.vmap(lambda o, l: _cache_attention._merge(o, l, B, n, jnp.bfloat16)))
  got, got_lse = run_on_kernels(batched, out, lse, expected=SPLIT_KV_COMBINE)
  assert kernel_targets(compiled_text(batched, out, lse))[SPLIT_KV_COMBINE] == 1
  merge = _kernel_merge(B, n, jnp.bfloat16)
  for i, (o, l) in enumerate(pieces):  # each vector is merged alike, whatever the batch
    want, want_lse = merge(o, l)
    np.testing.assert_array_equal(np.asarray(got[i], np.float32), np.asarray(want, np.float32))
    np.testing.assert_array_equal(np.asarray(got_lse[i]), np.asarray(want_lse))


@pytest.mark.parametrize("pieces,dtype,rows,lse_pieces,n,expected", [
    # lse pieces of the wrong shape
    (6, "bfloat16", 4, (6, 4, 2), 3,
     ["lse_pieces must have shape (batch * n, heads, rows) = (6, 2, 4)"]),
    # pieces not a multiple of n
    (5, "float32", 1, (5, 2, 1), 2, ["multiple of n = 2"]),
])
def test_handler_rejects_bad_pieces_via_ffi_error(pieces, dtype, rows, lse_pieces, n, expected):
  message = ffi_error_message(f"""
    out = jnp.ones(({pieces}, {rows}, 2, 64), jnp.{dtype})
    call = jax.ffi.ffi_call("jax_fa3_split_kv_combine", (
        jax.ShapeDtypeStruct((2, {rows}, 2, 64), jnp.{dtype}),
        jax.ShapeDtypeStruct((2, 2, {rows}), jnp.float32)))
    result = lambda: call(out, jnp.ones({lse_pieces}, jnp.float32), n=np.int32({n}))
  """)
  assert all(e in message for e in expected), message


def test_handler_rejects_a_head_dim_not_a_multiple_of_8_via_ffi_error():
  message = ffi_error_message("""
    out = jnp.ones((4, 1, 2, 12), jnp.float16)
    call = jax.ffi.ffi_call("jax_fa3_split_kv_combine", (
        jax.ShapeDtypeStruct((2, 1, 2, 12), jnp.float16),
        jax.ShapeDtypeStruct((2, 2, 1), jnp.float32)))
    result = lambda: call(out, jnp.ones((4, 2, 1), jnp.float32), n=np.int32(2))
  """)
  assert "head_dim" in message and "multiple of 8" in message and "got 12" in message, message


def _decode_step(lengths, splits):
  return jax.jit(lambda q, kc, vc: jax_fa3.flash_attention_with_kvcache(
      q, kc, vc, cache_seqlens=lengths, causal=True, num_splits=splits, return_lse=True))


@pytest.mark.parametrize("dtype,d", [(jnp.bfloat16, 128), (jnp.float16, 64), (jnp.bfloat16, 256)])
@pytest.mark.parametrize("s_q", [1, 3])  # GQA-packed decode; a causal chunk of 3 queries
def test_split_kv_decode_with_the_kernel_merge(monkeypatch, dtype, d, s_q):
  # The same pieces (the masked kernel's) merged by the kernel and by XLA: one rounding apart at
  # most; and the unsplit call within a few bf16 roundings (the pieces are rounded before the
  # merge). Row 1 has no key: out 0, lse +inf.
  b, cap, h, h_k, splits = 3, 4096, 16, 2, 8
  rng = np.random.default_rng(d + s_q)
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)
  q, k_cache, v_cache = normal(b, s_q, h, d), normal(b, cap, h_k, d), normal(b, cap, h_k, d)
  skip_unless_compiled(q)
  lengths = jnp.asarray([4000, 0, 1300], jnp.int32)
  fwd = FLASH_FWD_DECODE if s_q == 1 else FLASH_FWD_ROW_BOUNDS
  got, got_lse = run_on_kernels(_decode_step(lengths, splits), q, k_cache, v_cache,
                                expected={fwd, SPLIT_KV_COMBINE})
  one, one_lse = run_on_kernels(_decode_step(lengths, 1), q, k_cache, v_cache, expected={fwd})
  with monkeypatch.context() as m:
    m.setattr(_cache_attention, "combine_kernel_applies", lambda *args: False)
    xla_step = _decode_step(lengths, splits)
    assert SPLIT_KV_COMBINE not in kernel_targets(compiled_text(xla_step, q, k_cache, v_cache))
    want, want_lse = run_on_kernels(xla_step, q, k_cache, v_cache, expected={fwd})
  got32, want32 = np.asarray(got, np.float32), np.asarray(want, np.float32)
  assert got.dtype == dtype and not np.isnan(got32).any()
  np.testing.assert_allclose(got32, want32, rtol=float(jnp.finfo(dtype).eps), atol=1e-4)
  assert np.mean(got32 != want32) < 0.01
  _check_lse(got_lse, want_lse)
  assert not got32[1].any() and np.isposinf(np.asarray(got_lse)[1]).all()
  one32 = np.asarray(one, np.float32)
  np.testing.assert_allclose(got32, one32, atol=4 * 2**-8 * np.abs(one32).max(), rtol=0)
  one_lse = np.asarray(one_lse)
  np.testing.assert_array_equal(np.isposinf(np.asarray(got_lse)), np.isposinf(one_lse))
  finite = np.isfinite(one_lse)
  np.testing.assert_allclose(np.asarray(got_lse)[finite], one_lse[finite], atol=1e-4, rtol=1e-5)


def test_default_split_of_a_long_cache_uses_the_kernel_merge(monkeypatch):
  # Decoding one row against 32k keys: the split is chosen for the kernels (num_splits=0), and
  # its merge is the kernel, matching the XLA merge of the same pieces.
  b, cap, h, h_k, d = 1, 32768, 32, 4, 128
  rng = np.random.default_rng(0)
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
  q, k_cache, v_cache = normal(b, 1, h, d), normal(b, cap, h_k, d), normal(b, cap, h_k, d)
  skip_unless_compiled(q)
  lengths = jnp.asarray([cap - 5], jnp.int32)
  step = _decode_step(lengths, 0)
  got, got_lse = run_on_kernels(step, q, k_cache, v_cache,
                                expected={FLASH_FWD_DECODE, SPLIT_KV_COMBINE})
  assert kernel_targets(compiled_text(step, q, k_cache, v_cache))[SPLIT_KV_COMBINE] == 1
  with monkeypatch.context() as m:
    m.setattr(_cache_attention, "combine_kernel_applies", lambda *args: False)
    want, want_lse = _decode_step(lengths, 0)(q, k_cache, v_cache)
  got32, want32 = np.asarray(got, np.float32), np.asarray(want, np.float32)
  np.testing.assert_allclose(got32, want32, rtol=2**-8, atol=1e-4)
  assert np.mean(got32 != want32) < 0.01
  _check_lse(got_lse, want_lse)
