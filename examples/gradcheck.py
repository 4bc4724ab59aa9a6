"""Numerical gradient checks (jax.test_util.check_grads) of flash_attention and the Flax layers.

Runs in float64 on the CPU (the pure-JAX path; finite differences need the precision), in
reverse mode: flash_attention's gradient is a custom VJP.
  python examples/gradcheck.py
"""
import pathlib
import sys

import jax

jax.config.update("jax_enable_x64", True)
jax.config.update("jax_platforms", "cpu")  # float64 lives on the CPU path

import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from jax.test_util import check_grads  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # run from a checkout
import jax_fa3  # noqa: E402
import jax_fa3.flax  # noqa: E402

F64 = jnp.float64
CHECK = dict(order=1, modes=("rev",), atol=1e-6, rtol=1e-6, eps=1e-6)


def check_flash_attention():
  kq, kk, kv = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(kq, (2, 12, 4, 8), F64)
  k, v = (jax.random.normal(key, (2, 17, 2, 8), F64) for key in (kk, kv))  # GQA, s_q != s_k
  for options in (dict(), dict(causal=True), dict(window_size=(5, 2), softcap=3.0)):
    check_grads(jax.jit(lambda q, k, v: jax_fa3.flash_attention(q, k, v, **options)),
                (q, k, v), **CHECK)
    print(f"flash_attention {options or '(plain)'}: ok")


def check_linen_layer():
  layer = jax_fa3.flax.linen.MultiHeadDotProductAttention(
      num_heads=4, num_kv_heads=2, causal=True, dtype=F64, param_dtype=F64)
  x = jax.random.normal(jax.random.key(1), (2, 10, 32), F64)
  params = layer.init(jax.random.key(2), x)["params"]
  check_grads(jax.jit(lambda p, x: layer.apply({"params": p}, x)), (params, x), **CHECK)
  print("linen MultiHeadDotProductAttention (GQA, causal): ok")


def check_nnx_layer():
  model = jax_fa3.flax.MultiHeadAttention(4, 32, window_size=(3, 3), dtype=F64, param_dtype=F64,
                                          rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model)
  x = jax.random.normal(jax.random.key(3), (2, 10, 32), F64)
  check_grads(jax.jit(lambda p, x: nnx.merge(graphdef, p)(x)), (params, x), **CHECK)
  print("nnx MultiHeadAttention (sliding window): ok")


if __name__ == "__main__":
  check_flash_attention()
  check_linen_layer()
  check_nnx_layer()
  print("all gradient checks passed")
