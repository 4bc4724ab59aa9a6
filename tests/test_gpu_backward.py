"""The bf16/fp16 backward kernel: jax.grad through flash_attention against the float64 oracle's
gradients (GPU only).

Every check compiles the gradient, asserts that the program calls both `jax_fa3_flash_fwd` and
`jax_fa3_flash_bwd` (tests/kernel_targets.py: a pure-JAX fallback fails), and holds dq, dk, dv
to FlashAttention-3's criterion (tests/fa3_criterion.py): error vs the float64 oracle at most 2x
that of naive backprop in the same dtype, plus two roundings of the gradient's magnitude.
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
from fa3_criterion import check_grads
from kernel_build import skip_unless_compiled
from kernel_targets import FLASH_BWD, FLASH_FWD, run_on_kernels

pytestmark = pytest.mark.gpu


def _inputs(seed, b, s_q, s_k, h, h_k, d, dtype):
  keys = jax.random.split(jax.random.PRNGKey(seed), 4)
  shape_q, shape_k = (b, s_q, h, d), (b, s_k, h_k, d)
  make = lambda key, shape: jax.random.normal(key, shape, jnp.float32).astype(dtype)
  return (make(keys[0], shape_q), make(keys[1], shape_k), make(keys[2], shape_k),
          make(keys[3], shape_q))


def _grad_fn(do, **kw):
  def loss(q, k, v):
    out = jax_fa3.flash_attention(q, k, v, **kw)
    return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32))
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def _check_backward(q, k, v, do, dtype, **kw):
  """Runs the kernels' gradient (the backward kernel's target asserted) and checks it."""
  skip_unless_compiled(q)
  assert q.dtype == dtype
  grads = run_on_kernels(_grad_fn(do, **kw), q, k, v, expected={FLASH_FWD, FLASH_BWD})
  check_grads(grads, q, k, v, do, **kw)
  return grads


def _check_repeats_bit_for_bit(q, k, v, do, dtype, **kw):
  """Checks the kernels' gradient once, then requires two more runs to reproduce it bit for bit."""
  first = _check_backward(q, k, v, do, dtype, **kw)
  again = _grad_fn(do, **kw)
  for _ in range(2):
    for a, b in zip(first, again(q, k, v)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("s_q,s_k", [(1, 1), (63, 63), (65, 65), (1000, 1000), (128, 1000),
                                     (1000, 128), (4097, 4097), (1, 4097), (4097, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_backward_seqlens(s_q, s_k, causal):
  q, k, v, do = _inputs(s_q + 3 * s_k, 2, s_q, s_k, 4, 4, 128, jnp.bfloat16)
  _check_backward(q, k, v, do, jnp.bfloat16, causal=causal)


@pytest.mark.parametrize("d", [64, 96, 128, 192, 256, 40])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_backward_head_dims_and_dtypes(d, dtype):
  q, k, v, do = _inputs(d, 2, 257, 391, 4, 2, d, dtype)
  _check_backward(q, k, v, do, dtype, causal=d % 64 == 0)


@pytest.mark.parametrize("window,softcap", [((64, 0), 0.0), ((100, 30), 0.0), ((-1, -1), 20.0)])
@pytest.mark.parametrize("h,h_k", [(8, 2), (8, 1)])
def test_backward_window_softcap_gqa(window, softcap, h, h_k):
  q, k, v, do = _inputs(h_k, 1, 500, 700, h, h_k, 64, jnp.bfloat16)
  _check_backward(q, k, v, do, jnp.bfloat16, window_size=window, softcap=softcap)


@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_deterministic_backward_matches_the_oracle_and_repeats_bit_for_bit(d, dtype):
  # GQA (dk, dv summed over a head group) and s_k not a multiple of any tile: the deterministic
  # accumulation order covers the partial tiles and the group reduction.
  q, k, v, do = _inputs(5 + d, 2, 700, 700, 8, 2, d, dtype)
  kw = dict(causal=True, deterministic=True)
  _check_repeats_bit_for_bit(q, k, v, do, dtype, **kw)


# d = 128 without a mask, at least 1024 queries, more than one kv head: the kernel with 80-row Q
# blocks, dQ computed transposed and dS stored by stmatrix.trans (cuda/flash_bwd/params.h,
# wide_q_blocks). s_q not a multiple of 80 leaves a partial last Q block; d = 120 runs the
# bucket with zero-filled columns.
@pytest.mark.parametrize("s_q,s_k,d", [(1024, 1024, 128), (1103, 1300, 128), (2000, 777, 128),
                                       (1201, 1201, 120)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_backward_80_row_q_blocks(s_q, s_k, d, dtype):
  q, k, v, do = _inputs(s_q + s_k + d, 2, s_q, s_k, 8, 2, d, dtype)
  _check_backward(q, k, v, do, dtype)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_deterministic_backward_80_row_q_blocks_repeats_bit_for_bit(dtype):
  q, k, v, do = _inputs(11, 2, 1100, 900, 8, 2, 128, dtype)
  kw = dict(deterministic=True)
  _check_repeats_bit_for_bit(q, k, v, do, dtype, **kw)


# Causal problems whose kv heads' Q + dO + fp32 dQ exceed the L2 budget launch longest first in
# sections of kv heads (cuda/flash_bwd/tile_order.h): here 12 kv heads of 8 MiB each (32 query
# heads per kv head at d = 128, 16 at d = 256; 256 queries, since the float64 oracle's time grows
# with the b * h * s^2 scores) make two sections of 6 per batch row (tests/cuda/
# check_bwd_tile_order.cu checks that choice for these shapes).
@pytest.mark.parametrize("b,d,h", [(1, 128, 384), (2, 256, 192)])
def test_backward_longest_first_in_sections(b, d, h):
  q, k, v, do = _inputs(d + h, b, 256, 256, h, 12, d, jnp.bfloat16)
  _check_backward(q, k, v, do, jnp.bfloat16, causal=True)


def test_deterministic_backward_in_sections_repeats_bit_for_bit():
  q, k, v, do = _inputs(5, 1, 256, 256, 384, 12, 128, jnp.bfloat16)
  _check_repeats_bit_for_bit(q, k, v, do, jnp.bfloat16, causal=True, deterministic=True)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_backward_softmax_scale(dtype):
  q, k, v, do = _inputs(77, 2, 333, 400, 4, 2, 128, dtype)
  _check_backward(q, k, v, do, dtype, softmax_scale=0.3)
  _check_backward(q, k, v, do, dtype, softmax_scale=0.05, causal=True, softcap=10.0)
