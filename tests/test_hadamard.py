"""hadamard_transform: orthonormality, agreement with the explicit matrix, block-diagonal d."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fa3


def _hadamard_matrix(p):
  h = np.ones((1, 1))
  while h.shape[0] < p:
    h = np.block([[h, h], [h, -h]])
  return h / np.sqrt(p)


def _explicit(x, signs):
  d = x.shape[-1]
  p = d & -d
  block = _hadamard_matrix(p)
  full = np.kron(np.eye(d // p), block)
  xs = x * (signs if signs is not None else 1.0)
  return xs @ full.T


@pytest.mark.parametrize("d", [1, 8, 64, 96, 128, 192, 256])
@pytest.mark.parametrize("with_signs", [False, True])
def test_matches_explicit_matrix(d, with_signs):
  rng = np.random.default_rng(d)
  x = rng.standard_normal((3, 5, d))
  signs = rng.choice([-1.0, 1.0], size=d) if with_signs else None
  y = jax_fa3.hadamard_transform(jnp.asarray(x), signs=None if signs is None else jnp.asarray(signs))
  np.testing.assert_allclose(np.asarray(y), _explicit(x, signs), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("d", [8, 96, 128])
def test_inverse_is_the_transpose_and_undoes_the_transform(d):
  rng = np.random.default_rng(d + 1)
  x = rng.standard_normal((3, 5, d))
  signs = rng.choice([-1.0, 1.0], size=d)
  p = d & -d
  full = np.kron(np.eye(d // p), _hadamard_matrix(p)) * signs[None, :]  # H·diag(signs)
  y = jax_fa3.hadamard_transform(jnp.asarray(x), signs=jnp.asarray(signs), inverse=True)
  np.testing.assert_allclose(np.asarray(y), x @ full, rtol=1e-12, atol=1e-12)  # (H·D)^T = D·H
  back = jax_fa3.hadamard_transform(jax_fa3.hadamard_transform(jnp.asarray(x), signs=signs),
                                    signs=signs, inverse=True)
  np.testing.assert_allclose(np.asarray(back), x, rtol=1e-12, atol=1e-12)
  batched = jax.vmap(lambda x, s: jax_fa3.hadamard_transform(x, signs=s, inverse=True))(
      jnp.asarray(x[:2]), jnp.asarray(np.stack([signs, -signs])))
  np.testing.assert_allclose(np.asarray(batched[1]), -(x[1] @ full), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 1e-2), (jnp.float16, 2e-3)])
def test_orthonormal_and_involutive(dtype, tol):
  x = jax.random.normal(jax.random.PRNGKey(0), (4, 7, 128), dtype)
  y = jax_fa3.hadamard_transform(x)
  assert y.dtype == dtype and y.shape == x.shape
  back = jax_fa3.hadamard_transform(y)  # H is symmetric and orthonormal: H·H = I
  rel = jnp.linalg.norm((back - x).astype(jnp.float32)) / jnp.linalg.norm(x.astype(jnp.float32))
  assert float(rel) < tol


def test_preserves_inner_products_of_rotated_pairs():
  key = jax.random.PRNGKey(1)
  q, k = jax.random.normal(key, (2, 16, 64))
  signs = jnp.where(jax.random.bernoulli(key, 0.5, (64,)), 1.0, -1.0)
  rq, rk = (jax_fa3.hadamard_transform(x, signs=signs) for x in (q, k))
  np.testing.assert_allclose(np.asarray(rq @ rk.T), np.asarray(q @ k.T), rtol=1e-5, atol=1e-4)


def test_vmap_and_jit():
  x = jax.random.normal(jax.random.PRNGKey(2), (3, 4, 32))
  y = jax.jit(jax.vmap(jax_fa3.hadamard_transform))(x)
  np.testing.assert_allclose(np.asarray(y), np.asarray(jax_fa3.hadamard_transform(x)), rtol=1e-6)


def test_bad_inputs():
  with pytest.raises(TypeError, match="x must be a JAX or NumPy array"):
    jax_fa3.hadamard_transform([1.0, 2.0])
  with pytest.raises(TypeError, match="floating dtype"):
    jax_fa3.hadamard_transform(jnp.ones((4, 8), jnp.int32))
  with pytest.raises(ValueError, match=r"signs must have shape \(8,\)"):
    jax_fa3.hadamard_transform(jnp.ones((4, 8)), signs=jnp.ones((4,)))
  with pytest.raises(TypeError, match="inverse must be a bool"):
    jax_fa3.hadamard_transform(jnp.ones((4, 8)), inverse="yes")
  with pytest.raises(ValueError, match="rank >= 1"):
    jax_fa3.hadamard_transform(jnp.ones(()))


@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("inverse", [False, True])
def test_out_dtype_rounds_the_float32_transform_once(out_dtype, inverse):
  x = jax.random.normal(jax.random.PRNGKey(4), (5, 7, 128), jnp.float32) * 3.0
  signs = jnp.where(jax.random.bernoulli(jax.random.PRNGKey(5), 0.5, (128,)), 1.0, -1.0)
  y = jax_fa3.hadamard_transform(x, signs=signs, inverse=inverse, out_dtype=out_dtype)
  assert y.dtype == out_dtype
  want = jax_fa3.hadamard_transform(x, signs=signs, inverse=inverse).astype(out_dtype)
  np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(want, np.float32))
  lanes = jax.vmap(lambda x, s: jax_fa3.hadamard_transform(x, signs=s, inverse=inverse,
                                                           out_dtype=out_dtype))
  both = lanes(jnp.stack([x, x]), jnp.stack([signs, -signs]))
  assert both.dtype == out_dtype
  np.testing.assert_array_equal(np.asarray(both[0], np.float32), np.asarray(want, np.float32))
  # The transform is linear: the negated signs negate the result.
  np.testing.assert_array_equal(np.asarray(both[1], np.float32), -np.asarray(want, np.float32))


def test_out_dtype_validation():
  with pytest.raises(ValueError, match="out_dtype must be x's dtype"):
    jax_fa3.hadamard_transform(jnp.ones((4, 8), jnp.bfloat16), out_dtype=jnp.float32)
  with pytest.raises(ValueError, match="out_dtype must be x's dtype"):
    jax_fa3.hadamard_transform(jnp.ones((4, 8), jnp.float32), out_dtype=jnp.int8)
  with pytest.raises(TypeError, match="out_dtype must be a dtype"):
    jax_fa3.hadamard_transform(jnp.ones((4, 8), jnp.float32), out_dtype="not a dtype")
  y = jax_fa3.hadamard_transform(jnp.ones((4, 8), jnp.float16), out_dtype=jnp.float16)
  assert y.dtype == jnp.float16
