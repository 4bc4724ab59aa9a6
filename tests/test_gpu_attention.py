"""Hopper kernels against the fp32 reference on fresh random data (GPU only).

Tolerances: inputs are rounded to bf16/fp16 first and the reference computes on those rounded
values in fp32, so only the kernel's own rounding is measured: P rounded to 16 bits before the PV
GEMM and the output rounded once. bf16 has unit roundoff 2^-8 ≈ 3.9e-3 → 1e-2 relative (Frobenius);
fp16 2^-11 ≈ 4.9e-4 → 2e-3.
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
from ffi_probe import ffi_error_message
from kernel_build import skip_unless_compiled

pytestmark = pytest.mark.gpu

TOL = {jnp.bfloat16: 1e-2, jnp.float16: 2e-3}


def _inputs(seed, b, s_q, s_k, h, h_k, d, dtype):
  keys = jax.random.split(jax.random.PRNGKey(seed), 3)
  q = jax.random.normal(keys[0], (b, s_q, h, d), jnp.float32).astype(dtype)
  k = jax.random.normal(keys[1], (b, s_k, h_k, d), jnp.float32).astype(dtype)
  v = jax.random.normal(keys[2], (b, s_k, h_k, d), jnp.float32).astype(dtype)
  return q, k, v


def _rel(x, ref):
  x, ref = jnp.asarray(x, jnp.float32), jnp.asarray(ref, jnp.float32)
  return float(jnp.linalg.norm(x - ref) / jnp.maximum(jnp.linalg.norm(ref), 1e-30))


def _check_forward(q, k, v, dtype, **kw):
  skip_unless_compiled(q)
  fn = jax.jit(lambda q, k, v: jax_fa3.flash_attention(q, k, v, return_lse=True, **kw))
  assert "jax_fa3_flash_fwd" in fn.lower(q, k, v).as_text(), "kernel not dispatched"
  out, lse = fn(q, k, v)
  out2, lse2 = fn(q, k, v)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(out2))  # same inputs, same bits
  np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse2))
  cfg = jax_fa3._validation.attention_config(
      q, k, v, softmax_scale=kw.get("softmax_scale"), causal=kw.get("causal", False),
      window_size=kw.get("window_size", (-1, -1)), softcap=kw.get("softcap", 0.0),
      deterministic=False)
  ref_out, ref_lse, _ = _bench.host_reference(q, k, v, cfg)
  out_np, lse_np = np.asarray(out, np.float32), np.asarray(lse)
  assert np.all(np.isfinite(out_np)), "non-finite output (unwritten or NaN)"
  assert _rel(out_np, ref_out) < TOL[dtype], _rel(out_np, ref_out)
  ref_lse = np.asarray(ref_lse)
  np.testing.assert_array_equal(np.isposinf(lse_np), np.isposinf(ref_lse))
  finite = np.isfinite(ref_lse)
  np.testing.assert_allclose(lse_np[finite], ref_lse[finite], atol=2e-3, rtol=1e-3)


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


@pytest.mark.parametrize("window", [(64, 0), (100, 30), (-1, 17), (0, 0)])
def test_forward_windows(window):
  q, k, v = _inputs(3, 1, 700, 900, 8, 2, 128, jnp.bfloat16)
  _check_forward(q, k, v, jnp.bfloat16, window_size=window)


@pytest.mark.parametrize("h,h_k", [(8, 1), (8, 2), (6, 6)])
@pytest.mark.parametrize("softcap", [0.0, 15.0])
def test_forward_gqa_softcap(h, h_k, softcap):
  q, k, v = _inputs(h * 10 + h_k, 3, 257, 257, h, h_k, 64, jnp.bfloat16)
  _check_forward(q, k, v, jnp.bfloat16, causal=True, softcap=softcap)


@pytest.mark.parametrize("b,h", [(1, 1), (64, 16)])
def test_forward_grid_sizes(b, h):
  # One tile (most SMs idle) and far more tiles than SMs (persistent scheduling wraps around).
  q, k, v = _inputs(b + h, b, 512 if b > 1 else 2048, 512 if b > 1 else 2048, h, h, 128,
                    jnp.bfloat16)
  _check_forward(q, k, v, jnp.bfloat16, causal=b > 1)


def test_forward_under_vmap_folds_into_batch():
  q, k, v = _inputs(11, 2, 130, 130, 2, 2, 128, jnp.bfloat16)
  stacked = [jnp.stack([x, x[::-1]]) for x in (q, k, v)]
  fn = jax.jit(jax.vmap(lambda q, k, v: jax_fa3.flash_attention(q, k, v, causal=True)))
  hlo = fn.lower(*stacked).as_text()
  assert hlo.count("jax_fa3_flash_fwd") == 1  # one launch, not a loop
  out = fn(*stacked)
  np.testing.assert_array_equal(np.asarray(out[0]),
                                np.asarray(jax_fa3.flash_attention(q, k, v, causal=True)))


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
