"""Timing and peer plumbing shared by `python -m jax_fa3` and benchmarks/bench_attention.py."""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import pathlib
import platform
import statistics
import subprocess
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

import jax_fa3
from jax_fa3 import reference


def attention_flops(b, h, s_q, s_k, d, causal, direction="fwd") -> float:
  """FlashAttention's count: 4·b·h·s_q·s_k·d forward (halved when causal), backward 2.5×."""
  flops = 4.0 * b * h * s_q * s_k * d * (0.5 if causal else 1.0)
  return flops * {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}[direction]


def git_commit(path) -> str:
  """The short commit of the checkout holding `path`, "+dirty" when it has local changes; for a
  tree that is no checkout (e.g. unpacked from `git ls-files` on a GPU machine), the commit
  named by JAX_FA3_BENCH_COMMIT, when set."""
  named = os.environ.get("JAX_FA3_BENCH_COMMIT")
  if named:
    return named
  root = pathlib.Path(path).resolve().parent
  try:
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                         text=True, check=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                           capture_output=True, text=True, check=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return "unknown (not a git checkout)"
  return rev + ("+dirty" if dirty else "")


def run_header(script) -> dict:
  """What every benchmark JSON starts with: date (UTC), the commit of the checkout holding
  `script` (a benchmark's __file__), device, versions, whether the kernels ran."""
  return dict(date=str(datetime.datetime.now(datetime.timezone.utc).date()),
              commit=git_commit(script), device=jax.devices()[0].device_kind,
              jax=jax.__version__, jax_fa3=jax_fa3.__version__,
              kernels=jax_fa3.kernels_available(), python=platform.python_version())


def median_seconds(fn: Callable, *args, min_time=0.2, repeats=7) -> float:
  """Median over `repeats` of the per-call time of back-to-back asynchronous launches.

  Only the last launch's outputs are kept and waited for: one device runs the launches in order,
  and an earlier output dropped while its launch is in flight is freed when the launch is done.
  Holding every output (up to 200 x 1 GiB for a 2 GiB copy) ran an 80 GB GPU out of memory."""
  jax.block_until_ready(fn(*args))  # compile + warm up
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*args))
  once = max(time.perf_counter() - t0, 1e-6)
  iters = max(1, min(200, int(min_time / once)))
  samples = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    out = None
    for _ in range(iters):
      out = fn(*args)
    jax.block_until_ready(out)
    samples.append((time.perf_counter() - t0) / iters)
  return statistics.median(samples)


@dataclasses.dataclass
class Peer:
  name: str
  forward: Callable          # (q, k, v) -> out, under jit
  dtype: object = None       # force this input dtype (e.g. Pallas MGPU runs fp16 only)
  unit_scale: bool = False   # the peer applies no 1/sqrt(d) softmax scale (Pallas MGPU)
  # (q, k, v) -> the forward's arguments, computed outside the timing (e.g. fp8 quantization).
  prepare: Callable | None = None
  max_rel_err: float = 2e-2  # above this vs the fp32 reference the speed is not quoted
  forward_only: bool = False


def _dpa(implementation, causal):
  def f(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=implementation)
  return f


def peers(causal: bool, on_gpu: bool) -> list[Peer]:
  out = [Peer("jax_fa3", lambda q, k, v: jax_fa3.flash_attention(q, k, v, causal=causal)),
         Peer("xla", _dpa("xla", causal))]
  if on_gpu:
    out.append(Peer("cudnn", _dpa("cudnn", causal)))
    try:
      from jax.experimental.pallas.ops.gpu import attention_mgpu  # noqa: PLC0415
      # JAX's own tuned setting for H100 (attention_mgpu's benchmark): 2 WGs of 64 query rows.
      config = attention_mgpu.TuningConfig(
          block_q=64, block_kv=128, max_concurrent_steps=2, causal=causal,
          block_q_dkv=64, block_kv_dkv=64, block_q_dq=64, block_kv_dq=64)
      def mgpu(q, k, v):
        return attention_mgpu.attention(q, k, v, config)
      out.append(Peer("pallas_mgpu", mgpu, dtype=jnp.float16, unit_scale=True))
    except Exception:  # noqa: BLE001 (optional peer; absent in older JAX)
      pass
  return out


def cudnn_fp8(causal: bool):
  """cuDNN's fp8 forward through JAX's private API: (prepare, call), or None where it is absent.

  prepare(q, k, v) quantizes each tensor with one scale (max |x| / 448, what cuDNN's fp8 API
  takes); call(*prepare(...)) returns cuDNN's e4m3 output dequantized to bfloat16.
  """
  try:
    from jax._src.cudnn import fused_attention_stablehlo as cudnn_fa  # noqa: PLC0415
  except Exception:  # noqa: BLE001 (private API: absent or moved)
    return None

  def per_tensor(x):
    scale = jnp.maximum(jnp.max(jnp.abs(x.astype(jnp.float32))), 1e-30) / 448.0
    return (x.astype(jnp.float32) / scale).astype(jnp.float8_e4m3fn), scale

  def prepare(q, k, v):
    (q8, qs), (k8, ks), (v8, vs) = per_tensor(q), per_tensor(k), per_tensor(v)
    return jax.block_until_ready((q8, k8, v8, qs, ks, vs))

  def call(q8, k8, v8, qs, ks, vs):
    one = lambda x: jnp.asarray(x, jnp.float32).reshape(1, 1, 1, 1)
    out_scale = 1.0 / vs  # |O| <= max|v| = 448 * vs, so O * out_scale fits e4m3
    params = dict(amax_dQ=one(0), amax_dK=one(0), amax_dV=one(0), amax_dP=one(0),
                  descale_q=one(qs), descale_k=one(ks), descale_v=one(vs),
                  descale_s=one(1 / 448.0), scale_s=one(448.0), scale_o=one(out_scale),
                  descale_o=one(1 / out_scale), descale_dO=one(1), descale_dP=one(1),
                  scale_dQ=one(1), scale_dK=one(1), scale_dV=one(1), scale_dP=one(1))
    out, _, _ = cudnn_fa.dot_product_attention(
        q8, k8, v8, fp8_params=params, scale=q8.shape[-1] ** -0.5,
        mask_type=cudnn_fa.MaskType.CAUSAL if causal else cudnn_fa.MaskType.NO_MASK,
        qkv_layout="BTNH", use_fp8=True)
    return (out.astype(jnp.float32) / out_scale).astype(jnp.bfloat16)

  return prepare, call


def relative_error(out, q, k, v, causal, unit_scale=False) -> float:
  """‖out − ref‖/‖ref‖ against the fp32 reference on the same (rounded) inputs."""
  f32 = lambda x: x.astype(jnp.float32)
  scale = 1.0 if unit_scale else 1 / np.sqrt(q.shape[-1])
  ref, _ = reference.attention_forward(f32(q), f32(k), f32(v), softmax_scale=scale,
                                       window_right=0 if causal else -1)
  diff = jnp.linalg.norm(f32(out) - ref)
  return float(diff / jnp.linalg.norm(ref))


def host_reference(q, k, v, cfg, dout=None):
  """The fp32 reference on the host CPU: (out, lse) and, given dout, also (dq, dk, dv) (else None).

  Kernel tests and sanitizer runs keep XLA's own work off the GPU: there XLA autotunes each new
  shape's GEMMs (a 70 s stall in one test run, H200, 2026-11-30) and, under compute-sanitizer, its
  compiler crashed. Only the kernels under test need the GPU; their results come over for the
  comparison.
  """
  cpu = jax.devices("cpu")[0]
  f32 = lambda x: jax.device_put(x, cpu).astype(jnp.float32)
  with jax.default_device(cpu):
    out, lse = reference.attention_forward(f32(q), f32(k), f32(v), **cfg.kwargs())
    if dout is None:
      return out, lse, None
    grads = reference.attention_backward(f32(q), f32(k), f32(v), out, lse, f32(dout),
                                         **cfg.kwargs())
  return out, lse, grads


def gradient_errors(grads, ref_grads) -> dict[str, float]:
  """{"dq", "dk", "dv"}: relative Frobenius errors, each denominator floored at 1e-3·‖dv_ref‖.

  With one visible key per row P = 1 and dq = dk = 0 exactly (dP = D), while a kernel's dP and D
  are one dot product summed in two orders: ~1e-6 of rounding is left over, "infinitely" wrong
  relative to an exact 0. The norm of dv (the magnitude of the cancelling terms) floors the
  denominator, so errors stay measured against the gradient's natural scale.
  """
  as64 = lambda x: np.asarray(jnp.asarray(x, jnp.float32), np.float64)
  floor = 1e-3 * float(np.linalg.norm(as64(ref_grads[2])))
  errors = {}
  for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
    err = np.linalg.norm(as64(got) - as64(want))
    errors[name] = float(err / max(float(np.linalg.norm(as64(want))), floor, 1e-30))
  return errors


def gradient_error(forward, h, d, causal, dtype, unit_scale=False, seqlen=1024, seed=0) -> float:
  """The largest of gradient_errors(...) for forward at (1, seqlen, h, d): the gradients of
  sum(forward(q, k, v) * dout) against the fp32 reference on the same (rounded) inputs.

  A benchmark checks each peer's backward once per shape family here, at a size the reference
  handles, before it quotes the peer's backward speed (a peer's fast backward can be a wrong one:
  flash-attn3-jax 0.2.3's non-causal gradients were).
  """
  keys = jax.random.split(jax.random.PRNGKey(seed), 2)
  q, k, v = random_qkv(keys[0], 1, seqlen, h, d, dtype)
  dout = jax.random.normal(keys[1], q.shape, jnp.float32).astype(dtype)

  def loss(q, k, v):
    return jnp.sum(forward(q, k, v).astype(jnp.float32) * dout.astype(jnp.float32))

  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
  f32 = lambda x: x.astype(jnp.float32)
  kwargs = dict(softmax_scale=1.0 if unit_scale else 1 / np.sqrt(d),
                window_right=0 if causal else -1)
  out, lse = reference.attention_forward(f32(q), f32(k), f32(v), **kwargs)
  ref_grads = reference.attention_backward(f32(q), f32(k), f32(v), out, lse, f32(dout), **kwargs)
  return max(gradient_errors(grads, ref_grads).values())


def random_qkv(key, b, s, h, d, dtype):
  kq, kk, kv = jax.random.split(key, 3)
  return tuple(jax.random.normal(kk_, (b, s, h, d), jnp.float32).astype(dtype) for kk_ in (kq, kk, kv))


def failure(e: Exception) -> str:
  """One line naming an exception, for a benchmark row whose peer failed (the others go on)."""
  first_line = (str(e).splitlines() or [""])[0]
  return f"{type(e).__name__}: {first_line[:120]}"


def record(rows: list, row: dict, measure: Callable) -> None:
  """Runs measure(row), which fills in the row, or notes its failure as row["error"] (one failing
  peer must not hide the rest); appends the row and prints it as one JSON line."""
  try:
    measure(row)
  except Exception as e:  # noqa: BLE001
    row["error"] = failure(e)
  rows.append(row)
  print(json.dumps(row), flush=True)
