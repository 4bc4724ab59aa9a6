"""FlashAttention-3's outlier inputs (paper, Table 3), the fp8 accuracy tests' data."""
import jax.numpy as jnp
import numpy as np


def outlier_arrays(rng, shape, count):
  """`count` arrays N(0, 1) + N(0, variance 100) · Bernoulli(0.001) of `shape`, drawn in turn
  from the NumPy generator `rng`, rounded to bfloat16."""
  def one():
    x = rng.standard_normal(shape)
    x += 10.0 * rng.standard_normal(shape) * (rng.random(shape) < 1e-3)
    return jnp.asarray(x, jnp.bfloat16)

  return tuple(one() for _ in range(count))


def outlier_qkv_dout(seed, shape):
  """q, k, v with outliers and dout N(0, 1), all of `shape`, bfloat16 (the fp8 backward's tests)."""
  rng = np.random.default_rng(seed)
  q, k, v = outlier_arrays(rng, shape, 3)
  return q, k, v, jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
