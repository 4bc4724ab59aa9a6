"""What users compose flash_attention with, through the bf16/fp16 kernels (GPU only): jit, vmap,
grad, value_and_grad, remat; sharded jit on Auto and Explicit meshes and shard_map on one device;
ring attention over two devices.

Each case asserts the kernel targets of the executable it runs (tests/kernel_targets.py) and
checks outputs and gradients against the float64 oracle with FlashAttention-3's criterion
(tests/fa3_criterion.py).
"""
import functools
import os

os.environ["JAX_FA3_DEBUG_POISON_OUTPUTS"] = "1"  # unwritten kernel outputs are NaN

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jax_fa3  # noqa: E402
from fa3_criterion import C, check_grads, check_output, eps, naive_attention  # noqa: E402
from kernel_build import skip_unless_compiled  # noqa: E402
from kernel_targets import (FLASH_BWD, FLASH_FWD, compile_on_kernels,  # noqa: E402
                            kernel_targets, run_on_kernels)
from oracle import oracle_attention  # noqa: E402

pytestmark = pytest.mark.gpu

DTYPES = [jnp.bfloat16, jnp.float16]
# A non-default scale and causal GQA: a slip in either moves values far past the criterion.
OPTIONS = dict(causal=True, softmax_scale=0.1)
FWD_BWD = {FLASH_FWD, FLASH_BWD}


def _inputs(seed, dtype, b=2, s=256, h=4, h_k=2, d=128):
  rng = np.random.default_rng(seed)
  make = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)
  q, k, v, do = make(b, s, h, d), make(b, s, h_k, d), make(b, s, h_k, d), make(b, s, h, d)
  skip_unless_compiled(q)
  return q, k, v, do


def _loss(q, k, v, do, **options):
  out = jax_fa3.flash_attention(q, k, v, **options)
  return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32))


def _grads(**options):
  return jax.grad(functools.partial(_loss, **options), argnums=(0, 1, 2))


def _out_and_grads(**options):
  """(q, k, v, dout) -> (out, dq, dk, dv) by one vjp."""
  def fn(q, k, v, do):
    out, vjp = jax.vjp(functools.partial(jax_fa3.flash_attention, **options), q, k, v)
    return (out,) + vjp(do)
  return fn


def _check_out_and_grads(results, q, k, v, do, **options):
  out, *grads = results
  check_output(out, q, k, v, **options)
  check_grads(grads, q, k, v, do, **options)


@pytest.mark.parametrize("dtype", DTYPES)
def test_jit(dtype):
  q, k, v, _ = _inputs(0, dtype)
  out = run_on_kernels(functools.partial(jax_fa3.flash_attention, **OPTIONS), q, k, v,
                       expected=FLASH_FWD)
  check_output(out, q, k, v, **OPTIONS)


@pytest.mark.parametrize("dtype", DTYPES)
def test_grad(dtype):
  q, k, v, do = _inputs(1, dtype)
  grads = run_on_kernels(lambda q, k, v: _grads(**OPTIONS)(q, k, v, do), q, k, v,
                         expected=FWD_BWD)
  check_grads(grads, q, k, v, do, **OPTIONS)


@pytest.mark.parametrize("dtype", DTYPES)
def test_value_and_grad(dtype):
  q, k, v, do = _inputs(2, dtype)
  value_and_grad = jax.value_and_grad(functools.partial(_loss, **OPTIONS), argnums=(0, 1, 2))
  loss, grads = run_on_kernels(value_and_grad, q, k, v, do, expected=FWD_BWD)
  check_grads(grads, q, k, v, do, **OPTIONS)
  # The loss is a dout-weighted sum of outputs, so the criterion's elementwise bound on the
  # output, weighted by |dout|, bounds it; 1e-5 relative covers the float32 sum of 2^18 terms.
  q64, k64, v64, do64 = (np.asarray(x, np.float64) for x in (q, k, v, do))
  ref_out, _ = oracle_attention(q64, k64, v64, **OPTIONS)
  naive_out, _ = naive_attention(q64, k64, v64, dtype, **OPTIONS)
  per_element = C * np.max(np.abs(naive_out - ref_out)) + eps(dtype) * (np.max(np.abs(ref_out))
                                                                          + 0.3)
  bound = np.sum(np.abs(do64)) * per_element + 1e-5 * np.sum(np.abs(ref_out * do64))
  assert abs(float(loss) - np.sum(ref_out * do64)) <= bound


@pytest.mark.parametrize("dtype", DTYPES)
def test_remat(dtype):
  q, k, v, do = _inputs(3, dtype)
  loss = jax.checkpoint(functools.partial(_loss, **OPTIONS))
  grads = run_on_kernels(jax.grad(loss, argnums=(0, 1, 2)), q, k, v, do, expected=FWD_BWD)
  check_grads(grads, q, k, v, do, **OPTIONS)


@pytest.mark.parametrize("dtype", DTYPES)
def test_vmap_of_grad_folds_into_one_launch_each(dtype):
  lanes = [_inputs(4 + i, dtype) for i in range(2)]
  stacked = [jnp.stack(xs) for xs in zip(*lanes)]  # (2, b, s, h, d) each
  fn = jax.vmap(_grads(**OPTIONS))
  compiled = compile_on_kernels(fn, *stacked, expected=FWD_BWD)
  # The vmapped axis is folded into the batch: one forward and one backward launch, no loop.
  assert kernel_targets(compiled.as_text()) == {FLASH_FWD: 1, FLASH_BWD: 1}
  grads = compiled(*stacked)
  for i, (q, k, v, do) in enumerate(lanes):
    check_grads([g[i] for g in grads], q, k, v, do, **OPTIONS)


def _one_device_mesh(kind):
  axis_type = getattr(jax.sharding, "AxisType", None)
  if axis_type is None:
    pytest.skip("this JAX has no mesh axis types")
  kinds = {"auto": axis_type.Auto, "explicit": axis_type.Explicit}
  return jax.make_mesh((1, 1), ("data", "model"), axis_types=(kinds[kind],) * 2,
                       devices=jax.devices()[:1])


@pytest.mark.parametrize("kind", ["auto", "explicit"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_sharded_jit_on_one_device(kind, dtype):
  # Auto: jax_fa3._partitioning's custom_partitioning rule; Explicit: its shard_map plan.
  mesh = _one_device_mesh(kind)
  args = _inputs(6, dtype)
  spec = P("data", None, "model")
  placed = [jax.device_put(x, NamedSharding(mesh, spec)) for x in args]
  results = run_on_kernels(_out_and_grads(**OPTIONS), *placed, expected=FWD_BWD)
  _check_out_and_grads(results, *args, **OPTIONS)


@pytest.mark.parametrize("dtype", DTYPES)
def test_shard_map_on_one_device(dtype):
  mesh = _one_device_mesh("auto")
  args = _inputs(7, dtype)
  spec = P("data", None, "model")
  mapped = jax.shard_map(_out_and_grads(**OPTIONS), mesh=mesh, in_specs=(spec,) * 4,
                         out_specs=(spec,) * 4)
  placed = [jax.device_put(x, NamedSharding(mesh, spec)) for x in args]
  results = run_on_kernels(mapped, *placed, expected=FWD_BWD)
  _check_out_and_grads(results, *args, **OPTIONS)


@pytest.mark.parametrize("causal,zigzag", [(True, True), (False, False)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_ring_attention_on_two_devices(causal, zigzag, dtype):
  devices = jax.devices()
  if len(devices) < 2:
    pytest.skip(f"ring attention needs 2 devices, found {len(devices)}")
  n = 2
  mesh = jax.make_mesh((n,), ("seq",), devices=devices[:n])
  args = _inputs(8, dtype, s=512)
  options = dict(causal=causal, softmax_scale=0.1)
  order = (lambda x: jax_fa3.zigzag_permute(x, n)) if zigzag else (lambda x: x)
  unorder = (lambda x: jax_fa3.zigzag_unpermute(x, n)) if zigzag else (lambda x: x)

  def per_device(q, k, v, do):
    attention = functools.partial(jax_fa3.ring_attention, axis_name="seq", zigzag=zigzag,
                                  **options)
    out, vjp = jax.vjp(attention, q, k, v)
    return (out,) + vjp(do)

  spec = P(None, "seq")
  mapped = jax.shard_map(per_device, mesh=mesh, in_specs=(spec,) * 4, out_specs=(spec,) * 4,
                         check_vma=False)
  placed = [jax.device_put(order(x), NamedSharding(mesh, spec)) for x in args]
  results = run_on_kernels(mapped, *placed, expected=FWD_BWD)
  _check_out_and_grads([unorder(x) for x in results], *args, **options)
