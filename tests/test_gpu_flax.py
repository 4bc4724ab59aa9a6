"""The Flax linen and nnx layers on the kernels (GPU only), bf16/fp16 and FP8 modes: forward and
gradients of the parameters and the input.

Reference: Flax's own layer (same parameter tree, jax_fa3-free attention) computing in float64;
"naive": the same Flax layer computing in the test's dtype. The bf16/fp16 mode meets
FlashAttention-3's criterion (tests/fa3_criterion.py) against them, output and every gradient
leaf. FP8 mode: the output within FP8_TOL of the float64 layer (relative, Frobenius). Its gradients
with fp8_backward="recompute" are straight-through (those of the bf16/fp16 attention at the
unquantized inputs), so every leaf but the output projection's kernel meets the same criterion,
and that one (attention output^T · cotangent) inherits the output's fp8 error; with "bf16" (the
default: the backward differentiates the fp8 function, at the quantized q and k) every leaf carries
fp8 error and is held to FP8_GRAD_TOL (tests/test_flax.py measures 0.5-5.1% per leaf). No biases: the key bias's gradient is zero in exact arithmetic, so its value is
rounding noise a max-error criterion cannot judge.
"""
import os

os.environ["JAX_FA3_DEBUG_POISON_OUTPUTS"] = "1"  # unwritten kernel outputs are NaN

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402

import jax_fa3.flax as fx  # noqa: E402
from fa3_criterion import assert_within_criterion  # noqa: E402
from kernel_build import skip_unless_compiled  # noqa: E402
from kernel_targets import (FLASH_BWD, FLASH_FWD, FLASH_FWD_FP8,  # noqa: E402
                            ROTATE_QUANTIZE_FP8, assert_targets, kernel_targets)

pytestmark = pytest.mark.gpu

B, S, HEADS, KV_HEADS, HEAD_DIM = 2, 256, 4, 2, 128
FEATURES = HEADS * HEAD_DIM
# e4m3 keeps 3 mantissa bits (RMS relative rounding error ~2.6% per element); the output inherits
# about independent errors of that size from q, k, P and v: sqrt(4) x 2.6% ~ 5% (tests/test_flax.py
# measures 4.1-4.8% on the emulation); a wrong rotation, scale or head grouping is O(1).
FP8_TOL = 6e-2
FP8_GRAD_TOL = 8e-2
DTYPES = [jnp.bfloat16, jnp.float16]


# The layers' modes: bf16/fp16 attention, or FP8 mode with either fp8_backward.
MODES = [None, "bf16", "recompute"]


def _mode_options(fp8_backward):
  return dict(fp8=True, fp8_backward=fp8_backward) if fp8_backward else {}


def _run_on_expected_kernels(fn, params, x, fp8_backward):
  """Runs jit(fn) after checking its kernels: FP8 mode's rotate + quantize and fp8 forward, a bf16
  forward only where the backward recomputes it, and the backward."""
  compiled = jax.jit(fn).lower(params, x).compile()
  text = compiled.as_text()
  if fp8_backward:
    assert_targets(text, {ROTATE_QUANTIZE_FP8, FLASH_FWD_FP8, FLASH_BWD})
    assert (FLASH_FWD in kernel_targets(text)) == (fp8_backward == "recompute")
  else:
    assert_targets(text, {FLASH_FWD, FLASH_BWD})
  return compiled(params, x)


def _data(seed, dtype):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((B, S, FEATURES)), dtype)
  cotangent = jnp.asarray(rng.standard_normal((B, S, FEATURES)), jnp.float32)
  skip_unless_compiled(jnp.zeros((1, 1, 1, HEAD_DIM), dtype))
  return x, cotangent


def _value_and_grads(apply, params, x, cotangent):
  """(output, (d params, d x)) of <apply(params, x), cotangent>."""
  def loss(p, x):
    out = apply(p, x)
    return jnp.sum(out.astype(jnp.float32) * cotangent), out
  (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x)
  return out, grads


def _check(got, ref, naive, dtype, fp8_backward):
  """got, ref, naive: (output, (param grads, x grad)) of the kernel layer, the float64 layer and
  the layer in dtype."""
  fp8 = fp8_backward is not None
  (out, grads), (ref_out, ref_grads), (naive_out, naive_grads) = got, ref, naive
  if fp8:
    out64, ref64 = np.asarray(out, np.float64), np.asarray(ref_out, np.float64)
    rel = np.linalg.norm(out64 - ref64) / np.linalg.norm(ref64)
    assert rel < FP8_TOL, rel
  else:
    assert_within_criterion("out", out, ref_out, naive_out, dtype)
  leaves = jax.tree_util.tree_flatten_with_path(grads)[0]
  assert jax.tree.structure(grads) == jax.tree.structure(ref_grads)
  for (path, g), r, n in zip(leaves, jax.tree.leaves(ref_grads), jax.tree.leaves(naive_grads)):
    name = jax.tree_util.keystr(path)
    if fp8_backward == "bf16" or (fp8 and "out" in name and "kernel" in name):
      g64, r64 = np.asarray(g, np.float64), np.asarray(r, np.float64)
      tol = FP8_GRAD_TOL if fp8_backward == "bf16" else FP8_TOL
      assert np.linalg.norm(g64 - r64) / np.linalg.norm(r64) < tol, name
    else:
      assert_within_criterion(name, g, r, n, dtype)


@pytest.mark.parametrize("fp8_backward", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_linen_layer(dtype, fp8_backward):
  x, cotangent = _data(0, dtype)
  layer = fx.linen.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=FEATURES,
                                                use_bias=False, causal=True, dtype=dtype,
                                                **_mode_options(fp8_backward))
  variables = jax.jit(layer.init)(jax.random.key(0), x)
  params, rest = variables["params"], {k: v for k, v in variables.items() if k != "params"}
  got = _run_on_expected_kernels(
      lambda p, x: _value_and_grads(lambda p, x: layer.apply({"params": p, **rest}, x), p, x,
                                    cotangent), params, x, fp8_backward)
  mask = nn.make_causal_mask(jnp.ones((B, S)))

  def flax_layer(compute_dtype):
    flax_mha = nn.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=FEATURES,
                                               use_bias=False, dtype=compute_dtype)
    apply = lambda p, x: flax_mha.apply({"params": p}, x, mask=mask)
    return jax.jit(lambda p, x: _value_and_grads(apply, p, x, cotangent))(
        params, x.astype(compute_dtype))

  _check(got, flax_layer(jnp.float64), flax_layer(dtype), dtype, fp8_backward)


@pytest.mark.parametrize("fp8_backward", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_nnx_layer(dtype, fp8_backward):
  x, cotangent = _data(1, dtype)
  make = lambda cls, compute_dtype, **kw: cls(HEADS, FEATURES, num_kv_heads=KV_HEADS,
                                              use_bias=False, dtype=compute_dtype, decode=False,
                                              rngs=nnx.Rngs(0), **kw)
  model = make(fx.MultiHeadAttention, dtype, causal=True, **_mode_options(fp8_backward))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  got = _run_on_expected_kernels(
      lambda p, x: _value_and_grads(lambda p, x: nnx.merge(graphdef, p, rest)(x), p, x,
                                    cotangent), params, x, fp8_backward)
  mask = nnx.make_causal_mask(jnp.ones((B, S)))

  def flax_layer(compute_dtype):
    ref_graphdef, ref_params, ref_rest = nnx.split(make(nnx.MultiHeadAttention, compute_dtype),
                                                   nnx.Param, ...)
    # One seed, one parameter tree: the same weights as the kernel layer's.
    jax.tree.map(np.testing.assert_array_equal, ref_params, params)
    apply = lambda p, x: nnx.merge(ref_graphdef, p, ref_rest)(x, mask=mask)
    return jax.jit(lambda p, x: _value_and_grads(apply, p, x, cotangent))(
        ref_params, x.astype(compute_dtype))

  _check(got, flax_layer(jnp.float64), flax_layer(dtype), dtype, fp8_backward)
