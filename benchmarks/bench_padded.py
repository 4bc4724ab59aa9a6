"""Padded and packed batches on the kernels: what lengths, segment ids and varlen cost when there is
no padding, and what a half-padded batch or packed documents save.

For each shape (bf16, 16k tokens per batch, 16 heads, d = 128 by default) and causal or not, the
forward and forward + backward (`jax.grad` of a loss on the output) of:
  plain      `flash_attention(q, k, v)`: the whole-row kernels;
  full       the same with `query_seq_lengths = key_value_seq_lengths = seqlen` (the key-range
             kernels on a batch without padding: the overhead of key ranges, target <= 5%);
  half       lengths seqlen / 2 on every row (half the tokens are padding: target <= 55% of
             `plain`, the tiles of padding being skipped);
  ragged     lengths spread evenly over [seqlen / 8, seqlen] (56% of the tokens real);
  segments   `q_segment_ids = kv_segment_ids` all one id (packed rows holding one document each:
             the overhead of segment ids, target <= 5%);
  varlen     `flash_attention_varlen` over the batch's rows as packed sequences of equal length
             (self-attention: the packed route, no gather; target <= 5%);
  documents  four equal documents per row by segment ids (a quarter of the keys per query);
  cudnn      `jax.nn.dot_product_attention(..., implementation="cudnn")` with the same `half`
             lengths, as the peer a JAX user would otherwise call.
Off-GPU it times the pure-JAX path, saying so.

  python benchmarks/bench_padded.py [--seqlens 2048,8192] [--head-dim 128]
"""
from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

import jax_fa3
from jax_fa3 import _bench

TOKENS, HEADS = 16384, 16


def _lengths(kind, b, s):
  if kind == "full":
    return jnp.full((b,), s, jnp.int32)
  if kind == "half":
    return jnp.full((b,), s // 2, jnp.int32)
  if kind == "ragged":
    return jnp.asarray(np.linspace(s // 8, s, b).astype(np.int32))
  return None


def _segment_ids(kind, b, s):
  if kind == "segments":
    return jnp.ones((b, s), jnp.int32)
  if kind == "documents":
    return jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32) // max(1, s // 4), (b, s))
  return None


def _call(kind, causal, lengths, segment_ids=None):
  if kind == "cudnn":
    def attend(q, k, v):
      return jax.nn.dot_product_attention(q, k, v, is_causal=causal, query_seq_lengths=lengths,
                                          key_value_seq_lengths=lengths, implementation="cudnn")
  elif kind == "varlen":
    def attend(q, k, v):
      b, s = q.shape[:2]
      cu = jnp.arange(b + 1, dtype=jnp.int32) * s
      packed = [x.reshape((b * s,) + x.shape[2:]) for x in (q, k, v)]
      return jax_fa3.flash_attention_varlen(*packed, cu, cu, s, s, causal=causal).reshape(q.shape)
  else:
    def attend(q, k, v):
      return jax_fa3.flash_attention(q, k, v, causal=causal, query_seq_lengths=lengths,
                                     key_value_seq_lengths=lengths, q_segment_ids=segment_ids,
                                     kv_segment_ids=segment_ids)

  def loss(q, k, v):
    return jnp.sum(attend(q, k, v).astype(jnp.float32))
  return jax.jit(attend), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def run(seqlens, d, min_time):
  on_gpu = jax.default_backend() == "gpu"
  kinds = (["plain", "full", "segments", "varlen", "half", "ragged", "documents"]
           + (["cudnn"] if on_gpu else []))
  rows = []
  for s in seqlens:
    b = max(1, TOKENS // s)
    q, k, v = _bench.random_qkv(jax.random.PRNGKey(s), b, s, HEADS, d, jnp.bfloat16)
    for causal in (False, True):
      base = {}
      for kind in kinds:
        lengths = _lengths("half" if kind == "cudnn" else kind, b, s)
        segment_ids = _segment_ids(kind, b, s)

        def measure(row, kind=kind, lengths=lengths, segment_ids=segment_ids):
          fwd, grad = _call(kind, causal, lengths, segment_ids)
          row["fwd_ms"] = _bench.median_seconds(fwd, q, k, v, min_time=min_time) * 1e3
          row["fwd_bwd_ms"] = _bench.median_seconds(grad, q, k, v, min_time=min_time) * 1e3
          if kind == "plain":
            base.update(row)
          elif base:
            row["fwd_vs_plain"] = row["fwd_ms"] / base["fwd_ms"]
            row["fwd_bwd_vs_plain"] = row["fwd_bwd_ms"] / base["fwd_bwd_ms"]

        _bench.record(rows, dict(kind=kind, batch=b, seqlen=s, d=d, heads=HEADS, causal=causal),
                      measure)
  return rows


def table(rows) -> str:
  lines = ["| seqlen | causal | kind | fwd ms | ÷ plain | fwd+bwd ms | ÷ plain |",
           "|---|---|---|---|---|---|---|"]
  for r in rows:
    if "error" in r:
      lines.append(f"| {r['seqlen']} | {r['causal']} | {r['kind']} | {r['error']} | | | |")
      continue
    ratio = lambda key: f"{r[key]:.3f}" if key in r else ""
    lines.append(f"| {r['seqlen']} | {r['causal']} | {r['kind']} | {r['fwd_ms']:.3f} | "
                 f"{ratio('fwd_vs_plain')} | {r['fwd_bwd_ms']:.3f} | {ratio('fwd_bwd_vs_plain')} |")
  return "\n".join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seqlens", default="2048,8192")
  parser.add_argument("--head-dim", type=int, default=128)
  parser.add_argument("--min-time", type=float, default=0.2)
  parser.add_argument("--json", default="bench_padded.json")
  args = parser.parse_args()
  header = _bench.run_header(__file__)
  print(json.dumps(header))
  if jax.default_backend() != "gpu":
    print("no GPU: timing the pure-JAX path (the kernels need a Hopper GPU)")
  rows = run([int(x) for x in args.seqlens.split(",")], args.head_dim, args.min_time)
  with open(args.json, "w") as f:
    json.dump(dict(header=header, rows=rows), f, indent=1)
  print(f"\n{header}\npadded and packed batches, bf16, {TOKENS} tokens, {HEADS} heads, d={args.head_dim}\n"
        f"{table(rows)}")


if __name__ == "__main__":
  main()
