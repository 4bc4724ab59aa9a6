"""The benchmarks' timer (jax_fa3._bench.median_seconds): back-to-back launches without keeping
every launch's outputs alive (a 2 GiB copy timed 80 times held 80 GiB and ran an 80 GB GPU out of
memory); and the gradient check that comes before a peer's backward speed is quoted."""
import jax
import jax.numpy as jnp

from jax_fa3 import _bench
from repo_script import load_script


def test_median_seconds_keeps_only_the_last_outputs_alive():
  x = jnp.ones((256, 1024), jnp.float32)
  double = jax.jit(lambda x: x * 2.0)
  live = []

  def call(x):
    out = double(x)
    live.append(len(jax.live_arrays()))
    return out

  before = len(jax.live_arrays())
  seconds = _bench.median_seconds(call, x, min_time=0.05, repeats=2)
  assert seconds > 0
  assert len(live) > 20  # many launches per sample: holding them all would show here
  assert max(live) - before <= 2, max(live) - before


def test_benchmark_headers_take_the_named_commit_outside_a_checkout(tmp_path, monkeypatch):
  # A tree unpacked on a GPU machine is no git checkout: its JSON headers say so, unless the
  # commit is named (tools/gpu_ab.sh NAME=TREE:LIB:COMMIT exports it).
  script = tmp_path / "bench.py"
  monkeypatch.delenv("JAX_FA3_BENCH_COMMIT", raising=False)
  assert _bench.git_commit(script) == "unknown (not a git checkout)"
  monkeypatch.setenv("JAX_FA3_BENCH_COMMIT", "9c474fa")
  assert _bench.git_commit(script) == "9c474fa"


def test_gradient_error_passes_exact_gradients_and_flags_wrong_ones():
  import jax_fa3  # noqa: PLC0415
  attend = lambda q, k, v: jax_fa3.flash_attention(q, k, v, causal=True)
  good = _bench.gradient_error(attend, 2, 32, True, jnp.float32, seqlen=64)
  assert good < 1e-4  # float32 inputs: the same math in another order
  # A backward that drops dK (k's gradient stopped) while its forward is right.
  no_dk = lambda q, k, v: jax_fa3.flash_attention(q, jax.lax.stop_gradient(k), v, causal=True)
  assert _bench.gradient_error(no_dk, 2, 32, True, jnp.float32, seqlen=64) > 0.5
  # Scores unscaled in both directions (Pallas MGPU's convention) are checked as such.
  unscaled = lambda q, k, v: jax_fa3.flash_attention(q, k, v, softmax_scale=1.0)
  assert _bench.gradient_error(unscaled, 2, 32, False, jnp.float32, unit_scale=True,
                               seqlen=64) < 1e-4
  assert _bench.gradient_error(unscaled, 2, 32, False, jnp.float32, seqlen=64) > 1e-2


def test_decode_loop_unrolled_computes_the_same_steps():
  # bench_decode.py --unroll: the same 32 steps (each fed by the last one's output, lengths moving
  # by one), fewer trips of the while loop.
  bench_decode = load_script("benchmarks/bench_decode.py")
  step = lambda q, k, v, lengths: q * k.sum() + v.sum() * lengths.sum()
  args = (jnp.full((2,), 0.5), jnp.ones((3,)), jnp.ones((3,)), jnp.asarray([2, 3]))
  plain = bench_decode.looped(step)(*args)
  unrolled = bench_decode.looped(step, unroll=8)(*args)
  assert bench_decode.DECODE_STEPS % 8 == 0
  assert jnp.array_equal(plain, unrolled) and not jnp.array_equal(plain, args[0])
