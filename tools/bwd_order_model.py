"""How much of the causal backward's time its grid order wastes in the last wave: a
list-scheduling model of the grid on the GPU's SMs (one CTA per SM, each CTA as long as its Q
blocks plus a fixed cost), for the plain order and for longest first in sections of kv heads
(cuda/flash_bwd/tile_order.h), at the benchmark's shapes (16k tokens per call, width 2048).

    python tools/bwd_order_model.py [--sms 132] [--budget-mib 64]

Prints, per (d, seqlen), the ideal time over the modelled time (1.0: no tail) of the plain order,
of the rule before sections (longest first over whole batch rows within the budget, else plain)
and of the sections the kernel now takes, and the gain of the last over the rule before.
"""
from __future__ import annotations

import argparse
import heapq

# (head dim, Q rows per block, keys per block) of the key-major and row-major backward kernels.
TILES = ((64, 128, 128), (128, 64, 128), (256, 64, 64))
CTA_FIXED_COST = 2  # in Q-block units: prologue, K/V load, dK/dV epilogue


def makespan(lengths, sms):
  """Greedy list scheduling in launch order: each CTA starts on the first SM to free up."""
  free = [0.0] * sms
  end = 0.0
  for length in lengths:
    start = heapq.heappop(free)
    finish = start + length + CTA_FIXED_COST
    end = max(end, finish)
    heapq.heappush(free, finish)
  return end


def causal_lengths(s, block_m, block_n, b, h_k, section):
  """Q blocks per CTA in launch order: batch, section of kv heads, K block, head in section."""
  num_m, num_n = s // block_m, s // block_n
  length = lambda n: num_m - (n * block_n) // block_m
  return [length(n) for _ in range(b) for _ in range(h_k // section) for n in range(num_n)
          for _ in range(section)]


def section_heads(h_k, group, s, d, budget_bytes):
  """tile_order.h's choice: the most kv heads, a divisor of h_k, whose Q + dO + fp32 dQ fit."""
  head_bytes = group * s * d * (2 + 2 + 4)
  fits = [c for c in range(1, h_k + 1) if h_k % c == 0 and c * head_bytes <= budget_bytes]
  return max(fits) if fits else 1


def model(sms=132, budget_mib=64, tokens=16384, width=2048, seqlens=(1024, 4096, 8192, 16384)):
  rows = []
  for d, block_m, block_n in TILES:
    h = width // d
    for s in seqlens:
      b = tokens // s
      lengths = causal_lengths(s, block_m, block_n, b, h, 1)
      ideal = sum(x + CTA_FIXED_COST for x in lengths) / sms
      section = section_heads(h, 1, s, d, budget_mib << 20)
      plain = ideal / makespan(lengths, sms)
      sectioned = ideal / makespan(causal_lengths(s, block_m, block_n, b, h, section), sms)
      whole_rows = h * s * d * (2 + 2 + 4) <= budget_mib << 20
      before = (ideal / makespan(causal_lengths(s, block_m, block_n, b, h, h), sms)
                if whole_rows else plain)
      rows.append(dict(d=d, seqlen=s, plain=plain, before=before, section=section,
                       sectioned=sectioned))
  return rows


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--sms", type=int, default=132)
  parser.add_argument("--budget-mib", type=int, default=64)
  args = parser.parse_args()
  print("| d | seqlen | plain order | whole rows or plain | heads per section | sections | gain |")
  print("|---|---|---|---|---|---|---|")
  for r in model(args.sms, args.budget_mib):
    print(f"| {r['d']} | {r['seqlen']} | {r['plain']:.3f} | {r['before']:.3f} | {r['section']} | "
          f"{r['sectioned']:.3f} | {r['sectioned'] / r['before'] - 1:+.1%} |")


if __name__ == "__main__":
  main()
