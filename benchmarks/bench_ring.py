"""Ring attention (sequence parallelism) scaling: one long sequence on 1 vs n GPUs.

For each causal mode, times forward+backward (jit of the gradient of <out, dout>) of
`jax_fa3.flash_attention` on one GPU and of `jax_fa3.sequence_parallel_attention` with the
sequence split over n GPUs (zig-zag order when causal), and reports tokens/s and the speed-up.

How much of the ring's communication is hidden behind compute:
  t_ring     the real ring, fwd+bwd
  t_compute  the same program with every ppermute replaced by a local roll of the tokens (the
             same kernels on the same shapes, no transfer)
  t_comm     the ring's transfers alone (K/V blocks n-1 times forward, K/V plus the fp32 dK/dV
             accumulators n times backward), no compute
  hidden = (t_compute + t_comm - t_ring) / t_comm, clipped to [0, 1]: 1 means the ring costs no
  more than its compute.

Before timing, the n-GPU output and gradients are compared with the 1-GPU ones on a shorter
sequence, and the compiled n-GPU program is checked for collective-permute and no all-gather.

  python benchmarks/bench_ring.py [--seqlen 131072] [--heads 8] [--head-dim 128] [--json out.json]

One 128k-token fwd+bwd at 16 heads of 128 is ~5 PFLOP (16 s on one GPU at 300 TFLOP/s):
8 heads keep the whole run, 8 timed programs of 3 repeats each, within a few minutes.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import re
import time
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_fa3
from jax_fa3 import _bench
from jax_fa3 import ring as ring_module
from jax_fa3._partitioning import shard_map


def _loss_grad(attention):
  def loss(q, k, v, dout):
    return jnp.sum(attention(q, k, v).astype(jnp.float32) * dout.astype(jnp.float32))
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def _single(causal):
  return _loss_grad(lambda q, k, v: jax_fa3.flash_attention(q, k, v, causal=causal))


def _sharded(mesh, causal):
  return _loss_grad(lambda q, k, v: jax_fa3.sequence_parallel_attention(
      q, k, v, seq_axis="seq", mesh=mesh, causal=causal, zigzag=causal))


def _comm_only(mesh, n):
  """The ring's transfers without its compute: (k, v) n-1 times, (k, v, dk, dv) n times."""
  spec = P(None, "seq", None, None)

  def body(k, v):
    f32 = jnp.float32

    def forward_step(carry, _):
      return ring_module._rotate(carry, "seq", n), None

    def backward_step(carry, _):
      k, v, dk, dv = carry
      k, v = ring_module._rotate((k, v), "seq", n)
      dk, dv = ring_module._rotate((dk + 1, dv + 1), "seq", n)  # +1: a data dependence per step
      return (k, v, dk, dv), None

    (k1, v1), _ = jax.lax.scan(forward_step, (k, v), None, length=n - 1)
    (k2, v2, dk, dv), _ = jax.lax.scan(backward_step, (k, v, k.astype(f32), v.astype(f32)),
                                       None, length=n)
    return k1 + k2, v1 + v2, dk, dv

  return jax.jit(shard_map(body, mesh, (spec, spec), (spec, spec, spec, spec)))


def _local_roll(x, axis_name, n):
  """Stands in for the ring's ppermute: the same shapes and work, an on-device copy (jnp.roll of
  the tokens) instead of a transfer. Not the identity: with unchanged K/V every step's attention
  is the same expression, and XLA merged the steps (the first 2-GPU run timed half the compute)."""
  del axis_name, n
  return jax.tree_util.tree_map(lambda a: jnp.roll(a, 1, axis=1), x)


def _log(message):
  print(f"[bench_ring {time.strftime('%H:%M:%S')}] {message}", flush=True)


def _time(fn, *args, min_time):
  return _bench.median_seconds(fn, *args, min_time=min_time, repeats=3)


def _rel(a, b):
  a, b = (np.asarray(x, np.float32) for x in (a, b))
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def check(mesh, n, b, s, h, d, causal, dtype):
  """n-GPU vs 1-GPU out and gradients (relative errors) and the collectives the program uses."""
  key = jax.random.PRNGKey(1)
  q, k, v = _bench.random_qkv(key, b, s, h, d, dtype)
  dout = jax.random.normal(jax.random.PRNGKey(2), q.shape, jnp.float32).astype(dtype)
  one = jax.devices()[0]
  out1 = jax.jit(lambda q, k, v: jax_fa3.flash_attention(q, k, v, causal=causal))(
      *(jax.device_put(x, one) for x in (q, k, v)))
  grads1 = _single(causal)(*(jax.device_put(x, one) for x in (q, k, v, dout)))
  perm = (lambda x: jax_fa3.zigzag_permute(x, n)) if causal else (lambda x: x)
  unperm = (lambda x: jax_fa3.zigzag_unpermute(x, n)) if causal else (lambda x: x)
  sharding = NamedSharding(mesh, P(None, "seq", None, None))
  qs, ks, vs, dos = (jax.device_put(perm(x), sharding) for x in (q, k, v, dout))
  forward = jax.jit(lambda q, k, v: jax_fa3.sequence_parallel_attention(
      q, k, v, seq_axis="seq", mesh=mesh, causal=causal, zigzag=causal))
  outn = unperm(forward(qs, ks, vs))
  # One compilation serves both the gradients and the HLO text the collectives are counted in.
  grad_n = _sharded(mesh, causal).lower(qs, ks, vs, dos).compile()
  gradsn = [unperm(g) for g in grad_n(qs, ks, vs, dos)]
  hlo = grad_n.as_text()
  return dict(
      out_rel_err=_rel(outn, out1),
      **{f"d{name}_rel_err": _rel(gn, g1) for name, gn, g1 in zip("qkv", gradsn, grads1)},
      collective_permutes=len(re.findall(r"collective-permute(-start)?\(", hlo)),
      all_gathers=len(re.findall(r"all-gather(-start)?\(", hlo)))


def run(seqlen, h, d, n, dtype, min_time, check_seqlen):
  devices = jax.devices()[:n]
  if len(devices) < n:
    raise SystemExit(f"need {n} devices, found {len(jax.devices())}")
  mesh = jax.sharding.Mesh(np.array(devices), ("seq",))
  sharding = NamedSharding(mesh, P(None, "seq", None, None))
  b = 1
  rows = []
  for causal in (False, True):
    row = dict(seqlen=seqlen, b=b, h=h, d=d, causal=causal, devices=n, dtype=str(jnp.dtype(dtype)))
    if n > 1:
      _log(f"causal={causal}: checking {n} GPUs against 1 at seqlen {check_seqlen}")
      row.update(check(mesh, n, b, check_seqlen, h, d, causal, dtype))
      _log(f"check: {row}")
    key = jax.random.PRNGKey(0)
    q, k, v = _bench.random_qkv(key, b, seqlen, h, d, dtype)
    dout = jax.random.normal(jax.random.PRNGKey(3), q.shape, jnp.float32).astype(dtype)
    flops = _bench.attention_flops(b, h, seqlen, seqlen, d, causal, "fwd_bwd")
    one = jax.devices()[0]
    args1 = [jax.device_put(x, one) for x in (q, k, v, dout)]
    _log(f"causal={causal}: timing 1 GPU at seqlen {seqlen}")
    t1 = _time(_single(causal), *args1, min_time=min_time)
    del args1
    _log(f"1 GPU: {t1 * 1e3:.1f} ms")
    row.update(t_1gpu_ms=t1 * 1e3, tokens_per_s_1gpu=b * seqlen / t1,
               tflops_1gpu=flops / t1 / 1e12)
    if n > 1:
      args = [jax.device_put(x, sharding) for x in (q, k, v, dout)]
      t_ring = _time(_sharded(mesh, causal), *args, min_time=min_time)
      _log(f"ring: {t_ring * 1e3:.1f} ms")
      with mock.patch.object(ring_module, "_rotate", _local_roll):
        t_compute = _time(_sharded(mesh, causal), *args, min_time=min_time)
      _log(f"ring without transfers: {t_compute * 1e3:.1f} ms")
      t_comm = _time(_comm_only(mesh, n), args[1], args[2], min_time=min_time)
      _log(f"transfers alone: {t_comm * 1e3:.1f} ms")
      del args
      hidden = (t_compute + t_comm - t_ring) / t_comm
      row.update(t_ring_ms=t_ring * 1e3, t_compute_ms=t_compute * 1e3, t_comm_ms=t_comm * 1e3,
                 tokens_per_s_ngpu=b * seqlen / t_ring, tflops_per_gpu=flops / t_ring / n / 1e12,
                 speedup=t1 / t_ring, comm_hidden=float(np.clip(hidden, 0.0, 1.0)))
    rows.append(row)
    print(json.dumps(row), flush=True)
  return rows


def table(rows) -> str:
  lines = ["| causal | GPUs | tokens/s 1 GPU | tokens/s n GPUs | speed-up | TFLOP/s per GPU "
           "(1 / n) | compute / comm / ring ms | comm hidden | max rel err vs 1 GPU |",
           "|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    if r["devices"] == 1:
      lines.append(f"| {r['causal']} | 1 | {r['tokens_per_s_1gpu']:,.0f} | | | "
                   f"{r['tflops_1gpu']:.0f} | | | |")
      continue
    err = max(r[f"{x}_rel_err"] for x in ("out", "dq", "dk", "dv"))
    lines.append(
        f"| {r['causal']} | {r['devices']} | {r['tokens_per_s_1gpu']:,.0f} | "
        f"{r['tokens_per_s_ngpu']:,.0f} | {r['speedup']:.2f}× | {r['tflops_1gpu']:.0f} / "
        f"{r['tflops_per_gpu']:.0f} | {r['t_compute_ms']:.1f} / {r['t_comm_ms']:.1f} / "
        f"{r['t_ring_ms']:.1f} | {r['comm_hidden']:.0%} | {err:.1e} |")
  return "\n".join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seqlen", type=int, default=131072)
  parser.add_argument("--heads", type=int, default=8)
  parser.add_argument("--head-dim", type=int, default=128)
  parser.add_argument("--devices", type=int, default=None, help="default: all local devices")
  parser.add_argument("--check-seqlen", type=int, default=8192)
  parser.add_argument("--min-time", type=float, default=0.1)
  parser.add_argument("--json", default=None)
  args = parser.parse_args()
  n = args.devices or len(jax.devices())
  rows = run(args.seqlen, args.heads, args.head_dim, n, jnp.bfloat16, args.min_time,
             args.check_seqlen)
  meta = dict(date=datetime.date.today().isoformat(), jax=jax.__version__,
              device=jax.devices()[0].device_kind, python=platform.python_version(),
              backward_kernel=jax_fa3._local_attention.backward_kernel_enabled())
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(meta=meta, rows=rows), f, indent=1)
  print(json.dumps(meta))
  print(table(rows))


if __name__ == "__main__":
  main()
