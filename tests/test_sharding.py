"""Partitioning rules of the attention ops under jit, shard_map, pmap and vmap (8 CPU devices).

tests/conftest.py sets XLA_FLAGS=--xla_force_host_platform_device_count=8 before JAX starts. The
meshes are built from CPU devices, so on a GPU machine these tests still run the reference path.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_fa3
from cpu_mesh import CPUS, make_mesh
from jax_fa3 import _partitioning, attention
from jax_fa3._config import AttentionConfig

pytestmark = pytest.mark.skipif(len(CPUS) < 8, reason="needs 8 CPU devices (XLA_FLAGS="
                                "--xla_force_host_platform_device_count=8 before JAX starts)")
MESH_KINDS = ["auto", "explicit"]
COLLECTIVES = ("all-gather", "all-to-all", "collective-permute", "all-reduce", "reduce-scatter")


def qkv(b=4, s=64, h=4, h_k=2, d=16, seed=0):
  rng = np.random.default_rng(seed)
  make = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
  return make(b, s, h, d), make(b, s, h_k, d), make(b, s, h_k, d), make(b, s, h, d)


def fwd_bwd(q, k, v, ct, **kw):
  """(out, dq, dk, dv) for cotangent ct: no scalar loss, so no reduction of our own in the HLO."""
  out, vjp = jax.vjp(lambda q, k, v: jax_fa3.flash_attention(q, k, v, **kw), q, k, v)
  return (out,) + vjp(ct)


def on_one_device(fn, *args):
  return jax.device_get(jax.jit(fn)(*jax.device_put(args, CPUS[0])))


def assert_close(got, want, tol=2e-5):
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=tol, atol=tol)


def collectives(hlo):
  return {c: hlo.count(c + "(") + hlo.count(c + "-start(") for c in COLLECTIVES}


def run_sharded(fn, mesh, specs, *args):
  args = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(args, specs)]
  compiled = jax.jit(fn).lower(*args).compile()
  return compiled(*args), compiled.as_text()


@pytest.mark.parametrize("kind", MESH_KINDS)
def test_batch_and_head_sharding_run_locally(kind):
  mesh = make_mesh((2, 2, 2), ("data", "model", "other"), kind)
  args = qkv()
  fn = functools.partial(fwd_bwd, causal=True, softcap=5.0)
  spec = P("data", None, "model", None)
  got, hlo = run_sharded(fn, mesh, [spec] * 4, *args)
  assert_close(got, on_one_device(fn, *args))
  assert all(n == 0 for n in collectives(hlo).values()), collectives(hlo)
  for x in got:
    assert tuple(x.sharding.spec)[:3] == ("data", None, "model")


@pytest.mark.parametrize("kind,causal", [("auto", False), ("auto", True), ("explicit", True)])
def test_sequence_sharding_under_jit_runs_a_ring(kind, causal):
  mesh = make_mesh((2, 4), ("data", "seq"), kind)
  args = qkv()
  fn = functools.partial(fwd_bwd, causal=causal)
  got, hlo = run_sharded(fn, mesh, [P("data", "seq")] * 4, *args)
  assert_close(got, on_one_device(fn, *args))
  counts = collectives(hlo)
  assert counts["collective-permute"] > 0, counts
  assert counts["all-gather"] == 0 and counts["all-to-all"] == 0, counts
  assert tuple(got[0].sharding.spec)[:2] == ("data", "seq")


def test_sliding_window_with_sequence_sharding_gathers_and_is_correct():
  mesh = make_mesh((2, 4), ("data", "seq"), "auto")
  args = qkv()
  fn = functools.partial(fwd_bwd, window_size=(9, 3))
  got, _ = run_sharded(fn, mesh, [P("data", "seq")] * 4, *args)
  assert_close(got, on_one_device(fn, *args))


@pytest.mark.parametrize("kind", MESH_KINDS)
def test_head_dim_sharding_is_replicated(kind):
  mesh = make_mesh((2, 4), ("data", "model"), kind)
  q, k, v, _ = qkv()
  fn = functools.partial(jax_fa3.flash_attention, causal=True)
  (out,), _ = run_sharded(lambda *a: (fn(*a),), mesh, [P("data", None, None, "model")] * 3, q, k, v)
  assert_close([out], [on_one_device(fn, q, k, v)])


def test_mqa_head_sharding_keeps_queries_split():
  mesh = make_mesh((2, 4), ("data", "model"), "auto")
  q, k, v, ct = qkv(h=4, h_k=1)
  fn = functools.partial(fwd_bwd, causal=True)
  got, hlo = run_sharded(fn, mesh, [P("data", None, "model"), P("data"), P("data"),
                                    P("data", None, "model")], q, k, v, ct)
  assert_close(got, on_one_device(fn, q, k, v, ct))
  counts = collectives(hlo)
  assert counts["all-gather"] == 0 and counts["all-to-all"] == 0, counts  # dk/dv: all-reduce


def test_gqa_on_an_explicit_mesh_of_size_one():
  # An Explicit mesh of size one runs the shard_map plan like any other: unpartitioned, the
  # reference path's einsums and reshapes met operands typed with the mesh's axes and failed.
  mesh = make_mesh((1, 1), ("data", "model"), "explicit")
  args = qkv()
  fn = functools.partial(fwd_bwd, causal=True)
  got, _ = run_sharded(fn, mesh, [P("data", None, "model")] * 4, *args)
  assert_close(got, on_one_device(fn, *args))


def test_shard_map_over_flash_attention():
  mesh = make_mesh((4, 2), ("data", "model"), "auto")
  args = qkv()
  fn = functools.partial(fwd_bwd, causal=True)
  spec = P("data", None, "model")
  mapped = _partitioning.shard_map(fn, mesh, (spec,) * 4, (spec,) * 4)
  got, hlo = run_sharded(mapped, mesh, [spec] * 4, *args)
  assert_close(got, on_one_device(fn, *args))
  assert all(n == 0 for n in collectives(hlo).values()), collectives(hlo)


@pytest.mark.skipif(not hasattr(jax, "shard_map"), reason="jax.shard_map (with check_vma) needs JAX >= 0.7")
def test_users_checked_shard_map_over_flash_attention():
  # A user's own jax.shard_map keeps its default check_vma=True: scan carries must stay typed.
  mesh = make_mesh((4, 2), ("data", "model"), "auto")
  args = qkv()
  fn = functools.partial(fwd_bwd, causal=True)
  spec = P("data", None, "model")
  mapped = jax.shard_map(fn, mesh=mesh, in_specs=(spec,) * 4, out_specs=(spec,) * 4)
  got, _ = run_sharded(mapped, mesh, [spec] * 4, *args)
  assert_close(got, on_one_device(fn, *args))


@pytest.mark.skipif(not hasattr(jax, "shard_map"), reason="jax.shard_map (with check_vma) needs JAX >= 0.7")
@pytest.mark.parametrize("keys_split_alone", [False, True])
def test_kernel_branch_types_match_under_checked_shard_map(monkeypatch, keys_split_alone):
  """The kernel branch of lax.platform_dependent is traced on every platform: inside a user's
  checked shard_map its results must vary over the same mesh axes as the pure-JAX branch's, or
  tracing fails (as it did on the H200). Traced here with the kernel branch switched on; only
  the CPU branch is lowered, so nothing needs the extension."""
  from jax_fa3 import _ffi, _local_attention  # noqa: PLC0415
  monkeypatch.setattr(_local_attention, "_use_kernel", lambda target, q: True)
  monkeypatch.setattr(_ffi, "flash_bwd_workspace_bytes", lambda *args: 16)
  mesh = make_mesh((4, 2), ("data", "model"), "auto")
  args = [x.astype(jnp.bfloat16) for x in qkv()]
  if keys_split_alone:
    # k and v vary over "model" and q does not: the output varies over both axes all the same.
    # (Forward only: a cotangent must vary like the output, which q's spec cannot express.)
    split = P("data", "model")
    mapped = jax.shard_map(lambda q, k, v: jax_fa3.flash_attention(q, k, v, causal=True),
                           mesh=mesh, in_specs=(P("data"), split, split), out_specs=split)
    assert "jax_fa3_flash_fwd" in str(jax.make_jaxpr(mapped)(*args[:3]))
    return
  spec = P("data", None, "model")
  mapped = jax.shard_map(functools.partial(fwd_bwd, causal=True), mesh=mesh,
                         in_specs=(spec,) * 4, out_specs=(spec,) * 4)
  jaxpr = str(jax.make_jaxpr(mapped)(*args))
  assert "jax_fa3_flash_fwd" in jaxpr and "jax_fa3_flash_bwd" in jaxpr


def test_pmap_over_flash_attention():
  q, k, v, ct = qkv()
  fn = functools.partial(fwd_bwd, causal=True)
  split = lambda x: x.reshape((4, 1) + x.shape[1:])
  got = jax.pmap(fn, devices=CPUS[:4])(*map(split, (q, k, v, ct)))
  want = on_one_device(fn, q, k, v, ct)
  assert_close([g.reshape(w.shape) for g, w in zip(got, want)], want)


def test_vmap_composes_with_the_partitioning_rules():
  mesh = make_mesh((2, 4), ("data", "model"), "auto")
  q, k, v, _ = qkv(h=8, h_k=4)
  stack = lambda x: jnp.stack([x, 2 * x])
  fn = jax.vmap(functools.partial(jax_fa3.flash_attention, causal=True))
  spec = P("data", None, None, "model")  # vmapped axis and heads sharded
  (out,), hlo = run_sharded(lambda *a: (fn(*a),), mesh, [spec] * 3, *map(stack, (q, k, v)))
  assert_close([out], [on_one_device(fn, *map(stack, (q, k, v)))])
  assert all(n == 0 for n in collectives(hlo).values()), collectives(hlo)


def fp8_fwd_bwd(q, k, v, ct, backward="bf16"):
  """flash_attention_fp8 (emulated here: same partitioned op as the kernel path) and its
  straight-through gradients."""
  fn = lambda q, k, v: jax_fa3.flash_attention_fp8(q, k, v, causal=True, key=jax.random.key(3),
                                                   backward=backward)
  out, vjp = jax.vjp(fn, q, k, v)
  return (out,) + vjp(ct)


@pytest.mark.parametrize("kind,backward", [(kind, "bf16") for kind in MESH_KINDS]
                         + [(MESH_KINDS[0], "fp8")])
def test_fp8_batch_and_head_sharding_run_locally(kind, backward):
  """Scales are per (batch, head, block of tokens) and v's per (batch, kv head), so a batch or
  head shard quantizes exactly as the whole: the output is the one-device output bit for bit,
  with no collective (before the op was partitioned, Explicit meshes failed to type-check the
  pure-JAX path, and on the GPU its CUDA passes were opaque to XLA)."""
  mesh = make_mesh((2, 2, 2), ("data", "model", "other"), kind)
  args = qkv(s=96, d=32)
  spec = P("data", None, "model", None)
  fn = functools.partial(fp8_fwd_bwd, backward=backward)
  got, hlo = run_sharded(fn, mesh, [spec] * 4, *args)
  want = on_one_device(fn, *args)
  np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
  assert_close(got[1:], want[1:])
  assert all(n == 0 for n in collectives(hlo).values()), collectives(hlo)
  assert tuple(got[0].sharding.spec)[:3] == ("data", None, "model")


def test_fp8_sequence_sharding_gathers_and_is_exact():
  """A sequence split would move the quantization blocks (and v's scale spans the sequence): the
  fp8 op gathers the sequence instead; the output is the one-device output bit for bit."""
  mesh = make_mesh((2, 4), ("data", "seq"), "auto")
  args = qkv(s=128, d=32)
  got, hlo = run_sharded(fp8_fwd_bwd, mesh, [P("data", "seq")] * 4, *args)
  want = on_one_device(fp8_fwd_bwd, *args)
  np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
  assert_close(got[1:], want[1:])
  assert collectives(hlo)["all-gather"] > 0


def test_fp8_vmap_over_rotation_keys_under_a_mesh():
  """Per-lane signs cannot be folded into the batch: the lanes run the local op under vmap."""
  mesh = make_mesh((2, 4), ("data", "model"), "auto")
  q, k, v, _ = qkv(h=8, h_k=4, d=32)
  keys = jax.random.split(jax.random.key(0), 2)
  fn = lambda q, k, v: jax.vmap(
      lambda key: jax_fa3.flash_attention_fp8(q, k, v, key=key))(keys)
  (out,), _ = run_sharded(lambda *a: (fn(*a),), mesh, [P("data", None, "model")] * 3, q, k, v)
  for i in range(2):
    lane = on_one_device(lambda q, k, v: jax_fa3.flash_attention_fp8(q, k, v, key=keys[i]),
                         q, k, v)
    np.testing.assert_array_equal(np.asarray(out[i]), np.asarray(lane))


@pytest.mark.skipif(not hasattr(jax.config, "jax_use_shardy_partitioner"),
                    reason="no Shardy switch in this JAX")
def test_gspmd_partitioner_callbacks():
  mesh = make_mesh((2, 4), ("data", "model"), "auto")
  args = qkv(h=8, h_k=4)
  fn = functools.partial(fwd_bwd, causal=True)
  before = jax.config.jax_use_shardy_partitioner
  jax.config.update("jax_use_shardy_partitioner", False)
  try:
    got, hlo = run_sharded(fn, mesh, [P("data", None, "model")] * 4, *args)
  finally:
    jax.config.update("jax_use_shardy_partitioner", before)
  assert_close(got, on_one_device(fn, *args))
  assert all(n == 0 for n in collectives(hlo).values()), collectives(hlo)


def test_plan_per_axis():
  sizes = {"b": 2, "h": 4, "s": 2, "d": 2}
  cfg = AttentionConfig(softmax_scale=0.25, window_right=0)
  q, kv = (4, 64, 8, 16), (4, 64, 4, 16)
  plan = lambda qs, ks, c=cfg, kvs=kv: _partitioning.plan_partition(
      attention.FORWARD, [q, kvs, kvs], [qs, ks, ks], sizes, c)
  assert plan((("b",), (), ("h",), ()), (("b",), (), ("h",), ())) == _partitioning.Plan(
      batch=("b",), heads=("h",), kv_heads=("h",))
  assert plan(((), ("s",), (), ("d",)), ((), ("s",), (), ())) == _partitioning.Plan(
      seq_q=("s",), seq_k=("s",), ring_axes=("s",))
  windowed = AttentionConfig(softmax_scale=0.25, window_left=4)
  assert plan(((), ("s",), (), ()), ((), ("s",), (), ()), windowed) == _partitioning.Plan()
  full = AttentionConfig(softmax_scale=0.25)
  assert plan(((), ("s",), (), ()), ((), (), (), ()), full) == _partitioning.Plan(seq_q=("s",))
  gqa = (4, 64, 2, 16)  # 4 head shards do not divide 2 kv heads: heads replicated
  assert plan(((), (), ("h",), ()), ((), (), (), ()), cfg, gqa) == _partitioning.Plan()


def paged_decode(q, k_pool, v_pool, table, lengths, splits=1):
  """A decode step over a paged cache read in place (`_cache_attention.Pages`), through the
  partitioned paged op (on the CPU its body gathers the pages and runs the reference)."""
  from jax_fa3 import _cache_attention  # noqa: PLC0415
  cfg = AttentionConfig(softmax_scale=q.shape[-1] ** -0.5, window_right=0)
  pages = _cache_attention.Pages(k_pool, v_pool, table)
  return (_cache_attention.attend(q, pages, None, lengths, cfg, False, splits),)


@pytest.mark.parametrize("kind,splits", [("auto", 1), ("auto", 2), ("explicit", 1)])
def test_paged_cache_batch_and_head_sharding_run_locally(kind, splits):
  """Batch rows (queries, page tables, lengths) and heads stay on their devices; the pools are
  replicated along their pages (any row may read any page) and split by heads like k/v: no
  collective, and the one-device result. Split-KV cuts each row's table into pieces first. The
  call is a partitioned op, as it must be on the GPU, where the paged kernel is opaque to XLA
  (here the pure-JAX body would partition by itself)."""
  mesh = make_mesh((2, 2, 2), ("data", "model", "other"), kind)
  rng = np.random.default_rng(3)
  b, h, h_k, d, page, per_seq = 4, 4, 2, 16, 8, 6
  num_pages = b * per_seq + 3
  q = jnp.asarray(rng.standard_normal((b, 1, h, d)), jnp.float32)
  k_pool, v_pool = (jnp.asarray(rng.standard_normal((num_pages, page, h_k, d)), jnp.float32)
                    for _ in range(2))
  table = jnp.asarray(rng.permutation(num_pages)[:b * per_seq].reshape(b, per_seq), jnp.int32)
  lengths = jnp.asarray([48, 1, 30, 17], jnp.int32)
  fn = functools.partial(paged_decode, splits=splits)
  specs = [P("data", None, "model"), P(None, None, "model"), P(None, None, "model"),
           P("data"), P("data")]
  if kind == "auto":
    assert "custom_partitioning" in str(jax.make_jaxpr(fn)(q, k_pool, v_pool, table, lengths))
  (got,), hlo = run_sharded(fn, mesh, specs, q, k_pool, v_pool, table, lengths)
  (want,) = on_one_device(fn, q, k_pool, v_pool, table, lengths)
  assert_close([got], [want])
  assert all(n == 0 for n in collectives(hlo).values()), collectives(hlo)
  assert tuple(got.sharding.spec)[:3] == ("data", None, "model")


def fp8_cache_decode(q, k8, v8, k_scales, v_scales, lengths, *table, block=8, splits=1):
  """A decode step over an e4m3 cache read in place (`_fp8_cache_decode`), through its
  partitioned op (on the CPU its body dequantizes and runs the reference)."""
  from jax_fa3 import _fp8_cache_decode  # noqa: PLC0415
  cfg = AttentionConfig(softmax_scale=q.shape[-1] ** -0.5, window_right=0)
  cache = _fp8_cache_decode.Fp8Cache(k8, v8, k_scales, v_scales, table[0] if table else None)
  return (_fp8_cache_decode.decode(q, cache, block, lengths, cfg, False, splits),)


@pytest.mark.parametrize("paged,splits", [(False, 1), (False, 2), (True, 2)])
def test_fp8_cache_decode_batch_and_head_sharding_run_locally(paged, splits):
  """As the paged decode above, for an e4m3 cache and its scales: batch rows and heads stay on
  their devices (a pool's pages and its scales' blocks replicated), no collective, the
  one-device result."""
  mesh = make_mesh((2, 2, 2), ("data", "model", "other"), "auto")
  rng = np.random.default_rng(5)
  b, h, h_k, d, block, capacity = 4, 4, 2, 16, 8, 48
  rows, slots = (b * 6 + 3, 8) if paged else (b, capacity)
  q = jnp.asarray(rng.standard_normal((b, 1, h, d)), jnp.float32)
  (k8, ks), (v8, vs) = (jax_fa3.quantize_fp8(jnp.asarray(
      rng.standard_normal((rows, slots, h_k, d)), jnp.float32), block_size=block)
      for _ in range(2))
  lengths = jnp.asarray([48, 1, 30, 17], jnp.int32)
  args = [q, k8, v8, ks, vs, lengths]
  cache_spec, scale_spec = (P(None, None, "model"), P(None, "model")) if paged else (
      P("data", None, "model"), P("data", "model"))
  specs = [P("data", None, "model"), cache_spec, cache_spec, scale_spec, scale_spec, P("data")]
  if paged:
    args.append(jnp.asarray(rng.permutation(rows)[:b * 6].reshape(b, 6), jnp.int32))
    specs.append(P("data"))
  fn = functools.partial(fp8_cache_decode, block=block, splits=splits)
  assert "custom_partitioning" in str(jax.make_jaxpr(fn)(*args))
  (got,), hlo = run_sharded(fn, mesh, specs, *args)
  (want,) = on_one_device(fn, *args)
  assert_close([got], [want])
  assert all(n == 0 for n in collectives(hlo).values()), collectives(hlo)
  assert tuple(got.sharding.spec)[:3] == ("data", None, "model")
