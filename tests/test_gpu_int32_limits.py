"""Where 32-bit arithmetic could break the kernels (GPU only): tensors past 2^31 elements through
every kernel (~5 GB per bf16 tensor), and window bounds near 2^31.

Each test runs the kernel on a tensor whose last elements sit beyond element 2^31, so an offset
computed in 32 bits would read or write the wrong place, and compares the tail of the result with
the same kernel run on the tail alone (small offsets). Batch entries are independent and the
kernels' arithmetic per (batch, head) does not depend on the batch size, so those comparisons are
exact; the long-sequence case compares rows whose key windows differ in block alignment, with a
bound far below what a wrong row or key would give (outputs are means of unit normals: ~0.1).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fa3
from kernel_build import skip_unless_compiled
from kernel_targets import (FLASH_BWD, FLASH_FWD, FLASH_FWD_FP8, HADAMARD, ROTATE_QUANTIZE_FP8,
                            run_on_kernels)

pytestmark = pytest.mark.gpu

_BIG = 2**31


def _normal(seed, shape, dtype=jnp.bfloat16):
  return jax.random.normal(jax.random.PRNGKey(seed), shape, dtype)


def _qkv(shape):
  assert np.prod(shape) > _BIG, shape
  return _normal(0, shape), _normal(1, shape), _normal(2, shape)


def _equal(got, want):
  np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)),
                                np.asarray(want.astype(jnp.float32)))


# (batch, seqlen, heads, head_dim) = 1040 * 2048 * 8 * 128 = 2.18e9 elements per tensor.
_BATCHED = (1040, 2048, 8, 128)


def test_forward_past_2_31_elements_in_the_batch():
  q, k, v = _qkv(_BATCHED)
  skip_unless_compiled(q)
  fn = lambda q, k, v: jax_fa3.flash_attention(q, k, v, causal=True, return_lse=True)
  out, lse = run_on_kernels(fn, q, k, v, expected=FLASH_FWD)
  tail_out, tail_lse = run_on_kernels(fn, q[-2:], k[-2:], v[-2:], expected=FLASH_FWD)
  _equal(out[-2:], tail_out)
  _equal(lse[-2:], tail_lse)


def test_forward_past_2_31_elements_in_one_sequence():
  s, w, n = 2_400_000, 127, 1024   # 1 * 2.4e6 * 8 * 128 = 2.46e9 elements per tensor
  q, k, v = _qkv((1, s, 8, 128))
  skip_unless_compiled(q)
  fn = lambda q, k, v: jax_fa3.flash_attention(q, k, v, window_size=(w, 0), return_lse=True)
  out, lse = run_on_kernels(fn, q, k, v, expected=FLASH_FWD)
  # The last n rows see keys [i - w, i]: the same keys as in this slice, bottom-right aligned.
  tail_out, tail_lse = run_on_kernels(fn, q[:, -n:], k[:, -(n + w):], v[:, -(n + w):],
                                      expected=FLASH_FWD)
  # The two calls tile the same keys differently, so their fp32 sums differ in order and the bf16
  # outputs may differ by one ulp (2^-7 relative at most; seen once in 10^6 on the H200); a wrong
  # row or key gives errors of ~0.1.
  np.testing.assert_allclose(np.asarray(out[:, -n:], np.float32), np.asarray(tail_out, np.float32),
                             atol=2e-3, rtol=2**-7)
  np.testing.assert_allclose(np.asarray(lse[:, :, -n:]), np.asarray(tail_lse), atol=1e-4, rtol=0)


def test_backward_past_2_31_elements():
  q, k, v = _qkv(_BATCHED)
  do = _normal(3, _BATCHED)
  skip_unless_compiled(q)

  def grads(q, k, v, do):
    # Deterministic: dQ's fp32 adds in a fixed order, so the two runs can agree bit for bit.
    _, vjp = jax.vjp(lambda q, k, v: jax_fa3.flash_attention(q, k, v, causal=True,
                                                               deterministic=True), q, k, v)
    return vjp(do)

  dq, dk, dv = run_on_kernels(grads, q, k, v, do, expected=(FLASH_FWD, FLASH_BWD))
  tail = run_on_kernels(grads, q[-2:], k[-2:], v[-2:], do[-2:], expected=(FLASH_FWD, FLASH_BWD))
  for got, want in zip((dq, dk, dv), tail):
    _equal(got[-2:], want)


def test_fp8_forward_past_2_31_elements(monkeypatch):
  # One tile never split in one call and whole in the other (the split changes only the order of
  # O's adds, but that is enough to break bit equality).
  monkeypatch.setenv("JAX_FA3_FP8_TAIL_SPLIT", "0")
  q, k, v = _qkv(_BATCHED)
  skip_unless_compiled(q)
  key = jax.random.PRNGKey(7)
  fn = lambda q, k, v: jax_fa3.flash_attention_fp8(q, k, v, causal=True, key=key,
                                                   return_lse=True)
  fp8_kernels = (FLASH_FWD_FP8, ROTATE_QUANTIZE_FP8)
  out, lse = run_on_kernels(fn, q, k, v, expected=fp8_kernels)
  tail_out, tail_lse = run_on_kernels(fn, q[-2:], k[-2:], v[-2:], expected=fp8_kernels)
  _equal(out[-2:], tail_out)
  _equal(lse[-2:], tail_lse)


def test_quantize_fp8_past_2_31_elements():
  x = _normal(4, _BATCHED)
  fn = lambda x: jax_fa3.quantize_fp8(x)
  values, scales = run_on_kernels(fn, x, expected=ROTATE_QUANTIZE_FP8)
  tail_values, tail_scales = run_on_kernels(fn, x[-2:], expected=ROTATE_QUANTIZE_FP8)
  _equal(values[-2:], tail_values)
  _equal(scales[-2:], tail_scales)


def test_hadamard_past_2_31_elements():
  x = _normal(5, (17_000_000, 128))   # 2.18e9 elements
  fn = lambda x: jax_fa3.hadamard_transform(x)
  y = run_on_kernels(fn, x, expected=HADAMARD)
  _equal(y[-1000:], run_on_kernels(fn, x[-1000:], expected=HADAMARD))


@pytest.mark.parametrize("window", [(2**31 - 1, 0), (2**31 - 1, 2**31 - 1), (5, 2**31 - 1)])
def test_backward_window_past_every_key_is_unbounded(window):
  """A bound of s_q + s_k or more is the unbounded side (-1); the backward's block ranges add it
  to row offsets in int32, so the handler clamps it as the forward's launch does."""
  q, k, v = (_normal(i, (2, 300, 4, 128)) for i in range(3))
  skip_unless_compiled(q)
  unbounded = tuple(-1 if w > 10**6 else w for w in window)

  def grads(window):
    loss = lambda q, k, v: jnp.sum(jax_fa3.flash_attention(
        q, k, v, window_size=window, deterministic=True).astype(jnp.float32) ** 2)
    return run_on_kernels(jax.grad(loss, argnums=(0, 1, 2)), q, k, v,
                          expected=(FLASH_FWD, FLASH_BWD))

  for got, want in zip(grads(window), grads(unbounded)):
    _equal(got, want)


@pytest.mark.parametrize("grad", [False, True])
def test_sequence_past_2_29_is_a_value_error_at_trace_time(grad):
  # Only traced (eval_shape), never allocated: the check runs before the kernel call exists.
  q = jax.ShapeDtypeStruct((1, 2**29 + 64, 1, 64), jnp.bfloat16)
  skip_unless_compiled(q)
  f = lambda q, k, v: jax_fa3.flash_attention(q, k, v)
  if grad:
    f = jax.grad(lambda q, k, v: jax_fa3.flash_attention(q, k, v).astype(jnp.float32).sum())
  with pytest.raises(ValueError, match="at most 2\\^29"):
    jax.eval_shape(f, q, q, q)
