"""The bf16/fp16 forward kernel against the float64 oracle on fresh random data (GPU only).

Every check compiles the call, asserts that the program calls `jax_fa3_flash_fwd`
(tests/kernel_targets.py: a pure-JAX fallback fails), and holds the output and LSE to
FlashAttention-3's criterion (tests/fa3_criterion.py): error vs the float64 oracle at most 2x
that of naive attention in the same dtype, plus two roundings of the output's magnitude. Rows
that see no key must give exactly 0 and LSE +inf.
"""

import os

# Every kernel output is filled with NaN bytes before the kernel runs (see cuda/ffi/ffi_common.h),
# so an element the kernel never writes fails the finiteness and value checks below.
os.environ["JAX_FA3_DEBUG_POISON_OUTPUTS"] = "1"

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fa3
from fa3_criterion import check_forward, check_output
from ffi_probe import ffi_error_message
from kernel_build import skip_unless_compiled
from kernel_targets import FLASH_FWD, compile_on_kernels, kernel_targets
from oracle import keys_seen_per_row

pytestmark = pytest.mark.gpu


def _inputs(seed, b, s_q, s_k, h, h_k, d, dtype):
  keys = jax.random.split(jax.random.PRNGKey(seed), 3)
  q = jax.random.normal(keys[0], (b, s_q, h, d), jnp.float32).astype(dtype)
  k = jax.random.normal(keys[1], (b, s_k, h_k, d), jnp.float32).astype(dtype)
  v = jax.random.normal(keys[2], (b, s_k, h_k, d), jnp.float32).astype(dtype)
  return q, k, v


def _check_forward(q, k, v, dtype, **kw):
  skip_unless_compiled(q)
  assert q.dtype == dtype
  fn = jax.jit(lambda q, k, v: jax_fa3.flash_attention(q, k, v, return_lse=True, **kw))
  compiled = compile_on_kernels(fn, q, k, v, expected=FLASH_FWD)
  out, lse = compiled(q, k, v)
  out2, lse2 = compiled(q, k, v)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(out2))  # same inputs, same bits
  np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse2))
  assert out.dtype == dtype and out.shape == q.shape
  assert lse.dtype == jnp.float32 and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
  check_forward(out, lse, q, k, v, **kw)


SEQLENS = [(1, 1), (63, 63), (65, 65), (1000, 1000), (4097, 4097), (128, 1000), (1000, 128),
           (1, 4097)]


@pytest.mark.parametrize("s_q,s_k", SEQLENS)
@pytest.mark.parametrize("causal", [False, True])
def test_forward_seqlens(s_q, s_k, causal):
  q, k, v = _inputs(s_q * 7 + s_k, 2, s_q, s_k, 4, 4, 128, jnp.bfloat16)
  _check_forward(q, k, v, jnp.bfloat16, causal=causal)


@pytest.mark.parametrize("d", [64, 96, 128, 192, 256, 40, 80, 136])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_forward_head_dims_and_dtypes(d, dtype):
  q, k, v = _inputs(d, 2, 333, 517, 4, 2, d, dtype)
  _check_forward(q, k, v, dtype, causal=d % 64 == 0)


@pytest.mark.parametrize("s_q,s_k,window", [
    (300, 2048, (-1, 0)), (300, 2049, (-1, 0)), (193, 2049, (300, 0)), (300, 8193, (-1, 0)),
    (300, 1024, (-1, -1)), (193, 1025, (-1, -1)), (385, 1000, (-1, -1)), (300, 3000, (-1, -1))])
def test_forward_d64_tile_choice(s_q, s_k, window):
  # d64 runs 128 x 128, 128 x 160 or 192 x 128 tiles by mask and s_k (cuda/flash_fwd/launch.h):
  # both sides of each threshold (2048 keys masked, 1024 without), with query counts that end
  # in a partial 192-row tile (193, 300, 385).
  q, k, v = _inputs(s_k + s_q, 1, s_q, s_k, 4, 2, 64, jnp.bfloat16)
  _check_forward(q, k, v, jnp.bfloat16, window_size=window)


@pytest.mark.parametrize("window", [(64, 0), (100, 30), (-1, 17), (0, 0)])
def test_forward_windows(window):
  q, k, v = _inputs(3, 1, 700, 900, 8, 2, 128, jnp.bfloat16)
  _check_forward(q, k, v, jnp.bfloat16, window_size=window)


@pytest.mark.parametrize("h,h_k", [(8, 1), (8, 2), (6, 6)])
@pytest.mark.parametrize("softcap", [0.0, 15.0])
def test_forward_gqa_softcap(h, h_k, softcap):
  q, k, v = _inputs(h * 10 + h_k, 3, 257, 257, h, h_k, 64, jnp.bfloat16)
  _check_forward(q, k, v, jnp.bfloat16, causal=True, softcap=softcap)


@pytest.mark.parametrize("b,h,s,causal", [(1, 1, 2048, False), (64, 16, 512, True),
                                          (13, 17, 384, True), (3, 5, 2560, True)])
def test_forward_grid_sizes(b, h, s, causal):
  # One tile (most SMs idle) and far more tiles than SMs (persistent scheduling wraps around).
  # Causal tiles run in pairs (cuda/flash_fwd/tile_scheduler.h); 13 x 17 heads of 3 m_blocks on
  # 132 SMs walk every branch of the pair order: whole double rounds of pairs within one head and
  # of two heads' middle tiles, then CTAs that take a pair over the last two rounds, CTAs with
  # one tile, and the lone middle tile. 3 x 5 heads of 20 m_blocks leave 18 pairs for a tail of
  # single tiles on 132 SMs, which then takes central pairs (three heads give two, the rest one).
  q, k, v = _inputs(b + h, b, s, s, h, h, 128, jnp.bfloat16)
  _check_forward(q, k, v, jnp.bfloat16, causal=causal)


def test_forward_under_vmap_folds_into_batch():
  q, k, v = _inputs(11, 2, 130, 130, 2, 2, 128, jnp.bfloat16)
  skip_unless_compiled(q)
  stacked = [jnp.stack([x, x[::-1]]) for x in (q, k, v)]
  fn = jax.jit(jax.vmap(lambda q, k, v: jax_fa3.flash_attention(q, k, v, causal=True)))
  assert kernel_targets(fn.lower(*stacked).compile().as_text()) == {FLASH_FWD: 1}  # one launch
  out = fn(*stacked)
  np.testing.assert_array_equal(np.asarray(out[0]),
                                np.asarray(jax_fa3.flash_attention(q, k, v, causal=True)))
  check_output(out[1], *(x[1] for x in stacked), causal=True)


def test_ffi_handler_rejects_bad_shapes():
  message = ffi_error_message("""
    q = jnp.ones((1, 8, 4, 64), jnp.bfloat16)
    k = jnp.ones((1, 8, 3, 64), jnp.bfloat16)   # 4 query heads are not a multiple of 3
    call = jax.ffi.ffi_call("jax_fa3_flash_fwd", (jax.ShapeDtypeStruct(q.shape, q.dtype),
                                                  jax.ShapeDtypeStruct((1, 4, 8), jnp.float32)))
    result = lambda: call(q, k, k, softmax_scale=np.float32(0.125), softcap=np.float32(0),
                          window_left=np.int32(-1), window_right=np.int32(-1))
  """)
  assert "head" in message


@pytest.mark.parametrize("softmax_scale", [0.05, 0.3])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_forward_softmax_scale(softmax_scale, dtype):
  # 0.3 at d = 128 is 3.4x the default: peaked rows (the online max moves a lot); 0.05 flat ones.
  q, k, v = _inputs(int(softmax_scale * 100), 2, 300, 450, 4, 2, 128, dtype)
  _check_forward(q, k, v, dtype, softmax_scale=softmax_scale)
  _check_forward(q, k, v, dtype, softmax_scale=softmax_scale, causal=True, softcap=10.0)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("options", [dict(causal=True), dict(window_size=(0, 0)),
                                     dict(window_size=(5, 0), softcap=8.0)])
def test_forward_rows_with_no_key_and_one_key(dtype, options):
  # s_q > s_k, bottom-right aligned: with causal the first s_q - s_k rows see no key and the next
  # one sees exactly key 0; window (0, 0) gives every visible row exactly one key.
  s_q, s_k = 300, 120
  seen = keys_seen_per_row(s_q, s_k, **options)
  assert (seen == 0).any() and (seen == 1).any()  # the case covers both kinds of rows
  q, k, v = _inputs(s_q + s_k, 2, s_q, s_k, 4, 4, 64, dtype)
  _check_forward(q, k, v, dtype, **options)
