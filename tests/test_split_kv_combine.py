"""The merge of split-KV decoding's pieces (jax_fa3._cache_attention._merge), on any machine: the
XLA merge against a float64 model, the dispatch (XLA without the kernels), and the program a
Hopper GPU would run, traced and lowered here with the kernels faked present: one
jax_fa3_split_kv_combine call per decode step, vmap folded into it, batch and head shards merged
on their devices. tests/test_gpu_split_kv_combine.py runs the kernel itself."""
import jax
import jax.export  # a submodule JAX 0.6 does not import with jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_fa3
from cpu_mesh import CPUS, make_mesh
from jax_fa3 import _cache_attention, _ffi
from kernel_targets import SPLIT_KV_COMBINE, jaxpr_equations, kernel_targets

COLLECTIVES = ("all-gather", "all-to-all", "collective-permute", "all-reduce", "reduce-scatter")


def _pieces(seed, b, n, rows, heads, d, dtype=jnp.float32):
  """Pieces with empty ones (lse +inf), a (row, head) of batch row 0 whose pieces are all empty,
  and lse spread over ±60 (weights from 1 down to underflow)."""
  rng = np.random.default_rng(seed)
  out = rng.standard_normal((b * n, rows, heads, d))
  lse = rng.standard_normal((b * n, heads, rows)) * 20
  lse[rng.random(lse.shape) < 0.25] = np.inf
  lse[:n, 0, 0] = np.inf
  out[np.isinf(lse).transpose(0, 2, 1)] = 0.0  # what the attention kernels write for no key
  return jnp.asarray(out, dtype), jnp.asarray(lse, jnp.float32)


def _model(out, lse, b, n):
  """The merge in float64: out = sum_p softmax_p(lse) out_p over the non-empty pieces."""
  out = np.asarray(out, np.float64).reshape((b, n) + out.shape[1:])
  lse = np.asarray(lse, np.float64).reshape((b, n) + lse.shape[1:])
  seen = np.isfinite(lse)
  top = np.where(seen, lse, -np.inf).max(axis=1)
  top0 = np.where(np.isfinite(top), top, 0)[:, None]
  weight = np.where(seen, np.exp(np.where(seen, lse, 0) - top0), 0)
  total = weight.sum(axis=1)
  merged = np.where(total > 0, top + np.log(np.where(total > 0, total, 1)), np.inf)
  weight = np.swapaxes(weight / np.where(total > 0, total, 1)[:, None], 2, 3)[..., None]
  return (weight * out).sum(axis=1), merged


@pytest.mark.parametrize("n", [1, 2, 3, 37])
def test_xla_merge_matches_the_float64_model(n):
  b, rows, heads, d = 3, 2, 5, 16
  out, lse = _pieces(n, b, n, rows, heads, d)
  got_out, got_lse = jax.jit(_cache_attention._merge_xla, static_argnums=(2, 3, 4))(
      out, lse, b, n, jnp.float32)
  want_out, want_lse = _model(out, lse, b, n)
  np.testing.assert_allclose(np.asarray(got_out), want_out, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(np.isinf(np.asarray(got_lse)), np.isinf(want_lse))
  finite = np.isfinite(want_lse)
  np.testing.assert_allclose(np.asarray(got_lse)[finite], want_lse[finite], rtol=1e-6, atol=1e-5)
  assert np.isposinf(np.asarray(got_lse)[0, 0, 0]) and not np.asarray(got_out)[0, 0, 0].any()


def test_xla_merge_rounds_once_to_the_output_dtype():
  b, n, rows, heads, d = 2, 5, 3, 2, 32
  out, lse = _pieces(7, b, n, rows, heads, d, jnp.bfloat16)
  merge = jax.jit(_cache_attention._merge_xla, static_argnums=(2, 3, 4))
  got, got_lse = merge(out, lse, b, n, jnp.bfloat16)
  want, want_lse = merge(out, lse, b, n, jnp.float32)
  assert got.dtype == jnp.bfloat16 and got_lse.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(got, np.float32),
                                np.asarray(want.astype(jnp.bfloat16), np.float32))
  np.testing.assert_array_equal(np.asarray(got_lse), np.asarray(want_lse))


@pytest.fixture
def kernels_faked(monkeypatch):
  """The kernels reported present (nothing runs on them here: a program compiled for the CPU
  lowers the XLA branch of every platform_dependent)."""
  monkeypatch.setattr(_ffi, "kernels_available", lambda: True)
  monkeypatch.setattr(_ffi, "has_target", lambda name: True)
  monkeypatch.setattr(_ffi, "ensure_registered", lambda: None)
  monkeypatch.setattr(_ffi, "build_config",
                      lambda: {"head_dims": ("64", "96", "128", "192", "256"),
                               "dtypes": ("bf16", "fp16")})


def _decode_case(dtype=jnp.bfloat16, b=3, cap=640, h=8, h_k=2, d=64, seed=0):
  """A decode step's operands; the default capacity is 4 or 5 of the kernels' key blocks (160
  keys at d <= 64, 128 at d = 128), so that it splits into up to that many pieces."""
  rng = np.random.default_rng(seed)
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)
  lengths = jnp.asarray([cap, 0, 17][:b] + [cap // 2] * max(0, b - 3), jnp.int32)
  return normal(b, 1, h, d), normal(b, cap, h_k, d), normal(b, cap, h_k, d), lengths


def _decoder(splits=4):
  """A decode step, a new function each time: JAX caches traces by function, and whether the
  kernel is called is decided when tracing (the kernels' presence is faked or not per test)."""
  return lambda q, k_cache, v_cache, lengths: jax_fa3.flash_attention_with_kvcache(
      q, k_cache, v_cache, cache_seqlens=lengths, causal=True, num_splits=splits,
      return_lse=True)


def _combine_calls(fn, *args):
  """The operand and result avals of every jax_fa3_split_kv_combine call in fn's jaxpr, the
  nested jaxprs' (custom_partitioning, platform_dependent's branches) too."""
  avals = lambda vs: [(tuple(v.aval.shape), np.dtype(v.aval.dtype)) for v in vs]
  return [(avals(e.invars), avals(e.outvars)) for e in jaxpr_equations(fn, *args)
          if e.primitive.name == "ffi_call" and e.params["target_name"] == SPLIT_KV_COMBINE]


@pytest.mark.skipif(jax_fa3.kernels_available(), reason="the XLA merge is taken off the kernels")
def test_without_kernels_the_merge_is_xla():
  q, k_cache, v_cache, lengths = _decode_case()
  assert not _cache_attention.combine_kernel_applies(
      jnp.zeros((12, 4, 2, 64), jnp.bfloat16), jnp.zeros((12, 2, 4), jnp.float32), jnp.bfloat16)
  assert _combine_calls(_decoder(), q, k_cache, v_cache, lengths) == []
  text = jax.jit(_decoder()).lower(q, k_cache, v_cache, lengths).as_text()
  assert not kernel_targets(text) and "custom_partitioning" not in text


@pytest.mark.parametrize("dtype,d,applies", [
    (jnp.bfloat16, 64, True), (jnp.float16, 256, True), (jnp.float32, 96, True),
    (jnp.bfloat16, 36, False),   # not a multiple of 8
    (jnp.bfloat16, 264, False),  # past 256
    (jnp.float32, 0, False),
    (jnp.float64, 64, False),    # the float64 path merges in XLA
])
def test_the_kernel_takes_its_dtypes_and_head_dims(kernels_faked, dtype, d, applies):
  out = jnp.zeros((4, 1, 2, d), dtype)
  lse = jnp.zeros((4, 2, 1), jnp.float32 if dtype != jnp.float64 else jnp.float64)
  assert _cache_attention.combine_kernel_applies(out, lse, dtype) == applies
  assert not _cache_attention.combine_kernel_applies(out, lse, jnp.float32 if dtype
                                                     != jnp.float32 else jnp.bfloat16)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_decode_builds_one_combine_call(kernels_faked, dtype):
  # The decode step's pieces (b, n, h, d) merge as (b * n) rows of one query: no transpose.
  b, n, h, h_k, d = 3, 4, 8, 2, 64
  q, k_cache, v_cache, lengths = _decode_case(dtype, b=b, h=h, h_k=h_k, d=d)
  ((operands, results),) = _combine_calls(_decoder(), q, k_cache, v_cache, lengths)
  assert operands == [((b * n, 1, h, d), np.dtype(dtype)),
                      ((b * n, h, 1), np.dtype(np.float32))]
  assert results == [((b, 1, h, d), np.dtype(dtype)), ((b, h, 1), np.dtype(np.float32))]
  # vmap folds into the batch rows: one call over lanes * b rows.
  lanes = 2
  stack = lambda x: jnp.stack([x] * lanes)
  ((operands, results),) = _combine_calls(jax.vmap(_decoder()), *map(stack, (q, k_cache, v_cache,
                                                                           lengths)))
  assert operands[0][0] == (lanes * b * n, 1, h, d)
  assert results[0][0] == (lanes * b, 1, h, d)


def test_gpu_decode_program_calls_the_combine_once(kernels_faked):
  """The decode step a Hopper GPU would run, lowered for platform CUDA (jax.export; nothing
  runs): the merge is one jax_fa3_split_kv_combine call, vmapped or not, and no XLA merge; the
  pieces come from one decode-target call, so no key ranges are built."""
  checks = [jax.export.DisabledSafetyCheck.custom_call(t) for t in
            ("jax_fa3_flash_fwd_key_ranges", "jax_fa3_flash_fwd_row_bounds",
             "jax_fa3_flash_fwd_paged", "jax_fa3_flash_fwd_decode", SPLIT_KV_COMBINE)]
  q, k_cache, v_cache, lengths = _decode_case(jnp.bfloat16, d=128, seed=5)

  def lowered(fn, *args):
    return jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)(
        *args).mlir_module()

  text = lowered(_decoder(), q, k_cache, v_cache, lengths)
  assert text.count(f"@{SPLIT_KV_COMBINE}(") == 1
  assert text.count("@jax_fa3_flash_fwd_decode(") == 1
  assert "@jax_fa3_flash_fwd_key_ranges(" not in text
  assert "@jax_fa3_flash_fwd_row_bounds(" not in text
  assert "stablehlo.exponential" not in text  # the XLA merge's exp: not lowered for CUDA
  stack = lambda x: jnp.stack([x, x])
  text = lowered(jax.vmap(_decoder()), *map(stack, (q, k_cache, v_cache, lengths)))
  assert text.count(f"@{SPLIT_KV_COMBINE}(") == 1
  assert lowered(_decoder(splits=1), q, k_cache, v_cache,
                 lengths).count(f"@{SPLIT_KV_COMBINE}(") == 0


def test_the_partitioned_merge_on_the_cpu_is_the_xla_merge(kernels_faked):
  # The kernel's wrapper (custom_partitioning, vmap rule) around the XLA branch: the values of
  # the plain XLA merge, bit for bit.
  b, n, rows, heads, d = 2, 3, 4, 2, 64
  out, lse = _pieces(11, b, n, rows, heads, d, jnp.bfloat16)
  got = jax.jit(lambda o, l: _cache_attention._merge(o, l, b, n, jnp.bfloat16))(out, lse)
  want = jax.jit(lambda o, l: _cache_attention._merge_xla(o, l, b, n, jnp.bfloat16))(out, lse)
  assert "custom_partitioning" in str(jax.make_jaxpr(
      lambda o, l: _cache_attention._merge(o, l, b, n, jnp.bfloat16))(out, lse))
  for g, w in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
  lanes = jax.vmap(lambda o, l: _cache_attention._merge(o, l, b, n, jnp.bfloat16))(
      jnp.stack([out, out[::-1]]), jnp.stack([lse, lse[::-1]]))
  for lane, (o, l) in enumerate([(out, lse), (out[::-1], lse[::-1])]):
    want = _cache_attention._merge_xla(o, l, b, n, jnp.bfloat16)
    for g, w in zip(lanes, want):
      np.testing.assert_array_equal(np.asarray(g[lane], np.float32), np.asarray(w, np.float32))


@pytest.mark.skipif(len(CPUS) < 8, reason="needs 8 CPU devices (tests/conftest.py)")
def test_batch_and_head_shards_merge_on_their_devices(kernels_faked):
  """Batch rows and kv heads sharded: the partitioned merge runs on each device's pieces, no
  collective (an opaque FFI call would have its operands gathered), the one-device values."""
  mesh = make_mesh((2, 2, 2), ("data", "model", "other"), "auto")
  q, k_cache, v_cache, lengths = _decode_case(jnp.float32, b=4, cap=320, h=4, h_k=2, d=16, seed=3)
  specs = [P("data", None, "model"), P("data", None, "model"), P("data", None, "model"),
           P("data")]
  fn = _decoder(splits=2)
  args = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip((q, k_cache, v_cache,
                                                                     lengths), specs)]
  compiled = jax.jit(fn).lower(*args).compile()
  got = compiled(*args)
  hlo = compiled.as_text()
  assert all(hlo.count(c + "(") + hlo.count(c + "-start(") == 0 for c in COLLECTIVES), hlo
  one_device = jax.device_put((q, k_cache, v_cache, lengths), CPUS[0])
  want = jax.device_get(jax.jit(_decoder(splits=2))(*one_device))
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-6, atol=2e-6)
  assert tuple(got[0].sharding.spec)[:3] == ("data", None, "model")


@pytest.mark.skipif(len(CPUS) < 8, reason="needs 8 CPU devices (tests/conftest.py)")
@pytest.mark.parametrize("n", [1, 3])
def test_sharded_pieces_merge_on_their_devices(kernels_faked, n):
  # Batch rows over "data", query rows over "other", heads over "model" (n = 1: no compound
  # factor in the sharding rule).
  mesh = make_mesh((2, 2, 2), ("data", "model", "other"), "auto")
  b, rows, heads, d = 4, 2, 6, 32
  out, lse = _pieces(n, b, n, rows, heads, d, jnp.bfloat16)
  merge = jax.jit(lambda o, l: _cache_attention._merge(o, l, b, n, jnp.bfloat16))
  args = (jax.device_put(out, NamedSharding(mesh, P("data", "other", "model"))),
          jax.device_put(lse, NamedSharding(mesh, P("data", "model", "other"))))
  compiled = merge.lower(*args).compile()
  hlo = compiled.as_text()
  assert all(hlo.count(c + "(") + hlo.count(c + "-start(") == 0 for c in COLLECTIVES), hlo
  got = compiled(*args)
  want = _cache_attention._merge_xla(out, lse, b, n, jnp.bfloat16)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
  assert tuple(got[0].sharding.spec)[:3] == ("data", "other", "model")
  assert tuple(got[1].sharding.spec) == ("data", "model", "other")
