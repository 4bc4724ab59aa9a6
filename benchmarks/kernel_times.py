"""Where a call's time goes on the GPU: each kernel's µs per call, from a `jax.profiler` trace.

A benchmark says how long a call takes; this says which kernels (ours, XLA's fusions, copies)
make up that time and how much of it is gaps between them (launch latency, host work). Scenarios
are the peers of bench_decode.py and the kinds of bench_padded.py:

  python benchmarks/kernel_times.py decode:jax_fa3:1:32768 padded:varlen:8192:causal
  python benchmarks/kernel_times.py padded:plain:8192 --grad
  python benchmarks/kernel_times.py step:bf16:128:8192 step:fp8:128:8192:causal

  decode:PEER:BATCH:CACHE            a bench_decode.py peer (jax_fa3, jax_fa3_unsplit, ...)
  padded:KIND:SEQLEN[:causal]        a bench_padded.py kind (plain, full, varlen, ...), the
                                     forward, or with --grad the forward + backward
  step:PEER:HEAD_DIM:SEQLEN[:causal] a bench_step.py peer's training step (bf16, fp8, ...)
  fp8:HEAD_DIM:SEQLEN[:causal]       `flash_attention_fp8` from bf16 (the preparation's kernels
                                     and the fp8 kernel), 16k tokens, width 2048

Prints, per scenario, the wall time per call (back-to-back launches), then each kernel's
count and µs per call, longest first, the kernels' sum and the span from the first kernel's start
to the last one's end per call. Off-GPU there is no device plane and it says so.
"""
from __future__ import annotations

import argparse
import collections
import glob
import pathlib
import sys
import tempfile
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_decode  # noqa: E402
import bench_padded  # noqa: E402
import bench_step  # noqa: E402
import jax_fa3  # noqa: E402
from jax_fa3 import _bench  # noqa: E402


def decode_scenario(peer, batch, cache):
  fn, appends, fp8 = bench_decode._peers()[peer]
  if appends:
    raise ValueError(f"peer {peer!r} donates its caches; time it with bench_decode.py")
  b, s = int(batch), int(cache)
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  q = jax.random.normal(keys[0], (b, 1, bench_decode.HEADS, bench_decode.D), jnp.bfloat16)
  shape = (b, s, bench_decode.KV_HEADS, bench_decode.D)
  k_cache = jax.random.normal(keys[1], shape, jnp.bfloat16)
  v_cache = jax.random.normal(keys[2], shape, jnp.bfloat16)
  if fp8:
    k_cache, v_cache = bench_decode.fp8_cache(k_cache), bench_decode.fp8_cache(v_cache)
  return jax.jit(fn), (q, k_cache, v_cache, jnp.full((b,), s, jnp.int32))


def padded_scenario(kind, seqlen, *flags, grad=False, head_dim=128):
  s = int(seqlen)
  b = max(1, bench_padded.TOKENS // s)
  causal = "causal" in flags
  lengths = bench_padded._lengths("half" if kind == "cudnn" else kind, b, s)
  fwd, fwd_bwd = bench_padded._call(kind, causal, lengths, bench_padded._segment_ids(kind, b, s))
  qkv = _bench.random_qkv(jax.random.PRNGKey(s), b, s, bench_padded.HEADS, head_dim,
                          jnp.bfloat16)
  return (fwd_bwd if grad else fwd), qkv


def _step_qkv(head_dim, seqlen):
  """bench_step.py's inputs: bf16 q, k, v of TOTAL_TOKENS tokens at model width WIDTH."""
  d, s = int(head_dim), int(seqlen)
  b = max(1, bench_step.TOTAL_TOKENS // s)
  return _bench.random_qkv(jax.random.PRNGKey(s + d), b, s, bench_step.WIDTH // d, d,
                           jnp.bfloat16)


def step_scenario(peer, head_dim, seqlen, *flags):
  qkv = _step_qkv(head_dim, seqlen)
  do = jax.random.normal(jax.random.PRNGKey(1), qkv[0].shape, jnp.float32)
  return bench_step._step_fn(bench_step._peers("causal" in flags)[peer], do), qkv


def fp8_scenario(head_dim, seqlen, *flags):
  qkv = _step_qkv(head_dim, seqlen)
  causal = "causal" in flags
  return jax.jit(lambda q, k, v: jax_fa3.flash_attention_fp8(q, k, v, causal=causal)), qkv


def parse(spec, grad):
  family, *rest = spec.split(":")
  if family == "decode" and len(rest) == 3:
    return decode_scenario(*rest)
  if family == "padded" and len(rest) >= 2:
    return padded_scenario(*rest, grad=grad)
  if family == "step" and len(rest) >= 3:
    return step_scenario(*rest)
  if family == "fp8" and len(rest) >= 2:
    return fp8_scenario(*rest)
  raise ValueError(f"scenario {spec!r}: expected decode:PEER:BATCH:CACHE, "
                   "padded:KIND:SEQLEN[:causal], step:PEER:HEAD_DIM:SEQLEN[:causal] or "
                   "fp8:HEAD_DIM:SEQLEN[:causal]")


def device_events(trace_dir):
  """(line name, kernel name, start ns, duration ns) of every event on the GPU planes."""
  from jax.profiler import ProfileData
  events = []
  for path in glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True):
    for plane in ProfileData.from_file(path).planes:
      if not plane.name.startswith("/device:GPU"):
        continue
      for line in plane.lines:
        # "XLA Ops" / "XLA Modules" lines annotate the stream lines' kernels: count them once.
        if line.name.startswith("XLA") or "Annotation" in line.name:
          continue
        events += [(line.name, e.name, e.start_ns, e.duration_ns) for e in line.events]
  return events


def profile(fn, args, calls):
  jax.block_until_ready(fn(*args))
  wall = _bench.median_seconds(fn, *args, min_time=0.05)
  with tempfile.TemporaryDirectory() as trace_dir:
    with jax.profiler.trace(trace_dir):
      for _ in range(calls):
        jax.block_until_ready(fn(*args))
      time.sleep(0.01)
    events = device_events(trace_dir)
  return wall, events


def report(spec, wall, events, calls):
  print(f"== {spec}: {wall * 1e6:.1f} µs per call (back-to-back)")
  if not events:
    print("   no GPU events in the trace (no GPU, or the profiler's device tracer is off)")
    return
  per_kernel = collections.defaultdict(lambda: [0, 0.0])
  for _, name, _, duration in events:
    per_kernel[name][0] += 1
    per_kernel[name][1] += duration
  for name, (count, total) in sorted(per_kernel.items(), key=lambda kv: -kv[1][1]):
    print(f"   {total / calls / 1e3:9.1f} µs  x{count / calls:<4g} {name[:110]}")
  busy = sum(e[3] for e in events) / calls / 1e3
  span = (max(e[2] + e[3] for e in events) - min(e[2] for e in events)) / calls / 1e3
  print(f"   {busy:9.1f} µs  kernels' sum per call; {span:.1f} µs first start to last end, "
        f"÷ {calls} calls (host sync between calls included)")


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("scenarios", nargs="+")
  parser.add_argument("--grad", action="store_true", help="padded: forward + backward")
  parser.add_argument("--calls", type=int, default=20)
  args = parser.parse_args()
  for spec in args.scenarios:
    fn, fn_args = parse(spec, args.grad)
    wall, events = profile(fn, fn_args, args.calls)
    report(spec, wall, events, args.calls)


if __name__ == "__main__":
  main()
