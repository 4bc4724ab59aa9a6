"""The kernels' key-range variants (jax_fa3_flash_fwd_key_ranges / _bwd_key_ranges: one interval
of keys per query, cuda/common/key_ranges.h) through the public API: lengths and segment ids in
`flash_attention`, `flash_attention_varlen` and a contiguous KV cache (GPU only). Calls whose
masks are lengths alone run the forward on row bounds (jax_fa3_flash_fwd_row_bounds, the same
kernels deriving each row's range); every such test runs twice, on the row bounds and on the
ranges they replace (`key_form`).

Main check, tolerance-free: a padded row's real part computes exactly what the plain kernel
computes on that row alone (the same tiles in the same order; padded keys contribute exact zeros),
so out, lse and, in deterministic mode, dq / dk / dv must be bit-identical to the plain kernel on
the row's slices (where the plain forward runs the key-range kernel's key block: see
`_same_forward_tiles`) wherever the row's diagonal is its own bottom-right alignment (k_len - q_len:
varlen, the KV cache, padded self-attention). The other diagonals (flash_attention with unequal
padding under a causal or window mask) are held to the float64 oracle. Padding holds random
finite values (and NaN where the contract allows) and every output is poisoned first, so the
zeros of padded rows and keys are written, not left over. Packed documents (segment ids) are
held to the float64 oracle, forward and backward.
"""
import os

os.environ["JAX_FA3_DEBUG_POISON_OUTPUTS"] = "1"

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fa3
from jax_fa3 import _cache_attention, _local_attention
from ffi_probe import ffi_error_message
from kernel_build import skip_unless_compiled
from kernel_targets import (FLASH_BWD, FLASH_BWD_KEY_RANGES, FLASH_FWD, FLASH_FWD_DECODE,
                            FLASH_FWD_KEY_RANGES, FLASH_FWD_PAGED, FLASH_FWD_PAGED_DECODE,
                            FLASH_FWD_PAGED_ROW_BOUNDS, FLASH_FWD_ROW_BOUNDS, compiled_text,
                            kernel_targets, run_on_kernels)
from oracle import attention_oracle, attention_oracle_grads, padding_mask
from paged_cache import shuffled_pages

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _masked_kernels(monkeypatch):
  monkeypatch.setenv(_local_attention.MASKED_KERNELS_ENV, "1")


class KeyForm:
  """The forward targets of calls whose masks are lengths alone: contiguous and paged, and those
  of a decode step (one query per row)."""
  def __init__(self, fwd, paged, decode, paged_decode):
    self.fwd, self.paged = fwd, paged
    self.decode, self.paged_decode = decode, paged_decode


@pytest.fixture(params=["row_bounds", "key_ranges"])
def key_form(request, monkeypatch):
  """Row bounds and the decode targets (the default), or the per-query ranges and covers they
  replace (what a library without those targets runs, and the form of segment ids and varlen):
  a decode step then reshapes around the key-range kernels."""
  if request.param == "key_ranges":
    monkeypatch.setattr(_local_attention, "_takes_row_bounds", lambda masks, target: False)
    monkeypatch.setattr(_cache_attention, "decode_applies", lambda *args: False)
    # The partitioned ops' traces are cached across calls of one shape: drop them both ways, so
    # neither form reuses the other's program.
    jax.clear_caches()
    yield KeyForm(FLASH_FWD_KEY_RANGES, FLASH_FWD_PAGED, FLASH_FWD_KEY_RANGES, FLASH_FWD_PAGED)
    jax.clear_caches()
  else:
    yield KeyForm(FLASH_FWD_ROW_BOUNDS, FLASH_FWD_PAGED_ROW_BOUNDS, FLASH_FWD_DECODE,
                  FLASH_FWD_PAGED_DECODE)


def _normal(seed, shape, dtype=jnp.bfloat16):
  return jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32).astype(dtype)


def _loss_grad(fn, dout):
  def loss(q, k, v):
    return jnp.sum(fn(q, k, v).astype(jnp.float32) * dout.astype(jnp.float32))
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def _plain_forward_key_block(d, causal, s_k):
  """Keys per block of the plain forward kernel at (d, causal, s_k), as cuda/flash_fwd/launch.h
  picks them: d64 runs 128-key blocks (128 x 128 or 192 x 128 tiles) except without a mask at
  most 1024 keys, where 160-key blocks stay unless their last block wastes more than 5% of s_k
  beyond what 128-key blocks waste."""
  wide = _local_attention.FORWARD_KEY_BLOCK[_local_attention.head_dim_bucket(d)]
  if wide != 160:
    return wide
  tail = lambda block: -s_k % block
  if causal or s_k > 1024 or tail(160) - tail(128) > 0.05 * s_k:
    return 128
  return 160


def _same_forward_tiles(d, causal, s_k):
  """Whether the plain forward walks a row of s_k keys in the key-range kernel's blocks."""
  return _plain_forward_key_block(d, causal, s_k) == _local_attention.FORWARD_KEY_BLOCK[
      _local_attention.head_dim_bucket(d)]


def _assert_equal_or_rounding_close(got, want, exact, msg):
  """Bit for bit where both sides ran the same tiles; otherwise the two differ only by where
  float32 partial sums were rounded (other key blocks), so within two bfloat16 ulps of the
  row's scale (2^-7 of max |want|) and 2^-7 relative."""
  if exact:
    np.testing.assert_array_equal(_bits(got), _bits(want), msg)
    return
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  np.testing.assert_allclose(got, want, rtol=2.0**-7, atol=2.0**-7 * float(np.max(np.abs(want))),
                             err_msg=msg)


def _bits(x):
  return np.asarray(x).view(np.uint16)


# (s_q, s_k, q_lengths, kv_lengths): empty rows, one token, block edges (64 / 128 / 176 keys per
# tile across the buckets), all padding and no padding.
_ROWS = [
    (300, 300, [300, 1, 0, 129, 64, 200], [300, 1, 0, 129, 64, 200]),
    (257, 391, [257, 100, 1, 0, 64], [391, 391, 176, 5, 0]),
]


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("rows", range(len(_ROWS)))
def test_padded_rows_equal_the_plain_kernel_on_each_row(d, causal, rows, key_form):
  s_q, s_k, q_lens, k_lens = _ROWS[rows]
  b, h, h_k = len(q_lens), 4, 2
  q, k, v = _normal(d, (b, s_q, h, d)), _normal(d + 1, (b, s_k, h_k, d)), _normal(d + 2, (b, s_k, h_k, d))
  dout = _normal(d + 3, (b, s_q, h, d))
  skip_unless_compiled(q)
  # Rows whose diagonal is their own alignment: k_len - q_len = s_k - s_q, or no causal mask.
  same_diag = [not causal or kl - ql == s_k - s_q for ql, kl in zip(q_lens, k_lens)]
  q_len, k_len = jnp.asarray(q_lens, jnp.int32), jnp.asarray(k_lens, jnp.int32)
  kw = dict(causal=causal, deterministic=True)

  def padded(q, k, v, return_lse=True):
    return jax_fa3.flash_attention(q, k, v, query_seq_lengths=q_len, key_value_seq_lengths=k_len,
                                   return_lse=return_lse, **kw)

  out, lse = run_on_kernels(jax.jit(padded), q, k, v, expected={key_form.fwd})
  # Gradients of a call that returns no lse: an lse cotangent sends the backward to the reference.
  grads = run_on_kernels(_loss_grad(lambda *a: padded(*a, return_lse=False), dout), q, k, v,
                         expected={key_form.fwd, FLASH_BWD_KEY_RANGES})
  out, lse = np.asarray(out), np.asarray(lse)
  dq, dk, dv = (np.asarray(g) for g in grads)
  for r, (ql, kl) in enumerate(zip(q_lens, k_lens)):
    # Padding: out 0, lse +inf, zero gradients, always.
    assert not np.any(np.asarray(out[r, ql:], np.float32)), f"row {r}: padded queries' out"
    assert np.all(np.isposinf(lse[r, :, ql:])), f"row {r}: padded queries' lse"
    assert not np.any(np.asarray(dq[r, ql:], np.float32)), f"row {r}: padded queries' dq"
    assert not np.any(np.asarray(dk[r, kl:], np.float32)), f"row {r}: padded keys' dk"
    assert not np.any(np.asarray(dv[r, kl:], np.float32)), f"row {r}: padded keys' dv"
    if ql == 0 or not same_diag[r]:
      continue
    if kl == 0:  # no key: the row's real queries see nothing (the API refuses an empty k alone)
      assert not np.any(np.asarray(out[r], np.float32)) and np.all(np.isposinf(lse[r]))
      assert not np.any(np.asarray(dq[r], np.float32))
      continue
    sl = lambda x, n: x[r:r + 1, :n]
    args = (sl(q, ql), sl(k, kl), sl(v, kl))
    exact = _same_forward_tiles(d, causal, kl)
    want_out, want_lse = run_on_kernels(
        jax.jit(lambda q, k, v: jax_fa3.flash_attention(q, k, v, return_lse=True, **kw)), *args,
        expected={FLASH_FWD})
    _assert_equal_or_rounding_close(out[r:r + 1, :ql], want_out, exact, f"row {r}: out")
    if exact:
      np.testing.assert_array_equal(lse[r:r + 1, :, :ql], np.asarray(want_lse), f"row {r}: lse")
    else:
      np.testing.assert_allclose(lse[r:r + 1, :, :ql], np.asarray(want_lse), rtol=1e-5, atol=1e-5,
                                 err_msg=f"row {r}: lse")
    want = run_on_kernels(_loss_grad(lambda q, k, v: jax_fa3.flash_attention(q, k, v, **kw),
                                     sl(dout, ql)), *args, expected={FLASH_FWD, FLASH_BWD})
    # The backward reads the forward's out (D = rowsum(dO * O)): other forward tiles move it too.
    for name, got, w, n in (("dq", dq, want[0], ql), ("dk", dk, want[1], kl),
                            ("dv", dv, want[2], kl)):
      _assert_equal_or_rounding_close(got[r:r + 1, :n], w, exact, f"row {r}: {name}")


def _oracle_with_diagonals(q, k, v, q_lens, k_lens, diagonals, window, scale):
  """Float64 out and lse of a padded batch with per-row diagonals: the window mask built here,
  lengths included, handed to the oracle as its mask."""
  s_q, s_k = q.shape[1], k.shape[1]
  i = np.arange(s_q)[None, :, None]
  j = np.arange(s_k)[None, None, :]
  centre = i + np.asarray(diagonals)[:, None, None]
  mask = (i < np.asarray(q_lens)[:, None, None]) & (j < np.asarray(k_lens)[:, None, None])
  if window[0] >= 0:
    mask &= j >= centre - window[0]
  if window[1] >= 0:
    mask &= j <= centre + window[1]
  return attention_oracle(np.asarray(q, np.float32), np.asarray(k, np.float32),
                          np.asarray(v, np.float32), softmax_scale=scale, mask=mask)


@pytest.mark.parametrize("window", [(-1, 0), (40, 0), (30, 70)])
def test_unequal_padding_under_masks_matches_the_oracle(window, key_form):
  # Rows whose padding differs between queries and keys keep the arrays' alignment
  # (diagonal s_k - s_q), not their own: no plain-kernel twin, so the float64 oracle.
  b, s_q, s_k, h, d = 4, 333, 300, 4, 128
  q, k, v = _normal(1, (b, s_q, h, d)), _normal(2, (b, s_k, h, d)), _normal(3, (b, s_k, h, d))
  skip_unless_compiled(q)
  q_lens, k_lens = [333, 200, 17, 100], [300, 250, 290, 0]
  out, lse = run_on_kernels(
      jax.jit(lambda q, k, v: jax_fa3.flash_attention(
          q, k, v, window_size=window, return_lse=True,
          query_seq_lengths=jnp.asarray(q_lens, jnp.int32),
          key_value_seq_lengths=jnp.asarray(k_lens, jnp.int32))), q, k, v,
      expected={key_form.fwd})
  want_out, want_lse = _oracle_with_diagonals(q, k, v, q_lens, k_lens, [s_k - s_q] * b, window,
                                              d ** -0.5)
  got = np.asarray(out, np.float64)
  # bf16: the output's own rounding (eps 2^-8 relative) plus P rounded to bf16 before PV.
  scale = np.abs(want_out).max()
  np.testing.assert_allclose(got, want_out, atol=1e-2 * scale, rtol=0)
  empty = np.isposinf(want_lse)
  np.testing.assert_array_equal(np.isposinf(np.asarray(lse)), empty)
  np.testing.assert_allclose(np.asarray(lse)[~empty], want_lse[~empty], atol=2e-3, rtol=0)


@pytest.mark.parametrize("window", [(-1, 0), (-1, -1), (70, 0)])
@pytest.mark.parametrize("lens_q,lens_k", [([5, 130, 0, 64, 1, 300], [5, 130, 0, 64, 1, 300]),
                                           ([5, 130, 0, 64, 1, 300], [7, 100, 3, 200, 1, 0])])
def test_varlen_runs_packed_on_the_kernels(window, lens_q, lens_k):
  # The packed arrays are one row of documents (jax_fa3.varlen), each query centred on its own
  # sequence's bottom-right diagonal; no gather. Every sequence against the float64 oracle alone.
  h, h_k, d = 4, 2, 128
  cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
  cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
  tq, tk = int(cu_q[-1]), int(cu_k[-1])
  q, k, v = _normal(50, (tq, h, d)), _normal(51, (tk, h_k, d)), _normal(52, (tk, h_k, d))
  dout = _normal(53, (tq, h, d))
  skip_unless_compiled(q[None])
  cq, ck = jnp.asarray(cu_q), jnp.asarray(cu_k)
  call = lambda q, k, v, return_lse=True: jax_fa3.flash_attention_varlen(
      q, k, v, cq, ck, max(lens_q), max(lens_k), window_size=window, return_lse=return_lse)
  out, lse = run_on_kernels(jax.jit(call), q, k, v, expected={FLASH_FWD_KEY_RANGES})
  # Gradients of a call that returns no lse (an lse cotangent takes the reference backward).
  grads = run_on_kernels(_loss_grad(lambda q, k, v: call(q, k, v, return_lse=False), dout), q, k,
                         v, expected={FLASH_FWD_KEY_RANGES, FLASH_BWD_KEY_RANGES})
  options = dict(softmax_scale=d ** -0.5, window_left=window[0], window_right=window[1])
  for r in range(len(lens_q)):
    qs, ks = slice(int(cu_q[r]), int(cu_q[r + 1])), slice(int(cu_k[r]), int(cu_k[r + 1]))
    if lens_q[r] == 0:
      continue
    if lens_k[r] == 0:  # no key: out 0, lse +inf, no gradient
      assert not np.any(np.asarray(out[qs], np.float32)) and np.all(np.isposinf(lse[:, qs]))
      assert not np.any(np.asarray(grads[0][qs], np.float32))
      continue
    arrays = [np.asarray(x, np.float64)[None, sl] for x, sl in ((q, qs), (k, ks), (v, ks),
                                                                (dout, qs))]
    want_out, want_lse = attention_oracle(*arrays[:3], **options)
    np.testing.assert_allclose(np.asarray(out, np.float64)[qs], want_out[0],
                               atol=1e-2 * np.abs(want_out).max(), rtol=0, err_msg=f"seq {r}")
    empty = np.isposinf(want_lse[0])
    np.testing.assert_array_equal(np.isposinf(np.asarray(lse)[:, qs]), empty)
    np.testing.assert_allclose(np.asarray(lse)[:, qs][~empty], want_lse[0][~empty], atol=2e-3,
                               rtol=0)
    for name, got, want, sl in zip(("dq", "dk", "dv"), grads,
                                   attention_oracle_grads(*arrays, **options), (qs, ks, ks)):
      np.testing.assert_allclose(np.asarray(got, np.float64)[sl], want[0],
                                 atol=2e-2 * np.abs(want).max() + 1e-6, rtol=0,
                                 err_msg=f"{name} {r}")


def test_kv_cache_decode_reads_the_cache_in_place_on_the_masked_kernel(key_form):
  b, cap, h, h_k, d = 3, 1000, 8, 2, 128
  k_cache, v_cache = _normal(8, (b, cap, h_k, d)), _normal(9, (b, cap, h_k, d))
  q = _normal(10, (b, 1, h, d))
  skip_unless_compiled(q)
  lengths = jnp.asarray([1, 999, 517], jnp.int32)
  call = jax.jit(lambda q, kc, vc: jax_fa3.flash_attention_with_kvcache(
      q, kc, vc, cache_seqlens=lengths, causal=True))
  out = np.asarray(run_on_kernels(call, q, k_cache, v_cache, expected={key_form.decode}))
  for r, n in enumerate(np.asarray(lengths)):
    want = jax.jit(lambda q, k, v: jax_fa3.flash_attention(q, k, v, causal=True))(
        q[r:r + 1], k_cache[r:r + 1, :n], v_cache[r:r + 1, :n])
    np.testing.assert_array_equal(_bits(out[r:r + 1]), _bits(np.asarray(want)), f"row {r}")


@pytest.mark.parametrize("page_size", [128, 256])
@pytest.mark.parametrize("s_q,splits", [(1, 1), (1, 4), (4, 1)])
def test_paged_cache_is_read_in_place_bit_for_bit(page_size, s_q, splits, key_form):
  # d = 128: the key block is 128 keys, so pages of 128 and 256 are read in place by the paged
  # kernel (the same K/V blocks as the contiguous call, fetched from their pages): out and lse
  # equal the contiguous cache's bit for bit.
  b, cap, h, h_k, d = 3, 1024, 8, 2, 128
  k_cache, v_cache = _normal(60, (b, cap, h_k, d)), _normal(61, (b, cap, h_k, d))
  q = _normal(62, (b, s_q, h, d))
  skip_unless_compiled(q)
  lengths = jnp.asarray([1, 1000, 517], jnp.int32)
  (k_pool, table), (v_pool, _) = (shuffled_pages(k_cache, page_size, 63),
                                  shuffled_pages(v_cache, page_size, 63))

  def call(**layout):
    return jax.jit(lambda q, kc, vc: jax_fa3.flash_attention_with_kvcache(
        q, kc, vc, cache_seqlens=lengths, causal=True, num_splits=splits, return_lse=True,
        **layout))

  fwd, on_pages = ((key_form.decode, key_form.paged_decode) if s_q == 1
                    else (key_form.fwd, key_form.paged))
  want_out, want_lse = run_on_kernels(call(), q, k_cache, v_cache, expected={fwd})
  paged = call(page_table=table)
  got_out, got_lse = run_on_kernels(paged, q, k_pool, v_pool, expected={on_pages})
  assert fwd not in kernel_targets(compiled_text(paged, q, k_pool, v_pool))
  np.testing.assert_array_equal(_bits(got_out), _bits(want_out))
  np.testing.assert_array_equal(np.asarray(got_lse), np.asarray(want_lse))


def test_cache_batch_idx_rows_are_read_in_place_bit_for_bit(key_form):
  # Picked rows of a contiguous cache: one page of the whole capacity each (1024, a multiple of
  # the key block), read in place.
  b, cap, h, h_k, d = 3, 1024, 8, 2, 128
  k_cache, v_cache = _normal(70, (5, cap, h_k, d)), _normal(71, (5, cap, h_k, d))
  q = _normal(72, (b, 1, h, d))
  skip_unless_compiled(q)
  rows = jnp.asarray([4, 0, 2], jnp.int32)
  lengths = jnp.asarray([1000, 3, 640], jnp.int32)
  picked = jax.jit(lambda q, kc, vc: jax_fa3.flash_attention_with_kvcache(
      q, kc, vc, cache_seqlens=lengths, cache_batch_idx=rows, causal=True, num_splits=1))
  got = run_on_kernels(picked, q, k_cache, v_cache, expected={key_form.paged_decode})
  want = run_on_kernels(
      jax.jit(lambda q, kc, vc: jax_fa3.flash_attention_with_kvcache(
          q, kc, vc, cache_seqlens=lengths, causal=True, num_splits=1)),
      q, k_cache[rows], v_cache[rows], expected={key_form.decode})
  np.testing.assert_array_equal(_bits(got), _bits(want))


_PAGED_FIRST_CALL = """
import jax, jax.numpy as jnp, numpy as np
import jax_fa3
from kernel_targets import FLASH_FWD_PAGED_DECODE, run_on_kernels
q = jax.random.normal(jax.random.PRNGKey(0), (2, 1, 8, 128), jnp.float32).astype(jnp.bfloat16)
pool = jax.random.normal(jax.random.PRNGKey(1), (4, 256, 2, 128), jnp.float32).astype(jnp.bfloat16)
table = jnp.asarray([[3, 0], [1, 2]], jnp.int32)
lengths = jnp.asarray([300, 17], jnp.int32)
out = run_on_kernels(jax.jit(lambda q, kp, vp: jax_fa3.flash_attention_with_kvcache(
    q, kp, vp, cache_seqlens=lengths, page_table=table, num_splits=1)), q, pool, pool,
    expected={FLASH_FWD_PAGED_DECODE})
assert np.all(np.isfinite(np.asarray(out, np.float32)))
print("paged first call ok")
"""


def test_a_paged_cache_can_be_the_first_kernel_call_of_a_process():
  # The paged path picks the kernel by a predicate that registers nothing: the FFI call itself
  # must register the targets, or XLA finds no handler for jax_fa3_flash_fwd_paged_decode.
  import pathlib, subprocess, sys  # noqa: E401, PLC0415
  skip_unless_compiled(jnp.zeros((1, 1, 1, 128), jnp.bfloat16))
  tests = pathlib.Path(__file__).resolve().parent
  # This process's path too: a jax_fa3 imported from a source tree finds its installed extension
  # through the distribution's metadata, which may lie on PYTHONPATH (pip install --target).
  inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(
      [str(tests), str(pathlib.Path(jax_fa3.__file__).resolve().parent.parent), *inherited])}
  result = subprocess.run([sys.executable, "-c", _PAGED_FIRST_CALL], env=env, cwd=tests,
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "paged first call ok" in result.stdout


@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("blocks", [5, 30])
def test_decode_target_pieces_match_the_xla_pieces(d, paged, blocks):
  # The decode targets' results themselves: q (b, 1, h, d) read in place as the g query heads of
  # each kv head, split-KV pieces of whole key blocks made by the kernel's scheduler (1, 3 and 7
  # pieces over 5 blocks: with 7, pieces of one block and the last two empty), against
  # _decode_pieces_xla on the same bf16 values in float32. Outputs are poisoned first, so every
  # piece, empty ones included (out 0, lse +inf), must be written. GQA 8:2 causal, and MHA with
  # a left window (exact per piece: the mask is on the row's own key positions). Paged: pages
  # of one key block, shuffled, read in place. Both tiles (launch.h, decode_tile_applies): 30
  # blocks in one piece (over 2048 keys at every head dim) and 72 query heads on one kv head run
  # the 128-row tile, shorter pieces of at most 64 heads the 64-row one.
  from jax_fa3._config import AttentionConfig  # noqa: PLC0415
  block = _local_attention.forward_key_block(d)
  b, cap = 5, blocks * block
  lengths = jnp.asarray([cap, 1, block, 3 * block + 7, 0], jnp.int32)
  splits = (1, 3, 7) if blocks == 5 else (1, 4)
  for h, h_k, window in [(8, 2, (-1, 0)), (4, 4, (2 * block, -1)), (72, 1, (-1, 0))]:
    q = _normal(d + h_k, (b, 1, h, d))
    k, v = _normal(d + h_k + 1, (b, cap, h_k, d)), _normal(d + h_k + 2, (b, cap, h_k, d))
    skip_unless_compiled(q)
    cfg = AttentionConfig(softmax_scale=d ** -0.5, window_left=window[0], window_right=window[1])
    if paged:
      (k_pool, table), (v_pool, _) = shuffled_pages(k, block, d), shuffled_pages(v, block, d)
      args, target = (q, k_pool, v_pool, lengths, table), FLASH_FWD_PAGED_DECODE
    else:
      args, target = (q, k, v, lengths), FLASH_FWD_DECODE
    f32 = lambda x: x.astype(jnp.float32)
    for n in splits:
      local = _cache_attention._decode_local(
          _cache_attention.PAGED_DECODE if paged else _cache_attention.DECODE, n)
      got_out, got_lse = run_on_kernels(jax.jit(lambda *a: local(*a, cfg)), *args,
                                        expected={target})
      want_out, want_lse = jax.jit(lambda q, k, v: _cache_attention._decode_pieces_xla(
          q, k, v, lengths, cfg, n, block))(f32(q), f32(k), f32(v))
      where = f"h={h}, h_k={h_k}, window={window}, n={n}"
      assert got_out.shape == (b, n, h, d) and got_lse.shape == (b, n, h), where
      got_out, want_out = np.asarray(got_out, np.float32), np.asarray(want_out)
      got_lse, want_lse = np.asarray(got_lse), np.asarray(want_lse)
      np.testing.assert_array_equal(np.isposinf(got_lse), np.isposinf(want_lse), where)
      assert not got_out[np.isposinf(got_lse)].any(), where
      finite = np.isfinite(want_lse)
      np.testing.assert_allclose(got_lse[finite], want_lse[finite], atol=2e-3, rtol=0,
                                 err_msg=where)
      np.testing.assert_allclose(got_out, want_out, atol=1e-2 * np.abs(want_out).max(), rtol=0,
                                 err_msg=where)


def test_decode_handler_rejects_bad_calls_via_ffi_error():
  # Two queries per row, split counts outside [1, 1024], results of the wrong shape and lengths
  # that are not one per row, each refused by name. (The results stay non-empty: XLA drops a
  # call whose results are empty.)
  for s_q, n, pieces, lengths, expected in [(2, 1, 1, "(2,)", "one query per row"),
                                            (1, 0, 1, "(2,)", "num_splits must be in"),
                                            (1, 5000, 5000, "(2,)", "num_splits must be in"),
                                            (1, 2, 3, "(2,)", "shape (b, num_splits, h, d)"),
                                            (1, 1, 1, "(2, 3)", "lengths")]:
    message = ffi_error_message(f"""
      q = jnp.ones((2, {s_q}, 8, 128), jnp.bfloat16)
      k = jnp.ones((2, 256, 2, 128), jnp.bfloat16)
      call = jax.ffi.ffi_call("jax_fa3_flash_fwd_decode", (
          jax.ShapeDtypeStruct((2, {pieces}, 8, 128), q.dtype),
          jax.ShapeDtypeStruct((2, {pieces}, 8), jnp.float32)))
      result = lambda: call(q, k, k, jnp.zeros({lengths}, jnp.int32),
                            softmax_scale=np.float32(0.125), softcap=np.float32(0),
                            window_left=np.int32(-1), window_right=np.int32(0),
                            num_splits=np.int32({n}))
    """)
    assert expected in message, message


def test_pages_smaller_than_the_key_block_are_gathered(key_form):
  b, cap, h, h_k, d = 2, 512, 4, 4, 128
  k_cache, v_cache = _normal(80, (b, cap, h_k, d)), _normal(81, (b, cap, h_k, d))
  q = _normal(82, (b, 1, h, d))
  skip_unless_compiled(q)
  (k_pool, table), (v_pool, _) = shuffled_pages(k_cache, 64, 83), shuffled_pages(v_cache, 64, 83)
  lengths = jnp.asarray([512, 100], jnp.int32)
  call = jax.jit(lambda q, kc, vc: jax_fa3.flash_attention_with_kvcache(
      q, kc, vc, cache_seqlens=lengths, page_table=table, num_splits=1))
  got = run_on_kernels(call, q, k_pool, v_pool, expected={key_form.decode})
  assert key_form.paged_decode not in kernel_targets(compiled_text(call, q, k_pool, v_pool))
  want = jax.jit(lambda q, kc, vc: jax_fa3.flash_attention_with_kvcache(
      q, kc, vc, cache_seqlens=lengths, num_splits=1))(q, k_cache, v_cache)
  np.testing.assert_array_equal(_bits(got), _bits(want))


def test_paged_handler_rejects_a_page_size_the_kernel_cannot_read():
  # d = 128 reads pages of multiples of 128 keys: 64 is refused by name.
  message = ffi_error_message("""
    q = jnp.ones((2, 1, 4, 128), jnp.bfloat16)
    pool = jnp.ones((6, 64, 4, 128), jnp.bfloat16)
    call = jax.ffi.ffi_call("jax_fa3_flash_fwd_paged", (
        jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((2, 4, 1), jnp.float32)))
    result = lambda: call(q, pool, pool, jnp.zeros((2, 128, 2), jnp.int32),
                          jnp.zeros((2, 2, 4), jnp.int32), jnp.zeros((2, 3), jnp.int32),
                          softmax_scale=np.float32(0.125), softcap=np.float32(0),
                          window_left=np.int32(-1), window_right=np.int32(0))
  """)
  assert "page_size" in message and "128" in message, message


def test_nan_in_padded_queries_and_keys_stays_out_of_real_rows(key_form):
  # The forward's contract: padded query and key positions may hold anything (an uninitialised
  # cache); padded values must be finite (0 * NaN in the PV product is NaN, as in any dense
  # formulation).
  b, s, h, d = 2, 256, 4, 64
  q, k, v = _normal(11, (b, s, h, d)), _normal(12, (b, s, h, d)), _normal(13, (b, s, h, d))
  skip_unless_compiled(q)
  lens = jnp.asarray([100, 256], jnp.int32)
  q_nan = q.at[0, 100:].set(jnp.nan)
  k_nan = k.at[0, 100:].set(jnp.nan)
  call = jax.jit(lambda q, k, v: jax_fa3.flash_attention(
      q, k, v, causal=True, query_seq_lengths=lens, key_value_seq_lengths=lens))
  clean = np.asarray(run_on_kernels(call, q, k, v, expected={key_form.fwd}))
  dirty = np.asarray(call(q_nan, k_nan, v))
  np.testing.assert_array_equal(_bits(dirty), _bits(clean))
  assert not np.any(np.asarray(dirty[0, 100:], np.float32))


@pytest.mark.parametrize("causal", [False, True])
def test_split_kv_decode_matches_the_unsplit_call(causal, key_form):
  # Split-KV (jax_fa3._cache_attention): pieces of whole key blocks, made by the decode target's
  # scheduler (or, on the ranges, batch rows of the masked kernel), merged by lse. The pieces'
  # outputs are rounded to bf16 before the merge, so the merged out may differ from the unsplit
  # call by a few bf16 roundings of its magnitude.
  b, cap, h, h_k, d = 2, 4096, 16, 2, 128
  k_cache, v_cache = _normal(20, (b, cap, h_k, d)), _normal(21, (b, cap, h_k, d))
  q = _normal(22, (b, 1, h, d))
  skip_unless_compiled(q)
  lengths = jnp.asarray([4000, 1300], jnp.int32)

  def call(splits):
    return jax.jit(lambda q, kc, vc: jax_fa3.flash_attention_with_kvcache(
        q, kc, vc, cache_seqlens=lengths, causal=causal, num_splits=splits, return_lse=True))

  out1, lse1 = run_on_kernels(call(1), q, k_cache, v_cache, expected={key_form.decode})
  out8, lse8 = run_on_kernels(call(8), q, k_cache, v_cache, expected={key_form.decode})
  out1, out8 = np.asarray(out1, np.float32), np.asarray(out8, np.float32)
  np.testing.assert_allclose(out8, out1, atol=4 * 2**-8 * np.abs(out1).max(), rtol=0)
  np.testing.assert_allclose(np.asarray(lse8), np.asarray(lse1), atol=1e-4, rtol=1e-5)


def _documents(s, lengths):
  """Segment ids of documents of these lengths packed from position 0, the rest padding (id 0)."""
  ids = np.zeros(s, np.int32)
  at = 0
  for doc, n in enumerate(lengths, start=1):
    ids[at:at + n] = doc
    at += n
  return ids


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (50, 0)])
def test_packed_documents_match_the_oracle(d, window):
  # Documents of 1 token, across tile edges, a whole row, and padding after them (its own id,
  # so padding tokens attend to one another, as the masks' rule says).
  s, h, h_k = 400, 4, 2
  seg = np.stack([_documents(s, [130, 1, 63, 129, 20]), _documents(s, [400]),
                  _documents(s, [1] * 5 + [300])])
  b = len(seg)
  q, k, v = _normal(d + 30, (b, s, h, d)), _normal(d + 31, (b, s, h_k, d)), _normal(d + 32, (b, s, h_k, d))
  dout = _normal(d + 33, (b, s, h, d))
  skip_unless_compiled(q)
  ids = jnp.asarray(seg)
  kw = dict(window_size=window, q_segment_ids=ids, kv_segment_ids=ids)
  out, lse = run_on_kernels(
      jax.jit(lambda q, k, v: jax_fa3.flash_attention(q, k, v, return_lse=True, **kw)), q, k, v,
      expected={FLASH_FWD_KEY_RANGES})
  grads = run_on_kernels(_loss_grad(lambda q, k, v: jax_fa3.flash_attention(q, k, v, **kw), dout),
                         q, k, v, expected={FLASH_FWD_KEY_RANGES, FLASH_BWD_KEY_RANGES})
  mask = padding_mask(s, s, q_segment_ids=seg, kv_segment_ids=seg)
  options = dict(softmax_scale=d ** -0.5, window_left=window[0], window_right=window[1],
                 mask=mask)
  arrays = [np.asarray(x, np.float64) for x in (q, k, v, dout)]
  want_out, want_lse = attention_oracle(*arrays[:3], **options)
  # bf16: the output's rounding (2^-8 relative) and P, dS rounded to bf16 before their GEMMs: a
  # few roundings of each tensor's magnitude.
  np.testing.assert_allclose(np.asarray(out, np.float64), want_out,
                             atol=1e-2 * np.abs(want_out).max(), rtol=0)
  np.testing.assert_allclose(np.asarray(lse), want_lse, atol=2e-3, rtol=0)
  for name, got, want in zip(("dq", "dk", "dv"), grads, attention_oracle_grads(*arrays, **options)):
    np.testing.assert_allclose(np.asarray(got, np.float64), want,
                               atol=2e-2 * np.abs(want).max(), rtol=0, err_msg=name)


def test_unordered_segment_ids_run_on_the_kernels_and_split_ones_on_the_reference():
  # Each id one contiguous run, in any order (the kernels' case), against an id split in two
  # (decided on the device: the reference path runs instead). Both match the oracle.
  s, h, d = 256, 2, 64
  q, k, v = _normal(40, (1, s, h, d)), _normal(41, (1, s, h, d)), _normal(42, (1, s, h, d))
  skip_unless_compiled(q)
  runs = np.repeat(np.array([5, 2, 9, 0], np.int32), 64)[None]
  split = np.tile(np.repeat(np.array([1, 2], np.int32), 32), 4)[None]
  for seg in (runs, split):
    ids = jnp.asarray(seg)
    call = jax.jit(lambda q, k, v: jax_fa3.flash_attention(
        q, k, v, causal=True, q_segment_ids=ids, kv_segment_ids=ids))
    out = run_on_kernels(call, q, k, v, expected={FLASH_FWD_KEY_RANGES})
    want, _ = attention_oracle(*(np.asarray(x, np.float64) for x in (q, k, v)),
                               softmax_scale=d ** -0.5, window_right=0,
                               mask=padding_mask(s, s, q_segment_ids=seg, kv_segment_ids=seg))
    np.testing.assert_allclose(np.asarray(out, np.float64), want, atol=1e-2 * np.abs(want).max(),
                               rtol=0)


@pytest.mark.parametrize("target,extra_args", [
    ("jax_fa3_flash_fwd_key_ranges", ""),
    ("jax_fa3_flash_bwd_key_ranges", "q, q, lse, "),
])
def test_ffi_handlers_reject_bad_key_ranges(target, extra_args):
  # s_q = 8: ranges (2, 128, 2) and covers (2, 2, 4). Unpadded ranges, int64 ranges and covers of
  # the wrong shape: an InvalidArgument naming the operand.
  good_ranges, good_covers = "jnp.zeros((2, 128, 2), jnp.int32)", "jnp.zeros((2, 2, 4), jnp.int32)"
  for ranges, covers, name in (("jnp.zeros((2, 8, 2), jnp.int32)", good_covers, "key_ranges"),
                               ("np.zeros((2, 128, 2), np.int64)", good_covers, "key_ranges"),
                               (good_ranges, "jnp.zeros((2, 1, 4), jnp.int32)", "key_covers")):
    results = ("(jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((2, 4, 8), "
               "jnp.float32))" if "fwd" in target else
               "(jax.ShapeDtypeStruct(q.shape, q.dtype),) * 3 + "
               "(jax.ShapeDtypeStruct((1 << 20,), jnp.uint8),)")
    bwd_attrs = "" if "fwd" in target else ", deterministic=np.bool_(False)"
    message = ffi_error_message(f"""
      jax.config.update("jax_enable_x64", True)
      q = jnp.ones((2, 8, 4, 64), jnp.bfloat16)
      lse = jnp.zeros((2, 4, 8), jnp.float32)
      call = jax.ffi.ffi_call("{target}", {results})
      result = lambda: call(q, q, q, {extra_args}{ranges}, {covers},
                            softmax_scale=np.float32(0.125), softcap=np.float32(0),
                            window_left=np.int32(-1), window_right=np.int32(-1){bwd_attrs})
    """)
    assert name in message, message


@pytest.mark.parametrize("d", [64, 128, 256])
def test_row_bounds_equal_the_key_ranges_bit_for_bit(d):
  # The masks of tests/key_range_cases.py that are one (q_len, k_len, diag) per row (padding,
  # diagonals past both ends, every window): the forward on row bounds and on the ranges built
  # from the same masks run the same kernel over the same keys per row, so out and lse agree bit
  # for bit; and with the float64 oracle within bf16's rounding.
  from jax_fa3._config import AttentionConfig  # noqa: PLC0415
  from key_range_cases import cases, visible  # noqa: PLC0415
  h, h_k = 4, 2
  skip_unless_compiled(jnp.zeros((1, 1, 1, d), jnp.bfloat16))
  ran = 0
  for c, (name, masks, s_q, s_k, wl, wr, _) in enumerate(cases()):
    if len(masks) != 3 or np.ndim(masks[2]) != 1:
      continue
    b = len(masks[0])
    q = _normal(3 * c, (b, s_q, h, d))
    k, v = _normal(3 * c + 1, (b, s_k, h_k, d)), _normal(3 * c + 2, (b, s_k, h_k, d))
    cfg = AttentionConfig(softmax_scale=d ** -0.5, window_left=wl, window_right=wr)
    args = (q, k, v, *(jnp.asarray(m, jnp.int32) for m in masks))
    call = jax.jit(lambda *a: _local_attention.forward_local_masked(*a, cfg))
    got_out, got_lse = run_on_kernels(call, *args, expected={FLASH_FWD_ROW_BOUNDS})
    with pytest.MonkeyPatch.context() as patch:
      patch.setattr(_local_attention, "_takes_row_bounds", lambda masks, target: False)
      jax.clear_caches()  # as in key_form
      ranges = jax.jit(lambda *a: _local_attention.forward_local_masked(*a, cfg))
      want_out, want_lse = run_on_kernels(ranges, *args, expected={FLASH_FWD_KEY_RANGES})
    jax.clear_caches()
    where = f"{name}, window ({wl}, {wr})"
    np.testing.assert_array_equal(_bits(got_out), _bits(want_out), where)
    np.testing.assert_array_equal(np.asarray(got_lse), np.asarray(want_lse), where)
    mask = visible(masks, s_q, s_k, wl, wr)
    oracle_out, _ = attention_oracle(*(np.asarray(x, np.float64) for x in (q, k, v)),
                                     softmax_scale=d ** -0.5, mask=mask)
    scale = max(float(np.abs(oracle_out).max()), 1e-30)
    np.testing.assert_allclose(np.asarray(got_out, np.float64), oracle_out, atol=1e-2 * scale,
                               rtol=0, err_msg=where)
    ran += 1
  assert ran >= 10


def test_ffi_handler_rejects_bad_row_bounds():
  # Row bounds are int32 (b, 3): a missing column, int64 and another batch are each refused by
  # name.
  for bounds, expected in (("jnp.zeros((2, 2), jnp.int32)", "(b, 3)"),
                           ("np.zeros((2, 3), np.int64)", "must be int32, got int64"),
                           ("jnp.zeros((3, 3), jnp.int32)", "(b, 3)")):
    message = ffi_error_message(f"""
      jax.config.update("jax_enable_x64", True)
      q = jnp.ones((2, 8, 4, 64), jnp.bfloat16)
      call = jax.ffi.ffi_call("jax_fa3_flash_fwd_row_bounds", (
          jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((2, 4, 8), jnp.float32)))
      result = lambda: call(q, q, q, {bounds}, softmax_scale=np.float32(0.125),
                            softcap=np.float32(0), window_left=np.int32(-1),
                            window_right=np.int32(-1))
    """)
    assert "row_bounds" in message and expected in message, message
