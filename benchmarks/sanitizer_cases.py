"""Small forward + backward kernel calls for compute-sanitizer (memcheck, racecheck, synccheck).

Run under the sanitizer, restricted to our kernels, e.g.

    compute-sanitizer --tool racecheck --kernel-name kns=jax_fa3 \
        python benchmarks/sanitizer_cases.py

Shapes are small (one to a few CTAs) but cover every tail path: ragged s_q/s_k, s_q != s_k,
GQA, causal, a window, softcap, and the head-dim buckets given on the command line. Each case
also checks the result against the fp32 reference, so a run that the sanitizer instruments but
that computes garbage does not pass silently. The fp8 forward (`jax_fa3_flash_fwd_fp8`, its V
transpose pre-pass included) runs the same shapes (no softcap; block_size 32 and 64) from
pre-quantized inputs and is checked against the pure-JAX emulation (--no-fp8 skips it); the
fused rotate + quantize pass of q runs too, checked against the XLA path, and so does the user's
call from floats (`flash_attention_fp8`: v quantized straight into the kernel's V layout).
--fp8-backward adds `jax.grad` of `flash_attention_fp8(..., backward="fp8")` at d = 64 and 128
(the fp8 backward kernel, its operand preparation and the rotation back), checked against the
same call's pure-JAX emulation on the CPU. --decode adds decode steps over a KV cache (the decode
targets: q read heads-major, split-KV pieces of whole key blocks, empty ones included, then the
combine), contiguous and paged, GQA causal and MHA with a left window, checked against the same
call on float32 inputs (the pure-JAX path), and at d <= 128 the same step over the cache
quantized to e4m3 (the e4m3 decode targets) against the bf16 call over its dequantized values;
--decode-only runs these alone.
"""
import argparse
import itertools
import os
import sys

# XLA's GPU autotuner runs candidate kernels while it compiles. Under memcheck the process died
# with a segmentation fault inside such a compile (XLA's slow-compile alarm for `jit_loss`, then
# the fault; H100, 2026-12-06); these cases' XLA ops are tiny, so nothing is autotuned. (Whether
# this avoids that fault has not been run yet.)
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_autotune_level=0").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jax_fa3  # noqa: E402
from jax_fa3 import _bench  # noqa: E402
from jax_fa3._validation import attention_config  # noqa: E402

CASES = [  # (b, s_q, s_k, h, h_k, causal, window, softcap)
    (1, 65, 129, 2, 1, False, (-1, -1), 0.0),
    (1, 129, 65, 2, 2, True, (-1, -1), 0.0),
    (2, 100, 100, 2, 1, False, (30, 10), 0.0),
    (1, 1, 77, 1, 1, True, (-1, -1), 15.0),
    # d = 128: the backward's 80-row Q blocks (s_q >= 1024, h_k > 1, no mask); ragged at both ends
    (1, 1043, 150, 4, 2, False, (-1, -1), 0.0),
]


def _rel(x, ref):
  x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
  return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


def run_case(d, dtype, b, s_q, s_k, h, h_k, causal, window, softcap, backward):
  keys = jax.random.split(jax.random.PRNGKey(d + s_q), 4)
  q = jax.random.normal(keys[0], (b, s_q, h, d), jnp.float32).astype(dtype)
  k = jax.random.normal(keys[1], (b, s_k, h_k, d), jnp.float32).astype(dtype)
  v = jax.random.normal(keys[2], (b, s_k, h_k, d), jnp.float32).astype(dtype)
  do = jax.random.normal(keys[3], (b, s_q, h, d), jnp.float32).astype(dtype)
  kw = dict(causal=causal, window_size=window, softcap=softcap)
  cfg = attention_config(q, k, v, softmax_scale=None, causal=causal, window_size=window,
                         softcap=softcap, deterministic=False)
  ref_out, _, ref_grads = _bench.host_reference(q, k, v, cfg, dout=do if backward else None)
  out = jax.jit(lambda q, k, v: jax_fa3.flash_attention(q, k, v, **kw))(q, k, v)
  errors = {"out": _rel(out, ref_out)}
  if backward:
    do32 = do.astype(jnp.float32)
    loss = lambda q, k, v: jnp.sum(jax_fa3.flash_attention(q, k, v, **kw).astype(jnp.float32) * do32)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    errors.update(_bench.gradient_errors(grads, ref_grads))
  return errors


def run_fp8_case(d, b, s_q, s_k, h, h_k, causal, window, block_size):
  from jax_fa3 import _fp8_emulation, _fp8_forward, _fp8_quantize, fp8  # noqa: PLC0415
  from jax_fa3._config import AttentionConfig, Fp8Config  # noqa: PLC0415
  keys = jax.random.split(jax.random.PRNGKey(d + s_q + 1), 3)
  q = jax.random.normal(keys[0], (b, s_q, h, d), jnp.float32)
  k = jax.random.normal(keys[1], (b, s_k, h_k, d), jnp.float32)
  v = jax.random.normal(keys[2], (b, s_k, h_k, d), jnp.float32)
  q8, q_scale = fp8.quantize_fp8(q, block_size=block_size)
  k8, k_scale = fp8.quantize_fp8(k, block_size=block_size)
  v_mean = _fp8_quantize.mean_over_keys(v)  # centred, as the call from floats does
  v8, v_scale = fp8.quantize_fp8(v - v_mean[:, None], block_size=None)
  args = (q8, k8, v8, q_scale, k_scale, v_scale[..., 0], v_mean)
  dequant = lambda values, scales: fp8.dequantize_fp8(values, scales, block_size=block_size)
  att = AttentionConfig(softmax_scale=d**-0.5, window_left=window[0],
                        window_right=0 if causal else window[1])
  cfg = Fp8Config(att, block_size=block_size, incoherent=False, return_lse=False,
                      tile_k=128)  # the kernels' kBlockN, every bucket
  out, _ = jax.jit(lambda *a: _fp8_forward.fp8_forward(*a[:6], cfg, v_mean=a[6]))(*args)
  cpu = jax.devices("cpu")[0]
  with jax.default_device(cpu):
    emu, _ = jax.jit(lambda *a: _fp8_emulation.emulated_forward(*a[:6], cfg, v_mean=a[6]))(
        *[jax.device_put(x, cpu) for x in args])
  # The fused rotate + quantize pass (quantize_fp8 above ran it unrotated) against the XLA path.
  signs = jax.random.rademacher(keys[0], (d,), dtype=jnp.float32)
  fused = jax.jit(lambda x: _fp8_quantize.rotate_quantize(x, signs, True, block_size))(q)
  xla = jax.jit(lambda x: _fp8_quantize.xla_rotate_quantize(x, signs, True, block_size))(q)
  # The user's call from floats: q/k rotated and quantized in one pass, v quantized straight into
  # the kernel's V layout (keys_transposed), the kernel with v_transposed; against the emulation.
  floats = [x.astype(jnp.bfloat16) for x in (q, k, v)]
  user_call = lambda q, k, v: fp8.flash_attention_fp8(
      q, k, v, causal=causal, window_size=window, block_size=block_size, key=keys[1])
  from_floats = jax.jit(user_call)(*floats)
  with jax.default_device(cpu):
    from_floats_emu = jax.jit(user_call)(*[jax.device_put(x, cpu) for x in floats])
  return {"out": _rel(out, emu), "rotated_q": _rel(dequant(*fused), dequant(*xla)),
          "rotated_q_scales": _rel(fused[1], xla[1]),
          "from_floats": _rel(from_floats, from_floats_emu)}


def run_fp8_backward_case(d, b, s_q, s_k, h, h_k, causal, window):
  keys = jax.random.split(jax.random.PRNGKey(d + s_q + 2), 5)
  q, k, v = (jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16)
             for key, shape in zip(keys, ((b, s_q, h, d), (b, s_k, h_k, d), (b, s_k, h_k, d))))
  do = jax.random.normal(keys[3], (b, s_q, h, d), jnp.float32)

  def loss(q, k, v):
    out = jax_fa3.flash_attention_fp8(q, k, v, causal=causal, window_size=window,
                                      backward="fp8", key=keys[4])
    return jnp.sum(out.astype(jnp.float32) * do)

  grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  got = grad(q, k, v)
  cpu = jax.devices("cpu")[0]
  with jax.default_device(cpu):
    want = grad(*[jax.device_put(x, cpu) for x in (q, k, v)])
  return {name: _rel(g, w) for name, g, w in zip(("dq", "dk", "dv"), got, want)}


def run_decode_case(d, paged, splits, h, h_k, window):
  from jax_fa3 import _local_attention  # noqa: PLC0415
  block = _local_attention.forward_key_block(d)
  b, cap = 3, 5 * block
  keys = jax.random.split(jax.random.PRNGKey(d + splits), 3)
  q = jax.random.normal(keys[0], (b, 1, h, d), jnp.float32).astype(jnp.bfloat16)
  k = jax.random.normal(keys[1], (b, cap, h_k, d), jnp.float32).astype(jnp.bfloat16)
  v = jax.random.normal(keys[2], (b, cap, h_k, d), jnp.float32).astype(jnp.bfloat16)
  # NumPy lengths and table: constants of both the GPU call and its CPU reference.
  lengths = np.asarray([cap, 1, 2 * block + 3], np.int32)
  options = dict(cache_seqlens=lengths, window_size=window, num_splits=splits)
  if paged:  # pages of one key block, in reverse order
    pages = b * 5
    table = np.arange(pages, dtype=np.int32)[::-1].reshape(b, 5).copy()
    as_pool = lambda c: jnp.zeros((pages, block, h_k, d), c.dtype).at[table.reshape(-1)].set(
        c.reshape(pages, block, h_k, d))
    k, v = as_pool(k), as_pool(v)
    options["page_table"] = table
  call = jax.jit(lambda q, k, v: jax_fa3.flash_attention_with_kvcache(q, k, v, **options))
  out = call(q, k, v)
  # The float32 reference on the CPU: under memcheck the process is XLA's GPU ops' as much as
  # ours, and a paged case died there with a segmentation fault (H100, 2026-12-06 and -07).
  cpu = jax.devices("cpu")[0]
  with jax.default_device(cpu):
    ref = call(*(jax.device_put(x.astype(jnp.float32), cpu) for x in (q, k, v)))
  errors = {"out": _rel(out, ref)}
  if d <= 128 and d % 16 == 0:
    # The same step over the cache quantized to e4m3 (one scale per 64 slots), read in place by
    # the e4m3 decode targets: exactly the bf16 call over the dequantized cache.
    pairs = [jax_fa3.quantize_fp8(x, block_size=64) for x in (k, v)]
    fp8_call = jax.jit(lambda q, kc, vc: jax_fa3.flash_attention_with_kvcache(
        q, kc, vc, block_size=64, **options))
    dequantized = [jax_fa3.dequantize_fp8(*pair, block_size=64, dtype=jnp.bfloat16)
                   for pair in pairs]
    errors["e4m3_out"] = _rel(fp8_call(q, *pairs), call(q, *dequantized))
  return errors


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--head-dims", default="64,128,256")
  parser.add_argument("--backward", action="store_true", help="also run jax.grad (needs the bwd kernel)")
  parser.add_argument("--no-fp8", action="store_true", help="skip the fp8 forward cases")
  parser.add_argument("--fp8-backward", action="store_true",
                      help="also jax.grad of flash_attention_fp8(backward='fp8') at d = 64, 128")
  parser.add_argument("--decode", action="store_true",
                      help="also decode steps over a KV cache (split-KV, paged; bf16 and e4m3)")
  parser.add_argument("--decode-only", action="store_true",
                      help="only the decode steps (--decode without the other cases)")
  parser.add_argument("--fp8-only", action="store_true",
                      help="only the fp8 forward cases (the kernel, the fused passes, the call "
                           "from floats)")
  args = parser.parse_args(argv)
  if args.decode_only:
    args.decode, args.no_fp8, args.backward, args.fp8_backward = True, True, False, False
  tol = 2e-2
  failed = 0
  bf16_cases = () if args.decode_only or args.fp8_only else CASES
  for d, case in itertools.product([int(x) for x in args.head_dims.split(",")], bf16_cases):
    errors = run_case(d, jnp.bfloat16, *case, backward=args.backward)
    ok = all(np.isfinite(e) and e < tol for e in errors.values())
    failed += not ok
    print(f"d={d} case={case}: " + " ".join(f"{k}={v:.2e}" for k, v in errors.items()),
          "ok" if ok else "FAILED", flush=True)
  if not args.no_fp8:
    for d, case, block_size in itertools.product([int(x) for x in args.head_dims.split(",")],
                                                 CASES, (32, 64)):
      if d not in (64, 128, 256):
        continue
      errors = run_fp8_case(d, *case[:-1], block_size=block_size)
      ok = all(np.isfinite(e) and e < tol for e in errors.values())
      failed += not ok
      print(f"fp8 d={d} case={case[:-1]} block_size={block_size}: "
            + " ".join(f"{k}={v:.2e}" for k, v in errors.items()), "ok" if ok else "FAILED",
            flush=True)
  if args.fp8_backward:
    for d, case in itertools.product([int(x) for x in args.head_dims.split(",")], CASES):
      if d not in (64, 128):
        continue
      errors = run_fp8_backward_case(d, *case[:-1])
      ok = all(np.isfinite(e) and e < tol for e in errors.values())
      failed += not ok
      print(f"fp8 backward d={d} case={case[:-1]}: "
            + " ".join(f"{k}={v:.2e}" for k, v in errors.items()), "ok" if ok else "FAILED",
            flush=True)
  if args.decode:
    heads = [(8, 2, (-1, 0)), (4, 4, (200, -1))]
    for d, paged, splits, (h, h_k, window) in itertools.product(
        [int(x) for x in args.head_dims.split(",")], (False, True), (1, 3, 9), heads):
      errors = run_decode_case(d, paged, splits, h, h_k, window)
      ok = all(np.isfinite(e) and e < tol for e in errors.values())
      failed += not ok
      print(f"decode d={d} paged={paged} splits={splits} h={h} h_k={h_k} window={window}: "
            + " ".join(f"{k}={v:.2e}" for k, v in errors.items()), "ok" if ok else "FAILED",
            flush=True)
  print(f"sanitizer cases: {failed} failed", flush=True)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
