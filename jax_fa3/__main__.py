"""`python -m jax_fa3`: what runs here, is it right, and how fast is it against JAX's own attention."""
from __future__ import annotations

import argparse
import datetime

import jax
import jax.numpy as jnp

import jax_fa3
from jax_fa3 import _bench


def _backend_report() -> bool:
  devices = jax.devices()
  print(f"jax_fa3 {jax_fa3.__version__} | jax {jax.__version__} | {datetime.date.today()}")
  print(f"devices: {', '.join(sorted({d.device_kind for d in devices}))} "
        f"(platform {devices[0].platform}, {len(devices)} device(s))")
  print(f"compiled extension: {jax_fa3.build_config() or 'not built'}")
  if jax_fa3.kernels_available():
    print("backend: Hopper kernels (sm_90a) through the XLA FFI")
  else:
    print(f"backend: pure-JAX reference path — {jax_fa3.kernels_unavailable_reason()}")
  return devices[0].platform == "gpu"


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
  args = parser.parse_args(argv)
  on_gpu = _backend_report()
  dtype = jnp.dtype(args.dtype)
  # GPU: the FlashAttention-3 paper's shapes (16k tokens, width 2048, d=128); CPU: small ones.
  shapes = ([(16384 // s, s, 16, 128) for s in (1024, 4096, 8192, 16384)] if on_gpu
            else [(1, 256, 4, 64), (1, 1024, 4, 64)])
  print(f"\n{'causal':>6} {'b':>3} {'seqlen':>6} {'h':>3} {'d':>4} | "
        f"{'peer':>12} {'rel.err':>8} {'ms':>9} {'TFLOP/s':>8}")
  key = jax.random.PRNGKey(0)
  for causal in (False, True):
    for b, s, h, d in shapes:
      key, sub = jax.random.split(key)
      # The fp8 call from bf16 (rotation, quantization and kernel; its error is the fp8 one,
      # ~5e-2 relative) beside the exact peers.
      fp8 = _bench.Peer("jax_fa3_fp8", lambda q, k, v, c=causal: jax_fa3.flash_attention_fp8(
          q, k, v, causal=c))
      for peer in _bench.peers(causal, on_gpu) + [fp8]:
        q, k, v = _bench.random_qkv(sub, b, s, h, d, peer.dtype or dtype)
        fn = jax.jit(peer.forward)
        try:
          err = _bench.relative_error(fn(q, k, v), q, k, v, causal, peer.unit_scale)
          seconds = _bench.median_seconds(fn, q, k, v, min_time=0.1 if on_gpu else 0.05, repeats=5)
        except Exception as e:  # noqa: BLE001 (a peer failing must not hide the others)
          print(f"{causal!s:>6} {b:>3} {s:>6} {h:>3} {d:>4} | {peer.name:>12} failed: "
                f"{type(e).__name__}: {str(e).splitlines()[0][:80]}")
          continue
        tflops = _bench.attention_flops(b, h, s, s, d, causal) / seconds / 1e12
        print(f"{causal!s:>6} {b:>3} {s:>6} {h:>3} {d:>4} | {peer.name:>12} {err:8.1e} "
              f"{seconds * 1e3:9.3f} {tflops:8.2f}")
  if not on_gpu:
    print("\nNo GPU: jax_fa3 ran its pure-JAX reference path (CPU timings are not kernel timings).")


if __name__ == "__main__":
  main()
