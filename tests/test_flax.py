"""jax_fa3.flax: the attention_fn drop-in, the linen/nnx layers, FP8 mode, and examples/train_gpt.py.

All float32 (explicit dtypes: conftest enables x64). Where we compare with Flax, the tolerance is
a relative (Frobenius) error of 1e-5: both sides compute the same math in float32 (unit roundoff
6e-8) in a different order (blocked online softmax vs one dense softmax) over <= 32 keys and
<= 64 features, which lands around 1e-7..1e-6; any semantic slip (scale, mask alignment, head
grouping) is an O(1e-1) error. Everything heavy runs under jit: eager tracing of the reference
path is slow on the CPU.
"""
import functools
import pathlib
import sys

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_fa3
import jax_fa3.flax as fx
from jax_fa3.flax.nnx_layers import _FLAX_HAS_GQA

# The layers mirror flax.nnx.MultiHeadAttention's num_kv_heads, and the tests compare with it.
pytestmark = pytest.mark.skipif(
    not _FLAX_HAS_GQA, reason=f"jax_fa3.flax needs flax >= 0.12.6 (GQA in nnx.MultiHeadAttention), "
                              f"found {flax.__version__}")
from oracle import visibility_mask
from repo_script import load_script

REPO = pathlib.Path(__file__).resolve().parent.parent
TOL = 1e-5
F32 = jnp.float32


def _normal(seed, shape):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), F32)


def _rel(x, ref):
  x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
  return np.linalg.norm(x - ref) / np.linalg.norm(ref)


def _assert_trees_close(tree, ref_tree, tol=TOL):
  """Elementwise rtol=tol, atol=tol * the tree's largest |value|: some leaves are zero in exact
  arithmetic (the key-projection bias cannot change a softmax) and hold only roundoff."""
  assert jax.tree.structure(tree) == jax.tree.structure(ref_tree)
  atol = tol * max(float(np.max(np.abs(leaf))) for leaf in jax.tree.leaves(ref_tree))
  for (path, x), ref in zip(jax.tree_util.tree_flatten_with_path(tree)[0],
                            jax.tree.leaves(ref_tree)):
    np.testing.assert_allclose(x, ref, rtol=tol, atol=atol, err_msg=jax.tree_util.keystr(path))


def _assert_trees_equal(tree, ref_tree):
  assert jax.tree.structure(tree) == jax.tree.structure(ref_tree)
  jax.tree.map(np.testing.assert_array_equal, tree, ref_tree)


def _value_and_grads(apply, params, x, cotangent):
  """jit(value_and_grad) of <apply(params, x), cotangent> w.r.t. params and x, plus the output."""
  def loss(p, x):
    out = apply(p, x)
    return jnp.sum(out * cotangent), out
  (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
  return out, grads


# ----------------------------------------------------------------------------- attention_fn

def test_linen_attention_fn_matches_flax_default():
  # Two leading batch dims: the drop-in folds them into one and back.
  x = _normal(0, (2, 3, 16, 32))
  flax_layer = nn.MultiHeadDotProductAttention(num_heads=4)
  ours = nn.MultiHeadDotProductAttention(num_heads=4, attention_fn=fx.dot_product_attention)
  params = jax.jit(flax_layer.init)(jax.random.key(0), x)["params"]
  cotangent = _normal(1, x.shape)
  run = lambda layer: _value_and_grads(lambda p, x: layer.apply({"params": p}, x), params, x,
                                       cotangent)
  out, grads = run(ours)
  ref_out, ref_grads = run(flax_layer)
  assert out.dtype == F32 and out.shape == x.shape
  assert _rel(out, ref_out) < TOL
  _assert_trees_close(grads, ref_grads)


def test_nnx_attention_fn_matches_flax_default_gqa_causal():
  x = _normal(2, (2, 24, 32))
  make = lambda **kw: nnx.MultiHeadAttention(4, 32, num_kv_heads=2, decode=False,
                                             rngs=nnx.Rngs(0), **kw)
  cotangent = _normal(3, x.shape)

  def run(model):
    graphdef, params = nnx.split(model)
    apply = lambda p, x: nnx.merge(graphdef, p)(x, is_causal=True)
    return _value_and_grads(apply, params, x, cotangent)

  out, grads = run(make(attention_fn=fx.dot_product_attention))
  ref_out, ref_grads = run(make())
  assert _rel(out, ref_out) < TOL
  _assert_trees_close(grads, ref_grads)


# ----------------------------------------------------------------------------- layers

LAYER_OPTIONS = [
    dict(causal=True, num_kv_heads=2),
    dict(window_size=(3, 2), num_kv_heads=1),  # MQA, a two-sided window
    dict(causal=True, window_size=(4, 0), num_kv_heads=4),
]


@pytest.mark.parametrize("api", ["linen", "nnx"])
@pytest.mark.parametrize("options", LAYER_OPTIONS, ids=str)
def test_layer_matches_flax_with_mask(api, options):
  """Our layer with causal/window/GQA == Flax's nnx layer given the equivalent boolean mask."""
  seqlen, options = 20, dict(options)
  num_kv_heads = options.pop("num_kv_heads")
  x = _normal(4, (2, seqlen, 32))
  flax_model = nnx.MultiHeadAttention(4, 32, num_kv_heads=num_kv_heads, decode=False,
                                      rngs=nnx.Rngs(0))
  left, right = options.get("window_size", (-1, -1))
  mask = visibility_mask(seqlen, seqlen, left, 0 if options.get("causal") else right)
  ref = nnx.jit(lambda m, x: m(x, mask=jnp.asarray(mask)[None, None]))(flax_model, x)

  if api == "nnx":
    ours = fx.MultiHeadAttention(4, 32, num_kv_heads=num_kv_heads, rngs=nnx.Rngs(1), **options)
    nnx.update(ours, nnx.state(flax_model))  # Flax's weights load unchanged
    out = nnx.jit(lambda m, x: m(x))(ours, x)
  else:
    # The linen tree is nnx's pure dict: weights move between the two APIs as they are.
    params = nnx.state(flax_model, nnx.Param).to_pure_dict()
    layer = fx.linen.MultiHeadDotProductAttention(num_heads=4, num_kv_heads=num_kv_heads,
                                                  **options)
    out = jax.jit(layer.apply)({"params": params}, x)
  assert _rel(out, ref) < TOL


def _linen_parent(layer_cls, **kwargs):
  """A parent module, so that the auto-generated child name is part of the comparison."""
  class Parent(nn.Module):
    @nn.compact
    def __call__(self, x):
      return layer_cls(num_heads=4, normalize_qk=True, **kwargs)(x)
  return Parent()


def test_linen_param_tree_identical_to_flax():
  x = _normal(5, (2, 16, 32))
  init = lambda module: jax.jit(module.init)(jax.random.key(7), x)
  ref = init(_linen_parent(nn.MultiHeadDotProductAttention))
  assert set(ref["params"]) == {"MultiHeadDotProductAttention_0"}
  _assert_trees_equal(init(_linen_parent(fx.linen.MultiHeadDotProductAttention)), ref)
  # fp8: the same params plus the signs in their own collection (shapes: no compilation).
  with_fp8 = jax.eval_shape(_linen_parent(fx.linen.MultiHeadDotProductAttention, fp8=True).init,
                            jax.random.key(7), x)
  assert jax.tree.map(jnp.shape, with_fp8["params"]) == jax.tree.map(jnp.shape, ref["params"])
  signs = with_fp8[fx.ROTATION_COLLECTION]["MultiHeadDotProductAttention_0"]["signs"]
  assert signs.shape == (8,) and signs.dtype == F32


def test_nnx_param_tree_identical_to_flax():
  make = lambda cls, **kw: cls(4, 32, num_kv_heads=2, normalize_qk=True, rngs=nnx.Rngs(3), **kw)
  ref = nnx.state(make(nnx.MultiHeadAttention)).to_pure_dict()
  _assert_trees_equal(nnx.state(make(fx.MultiHeadAttention, causal=True)).to_pure_dict(), ref)
  with_fp8 = make(fx.MultiHeadAttention, fp8=True)
  _assert_trees_equal(nnx.state(with_fp8, nnx.Param).to_pure_dict(), ref)
  signs = nnx.state(with_fp8, fx.Fp8RotationSigns).to_pure_dict()
  assert list(signs) == ["rotation_signs"] and signs["rotation_signs"].shape == (8,)
  assert not issubclass(fx.Fp8RotationSigns, nnx.Param)  # optimizers over nnx.Param skip it


# ----------------------------------------------------------------------------- fp8

# e4m3 keeps 3 mantissa bits: round-to-nearest leaves an RMS relative error of about 2.6% per
# quantized element. The output inherits roughly independent errors of that size from q and k
# (through the scores), from P and from v: about sqrt(4) * 2.6% ≈ 5%; on these N(0,1) inputs we
# measure 4.1-4.8%. 6e-2 bounds that; a rotation applied to q but not k, a wrong scale or a
# mis-grouped head is an O(1) error.
FP8_TOL = 6e-2
FP8_GRAD_TOL = 8e-2  # fp8_backward="bf16" gradients against exact attention's (see below)


@functools.cache  # shared by two tests: one init compilation
def _fp8_linen():
  x = _normal(6, (2, 64, 64))
  fp8_layer = fx.linen.MultiHeadDotProductAttention(num_heads=2, causal=True, fp8=True)
  exact_layer = fx.linen.MultiHeadDotProductAttention(num_heads=2, causal=True)
  variables = jax.jit(fp8_layer.init)(jax.random.key(0), x)
  return x, fp8_layer, exact_layer, variables


@pytest.mark.parametrize("fp8_backward", ["bf16", "recompute", "fp8"])
def test_fp8_linen_layer_close_to_exact_and_differentiable(fp8_backward):
  x, _, exact_layer, variables = _fp8_linen()
  layer = fx.linen.MultiHeadDotProductAttention(num_heads=2, causal=True, fp8=True,
                                                fp8_backward=fp8_backward)
  cotangent = _normal(7, x.shape)
  out, grads = _value_and_grads(
      lambda p, x: layer.apply({"params": p, **{fx.ROTATION_COLLECTION: variables[
          fx.ROTATION_COLLECTION]}}, x), variables["params"], x, cotangent)
  ref, ref_grads = _value_and_grads(lambda p, x: exact_layer.apply({"params": p}, x),
                                    variables["params"], x, cotangent)
  assert out.dtype == F32
  assert _rel(out, ref) < FP8_TOL
  if fp8_backward == "recompute":
    _assert_straight_through(grads, ref_grads, out_kernel_path="['out']['kernel']")
  else:
    _assert_close_gradients(grads, ref_grads)


def _assert_close_gradients(grads, ref_grads):
  """fp8_backward="bf16" (the default) differentiates the fp8 function, at the quantized q and k:
  every gradient differs from exact attention's by about the fp8 error (measured 0.5-5.1%
  relative per parameter, the most for the query bias, 3.8% for the input; FP8_GRAD_TOL = 8e-2).
  The key bias, whose exact gradient is zero (softmax ignores a shift shared by all keys), gets
  noise from the quantization of P and v (norm 0.82 against 26-274 for the other gradients), so
  it is bounded against the whole gradient's norm."""
  assert jax.tree.structure(grads) == jax.tree.structure(ref_grads)
  leaves = [np.asarray(g, np.float64) for g in jax.tree.leaves(grads)]
  ref_leaves = [np.asarray(g, np.float64) for g in jax.tree.leaves(ref_grads)]
  total = np.sqrt(sum(np.sum(r**2) for r in ref_leaves))
  for (path, _), g, g_ref in zip(jax.tree_util.tree_flatten_with_path(grads)[0], leaves,
                                 ref_leaves):
    name = jax.tree_util.keystr(path)
    assert np.all(np.isfinite(g)), name
    if np.linalg.norm(g_ref) > 1e-3 * total:
      assert _rel(g, g_ref) < FP8_GRAD_TOL, (name, _rel(g, g_ref))
    else:
      assert np.linalg.norm(g - g_ref) < 1e-2 * total, name


def _assert_straight_through(grads, ref_grads, out_kernel_path):
  """Straight-through gradients are exact attention's (measured: relative error 0.0 on the CPU),
  except the output projection's kernel, whose gradient is (attention output)^T · cotangent and
  so inherits the fp8 forward's error (measured 0.040, like the output's 0.039)."""
  assert jax.tree.structure(grads) == jax.tree.structure(ref_grads)
  for (path, g), g_ref in zip(jax.tree_util.tree_flatten_with_path(grads)[0],
                              jax.tree.leaves(ref_grads)):
    name = jax.tree_util.keystr(path)
    if name.endswith(out_kernel_path):
      assert _rel(g, g_ref) < FP8_TOL, (name, _rel(g, g_ref))
    else:  # the same float32 math in the same order: the file's float32 tolerance
      np.testing.assert_allclose(g, g_ref, rtol=TOL, atol=TOL * float(np.max(np.abs(g_ref))),
                                 err_msg=name)


def test_fp8_nnx_layer_gradients():
  # Closeness to exact attention is the linen test's (the same attention_fn underneath); the
  # signs are drawn after Flax's parameters, so one seed gives both layers the same weights.
  x, cotangent = _normal(8, (2, 64, 64)), _normal(9, (2, 64, 64))
  loss = lambda m, x: jnp.sum(m(x) * cotangent)
  exact = fx.MultiHeadAttention(2, 64, causal=True, rngs=nnx.Rngs(0))
  ref_grads = nnx.state(nnx.jit(nnx.grad(loss))(exact, x), nnx.Param).to_pure_dict()
  for fp8_backward in ("recompute", "bf16"):
    model = fx.MultiHeadAttention(2, 64, causal=True, fp8=True, fp8_backward=fp8_backward,
                                  rngs=nnx.Rngs(0))
    grads = nnx.jit(nnx.grad(loss))(model, x)  # w.r.t. nnx.Param
    assert not nnx.state(grads, fx.Fp8RotationSigns)  # the signs are not trained
    grads = nnx.state(grads, nnx.Param).to_pure_dict()
    if fp8_backward == "recompute":
      _assert_straight_through(grads, ref_grads, out_kernel_path="['out']['kernel']")
    else:
      _assert_close_gradients(grads, ref_grads)


def test_fp8_rotation_signs_linen_checkpoint_round_trip():
  x, fp8_layer, _, variables = _fp8_linen()
  blob = flax.serialization.to_bytes(variables)
  template = jax.jit(fp8_layer.init)(jax.random.key(1), x)  # other weights, other signs
  key = (fx.ROTATION_COLLECTION, "signs")
  signs_of = lambda v: np.asarray(v[key[0]][key[1]])
  assert signs_of(variables).shape == (32,) and set(np.abs(signs_of(variables))) == {1.0}
  assert not np.array_equal(signs_of(template), signs_of(variables))
  restored = flax.serialization.from_bytes(template, blob)
  np.testing.assert_array_equal(signs_of(restored), signs_of(variables))
  apply = jax.jit(fp8_layer.apply)
  np.testing.assert_array_equal(apply(restored, x), apply(variables, x))


def test_fp8_rotation_signs_nnx_checkpoint_round_trip():
  x = _normal(9, (2, 32, 64))
  make = lambda seed: fx.MultiHeadAttention(2, 64, fp8=True, rngs=nnx.Rngs(seed))
  trained, fresh = make(1), make(2)
  assert not np.array_equal(trained.rotation_signs[...], fresh.rotation_signs[...])
  # Save the full state (signs included) as bytes, restore into a model built with other seeds.
  blob = flax.serialization.to_bytes(nnx.state(trained).to_pure_dict())
  state = nnx.state(fresh)
  nnx.replace_by_pure_dict(state, flax.serialization.from_bytes(state.to_pure_dict(), blob))
  nnx.update(fresh, state)
  np.testing.assert_array_equal(fresh.rotation_signs[...], trained.rotation_signs[...])
  # split/merge keeps them too, and the call reads this instance's signs, not a captured copy.
  merged = nnx.merge(*nnx.split(trained))
  forward = nnx.jit(lambda m, x: m(x))
  np.testing.assert_array_equal(forward(fresh, x), forward(trained, x))
  np.testing.assert_array_equal(forward(merged, x), forward(trained, x))


# ----------------------------------------------------------------------------- errors

def _qkv(s_q=8, s_k=8):
  return _normal(10, (1, s_q, 2, 8)), _normal(11, (1, s_k, 2, 8)), _normal(12, (1, s_k, 2, 8))


# Ids from the kwargs' keys alone: the same in every pytest-xdist worker (a repr holding an
# object's address is not, and xdist then refuses the run).
@pytest.mark.parametrize("kwargs,error,match", [
    (dict(mask=jnp.ones((1, 1, 8, 8), bool)), ValueError, r"functools\.partial.*causal=True"),
    (dict(bias=jnp.zeros((1, 1, 8, 8), F32)), ValueError, r"no bias.*functools\.partial"),
    (dict(dropout_rate=0.1, deterministic=False), ValueError, "dropout_rate=0.0"),
    (dict(module=object()), ValueError, "sow"),
    (dict(qk_attn_weights_einsum=jnp.einsum), TypeError, "fp8=True"),
    (dict(signs=jnp.ones((8,), F32)), ValueError, "only apply with fp8=True"),
    (dict(fp8_backward="recompute"), ValueError, "fp8_backward only apply with fp8=True"),
    (dict(fp8=True, fp8_backward="fp16"), ValueError, "fp8_backward must be one of"),
    (dict(fp8=True, softcap=5.0), ValueError, "softcap"),
    (dict(window_size=(2,)), TypeError, "window_size"),
], ids=lambda v: "-".join(v) if isinstance(v, dict) else None)
def test_attention_fn_refuses_what_it_cannot_honour(kwargs, error, match):
  with pytest.raises(error, match=match):
    jax.eval_shape(functools.partial(fx.dot_product_attention, **kwargs), *_qkv())


def test_attention_fn_takes_any_number_of_batch_dims():
  q, k, v = _qkv()
  for batch_shape in ((), (3,), (2, 3)):
    args = [jax.ShapeDtypeStruct(batch_shape + x.shape[1:], x.dtype) for x in (q, k, v)]
    out = jax.eval_shape(fx.dot_product_attention, *args)
    assert out.shape == args[0].shape and out.dtype == F32


def test_attention_fn_is_causal_needs_equal_lengths():
  with pytest.raises(ValueError, match="bottom-right"):
    jax.eval_shape(functools.partial(fx.dot_product_attention, is_causal=True), *_qkv(8, 12))


def test_layers_refuse_what_they_cannot_honour():
  x = jax.ShapeDtypeStruct((1, 8, 16), F32)
  key = jax.random.key(0)
  linen_cases = [
      (dict(attention_fn=functools.partial(nn.dot_product_attention)), {}, TypeError, "flax.linen.MultiHead"),
      (dict(decode=True, fp8=True), {}, NotImplementedError, "decode"),
      (dict(dropout_rate=0.1), dict(deterministic=False), ValueError, "dropout"),
      ({}, dict(mask=jnp.ones((1, 1, 8, 8), bool)), ValueError, "causal=True"),
      ({}, dict(sow_weights=True), ValueError, "sow"),
      (dict(num_kv_heads=3), {}, ValueError, "num_kv_heads"),
  ]
  for fields, call_kwargs, error, match in linen_cases:
    layer = fx.linen.MultiHeadDotProductAttention(num_heads=2, **fields)
    with pytest.raises(error, match=match):
      jax.eval_shape(lambda x: layer.init({"params": key, "dropout": key}, x, **call_kwargs), x)

  with pytest.raises(TypeError, match="flax.nnx.MultiHeadAttention"):
    fx.MultiHeadAttention(2, 16, attention_fn=nnx.dot_product_attention, rngs=nnx.Rngs(0))
  # nnx layers run eagerly here; the errors come before any attention is computed.
  model = fx.MultiHeadAttention(2, 16, dropout_rate=0.1, rngs=nnx.Rngs(0))
  with pytest.raises(NotImplementedError, match="decode with fp8=True"):
    fx.MultiHeadAttention(2, 16, fp8=True, rngs=nnx.Rngs(0)).init_cache((1, 8, 16))
  with pytest.raises(NotImplementedError, match="decode with fp8=True"):
    fx.MultiHeadAttention(2, 16, decode=True, fp8=True, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="cache not initialized"):
    fx.MultiHeadAttention(2, 16, decode=True, rngs=nnx.Rngs(0))(jnp.zeros((1, 1, 16), F32))
  with pytest.raises(ValueError, match="fp8_backward must be one of"):
    fx.MultiHeadAttention(2, 16, fp8=True, fp8_backward="exact", rngs=nnx.Rngs(0))
  x = jnp.zeros(x.shape, F32)
  with pytest.raises(ValueError, match="dropout"):
    model(x, deterministic=False)
  with pytest.raises(ValueError, match="causal=True"):
    model(x, deterministic=True, mask=jnp.ones((1, 1, 8, 8), bool))


# ----------------------------------------------------------------------------- examples

def _load_example(name):
  return load_script(f"examples/{name}.py", f"example_{name}")


def test_train_gpt_two_steps_data_parallel_compare(tmp_path):
  train_gpt = _load_example("train_gpt")
  devices = len(jax.local_devices())
  plot = tmp_path / "loss.png"
  results = train_gpt.main(["--small", "--depth", "1", "--steps", "2", "--batch", str(2 * devices),
                            "--parallel", "shard_map", "--compare", "--plot", str(plot),
                            "--quiet"])
  assert [r["attention"] for r in results] == ["jax_fa3", "xla"]
  for r in results:
    assert len(r["losses"]) == 2 and np.all(np.isfinite(r["losses"]))
  # Same init, same data: the two attentions give the same training curve.
  np.testing.assert_allclose(results[0]["losses"], results[1]["losses"], rtol=1e-4)
  assert plot.stat().st_size > 0


def test_train_gpt_compare_fp8(tmp_path):
  # FP8 mode trains from the very same parameters (its rotation signs live outside them); its
  # losses are those of bf16 up to the fp8 error.
  train_gpt = _load_example("train_gpt")
  plot = tmp_path / "loss.png"
  results = train_gpt.main(["--small", "--depth", "1", "--steps", "3", "--compare-fp8", "--plot",
                            str(plot), "--quiet"])
  assert [r["attention"] for r in results] == ["jax_fa3", "jax_fa3_fp8"]
  bf16, fp8 = (np.asarray(r["losses"]) for r in results)
  assert np.all(np.isfinite(fp8))
  assert fp8[0] != bf16[0]  # the FP8 forward ran
  np.testing.assert_allclose(fp8, bf16, rtol=3e-3)  # measured 3e-4 relative after 3 steps
  assert plot.stat().st_size > 0


@pytest.mark.parametrize("name,expected", [("quickstart", "attention_fn drop-in"),
                                           ("gradcheck", "all gradient checks passed")])
def test_example_runs_as_a_script(name, expected):
  # A fresh interpreter, as a user runs it: no x64 or fake devices from this pytest process.
  import os  # noqa: PLC0415
  import subprocess  # noqa: PLC0415
  import jax_fa3  # noqa: PLC0415
  env = {**os.environ, "PYTHONPATH": str(pathlib.Path(jax_fa3.__file__).resolve().parent.parent)}
  env.pop("XLA_FLAGS", None)
  env.pop("JAX_ENABLE_X64", None)
  result = subprocess.run([sys.executable, str(REPO / "examples" / f"{name}.py")], env=env,
                          capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-2000:]
  assert expected in result.stdout


def test_train_gpt_generation_with_the_kv_cache_equals_recomputing():
  # Greedy generation through the layers' KV cache (decode=True) gives the bytes that running the
  # whole sequence through the model again at every step gives.
  train_gpt = _load_example("train_gpt")
  results = train_gpt.main(["--small", "--depth", "1", "--steps", "2", "--quiet"])
  config = train_gpt.model_config(train_gpt.parse_args(["--small", "--depth", "1"]))
  params = results[0]["params"]
  prompt = b"def f("
  cached = train_gpt.generate(config, params, prompt, 12)
  model = train_gpt.GPT(config)
  forward = jax.jit(lambda tokens: model.apply({"params": params}, tokens))
  tokens = list(prompt)
  for _ in range(12):
    logits = forward(jnp.asarray([tokens], jnp.int32))
    tokens.append(int(jnp.argmax(logits[0, -1])))
  assert cached == bytes(tokens[len(prompt):])
  with pytest.raises(ValueError, match="must fit in the model's 64 positions"):
    train_gpt.generate(config, params, prompt, 60)


def test_train_gpt_packed_documents_see_only_themselves():
  # --packed: a row of several files as documents (segment ids, positions restarting per file).
  # Each document's logits inside the packed row equal its logits alone, and training runs.
  train_gpt = _load_example("train_gpt")
  results = train_gpt.main(["--small", "--depth", "1", "--steps", "2", "--packed", "--quiet"])
  assert len(results[0]["losses"]) == 2 and np.all(np.isfinite(results[0]["losses"]))
  config = train_gpt.model_config(train_gpt.parse_args(["--small", "--depth", "1"]))
  model, params = train_gpt.GPT(config), results[0]["params"]
  rng = np.random.default_rng(0)
  lengths = [20, 1, 30, 13]  # four documents filling the 64 positions
  tokens = jnp.asarray(rng.integers(0, 256, (1, sum(lengths))), jnp.int32)
  segments = jnp.asarray(np.repeat(np.arange(4), lengths)[None], jnp.int32)
  packed = jax.jit(lambda t, s: model.apply({"params": params}, t, s))(tokens, segments)
  start = 0
  for n in lengths:
    alone = model.apply({"params": params}, tokens[:, start:start + n])
    np.testing.assert_allclose(np.asarray(packed[:, start:start + n]), np.asarray(alone),
                               rtol=1e-5, atol=1e-5)
    start += n
