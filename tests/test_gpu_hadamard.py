"""The CUDA Hadamard kernel against the pure-JAX transform (Hopper GPU only)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fa3
from jax_fa3.hadamard import hadamard_reference
from ffi_probe import ffi_error_message
from kernel_targets import HADAMARD, run_on_kernels

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("d", [8, 64, 96, 128, 192, 256, 1024, 8192])
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 8e-3), (jnp.float16, 1e-3)])
def test_kernel_matches_reference(d, dtype, tol):
  rows = 1000 if d < 8192 else 7   # ragged: not a multiple of the rows per CTA
  x = jax.random.normal(jax.random.PRNGKey(d), (rows, d), jnp.float32).astype(dtype)
  signs = jnp.where(jax.random.bernoulli(jax.random.PRNGKey(1), 0.5, (d,)), 1.0, -1.0)
  y = run_on_kernels(lambda x, s: jax_fa3.hadamard_transform(x, signs=s), x, signs,
                     expected=HADAMARD)
  ref = hadamard_reference(x.astype(jnp.float32), signs)
  assert y.dtype == dtype
  rel = float(jnp.linalg.norm(y.astype(jnp.float32) - ref) / jnp.linalg.norm(ref))
  assert rel < tol, rel


@pytest.mark.parametrize("d", [64, 96, 128, 256])
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 8e-3)])
def test_kernel_inverse_matches_reference_and_undoes_the_transform(d, dtype, tol):
  rows = 999  # not a multiple of the rows per CTA of either kernel
  x = jax.random.normal(jax.random.PRNGKey(d + 1), (rows, d), jnp.float32).astype(dtype)
  signs = jnp.where(jax.random.bernoulli(jax.random.PRNGKey(2), 0.5, (d,)), 1.0, -1.0)
  y = run_on_kernels(lambda x, s: jax_fa3.hadamard_transform(x, signs=s, inverse=True), x, signs,
                     expected=HADAMARD)
  ref = hadamard_reference(x.astype(jnp.float32), signs, inverse=True)
  assert y.dtype == dtype
  rel = float(jnp.linalg.norm(y.astype(jnp.float32) - ref) / jnp.linalg.norm(ref))
  assert rel < tol, rel
  x32 = x.astype(jnp.float32)
  back = run_on_kernels(
      lambda x, s: jax_fa3.hadamard_transform(jax_fa3.hadamard_transform(x, signs=s), signs=s,
                                              inverse=True), x32, signs, expected=HADAMARD)
  np.testing.assert_allclose(np.asarray(back), np.asarray(x32), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("d", [64, 96, 128, 256])
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("inverse", [False, True])
def test_kernel_out_dtype_is_the_float32_kernel_rounded_once(d, out_dtype, inverse):
  # Bit for bit: the float32 transform in registers, rounded once to out_dtype (d = 96 takes the
  # shared-memory kernel, the others the register one).
  rows = 1001
  x = jax.random.normal(jax.random.PRNGKey(d + 7), (rows, d), jnp.float32) * 5.0
  signs = jnp.where(jax.random.bernoulli(jax.random.PRNGKey(3), 0.5, (d,)), 1.0, -1.0)
  y = run_on_kernels(lambda x, s: jax_fa3.hadamard_transform(x, signs=s, inverse=inverse,
                                                             out_dtype=out_dtype),
                     x, signs, expected=HADAMARD)
  y32 = run_on_kernels(lambda x, s: jax_fa3.hadamard_transform(x, signs=s, inverse=inverse),
                       x, signs, expected=HADAMARD)
  assert y.dtype == out_dtype
  np.testing.assert_array_equal(np.asarray(y, np.float32),
                                np.asarray(y32.astype(out_dtype), np.float32))


def test_kernel_is_called_and_vmaps():
  x = jax.random.normal(jax.random.PRNGKey(3), (3, 5, 128), jnp.bfloat16)
  batched = run_on_kernels(jax.vmap(lambda x, s: jax_fa3.hadamard_transform(x, signs=s)),
                           x, jnp.ones((3, 128), jnp.float32) * jnp.array([[1.0], [-1.0], [1.0]]),
                           expected=HADAMARD)
  np.testing.assert_allclose(np.asarray(batched[1], np.float32),
                             -np.asarray(jax_fa3.hadamard_transform(x[1]), np.float32), rtol=1e-2,
                             atol=1e-2)


@pytest.mark.parametrize("x_dtype,out_dtype,signs_len,expected", [
    ("float32", "float32", 3, "signs must have shape (16,)"),   # signs of the wrong length
    ("bfloat16", "float32", 16, "output dtype must be x's"),   # a widening output
])
def test_kernel_rejects_bad_call_via_ffi_error(x_dtype, out_dtype, signs_len, expected):
  message = ffi_error_message(f"""
    x = jnp.ones((4, 16), jnp.{x_dtype})
    call = jax.ffi.ffi_call("jax_fa3_hadamard", jax.ShapeDtypeStruct(x.shape, jnp.{out_dtype}))
    result = lambda: call(x, jnp.ones(({signs_len},), jnp.float32), apply_signs=np.bool_(True),
                          signs_after=np.bool_(False))
  """)
  assert expected in message
