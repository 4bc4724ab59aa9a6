"""One attention training step, as a model's loop runs it: jit(value_and_grad) of a loss on the
attention output, for our bf16 kernels, our FP8 mode (both backward choices) and cuDNN.

Shapes: 16k tokens per batch, model width 2048 (d=128 × 16 heads, d=256 × 8), seqlen 8k by default,
bf16 inputs. Per peer: the step (forward + backward, one call), the forward alone and the backward
(step minus forward), in ms; and the step's device memory from XLA's compiled memory analysis
(arguments + outputs + temporaries, workspace included; aliased buffers counted once).

  python benchmarks/bench_step.py [--seqlens 8192] [--head-dims 128,256] [--peers bf16,fp8]
                                  [--json out.json]

Peers: `bf16` (jax_fa3.flash_attention), `fp8` (flash_attention_fp8 from bf16, backward="bf16":
the bf16 backward kernel at the quantized q and k, from the fp8 forward's out and lse), `fp8_recompute` (backward=
"recompute": a bf16 forward runs again before the backward), `fp8_backward_fp8` (backward="fp8":
the fp8 backward kernel, e4m3 for S, dV and dK), `cudnn`
(jax.nn.dot_product_attention(implementation="cudnn")), `fa3_kernels` (FlashAttention-3's own
kernels through flash-attn3-jax where installed: causal d = 128 only). Each peer's gradients are checked
against our bf16 ones before its time is quoted (fp8: within 8e-2 relative, the fp8 error).
"""
from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

import jax_fa3
from jax_fa3 import _bench, _fp8_backward

TOTAL_TOKENS = 16384
WIDTH = 2048
CASES = ((128, False), (256, False), (128, True))  # (head_dim, causal), the three shapes


def _peers(causal):
  fp8 = lambda backward: (lambda q, k, v: jax_fa3.flash_attention_fp8(q, k, v, causal=causal,
                                                                       backward=backward))
  peers = {"bf16": lambda q, k, v: jax_fa3.flash_attention(q, k, v, causal=causal),
           "fp8": fp8("bf16"), "fp8_recompute": fp8("recompute"), "fp8_backward_fp8": fp8("fp8")}
  if jax.devices()[0].platform == "gpu":
    peers["cudnn"] = lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=causal, implementation="cudnn")
    fa3 = _flash_attn3(causal)
    if fa3 is not None:
      peers["fa3_kernels"] = fa3
  return peers


def _flash_attn3(causal):
  """FA3's own kernels (flash-attn3-jax, d = 128) where installed; causal only, since that
  package's non-causal backward returns wrong gradients (0.2.3)."""
  if not causal:
    return None
  try:
    from flash_attn3_jax import flash_mha  # noqa: PLC0415
  except ImportError:
    return None
  return lambda q, k, v: flash_mha(q, k, v, is_causal=True)


def _step_fn(forward, do):
  def loss(q, k, v):
    return jnp.sum(forward(q, k, v).astype(jnp.float32) * do)
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def _memory_mib(compiled) -> float | None:
  analysis = compiled.memory_analysis()
  if analysis is None:
    return None
  total = (analysis.argument_size_in_bytes + analysis.output_size_in_bytes
           + analysis.temp_size_in_bytes - analysis.alias_size_in_bytes)
  return total / 2**20


def _rel(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def run(head_dims, seqlens, min_time, peers=None):
  rows = []
  for d, causal in CASES:
    if d not in head_dims:
      continue
    h = WIDTH // d
    for s in seqlens:
      b = max(1, TOTAL_TOKENS // s)
      q, k, v = _bench.random_qkv(jax.random.PRNGKey(s + d), b, s, h, d, jnp.bfloat16)
      do = jax.random.normal(jax.random.PRNGKey(1), q.shape, jnp.float32)
      reference_grads = None
      for name, forward in _peers(causal).items():
        if peers is not None and name not in peers:
          continue

        def measure(row, name=name, forward=forward):
          nonlocal reference_grads
          if name == "fp8_backward_fp8" and jax.devices()[0].platform == "gpu":
            reason = _fp8_backward.kernel_unavailable_reason(d)
            if reason is not None:  # the float32 emulation: ~100 ms a step, not worth timing
              row["note"] = f"not timed: no fp8 backward kernel ({reason})"
              return
          step = _step_fn(forward, do)
          compiled = step.lower(q, k, v).compile()
          row["step_mib"] = _memory_mib(compiled)
          _, grads = step(q, k, v)
          if reference_grads is None:
            reference_grads = grads
          row["grad_rel_err"] = max(_rel(g, r) for g, r in zip(grads, reference_grads))
          bound = 8e-2 if name.startswith("fp8") else 2e-2
          if row["grad_rel_err"] > bound:
            row["note"] = "gradients wrong: speed not quoted"
          else:
            t_step = _bench.median_seconds(step, q, k, v, min_time=min_time)
            t_fwd = _bench.median_seconds(jax.jit(forward), q, k, v, min_time=min_time)
            row.update(step_ms=t_step * 1e3, fwd_ms=t_fwd * 1e3, bwd_ms=(t_step - t_fwd) * 1e3)

        _bench.record(rows, dict(peer=name, d=d, h=h, b=b, seqlen=s, causal=causal), measure)
  return rows


def table(rows) -> str:
  lines = ["| d | causal | seqlen | peer | step ms | fwd ms | bwd ms | step ÷ bf16 step | "
           "step MiB |", "|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    base = next((x for x in rows if x["peer"] == "bf16" and
                 (x["d"], x["causal"], x["seqlen"]) == (r["d"], r["causal"], r["seqlen"])), None)
    fmt = lambda key, row=r: "—" if row.get(key) is None else f"{row[key]:.3f}"
    speedup = ("—" if base is None or r.get("step_ms") is None or base.get("step_ms") is None
               else f"{base['step_ms'] / r['step_ms']:.2f}×")
    mib = "—" if r.get("step_mib") is None else f"{r['step_mib']:.0f}"
    lines.append(f"| {r['d']} | {r['causal']} | {r['seqlen']} | {r['peer']} | {fmt('step_ms')} | "
                 f"{fmt('fwd_ms')} | {fmt('bwd_ms')} | {speedup} | {mib} |")
  return "\n".join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--head-dims", default="128,256")
  parser.add_argument("--seqlens", default="8192")
  parser.add_argument("--min-time", type=float, default=0.2)
  parser.add_argument("--json", default="bench_step.json")
  parser.add_argument("--peers", default=None,
                      help="comma-separated subset (default: all), e.g. bf16,fp8_backward_fp8")
  args = parser.parse_args()
  header = _bench.run_header(__file__)
  print(json.dumps(header))
  rows = run([int(x) for x in args.head_dims.split(",")],
             [int(x) for x in args.seqlens.split(",")], args.min_time,
             None if args.peers is None else set(args.peers.split(",")))
  with open(args.json, "w") as f:
    json.dump(dict(header=header, rows=rows), f, indent=1)
  print(f"\n{header}\nattention training step (value_and_grad), bf16 inputs\n{table(rows)}")


if __name__ == "__main__":
  main()
