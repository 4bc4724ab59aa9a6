"""Ring attention (sequence parallelism) inside shard_map and pmap, on 8 CPU devices.

tests/conftest.py sets XLA_FLAGS=--xla_force_host_platform_device_count=8 before JAX starts.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_fa3
from cpu_mesh import CPUS, make_mesh
from jax_fa3 import _partitioning, ring

pytestmark = pytest.mark.skipif(len(CPUS) < 8, reason="needs 8 CPU devices (XLA_FLAGS="
                                "--xla_force_host_platform_device_count=8 before JAX starts)")


def qkv(b=2, s=128, h=4, h_k=2, d=16, seed=0):
  rng = np.random.default_rng(seed)
  make = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
  return make(b, s, h, d), make(b, s, h_k, d), make(b, s, h_k, d), make(b, s, h, d)


def vjp_of(attention):
  def fn(q, k, v, ct):
    out, vjp = jax.vjp(attention, q, k, v)
    return (out,) + vjp(ct)
  return fn


def single_device(q, k, v, ct, **kw):
  fn = vjp_of(functools.partial(jax_fa3.flash_attention, **kw))
  return jax.device_get(jax.jit(fn)(*jax.device_put((q, k, v, ct), CPUS[0])))


def assert_close(got, want, tol=2e-5):
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=tol, atol=tol)


def count(hlo, op):
  return hlo.count(op + "(") + hlo.count(op + "-start(")


def test_zigzag_order():
  idx = ring.zigzag_indices(16, 4)  # 8 chunks of 2: device r holds chunks r and 7 - r
  np.testing.assert_array_equal(idx.reshape(4, 2, 2)[:, :, 0], [[0, 14], [2, 12], [4, 10], [6, 8]])
  x = jnp.arange(2 * 16 * 3).reshape(2, 16, 3)
  np.testing.assert_array_equal(ring.zigzag_unpermute(ring.zigzag_permute(x, 4), 4), x)
  np.testing.assert_array_equal(ring.zigzag_permute(x, 4)[:, 2], x[:, 14])
  with pytest.raises(ValueError, match="divisible"):
    ring.zigzag_indices(12, 4)


@pytest.mark.parametrize("causal,zigzag,softcap", [
    (False, False, 0.0), (True, False, 0.0), (True, True, 5.0)])
def test_ring_attention_in_shard_map(causal, zigzag, softcap):
  mesh = make_mesh((2, 4), ("data", "seq"))
  q, k, v, ct = qkv()
  order = ((lambda x: ring.zigzag_permute(x, 4)) if zigzag else (lambda x: x))
  unorder = ((lambda x: ring.zigzag_unpermute(x, 4)) if zigzag else (lambda x: x))
  attention = functools.partial(ring.ring_attention, axis_name="seq", causal=causal,
                                softcap=softcap, zigzag=zigzag)
  spec = P("data", "seq")
  fn = _partitioning.shard_map(vjp_of(attention), mesh, (spec,) * 4, (spec,) * 4)
  args = [jax.device_put(order(x), NamedSharding(mesh, spec)) for x in (q, k, v, ct)]
  compiled = jax.jit(fn).lower(*args).compile()
  got = [unorder(x) for x in compiled(*args)]
  assert_close(got, single_device(q, k, v, ct, causal=causal, softcap=softcap))
  hlo = compiled.as_text()
  assert count(hlo, "collective-permute") > 0
  assert count(hlo, "all-gather") == 0 and count(hlo, "all-to-all") == 0


@pytest.mark.parametrize("kind", ["auto", "explicit"])
def test_sequence_parallel_attention_under_jit(kind):
  mesh = make_mesh((2, 4), ("data", "seq"), kind)
  q, k, v, ct = qkv()
  attention = functools.partial(ring.sequence_parallel_attention, mesh=mesh, seq_axis="seq",
                                batch_axis="data", causal=True, zigzag=True)
  spec = NamedSharding(mesh, P("data", "seq"))
  args = [jax.device_put(ring.zigzag_permute(x, 4), spec) for x in (q, k, v, ct)]
  got = jax.jit(vjp_of(attention))(*args)
  assert tuple(got[0].sharding.spec)[:2] == ("data", "seq")
  got = [ring.zigzag_unpermute(x, 4) for x in got]
  assert_close(got, single_device(q, k, v, ct, causal=True))


def test_ring_attention_under_pmap():
  q, k, v, _ = qkv(b=1)
  split = lambda x: jnp.moveaxis(x.reshape(1, 8, 16, *x.shape[2:]), 1, 0)  # (8, b, s/8, h, d)
  fn = jax.pmap(functools.partial(ring.ring_attention, axis_name="i", causal=True, zigzag=False),
                axis_name="i", devices=CPUS[:8])
  out = jnp.moveaxis(fn(split(q), split(k), split(v)), 0, 1).reshape(q.shape)
  want = jax_fa3.flash_attention(q, k, v, causal=True)
  assert_close([out], [want])


def test_ring_attention_rejects_what_it_cannot_do():
  q, k, v, _ = qkv(b=1, s=16)
  with pytest.raises(NotImplementedError, match="sliding windows"):
    ring.ring_attention(q, k, v, axis_name="seq", window_size=(4, 0))
  with pytest.raises(NotImplementedError, match="seqlen_q == seqlen_k"):
    ring.ring_attention(q[:, :8], k, v, axis_name="seq", causal=True)
