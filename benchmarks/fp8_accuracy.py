"""FlashAttention-3 paper, Table 3: FP8 attention accuracy with and without incoherent processing.

Inputs (as in the paper): Q, K, V ~ N(0, 1) + N(0, 100)·Bernoulli(0.001), i.e. every element is
N(0, 1) plus, with probability 0.001, an extra outlier term drawn from N(0, variance 100) (standard
deviation 10). The inputs are rounded to bfloat16 once and every method gets those same bf16
tensors; the reference is float64 attention of them, so each RMSE is that method's own error:

  bf16            jax_fa3.flash_attention on the bf16 inputs (the bf16 kernel on a Hopper GPU;
                  on the CPU the pure-JAX path, fp32 softmax, so only the bf16 output rounding)
  fp8_tensor      FP8 baseline: one scale per tensor for q, k and v, no rotation
  fp8_tensor_rot  per-tensor scales + rotation (not in the paper: isolates the rotation's share)
  fp8_block       q, k: one scale per (batch, head, 64 tokens); v: one per (batch, kv-head)
  fp8_block_rot   block quantization + incoherent processing (random Hadamard rotation) = FA3 FP8
  cudnn_fp8       cuDNN's fp8 forward (one scale per tensor, e4m3 output, dequantized), on a GPU
                  where JAX's private cuDNN fp8 API works; "vs cuDNN" = its RMSE / block+rot's

RMSE = sqrt(mean((out - reference)^2)) over all output elements. All fp8 variants quantize P the
same way (e4m3(2^6·P), see jax_fa3/fp8.py), so the differences come from q/k/v scaling and rotation.
Runs on the CPU through the exact emulation of the fp8 kernel, and on a Hopper GPU through the
kernels once `jax_fa3_flash_fwd_fp8` exists.

  PYTHONPATH=. python benchmarks/fp8_accuracy.py [--seqlen 1024 --heads 4 --json out.json]

--backward measures gradients instead: the relative RMSE (RMSE / RMS of the reference) of dq, dk
and dv against float64 attention's, for dO ~ N(0, 1), of
  bf16_exact      flash_attention's backward (at the unquantized inputs)
  fp8_bf16        flash_attention_fp8(backward="bf16"): the bf16 backward at the fp8 operands
  fp8_fp8         flash_attention_fp8(backward="fp8"): three of five GEMMs in e4m3
  fp8_fp8_norot   the same without the rotation

--sources measures where the forward's error comes from as attention sharpens: on q, k, v ~
N(0, 1) with q scaled by alpha (logit standard deviation alpha; 16 is a sharp, trained-model-like
regime), the relative RMSE (RMSE / RMS of the reference) of flash_attention (bf16),
flash_attention_fp8 (the kernel's numerics), and, in float64 with one rounding at a time, q and k
as the kernel multiplies them (rotated, block-quantized: `qk`), P as e4m3(2^6·P) summed as
quantized (`p`), and V centred and quantized with one scale per head (`v`).

--v-mean m adds m to every element of V (not in the paper): the kernel's PV accumulation on the
tensor cores keeps ~13 mantissa bits, which zero-mean V hides and a mean exposes, more so with
more keys (docs/CONTRACTS.md; e.g. --v-mean 2 --seqlen 4096 --head-dims 128).
"""
from __future__ import annotations

import argparse
import json
import platform
import time

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jax_fa3  # noqa: E402
from jax_fa3 import _bench, _fp8_forward, _fp8_quantize, fp8, reference  # noqa: E402
from jax_fa3.hadamard import hadamard_transform  # noqa: E402

PAPER = {"fp16": 1.9e-4, "fp8_baseline": 2.4e-2, "fa3_fp8": 9.1e-3}
METHODS = ("bf16", "fp8_tensor", "fp8_tensor_rot", "fp8_block", "fp8_block_rot")


def outlier_inputs(seed, b, s, h, d, outlier_prob=1e-3, outlier_std=10.0, v_mean=0.0):
  """q, k, v as bf16: N(0,1) + N(0, outlier_std^2) · Bernoulli(outlier_prob), float64 first;
  v_mean added to v."""
  rng = np.random.default_rng(seed)

  def one(mean=0.0):
    x = rng.standard_normal((b, s, h, d))
    x += rng.standard_normal((b, s, h, d)) * outlier_std * (rng.random((b, s, h, d)) < outlier_prob)
    return jnp.asarray(x + mean, jnp.bfloat16)

  return one(), one(), one(v_mean)


def quantize_per_tensor(x, block_size):
  """e4m3 values with one scale for the whole tensor, laid out as quantize_fp8's (b, h, n_blocks)."""
  xf = x.astype(jnp.float32)
  scale = _fp8_quantize.scale_from_amax(jnp.max(jnp.abs(xf)))
  b, s, h, _ = x.shape
  n = 1 if block_size is None else -(-s // block_size)
  return _fp8_quantize.to_e4m3(xf / scale), jnp.full((b, h, n), scale, jnp.float32)


def run_method(method, q, k, v, *, causal, signs, block_size=64):
  if method == "cudnn_fp8":
    prepare, call = _bench.cudnn_fp8(causal)
    return jax.jit(call)(*prepare(q, k, v))
  if method == "bf16":
    return jax_fa3.flash_attention(q, k, v, causal=causal)
  if method.startswith("fp8_block"):
    return fp8.flash_attention_fp8(q, k, v, causal=causal, incoherent=method.endswith("_rot"),
                                   signs=signs if method.endswith("_rot") else None,
                                   block_size=block_size)
  if method.endswith("_rot"):
    q = hadamard_transform(q.astype(jnp.float32), signs=signs)
    k = hadamard_transform(k.astype(jnp.float32), signs=signs)
  return fp8.flash_attention_fp8(quantize_per_tensor(q, block_size), quantize_per_tensor(k, block_size),
                                 quantize_per_tensor(v, None), causal=causal, incoherent=False,
                                 block_size=block_size)


def rmse(out, ref):
  return float(np.sqrt(np.mean((np.asarray(out, np.float64) - ref) ** 2)))


def measure(d, causal, *, batch, heads, seqlen, seed, v_mean=0.0, methods=METHODS):
  q, k, v = outlier_inputs(seed + d, batch, seqlen, heads, d, v_mean=v_mean)
  signs = jax.random.rademacher(jax.random.PRNGKey(seed), (d,), dtype=jnp.float32)
  f64 = [x.astype(jnp.float64) for x in (q, k, v)]
  ref, _ = reference.attention_forward(*f64, softmax_scale=1 / np.sqrt(d),
                                       window_right=0 if causal else -1)
  ref = np.asarray(ref)
  row = {"d": d, "causal": causal, "ref_rms": float(np.sqrt(np.mean(ref ** 2)))}
  for method in methods:
    try:
      row[method] = rmse(run_method(method, q, k, v, causal=causal, signs=signs), ref)
    except Exception as e:  # noqa: BLE001 (cuDNN refuses some shapes; the other methods go on)
      if method != "cudnn_fp8":
        raise
      row[method], row["cudnn_fp8_error"] = None, _bench.failure(e)
  if "fp8_block" in row and "fp8_block_rot" in row:
    row["gain_rot_vs_block"] = row["fp8_block"] / row["fp8_block_rot"]
  if "fp8_tensor" in row and "fp8_block_rot" in row:
    row["gain_fa3_vs_tensor"] = row["fp8_tensor"] / row["fp8_block_rot"]
  if row.get("cudnn_fp8") and "fp8_block_rot" in row:
    row["gain_vs_cudnn_fp8"] = row["cudnn_fp8"] / row["fp8_block_rot"]
  return row


GRAD_METHODS = {
    "bf16_exact": lambda q, k, v, causal, signs: jax_fa3.flash_attention(q, k, v, causal=causal),
    "fp8_bf16": lambda q, k, v, causal, signs: fp8.flash_attention_fp8(
        q, k, v, causal=causal, signs=signs, backward="bf16"),
    "fp8_fp8": lambda q, k, v, causal, signs: fp8.flash_attention_fp8(
        q, k, v, causal=causal, signs=signs, backward="fp8"),
    "fp8_fp8_norot": lambda q, k, v, causal, signs: fp8.flash_attention_fp8(
        q, k, v, causal=causal, incoherent=False, backward="fp8"),
}


def relative_rmse(got, ref):
  return rmse(got, ref) / float(np.sqrt(np.mean(ref ** 2)))


def measure_gradients(d, causal, *, batch, heads, seqlen, seed, v_mean=0.0):
  q, k, v = outlier_inputs(seed + d, batch, seqlen, heads, d, v_mean=v_mean)
  dout = jnp.asarray(np.random.default_rng(seed + d + 1).standard_normal(q.shape), jnp.bfloat16)
  signs = jax.random.rademacher(jax.random.PRNGKey(seed), (d,), dtype=jnp.float32)
  f64 = [x.astype(jnp.float64) for x in (q, k, v)]
  window_right = 0 if causal else -1
  ref_out, ref_lse = reference.attention_forward(*f64, softmax_scale=1 / np.sqrt(d),
                                                 window_right=window_right)
  refs = [np.asarray(g) for g in reference.attention_backward(
      *f64, ref_out, ref_lse, dout.astype(jnp.float64), softmax_scale=1 / np.sqrt(d),
      window_right=window_right)]
  row = {"d": d, "causal": causal}
  for name, attn in GRAD_METHODS.items():
    loss = lambda q, k, v, dout: jnp.sum(attn(q, k, v, causal, signs).astype(jnp.float32)
                                         * dout.astype(jnp.float32))
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v, dout)
    for grad_name, g, ref in zip(("dq", "dk", "dv"), grads, refs):
      row[f"{name}_{grad_name}"] = relative_rmse(g, ref)
  return row


SHARPNESS = (1.0, 4.0, 16.0)


def _float64_attention(q, k, v):
  return reference.attention_forward(q, k, v, softmax_scale=1 / np.sqrt(q.shape[-1]))[0]


def _attention_with_p_rounded(q, k, v):
  """Float64 attention of (b, s, h, d) inputs with P rounded as the fp8 kernel rounds it:
  e4m3(2^6 · exp(S - row max)), the row sum taken of the rounded values."""
  scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
  p = jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True))
  p = _fp8_quantize.to_e4m3(p * 64.0).astype(jnp.float64) / 64.0
  out = jnp.einsum("bhqk,bkhd->bqhd", p, v)
  return out / jnp.swapaxes(jnp.sum(p, axis=-1), 1, 2)[..., None]


def measure_sources(alpha, d, *, batch, heads, seqlen, seed, block_size=64):
  """Relative RMSE of each SOURCES entry at logit standard deviation alpha (q scaled by it)."""
  rng = np.random.default_rng(seed + d)
  normal = lambda: rng.standard_normal((batch, seqlen, heads, d))
  q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in (normal() * alpha, normal(), normal()))
  signs = jax.random.rademacher(jax.random.PRNGKey(seed), (d,), dtype=jnp.float32)
  q64, k64, v64 = (x.astype(jnp.float64) for x in (q, k, v))
  ref = np.asarray(_float64_attention(q64, k64, v64))
  q8, k8, v8, q_scale, k_scale, v_scale, v_mean = _fp8_quantize.rotate_and_quantize(
      q, k, v, signs, True, block_size)
  # Rotated q and k: the rotation is orthogonal, so their scores are q·k up to the rounding.
  q_used, k_used = (fp8.dequantize_fp8(x8, scales, block_size=block_size, dtype=jnp.float64)
                    for x8, scales in ((q8, q_scale), (k8, k_scale)))
  v_used = (fp8.dequantize_fp8(v8, v_scale[..., None], block_size=None, dtype=jnp.float64)
            + v_mean[:, None].astype(jnp.float64))
  outs = {"bf16": jax_fa3.flash_attention(q, k, v),
          "fp8": fp8.flash_attention_fp8(q, k, v, signs=signs, block_size=block_size),
          "qk": _float64_attention(q_used, k_used, v64),
          "p": _attention_with_p_rounded(q64, k64, v64),
          "v": _float64_attention(q64, k64, v_used)}
  top = jnp.max(jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q64, k64) / np.sqrt(d)), axis=-1)
  row = {"alpha": alpha, "d": d, "mean_top_p": float(jnp.mean(top))}
  row.update({name: relative_rmse(out, ref) for name, out in outs.items()})
  return row


def main_sources(args, backend):
  print(f"FP8 forward error by source: b={args.batch} h={args.heads} s={args.seqlen}, fp8 path: "
        f"{backend}, jax {jax.__version__} on {jax.devices()[0].platform}")
  print("q, k, v ~ N(0, 1), q scaled by alpha (logit std alpha), bf16; relative RMSE vs float64 "
        "attention; qk / p / v: that rounding alone, in float64\n")
  header = (f"{'d':>4} {'alpha':>5} {'mean top P':>10} | {'bf16':>8} {'fp8':>8} | "
            f"{'qk':>8} {'p':>8} {'v':>8}")
  print(header)
  print("-" * len(header))
  rows = []
  for d in args.head_dims:
    for alpha in SHARPNESS:
      r = measure_sources(alpha, d, batch=args.batch, heads=args.heads, seqlen=args.seqlen,
                          seed=args.seed)
      rows.append(r)
      print(f"{d:>4} {alpha:5g} {r['mean_top_p']:10.3f} | {r['bf16']:8.2e} {r['fp8']:8.2e} | "
            f"{r['qk']:8.2e} {r['p']:8.2e} {r['v']:8.2e}", flush=True)
  return rows


def main_gradients(args, backend):
  print(f"FP8 attention gradients: b={args.batch} h={args.heads} s={args.seqlen}, fp8 forward: "
        f"{backend}, jax {jax.__version__} on {jax.devices()[0].platform}")
  print("inputs N(0,1) + N(0, var 100)·Bernoulli(0.001), bf16, dO ~ N(0, 1); relative RMSE of "
        "dq / dk / dv vs float64 attention's gradients\n")
  names = list(GRAD_METHODS)
  header = f"{'d':>4} {'causal':>6} | " + " | ".join(f"{n:^20}" for n in names)
  print(header)
  print("-" * len(header))
  rows = []
  for d in args.head_dims:
    for causal in (False, True):
      r = measure_gradients(d, causal, batch=args.batch, heads=args.heads, seqlen=args.seqlen,
                            seed=args.seed, v_mean=args.v_mean)
      rows.append(r)
      cells = [" ".join(f"{r[f'{n}_{g}']:.1e}" for g in ("dq", "dk", "dv")) for n in names]
      print(f"{d:>4} {str(causal):>6} | " + " | ".join(f"{c:^20}" for c in cells), flush=True)
  return rows


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--heads", type=int, default=4)
  parser.add_argument("--seqlen", type=int, default=1024)
  parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--v-mean", type=float, default=0.0, help="added to every element of V")
  parser.add_argument("--backward", action="store_true", help="measure gradients (see above)")
  parser.add_argument("--sources", action="store_true",
                      help="the forward's error by source as attention sharpens (see above)")
  parser.add_argument("--json", default="fp8_accuracy.json")
  args = parser.parse_args()

  backend = "kernels" if _fp8_forward.kernel_unavailable_reason() is None else "pure-JAX emulation"
  if args.backward or args.sources:
    rows = (main_gradients if args.backward else main_sources)(args, backend)
    result = {"config": {**vars(args), "fp8_path": backend, "jax": jax.__version__,
                         "platform": jax.devices()[0].platform, "machine": platform.machine()},
              "rows": rows}
    if args.json:
      with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
      print(f"wrote {args.json}")
    return
  print(f"FP8 attention accuracy (FA3 Table 3): b={args.batch} h={args.heads} s={args.seqlen}, "
        f"fp8 path: {backend}, jax {jax.__version__} on {jax.devices()[0].platform}")
  print("inputs N(0,1) + N(0, var 100)·Bernoulli(0.001), bf16; RMSE vs float64 attention"
        + (f"; V shifted by {args.v_mean:g}" if args.v_mean else ""))
  print(f"paper (H100, s/shape not stated per row): fp16 {PAPER['fp16']:.1e}, "
        f"FP8 baseline {PAPER['fp8_baseline']:.1e}, FA3 FP8 {PAPER['fa3_fp8']:.1e} "
        f"(gain {PAPER['fp8_baseline'] / PAPER['fa3_fp8']:.1f}x)\n")
  with_cudnn = jax.default_backend() == "gpu" and _bench.cudnn_fp8(False) is not None
  methods = METHODS + (("cudnn_fp8",) if with_cudnn else ())
  header = (f"{'d':>4} {'causal':>6} | {'bf16':>8} {'fp8 tensor':>10} {'tensor+rot':>10} "
            f"{'fp8 block':>10} {'block+rot':>10} | {'rot gain':>8} {'vs tensor':>9}"
            + (f" | {'cuDNN fp8':>10} {'vs cuDNN':>8}" if with_cudnn else ""))
  print(header)
  print("-" * len(header))
  rows = []
  start = time.time()
  for d in args.head_dims:
    for causal in (False, True):
      r = measure(d, causal, batch=args.batch, heads=args.heads, seqlen=args.seqlen,
                  seed=args.seed, v_mean=args.v_mean, methods=methods)
      rows.append(r)
      cudnn = ""
      if with_cudnn:
        cudnn = (f" | {r['cudnn_fp8']:10.2e} {r['gain_vs_cudnn_fp8']:7.2f}x" if r["cudnn_fp8"]
                 else f" | {'failed':>10} {'—':>8}")
      print(f"{d:>4} {str(causal):>6} | {r['bf16']:8.2e} {r['fp8_tensor']:10.2e} "
            f"{r['fp8_tensor_rot']:10.2e} {r['fp8_block']:10.2e} {r['fp8_block_rot']:10.2e} | "
            f"{r['gain_rot_vs_block']:7.2f}x {r['gain_fa3_vs_tensor']:8.2f}x{cudnn}", flush=True)
  print(f"\nrot gain = fp8 block / block+rot; vs tensor = fp8 tensor / block+rot"
        + ("; vs cuDNN = cuDNN fp8 / block+rot" if with_cudnn else "")
        + f". {time.time() - start:.0f} s")
  result = {"config": {**vars(args), "fp8_path": backend, "jax": jax.__version__,
                       "platform": jax.devices()[0].platform, "machine": platform.machine()},
            "paper": PAPER, "rows": rows}
  if args.json:
    with open(args.json, "w") as f:
      json.dump(result, f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
  main()
