"""FP8 forward: what a user's call costs against the kernel alone, cuDNN's fp8 and our bf16.

Per head dim, causal or not and seqlen (16k tokens per call, width 2048): our bf16 forward,
`flash_attention_fp8(q, k, v)` from bf16 (rotation, quantization, kernel: what the Flax FP8 mode
runs), the fp8 kernel on pre-quantized inputs (v already in its layout), cuDNN's fp8 (per-tensor
scales, pre-quantized), and the preparation pass alone (fused rotate + quantize of q, k, v). Every
peer's output is checked against the fp32 reference first (fp8: within 0.1 relative). The peers
come from `bench_attention.py`, which this script runs with the fp8 set.

  python benchmarks/bench_fp8.py [--head-dims 128,256] [--seqlens 4096,8192,16384] \
      [--kv-heads N] [--json out.json] [--png out.png]

--kv-heads N gives k and v N heads (GQA; 1: MQA); the preparation pass's parts are still timed at
q's shape.

Before the table it prints the FP8 forward's speed targets checked on the points measured
(`targets`: the kernel's TFLOP/s at 8k and above, causal against non-causal, the call from bf16
against the kernel alone and against cuDNN's fp8), each with its worst point and whether every
point holds; the JSON keeps them under "targets".
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_attention  # noqa: E402

import jax_fa3  # noqa: E402
from jax_fa3 import _bench  # noqa: E402

PEERS = ("jax_fa3", "jax_fa3_fp8_e2e", "jax_fa3_fp8_vt", "cudnn_fp8")


def _row(rows, peer, d, causal, s):
  return next((r for r in rows if (r["peer"], r["d"], r["causal"], r["seqlen"]) ==
               (peer, d, causal, s)), {})


def table(rows, prep) -> str:
  lines = ["| d | causal | seqlen | bf16 ms | fp8 from bf16 ms | pre-quantized ms (TFLOP/s) | "
           "cuDNN fp8 TFLOP/s | prep pass µs | from bf16 ÷ pre-quantized | fp8 from bf16 vs "
           "bf16 | vs cuDNN fp8 |", "|---|---|---|---|---|---|---|---|---|---|---|"]
  fmt = lambda x, spec: "—" if x is None else format(x, spec)
  times = lambda x: "—" if x is None else f"{x:.2f}×"
  for d, causal, s in sorted({(r["d"], r["causal"], r["seqlen"]) for r in rows}):
    bf16, e2e, pre, cudnn = (_row(rows, p, d, causal, s) for p in PEERS)
    p = next((x for x in prep if (x["d"], x["seqlen"]) == (d, s)), {})
    ratio = lambda a, b: (None if a.get("fwd_ms") is None or b.get("fwd_ms") is None
                          else a["fwd_ms"] / b["fwd_ms"])
    lines.append(
        f"| {d} | {causal} | {s} | {fmt(bf16.get('fwd_ms'), '.3f')} | "
        f"{fmt(e2e.get('fwd_ms'), '.3f')} | {fmt(pre.get('fwd_ms'), '.3f')} "
        f"({fmt(pre.get('fwd_tflops'), '.0f')}) | {fmt(cudnn.get('fwd_tflops'), '.0f')} | "
        f"{fmt(p.get('user_call_us', p.get('fused_us')), '.0f')} | {times(ratio(e2e, pre))} | "
        f"{times(ratio(bf16, e2e))} | {times(ratio(cudnn, e2e))} |")
  return "\n".join(lines)


# The FP8 forward's speed targets (for the H200; they are checked wherever the benchmark runs).
KERNEL_TFLOPS = {128: 1050.0, 256: 1200.0}  # pre-quantized, non-causal, seqlen >= LONG
LONG = 8192
CAUSAL_SHARE = 0.9  # causal TFLOP/s >= this x non-causal's, seqlen >= LONG
FROM_BF16_OVERHEAD = 1.05  # from-bf16 time <= this x the pre-quantized kernel's, at LONG
OVER_CUDNN = 1.15  # from bf16 >= this x cuDNN fp8's speed, everywhere


def targets(rows) -> list[dict]:
  """Each target that applies to some point of `rows`: the worst measured value, where, the
  bound, and whether every point holds; the kernel's targets first (by head dim), then the
  call's. A target no point reaches (no fp8 rows off Hopper, no seqlen of 8k) is left out."""
  def measured(peer, d, causal, s, key="fwd_ms"):
    return _row(rows, peer, d, causal, s).get(key)

  found = {}  # (rank, name) -> (bound, higher_is_better, [(value, where), ...])

  def check(rank, name, bound, higher_is_better, value, where):
    found.setdefault((rank, name), (bound, higher_is_better, []))[2].append((value, where))

  for d, causal, s in sorted({(r["d"], r["causal"], r["seqlen"]) for r in rows}):
    pre, e2e = measured("jax_fa3_fp8_vt", d, causal, s), measured("jax_fa3_fp8_e2e", d, causal, s)
    pre_tflops = measured("jax_fa3_fp8_vt", d, causal, s, "fwd_tflops")
    cudnn = measured("cudnn_fp8", d, causal, s)
    where = f"d{d} {'causal' if causal else 'non-causal'} {s}"
    if not causal and s >= LONG and d in KERNEL_TFLOPS and pre_tflops:
      check(0, f"d{d} kernel TFLOP/s, non-causal, >= {LONG}", KERNEL_TFLOPS[d], True, pre_tflops,
            where)
    full = measured("jax_fa3_fp8_vt", d, False, s, "fwd_tflops")
    if causal and s >= LONG and pre_tflops and full:
      check(1, f"kernel causal / non-causal TFLOP/s, >= {LONG}", CAUSAL_SHARE, True,
            pre_tflops / full, where)
    if s == LONG and pre and e2e:
      check(2, f"from bf16 / pre-quantized time at {LONG}", FROM_BF16_OVERHEAD, False, e2e / pre,
            where)
    if e2e and cudnn:
      check(3, "from bf16, speed / cuDNN fp8's", OVER_CUDNN, True, cudnn / e2e, where)
  out = []
  for (_, name), (bound, better, points) in sorted(found.items()):
    worst, worst_at = min(points) if better else max(points)
    holds = all(v >= bound if better else v <= bound for v, _ in points)
    out.append(dict(target=name, bound=bound, higher_is_better=better, worst=worst,
                    worst_at=worst_at, points=len(points), holds=holds))
  return out


def targets_table(checked) -> str:
  lines = ["| target | bound | worst measured (where) | points | holds |", "|---|---|---|---|---|"]
  for t in checked:
    bound = ("≥ " if t["higher_is_better"] else "≤ ") + f"{t['bound']:g}"
    worst = f"{t['worst']:.0f}" if t["worst"] >= 100 else f"{t['worst']:.3g}"
    lines.append(f"| {t['target']} | {bound} | {worst} ({t['worst_at']}) | "
                 f"{t['points']} | {'yes' if t['holds'] else 'no'} |")
  return "\n".join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--head-dims", default="128,256")
  parser.add_argument("--seqlens", default="4096,8192,16384")
  parser.add_argument("--causal", choices=("both", "yes", "no"), default="both")
  parser.add_argument("--kv-heads", type=int, default=None,
                      help="k/v heads (GQA; 1: MQA; default: as many as the query heads)")
  parser.add_argument("--min-time", type=float, default=0.2)
  parser.add_argument("--json", default="bench_fp8.json")
  parser.add_argument("--png", default="bench_fp8.png")
  args = parser.parse_args()
  header = _bench.run_header(__file__)
  print(json.dumps(header))
  head_dims = [int(x) for x in args.head_dims.split(",")]
  seqlens = [int(x) for x in args.seqlens.split(",")]
  causal = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
  rows = bench_attention.run(head_dims, seqlens, ("fwd",), jnp.dtype(jnp.bfloat16),
                             args.min_time, causal, set(PEERS), kv_heads=args.kv_heads)
  prep = bench_attention.prep_rows(head_dims, seqlens, args.min_time, args.kv_heads) if \
      jax_fa3.kernels_available() else []
  checked = targets(rows)
  with open(args.json, "w") as f:
    json.dump(dict(header=header, rows=rows, fp8_prep=prep, targets=checked), f, indent=1)
  try:
    bench_attention.plot(rows, args.png)
  except ImportError:
    print("matplotlib missing: no plot")
  heads = "" if args.kv_heads is None else f", {args.kv_heads} k/v heads"
  print(f"\n{header}\nfp8 forward targets\n{targets_table(checked)}")
  print(f"\nfp8 forward, bf16 inputs, 16k tokens per call{heads}\n{table(rows, prep)}")


if __name__ == "__main__":
  main()
