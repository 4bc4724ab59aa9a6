"""FlashAttention-3 paper sweep: jax_fa3 against JAX's attention peers, in one run.

16k tokens in total, model width 2048 (d=64 × 32 heads, d=128 × 16, d=256 × 8), seqlen 512…16k,
causal and not; forward, and backward (time of fwd+bwd minus fwd; FLOPs 2.5× forward). Each peer's
output is checked against the fp32 reference before its speed is quoted.

FP8 peers (forward only, timed from pre-quantized inputs, FLOPs counted as the bf16 forward):
`jax_fa3_fp8` (our e4m3 kernel, block_size 64, incoherent processing off; the V transpose
pre-pass is inside the timing), `jax_fa3_fp8_vt` (the same kernel with v pre-quantized into its
own layout, as the user's call from bf16 quantizes it: no pre-pass) and, when JAX's private cuDNN FP8 API works, `cudnn_fp8` (per-tensor
scales, e4m3 output dequantized inside the timing). Their error vs the fp32 reference is the fp8
error (~5e-2 on normal data), so they are quoted up to 0.1. `jax_fa3_fp8_e2e` is the user's call
`flash_attention_fp8(q, k, v)` from bf16 inputs (random rotation, quantization with v written in
the kernel's layout, kernel; `jax_fa3_fp8_e2e_prepass`: v quantized as is, then the pre-pass)
and `fp8_prep` (a table of its own) times the rotation + quantization pass alone: the fused CUDA
pass and the XLA path it replaced.

  python benchmarks/bench_attention.py [--json out.json] [--png out.png] [--peers a,b] ...

The JSON's header names the date (UTC), GPU, JAX version and the commit measured;
`benchmarks/readme_table.py` turns one such JSON into the README's table and plot.
"""
from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

import jax_fa3
from jax_fa3 import _bench

TOTAL_TOKENS = 16384
WIDTH = 2048
GRAD_CHECK_SEQLEN = 1024  # each peer's gradients are checked at (1, this, h, d) first
PART_COPIES = 8  # fp8_prep: passes per timed call (see prep_rows)


def _grad_fn(forward):
  def loss(q, k, v, do):
    return jnp.sum(forward(q, k, v).astype(jnp.float32) * do.astype(jnp.float32))
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def _flash_attn3_peer(causal):
  """FA3's own kernels via the flash-attn3-jax package (sm90, d=128), when installed."""
  try:
    from flash_attn3_jax import flash_mha  # noqa: PLC0415
  except ImportError:
    try:
      from flash_attn_jax import flash_mha  # noqa: PLC0415  (its older module name)
    except ImportError:
      return None
  return _bench.Peer("fa3_kernels", lambda q, k, v: flash_mha(q, k, v, is_causal=causal))


def _fp8_peers(causal):
  """jax_fa3's fp8 kernel and cuDNN's fp8 attention, both from pre-quantized inputs."""
  from jax_fa3 import _fp8_forward, _fp8_quantize, fp8  # noqa: PLC0415
  from jax_fa3._config import AttentionConfig, Fp8Config  # noqa: PLC0415

  # v centred by its mean over the keys, as the user's call from bf16 does (fp8.py, step 2).
  def prepare_ours(q, k, v):
    q8, qs = fp8.quantize_fp8(q, block_size=64)
    k8, ks = fp8.quantize_fp8(k, block_size=64)
    vm = _fp8_quantize.mean_over_keys(v)
    v8, vs = fp8.quantize_fp8(v.astype(jnp.float32) - vm[:, None], block_size=None)
    return jax.block_until_ready((q8, k8, v8, qs, ks, vs[..., 0], vm))

  def ours(q8, k8, v8, qs, ks, vs, vm):
    att = AttentionConfig(softmax_scale=q8.shape[-1] ** -0.5, window_left=-1,
                          window_right=0 if causal else -1)
    cfg = Fp8Config(att, block_size=64, incoherent=False, return_lse=False)
    return _fp8_forward.fp8_forward(q8, k8, v8, qs, ks, vs, cfg, v_mean=vm)[0]

  # The kernel without its V pre-pass: v pre-quantized straight into the kernel's layout (the
  # quantization pass's keys-transposed mode, as the user's call from bf16 runs it).
  def prepare_ours_vt(q, k, v):
    q8, k8, _, qs, ks, _, _ = prepare_ours(q, k, v)
    vt, vs, vm = _fp8_quantize.centre_v_kernel_layout(v)
    return jax.block_until_ready((q8, k8, vt, qs, ks, vs, vm))

  def ours_vt(q8, k8, vt, qs, ks, vs, vm):
    att = AttentionConfig(softmax_scale=q8.shape[-1] ** -0.5, window_left=-1,
                          window_right=0 if causal else -1)
    cfg = Fp8Config(att, block_size=64, incoherent=False, return_lse=False)
    return _fp8_forward.kernel_forward(cfg, v_transposed=True)(q8, k8, vt, qs, ks, vs, vm)[0]

  # The whole user call from bf16: rotation + quantization of q and k (fused CUDA pass), v's
  # quantization (into the kernel's V layout) and the kernel, all inside the timing; `_prepass`:
  # the same with v quantized as is and transposed by the kernel's pre-pass.
  def end_to_end(q, k, v):
    return jax_fa3.flash_attention_fp8(q, k, v, causal=causal, block_size=64)

  def end_to_end_prepass(q, k, v):
    att = AttentionConfig(softmax_scale=q.shape[-1] ** -0.5, window_left=-1,
                          window_right=0 if causal else -1)
    cfg = Fp8Config(att, block_size=64, incoherent=True, transpose_v_in_quantize=False)
    signs = jax.random.rademacher(jax.random.PRNGKey(0), q.shape[-1:], dtype=jnp.float32)
    return fp8._fp8_from_float(q, k, v, signs, cfg)[0]

  peers = [_bench.Peer("jax_fa3_fp8", ours, prepare=prepare_ours, max_rel_err=0.1,
                       forward_only=True),
           _bench.Peer("jax_fa3_fp8_e2e", end_to_end, max_rel_err=0.1, forward_only=True),
           _bench.Peer("jax_fa3_fp8_e2e_prepass", end_to_end_prepass, max_rel_err=0.1,
                       forward_only=True)]
  if _fp8_forward.v_transposed_by_quantize(jnp.zeros((1, 1, 1, 128), jnp.bfloat16),
                                   Fp8Config(AttentionConfig(1.0, -1, -1))):
    peers.append(_bench.Peer("jax_fa3_fp8_vt", ours_vt, prepare=prepare_ours_vt,
                             max_rel_err=0.1, forward_only=True))
  cudnn = _bench.cudnn_fp8(causal)
  if cudnn is not None:
    prepare_cudnn, call_cudnn = cudnn
    peers.append(_bench.Peer("cudnn_fp8", call_cudnn, prepare=prepare_cudnn, max_rel_err=0.1,
                             forward_only=True))
  return peers


def _qkv(key, b, s, h, d, dtype, kv_heads=None):
  """Random q with h heads and k, v with kv_heads (None: h; fewer: GQA; 1: MQA)."""
  q, k, v = _bench.random_qkv(key, b, s, h, d, dtype)
  if kv_heads is None:
    return q, k, v
  if kv_heads < 1 or h % kv_heads:
    raise ValueError(f"kv_heads={kv_heads} must divide the {h} query heads of d={d}")
  return q, k[:, :, :kv_heads], v[:, :, :kv_heads]


def run(head_dims, seqlens, directions, dtype, min_time, causal_modes=(False, True),
        only_peers=None, on_row=None, kv_heads=None):
  """kv_heads: k and v heads (None: as many as q's; fewer: GQA; 1: MQA)."""
  rows = []
  grad_errors = {}  # (peer, d, h, causal) -> its gradients' error at GRAD_CHECK_SEQLEN
  key = jax.random.PRNGKey(0)
  for d in head_dims:
    h = WIDTH // d
    for causal in causal_modes:
      for s in seqlens:
        b = max(1, TOTAL_TOKENS // s)
        key, sub = jax.random.split(key)
        peers = _bench.peers(causal, on_gpu=True)
        fa3 = _flash_attn3_peer(causal)
        if fa3 is not None and d == 128:
          peers.append(fa3)
        peers += _fp8_peers(causal)
        if only_peers:
          peers = [p for p in peers if p.name in only_peers]
        for peer in peers:
          q, k, v = _qkv(sub, b, s, h, d, peer.dtype or dtype, kv_heads)
          fwd = jax.jit(peer.forward)
          row = dict(peer=peer.name, d=d, h=h, kv_heads=k.shape[2], b=b, seqlen=s, causal=causal,
                     dtype=str(jnp.dtype(peer.dtype or dtype)))
          try:
            args = peer.prepare(q, k, v) if peer.prepare else (q, k, v)
            row["rel_err"] = _bench.relative_error(fwd(*args), q, k, v, causal, peer.unit_scale)
            t_fwd = _bench.median_seconds(fwd, *args, min_time=min_time)
            row["fwd_ms"] = t_fwd * 1e3
            row["fwd_tflops"] = _bench.attention_flops(b, h, s, s, d, causal) / t_fwd / 1e12
            if row["rel_err"] > peer.max_rel_err:
              row["note"] = "output wrong: speed not quoted"
              row["fwd_tflops"] = None
          except Exception as e:  # noqa: BLE001 (one failing peer must not hide the rest)
            row["error"] = _bench.failure(e)
          if "bwd" in directions and "error" not in row and not peer.forward_only:
            try:
              family = (peer.name, d, h, causal)
              if family not in grad_errors:  # once per shape family, at a size the reference takes
                grad_errors[family] = _bench.gradient_error(
                    peer.forward, h, d, causal, peer.dtype or dtype, peer.unit_scale,
                    seqlen=GRAD_CHECK_SEQLEN)
              row["bwd_rel_err"] = grad_errors[family]
              do = jax.random.normal(sub, q.shape, jnp.float32).astype(q.dtype)
              grads = _grad_fn(peer.forward)
              if not row["bwd_rel_err"] <= peer.max_rel_err:
                row["bwd_note"] = "gradients wrong (vs the fp32 reference): speed not quoted"
              elif not all(bool(jnp.all(jnp.isfinite(x.astype(jnp.float32))))
                           for x in grads(q, k, v, do)):
                row["bwd_note"] = "non-finite gradients: speed not quoted"
              else:
                t_all = _bench.median_seconds(grads, q, k, v, do, min_time=min_time)
                t_bwd = max(t_all - t_fwd, 1e-9)
                row["bwd_ms"] = t_bwd * 1e3
                row["bwd_tflops"] = _bench.attention_flops(b, h, s, s, d, causal, "bwd") / t_bwd / 1e12
            except Exception as e:  # noqa: BLE001
              row["bwd_error"] = _bench.failure(e)
          rows.append(row)
          print(json.dumps(row), flush=True)
          if on_row is not None:
            on_row(rows)
  return rows


def prep_rows(head_dims, seqlens, min_time, kv_heads=None):
  """Time of the fp8 input pass alone (rotate + quantize q and k per 64-token block, quantize v
  per head) at the benchmark's shapes: what the user's call from bf16 runs on Hopper
  (`user_call`: v centred straight into the kernel's layout), the fused CUDA passes with v in its
  plain layout (`fused`, the path where the kernel layout does not apply) and the XLA path they
  replace."""
  from jax_fa3 import _fp8_forward, _fp8_quantize  # noqa: PLC0415

  def xla_path(q, k, v, signs):
    q8, qs = _fp8_quantize.xla_rotate_quantize(q, signs, True, 64)
    k8, ks = _fp8_quantize.xla_rotate_quantize(k, signs, True, 64)
    vm = _fp8_quantize.mean_over_keys(v)
    v8, vs = _fp8_quantize.quantize_blocks(v.astype(jnp.float32) - vm[:, None], None)
    return q8, k8, v8, qs, ks, vs, vm

  def fused_path(q, k, v, signs):
    return _fp8_quantize.rotate_and_quantize(q, k, v, signs, True, 64)

  def user_call_path(q, k, v, signs):
    return _fp8_forward.kernel_operands_from_float(q, k, v, signs, True, 64)

  rows = []
  for d in head_dims:
    h = WIDTH // d
    for s in seqlens:
      b = max(1, TOTAL_TOKENS // s)
      q, k, v = _qkv(jax.random.PRNGKey(1), b, s, h, d, jnp.bfloat16, kv_heads)
      signs = jax.random.rademacher(jax.random.PRNGKey(2), (d,), dtype=jnp.float32)
      row = dict(peer="fp8_prep", d=d, h=h, kv_heads=k.shape[2], b=b, seqlen=s)
      # Minimum traffic: read q, k, v in bf16, write them in e4m3 (scales are negligible).
      min_bytes = (q.size + k.size + v.size) * (2 + 1)
      for name, fn in (("user_call", user_call_path), ("fused", fused_path), ("xla", xla_path)):
        t = _bench.median_seconds(jax.jit(fn), q, k, v, signs, min_time=min_time)
        row[f"{name}_us"] = t * 1e6
        row[f"{name}_gbps"] = min_bytes / t / 1e9
      # Its parts: one rotated q/k (per 64-token block) and v (centred, one scale per head): as
      # is (the XLA mean included) and in the kernel's V layout, the mean taken by the pass
      # itself (what the user's call from bf16 runs) and, for comparison, with XLA's mean and the
      # pass that subtracts it (the call before the pass took the mean). One jitted call runs a
      # part on PART_COPIES distinct inputs: a single ~50 µs pass per call timed the host's
      # dispatch instead (H200, 2026-12-02: 72 µs here vs 52 in the standalone tool). Every part
      # runs at q's shape, also with fewer k/v heads (kv_heads), where k's and v's passes are shorter.
      copies = [q] + [q * (1 + 2.0**-6 * i) for i in range(1, PART_COPIES)]
      for name, fn in (("q_rotated", lambda x, s: _fp8_quantize.rotate_quantize(x, s, True, 64)),
                       ("v_per_head",
                        lambda x, s: _fp8_quantize.rotate_quantize(
                            x, s, False, None, _fp8_quantize.mean_over_keys(x))),
                       ("v_kernel_layout", lambda x, s: _fp8_quantize.centre_v_kernel_layout(x)),
                       ("v_kernel_layout_xla_mean",
                        lambda x, s: _fp8_quantize.quantize_v_kernel_layout(
                            x, _fp8_quantize.mean_over_keys(x)))):
        many = jax.jit(lambda xs, s, fn=fn: [fn(x, s) for x in xs])
        t = _bench.median_seconds(many, copies, signs, min_time=min_time) / PART_COPIES
        row[f"{name}_us"] = t * 1e6
        row[f"{name}_gbps"] = q.size * 3 / t / 1e9
      rows.append(row)
      print(json.dumps(row), flush=True)
  return rows


def prep_table(prep, rows) -> str:
  lines = ["| d | seqlen | user's call µs (GB/s) | v in its plain layout µs (GB/s) | XLA µs "
           "(GB/s) | user's call / our fp8 kernel time | q rotated µs (GB/s) | v per head µs "
           "(GB/s) | v in the kernel's layout µs (GB/s) | same, XLA's mean µs |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for r in prep:
    kernel = next((x for x in rows if (x["peer"], x["d"], x["seqlen"], x["causal"]) ==
                   ("jax_fa3_fp8", r["d"], r["seqlen"], False) and x.get("fwd_ms")), None)
    share = "—" if kernel is None else f"{r['user_call_us'] / 1e3 / kernel['fwd_ms']:.1%}"
    lines.append(f"| {r['d']} | {r['seqlen']} | {r['user_call_us']:.0f} "
                 f"({r['user_call_gbps']:.0f}) | {r['fused_us']:.0f} ({r['fused_gbps']:.0f}) | "
                 f"{r['xla_us']:.0f} ({r['xla_gbps']:.0f}) | {share} | "
                 f"{r['q_rotated_us']:.0f} ({r['q_rotated_gbps']:.0f}) | "
                 f"{r['v_per_head_us']:.0f} ({r['v_per_head_gbps']:.0f}) | "
                 f"{r['v_kernel_layout_us']:.0f} ({r['v_kernel_layout_gbps']:.0f}) | "
                 f"{r['v_kernel_layout_xla_mean_us']:.0f} |")
  return "\n".join(lines)


def table(rows, direction) -> str:
  peers = sorted({r["peer"] for r in rows}, key=lambda p: (p != "jax_fa3", p))
  head = f"| d | causal | seqlen | " + " | ".join(peers) + " |"
  lines = [head, "|" + "---|" * (3 + len(peers))]
  keys = sorted({(r["d"], r["causal"], r["seqlen"]) for r in rows})
  for d, causal, s in keys:
    cells = []
    for p in peers:
      r = next((r for r in rows if (r["peer"], r["d"], r["causal"], r["seqlen"]) == (p, d, causal, s)), None)
      value = None if r is None else r.get(f"{direction}_tflops")
      cells.append("—" if value is None else f"{value:.0f}")
    lines.append(f"| {d} | {causal} | {s} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def plot(rows, path):
  import matplotlib  # noqa: PLC0415
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415
  combos = sorted({(r["d"], r["causal"]) for r in rows})
  fig, axes = plt.subplots(1, len(combos), figsize=(4 * len(combos), 3.5), squeeze=False)
  for ax, (d, causal) in zip(axes[0], combos):
    for p in sorted({r["peer"] for r in rows}):
      pts = [(r["seqlen"], r.get("fwd_tflops")) for r in rows
             if r["peer"] == p and r["d"] == d and r["causal"] == causal and r.get("fwd_tflops")]
      if pts:
        ax.plot(*zip(*pts), marker="o", label=p)
    ax.set_xscale("log", base=2)
    ax.set_title(f"fwd d={d} {'causal' if causal else 'non-causal'}")
    ax.set_xlabel("seqlen")
    ax.set_ylabel("TFLOP/s")
  axes[0][0].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--head-dims", default="64,128,256")
  parser.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384")
  parser.add_argument("--directions", default="fwd,bwd")
  parser.add_argument("--causal", choices=("both", "yes", "no"), default="both")
  parser.add_argument("--peers", default=None,
                      help="comma-separated subset, e.g. jax_fa3,cudnn (default: every peer)")
  parser.add_argument("--dtype", default="bfloat16")
  parser.add_argument("--kv-heads", type=int, default=None,
                      help="k/v heads (GQA; 1: MQA; default: as many as the query heads)")
  parser.add_argument("--min-time", type=float, default=0.2)
  parser.add_argument("--json", default="bench_attention.json")
  parser.add_argument("--png", default="bench_attention.png")
  args = parser.parse_args()
  header = _bench.run_header(__file__)
  print(json.dumps(header))
  head_dims = [int(x) for x in args.head_dims.split(",")]
  seqlens = [int(x) for x in args.seqlens.split(",")]
  only = set(args.peers.split(",")) if args.peers else None

  # Rewritten after every row, so a run stopped by a time limit keeps what it measured.
  def write(rows, prep=()):
    with open(args.json, "w") as f:
      json.dump(dict(header=header, rows=rows, fp8_prep=list(prep)), f, indent=1)

  rows = run(head_dims, seqlens, args.directions.split(","), jnp.dtype(args.dtype), args.min_time,
             {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal], only, write,
             args.kv_heads)
  prep = []
  if jax_fa3.kernels_available() and (only is None or "fp8_prep" in only):
    prep = prep_rows(head_dims, seqlens, args.min_time, args.kv_heads)
  write(rows, prep)
  try:
    if rows:  # a run of the preparation rows alone (--peers fp8_prep) has nothing to plot
      plot(rows, args.png)
  except ImportError:
    print("matplotlib missing: no plot")
  print(f"\n{header}\nforward TFLOP/s\n{table(rows, 'fwd')}")
  if "bwd" in args.directions:
    print(f"\nbackward TFLOP/s\n{table(rows, 'bwd')}")
  if prep:
    print(f"\nfp8 input pass (rotate + quantize q, k; quantize v), bf16 inputs\n"
          f"{prep_table(prep, rows)}")


if __name__ == "__main__":
  main()
