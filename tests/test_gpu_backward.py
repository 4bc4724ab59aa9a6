"""Hopper backward kernels: jax.grad through flash_attention against the fp32 reference backward
on the same rounded inputs (GPU only).

Tolerances: the kernel rounds P and dS to 16 bits as GEMM operands and rounds dq/dk/dv once at the
end; with bf16 (unit roundoff 2^-8 ≈ 3.9e-3) two chained roundings give ~1e-2 relative
(Frobenius) → 1.5e-2; fp16 (2^-11) → 3e-3.
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
from jax_fa3 import _bench
from jax_fa3._validation import attention_config

from jax_fa3 import _local_attention
from kernel_build import skip_unless_compiled

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _local_attention.backward_kernel_enabled(),
                       reason="backward kernel switched off "
                       f"({_local_attention.BACKWARD_KERNEL_ENV}=0)"),
]

TOL = {jnp.bfloat16: 1.5e-2, jnp.float16: 3e-3}


def _inputs(seed, b, s_q, s_k, h, h_k, d, dtype):
  keys = jax.random.split(jax.random.PRNGKey(seed), 4)
  shape_q, shape_k = (b, s_q, h, d), (b, s_k, h_k, d)
  make = lambda key, shape: jax.random.normal(key, shape, jnp.float32).astype(dtype)
  return (make(keys[0], shape_q), make(keys[1], shape_k), make(keys[2], shape_k),
          make(keys[3], shape_q))


def _rel(x, ref):
  x, ref = jnp.asarray(x, jnp.float32), jnp.asarray(ref, jnp.float32)
  return float(jnp.linalg.norm(x - ref) / jnp.maximum(jnp.linalg.norm(ref), 1e-30))


def _check_backward(q, k, v, do, dtype, **kw):
  skip_unless_compiled(q)
  def loss(q, k, v):
    return jnp.sum(jax_fa3.flash_attention(q, k, v, **kw).astype(jnp.float32) * do.astype(jnp.float32))
  grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  assert "jax_fa3_flash_bwd" in grad.lower(q, k, v).as_text(), "backward kernel not dispatched"
  dq, dk, dv = grad(q, k, v)
  cfg = attention_config(q, k, v, softmax_scale=kw.get("softmax_scale"),
                         causal=kw.get("causal", False), window_size=kw.get("window_size", (-1, -1)),
                         softcap=kw.get("softcap", 0.0), deterministic=False)
  _, _, ref = _bench.host_reference(q, k, v, cfg, dout=do)
  errors = _bench.gradient_errors((dq, dk, dv), ref)
  for name, got in zip(("dq", "dk", "dv"), (dq, dk, dv)):
    assert got.dtype == dtype
    assert bool(jnp.all(jnp.isfinite(got.astype(jnp.float32)))), f"{name} not finite"
    assert errors[name] < TOL[dtype], (name, errors[name])
  return dq, dk, dv


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


def test_deterministic_backward_is_bit_identical():
  q, k, v, do = _inputs(5, 2, 2048, 2048, 8, 2, 128, jnp.bfloat16)
  def grads():
    loss = lambda q, k, v: jnp.sum(jax_fa3.flash_attention(q, k, v, causal=True, deterministic=True)
                                   .astype(jnp.float32) * do.astype(jnp.float32))
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
  first = grads()
  for _ in range(3):
    for a, b in zip(first, grads()):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
