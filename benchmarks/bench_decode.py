"""Decoding against a KV cache: µs per call and the HBM bandwidth it achieves, beside cuDNN and XLA.

One new query token per row (s_q = 1), d = 128, 32 query heads over 4 kv heads (GQA 8:1), bf16,
every row's cache full to the given length. Peers, same shapes, same cache:
`jax_fa3` (`flash_attention_with_kvcache`, attend only, split-KV as it chooses),
`jax_fa3_unsplit` (the same with `num_splits=1`), `jax_fa3_paged` (the same cache as a pool of
256-key pages with a page table, read in place), `jax_fa3_append` (the same call also
appending the token's k/v, caches donated), `jax_fa3_fp8` / `jax_fa3_fp8_append` (the same two
calls on the cache quantized to e4m3 with `quantize_fp8`, 64-slot blocks), `cudnn` / `xla`
(`jax.nn.dot_product_attention` with `key_value_seq_lengths`). Bandwidth counts the K and V bytes
a call must read (batch · length · kv_heads · d · 2 tensors · 2 bytes, 1 byte for the e4m3
caches) over its time; `copy` is the measured device copy bandwidth (read + write of a 2 GiB
buffer), the ceiling decoding can approach.

Two times per call:
  us          one jitted call per step, back to back: what a loop in Python that dispatches the
              attention alone pays (at batch 1 mostly the host's dispatch and launches);
  loop_us     DECODE_STEPS calls inside one jitted `fori_loop`, each step's query fed by the
              last step's output and its lengths moving by one (nothing loop-invariant to
              hoist): what a compiled decoding step pays, with no host round trip per call;
              `--unroll N` unrolls the loop's body N times (fewer trips of XLA's while loop).

  python benchmarks/bench_decode.py [--batches 1,8,64] [--caches 1024,8192,32768,131072]
                                    [--peers jax_fa3,cudnn]
"""
from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

import jax_fa3
from jax_fa3 import _bench

HEADS, KV_HEADS, D = 32, 4, 128
PAGE = 256  # keys per page of the paged peer (a multiple of the d = 128 kernel's key block)
DECODE_STEPS = 32
FP8_BLOCK = 64  # slots per scale of the e4m3 caches (quantize_fp8's default)


def fp8_cache(cache):
  """The e4m3 (values, scales) form of a bf16 cache that the fp8 peers attend over."""
  return jax_fa3.quantize_fp8(cache, block_size=FP8_BLOCK)


def looped(fn, steps=DECODE_STEPS, unroll=1):
  """(q, k_cache, v_cache, lengths) -> q after `steps` calls of fn in one compiled loop (its body
  unrolled `unroll` times: fewer trips of XLA's while loop per step)."""
  @jax.jit
  def run(q, k_cache, v_cache, lengths):
    def step(i, q):
      out = fn(q, k_cache, v_cache, lengths - i % 2)
      return q + (out * 1e-3).astype(q.dtype)
    return jax.lax.fori_loop(0, steps, step, q, unroll=unroll)
  return run


def copy_bandwidth(min_time) -> float:
  """Bytes read + written per second by a device copy of a 2 GiB buffer (256 MiB off-GPU)."""
  size = 2**30 if jax.default_backend() == "gpu" else 2**27
  x = jnp.ones((size // 2,), jnp.bfloat16)
  copy = jax.jit(lambda x: x * jnp.bfloat16(1.0) + jnp.bfloat16(0.0))  # one read, one write
  return 2 * x.nbytes / _bench.median_seconds(copy, x, min_time=min_time)


def _peers():
  def ours(q, k_cache, v_cache, lengths):
    return jax_fa3.flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths)

  def ours_unsplit(q, k_cache, v_cache, lengths):
    return jax_fa3.flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths,
                                                num_splits=1)

  def ours_paged(q, k_cache, v_cache, lengths):
    b, s = k_cache.shape[:2]
    pages = -(-s // PAGE)
    pad = ((0, 0), (0, pages * PAGE - s), (0, 0), (0, 0))
    pool = lambda c: jnp.pad(c, pad).reshape((b * pages, PAGE) + c.shape[2:])
    table = jnp.arange(b * pages, dtype=jnp.int32).reshape(b, pages)
    return jax_fa3.flash_attention_with_kvcache(q, pool(k_cache), pool(v_cache),
                                                cache_seqlens=lengths, page_table=table)

  def ours_append(q, k_cache, v_cache, lengths, k_new, v_new):
    return jax_fa3.flash_attention_with_kvcache(q, k_cache, v_cache, k_new, v_new,
                                                cache_seqlens=lengths - 1)

  def dpa(implementation):
    def call(q, k_cache, v_cache, lengths):
      return jax.nn.dot_product_attention(q, k_cache, v_cache, key_value_seq_lengths=lengths,
                                          implementation=implementation)
    return call

  # name -> (function, appends, caches in e4m3)
  peers = {"jax_fa3": (jax.jit(ours), False, False),
           "jax_fa3_unsplit": (jax.jit(ours_unsplit), False, False),
           "jax_fa3_paged": (jax.jit(ours_paged), False, False),
           "jax_fa3_append": (jax.jit(ours_append, donate_argnums=(1, 2)), True, False),
           "jax_fa3_fp8": (jax.jit(ours), False, True),
           "jax_fa3_fp8_append": (jax.jit(ours_append, donate_argnums=(1, 2)), True, True),
           "xla": (jax.jit(dpa("xla")), False, False)}
  if jax.default_backend() == "gpu":
    peers["cudnn"] = (jax.jit(dpa("cudnn")), False, False)
  return peers


def run(batches, caches, min_time, peer_names=None, unroll=1):
  """peer_names: the peers of _peers() to time (None: all); the first one timed gives the
  reference output the others' max_abs_diff is taken against."""
  peers = _peers()
  unknown = sorted(set(peer_names or ()) - set(peers))
  if unknown:
    raise ValueError(f"--peers: unknown peers {unknown}; known: {sorted(peers)}")
  if peer_names:
    peers = {name: peers[name] for name in peer_names}
  rows = []
  for b in batches:
    for s in caches:
      key = jax.random.PRNGKey(b * 7 + s)
      kq, kk, kv, kn = jax.random.split(key, 4)
      q = jax.random.normal(kq, (b, 1, HEADS, D), jnp.float32).astype(jnp.bfloat16)
      lengths = jnp.full((b,), s, jnp.int32)
      new = [jax.random.normal(kn, (b, 1, KV_HEADS, D), jnp.float32).astype(jnp.bfloat16)] * 2
      reference = None
      for name, (fn, appends, fp8) in peers.items():
        cache_bytes = b * s * KV_HEADS * D * 2 * (1 if fp8 else 2)

        def measure(row, fn=fn, appends=appends, fp8=fp8, cache_bytes=cache_bytes):
          nonlocal reference
          # Fresh caches per peer (the appending peer donates and so consumes them).
          k_cache = jax.random.normal(kk, (b, s, KV_HEADS, D), jnp.float32).astype(jnp.bfloat16)
          v_cache = jax.random.normal(kv, (b, s, KV_HEADS, D), jnp.float32).astype(jnp.bfloat16)
          if fp8:
            k_cache, v_cache = fp8_cache(k_cache), fp8_cache(v_cache)
          if appends:
            state = {"k": k_cache, "v": v_cache}

            def step(state=state):
              out, state["k"], state["v"] = fn(q, state["k"], state["v"], lengths, *new)
              return out
            out = step()
            seconds = _bench.median_seconds(step, min_time=min_time)
          else:
            out = fn(q, k_cache, v_cache, lengths)
            seconds = _bench.median_seconds(fn, q, k_cache, v_cache, lengths, min_time=min_time)
            loop = _bench.median_seconds(looped(fn, unroll=unroll), q, k_cache, v_cache, lengths,
                                         min_time=min_time) / DECODE_STEPS
            row.update(loop_us=loop * 1e6, loop_gb_per_s=cache_bytes / loop / 1e9)
          out = np.asarray(out, np.float32)
          if reference is None:
            reference = out
          elif not appends:  # the appending peer attends over its own new token
            row["max_abs_diff"] = float(np.max(np.abs(out - reference)))
          row.update(us=seconds * 1e6, gb_per_s=cache_bytes / seconds / 1e9)

        _bench.record(rows, dict(peer=name, batch=b, cache=s, d=D, heads=HEADS,
                                 kv_heads=KV_HEADS), measure)
  return rows


def table(rows, copy_gbs, unroll=1) -> str:
  peers = sorted({r["peer"] for r in rows}, key=lambda p: (not p.startswith("jax_fa3"), p))
  lines = ["| batch | cache | " + " | ".join(f"{p} µs (GB/s)" for p in peers) + " |",
           "|---|---|" + "---|" * len(peers)]
  for b, s in sorted({(r["batch"], r["cache"]) for r in rows}):
    cells = []
    for p in peers:
      r = next((r for r in rows if (r["peer"], r["batch"], r["cache"]) == (p, b, s)), None)
      if r is None or "us" not in r:
        cells.append("—")
        continue
      loop = (f"; loop {r['loop_us']:.1f} ({r['loop_gb_per_s']:.0f})" if "loop_us" in r else "")
      cells.append(f"{r['us']:.1f} ({r['gb_per_s']:.0f}){loop}")
    lines.append(f"| {b} | {s} | " + " | ".join(cells) + " |")
  lines.append(f"\ncopy bandwidth (read + write): {copy_gbs:.0f} GB/s; µs per call (GB/s), one "
               f"jitted call per step; loop: {DECODE_STEPS} steps in one compiled loop"
               + (f", unrolled {unroll} times" if unroll > 1 else ""))
  return "\n".join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batches", default="1,8,64")
  parser.add_argument("--caches", default="1024,8192,32768,131072")
  parser.add_argument("--peers", default="",
                      help="comma-separated peers to time (default: all)")
  parser.add_argument("--min-time", type=float, default=0.2)
  parser.add_argument("--unroll", type=int, default=1,
                      help="unroll the compiled loop's body this many times (a divisor of "
                           f"{DECODE_STEPS})")
  parser.add_argument("--json", default="bench_decode.json")
  args = parser.parse_args()
  header = _bench.run_header(__file__)
  print(json.dumps(header))
  copy_gbs = copy_bandwidth(args.min_time) / 1e9
  rows = run([int(x) for x in args.batches.split(",")], [int(x) for x in args.caches.split(",")],
             args.min_time, [p for p in args.peers.split(",") if p] or None, args.unroll)
  with open(args.json, "w") as f:
    json.dump(dict(header=header, copy_gb_per_s=copy_gbs, loop_unroll=args.unroll, rows=rows), f,
              indent=1)
  print(f"\n{header}\ndecode, one query per row, d={D}, {HEADS} heads / {KV_HEADS} kv heads\n"
        f"{table(rows, copy_gbs, args.unroll)}")


if __name__ == "__main__":
  main()
