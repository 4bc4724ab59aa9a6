"""Tensors past 2^31 elements (GPU only): the forward, the backward and the fp8 path on q, k, v of
1025 x 1024 x 16 x 128 = 2^31 + 2^21 bf16 elements each, checked on batch entries whose element
offsets pass 2^31 bytes (entry 700), reach 2^31 - 2^21 (entry 1023) and start at 2^31 (entry 1024).

An offset computed in 32 bits there wraps (or goes negative) and reads or writes another entry's
data, which the float64 oracle on those entries catches. Memory on the GPU: four 4.3 GB inputs,
three gradients and the backward's float32 dq accumulator, under 60 GB in all.
"""
import os

os.environ["JAX_FA3_DEBUG_POISON_OUTPUTS"] = "1"  # unwritten kernel outputs are NaN

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import jax_fa3  # noqa: E402
from fa3_criterion import check_forward, check_grads  # noqa: E402
from kernel_build import skip_unless_compiled  # noqa: E402
from kernel_targets import (FLASH_BWD, FLASH_FWD, FLASH_FWD_FP8,  # noqa: E402
                            ROTATE_QUANTIZE_FP8, run_on_kernels)
from oracle import oracle_attention  # noqa: E402

pytestmark = pytest.mark.gpu

SHAPE = (1025, 1024, 16, 128)
assert np.prod(SHAPE) == 2**31 + 2**21
CHECKED = np.array([0, 700, 1023, 1024])  # first entry; past 2^31 bytes; last below; past 2^31
# fp8 against the same kernel on the checked entries alone: identical e4m3 inputs (scales are per
# entry and head), so only the accumulation order can differ (the tail split depends on the grid);
# tests/test_gpu_fp8.py's kernel-vs-emulation bound covers that. The fp8 error itself vs float64
# is ~5e-2 on N(0, 1) data (tests/test_fp8.py): 8e-2 bounds it.
FP8_SAME_KERNEL_TOL = 1e-2
FP8_ORACLE_TOL = 8e-2


@pytest.fixture(scope="module")
def inputs():
  q_probe = jnp.zeros((1, 1, 1, SHAPE[-1]), jnp.bfloat16)
  skip_unless_compiled(q_probe)
  make = jax.jit(lambda key: jax.random.normal(key, SHAPE, jnp.bfloat16))
  return tuple(make(jax.random.PRNGKey(i)) for i in range(4))  # q, k, v, dout


def _entries(*arrays):
  return [np.asarray(x[CHECKED]) for x in arrays]


def _rms(x):
  return float(np.sqrt(np.mean(np.square(x, dtype=np.float64))))


def test_forward_past_2_31_elements(inputs):
  q, k, v, _ = inputs
  fn = jax.jit(lambda q, k, v: tuple(x[CHECKED] for x in jax_fa3.flash_attention(
      q, k, v, causal=True, return_lse=True)))
  out, lse = run_on_kernels(fn, q, k, v, expected=FLASH_FWD)
  check_forward(out, lse, *(jnp.asarray(x) for x in _entries(q, k, v)), causal=True)


def test_backward_past_2_31_elements(inputs):
  q, k, v, do = inputs

  def grads(q, k, v, do):
    loss = lambda q, k, v: jnp.sum(jax_fa3.flash_attention(q, k, v, causal=True)
                                   .astype(jnp.float32) * do.astype(jnp.float32))
    return tuple(g[CHECKED] for g in jax.grad(loss, argnums=(0, 1, 2))(q, k, v))

  got = run_on_kernels(grads, q, k, v, do, expected={FLASH_FWD, FLASH_BWD})
  check_grads(got, *(jnp.asarray(x) for x in _entries(q, k, v, do)), causal=True)


def test_fp8_past_2_31_elements(inputs):
  q, k, v, _ = inputs
  fn = jax.jit(lambda q, k, v: jax_fa3.flash_attention_fp8(q, k, v, causal=True)[CHECKED])
  out = np.asarray(run_on_kernels(fn, q, k, v, expected={FLASH_FWD_FP8, ROTATE_QUANTIZE_FP8}),
                   np.float64)
  small = [x[CHECKED] for x in (q, k, v)]
  alone = np.asarray(run_on_kernels(lambda q, k, v: jax_fa3.flash_attention_fp8(q, k, v,
                                                                                causal=True),
                                    *small, expected=FLASH_FWD_FP8), np.float64)
  assert np.all(np.isfinite(out))
  for i, entry in enumerate(CHECKED):
    diff, scale = _rms(out[i] - alone[i]), _rms(alone[i])
    assert diff <= FP8_SAME_KERNEL_TOL * scale, (int(entry), diff, scale)
  ref, _ = oracle_attention(*(np.asarray(x, np.float64) for x in small), causal=True)
  for i, entry in enumerate(CHECKED):
    assert _rms(out[i] - ref[i]) <= FP8_ORACLE_TOL * _rms(ref[i]), int(entry)
