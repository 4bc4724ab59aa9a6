"""One jitted attention step, run a few times, for a profiler (ncu) to pick a kernel launch from.

  ncu --clock-control none -k regex:flash_bwd_kernel --launch-skip 1 -c 1 --section ... \
      python benchmarks/profile_step.py --direction bwd --seqlen 8192 --head-dim 128

--direction fp8 runs the e4m3 forward (its V transpose pre-pass is a second kernel).
--impl fa3_kernels runs FlashAttention-3's own kernels instead (the flash-attn3-jax package,
d = 128; its backward kernel matches -k regex:FlashAttnBwd).
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import jax_fa3
from jax_fa3 import _bench


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--direction", choices=("fwd", "bwd", "fp8"), default="bwd",
                      help="fp8: the e4m3 forward kernel on pre-quantized inputs (block size 64)")
  parser.add_argument("--seqlen", type=int, default=8192)
  parser.add_argument("--head-dim", type=int, default=128)
  parser.add_argument("--tokens", type=int, default=16384)
  parser.add_argument("--width", type=int, default=2048)
  parser.add_argument("--causal", action="store_true")
  parser.add_argument("--steps", type=int, default=3)
  parser.add_argument("--impl", choices=("jax_fa3", "fa3_kernels"), default="jax_fa3")
  args = parser.parse_args()
  s, d = args.seqlen, args.head_dim
  b, h = max(1, args.tokens // s), args.width // d
  q, k, v = _bench.random_qkv(jax.random.PRNGKey(0), b, s, h, d, jnp.bfloat16)
  do = jax.random.normal(jax.random.PRNGKey(1), q.shape, jnp.float32).astype(jnp.bfloat16)
  attention = lambda q, k, v: jax_fa3.flash_attention(q, k, v, causal=args.causal)
  if args.impl == "fa3_kernels":
    from flash_attn3_jax import flash_mha  # noqa: PLC0415
    attention = lambda q, k, v: flash_mha(q, k, v, is_causal=args.causal)
  if args.direction == "fp8":
    from jax_fa3 import _fp8_forward, fp8  # noqa: PLC0415
    from jax_fa3._config import AttentionConfig, Fp8Config  # noqa: PLC0415
    q8, qs = fp8.quantize_fp8(q, block_size=64)
    k8, ks = fp8.quantize_fp8(k, block_size=64)
    v8, vs = fp8.quantize_fp8(v, block_size=None)
    att = AttentionConfig(softmax_scale=d ** -0.5, window_left=-1,
                          window_right=0 if args.causal else -1)
    cfg = Fp8Config(att, block_size=64, incoherent=False, return_lse=False)
    run = lambda: _fp8_forward.fp8_forward(q8, k8, v8, qs, ks, vs[..., 0], cfg)[0]
  elif args.direction == "fwd":
    step = jax.jit(attention)
    run = lambda: step(q, k, v)
  else:
    loss = lambda q, k, v: jnp.sum(attention(q, k, v).astype(jnp.float32) * do.astype(jnp.float32))
    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    run = lambda: step(q, k, v)
  for _ in range(args.steps):
    jax.block_until_ready(run())
  print(f"profile_step: {args.impl} {args.direction} b={b} s={s} h={h} d={d} causal={args.causal}, "
        f"{args.steps} steps")


if __name__ == "__main__":
  main()
