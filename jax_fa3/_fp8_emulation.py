"""Pure-JAX emulation of the fp8 attention kernel's numerics (`jax_fa3_flash_fwd_fp8`).

Inputs are quantized as `jax_fa3._fp8_quantize` does: q, k (rotated by H·diag(signs) or not) in
e4m3 with one float32 scale per (batch, head, block of tokens), v - μ (μ its float32 mean over the
keys) with one scale per (batch, kv head). Then, per query row:

- S = q8 · k8 in float32 (each e4m3 product is exact), descaled by the product
  (softmax_scale · log2(e) · q_scale[row block]) · k_scale[column block] (the kernel folds it
  into its exp2 FFMA); masked keys get -inf.
- Online softmax over key tiles of `tile_k` keys (the kernel's kBlockN), last tile first as the
  kernel visits them: P is quantized relative to the running max, so the order decides which
  e4m3 values P rounds to. The running max is lazy: it moves to a tile's larger maximum only
  when that exceeds it by more than LAZY_MAX_MARGIN_LOG2 (log2 units), so P <= 2^2.8.
- P is quantized as e4m3(2^P_OFFSET_LOG2 · P) (FlashAttention-3's Max_offset, 6 instead of 8 so
  that 2^6 · 2^2.8 ≈ 445.7 < 448 fits e4m3); the row sum is that of the quantized P, so each output row
  is a weighted mean of v's rows with weights summing to one.
- O = (Σ P8 · v8) · v_scale / (2^6 · row sum) + μ in float32, rounded to bfloat16 (the kernel's
  output type). LSE = (running max + log2(row sum)) · ln 2, float32. A row that sees no key gets
  O = 0 and LSE = +inf.

Why v is centred: the fp8 tensor cores add each P·V product into the float32 accumulator with
about 13 mantissa bits (aligned to the larger exponent, truncated). Where v's values share a sign
the accumulator grows with the keys and the products lose their low bits: uncentred, O came out
7% low at 4k keys for V ~ N(2, 1) (H200, 2026-12-03). Centred, the terms cancel as a zero-mean
V's do, and adding μ back is exact since the weights sum to one.

The kernel differs from this emulation only in float32 operation order, the exp2 of the hardware
(a few ulps, which now and then moves a P across an e4m3 rounding boundary, and the LSE with it
by up to one e4m3 step of that term), and the tensor-core accumulator's precision: compare the
two to a tolerance, not bitwise. Visiting the tiles in another order changes the output by ~3%
RMS, the size of the fp8 error itself.
"""
from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

from jax_fa3._config import Fp8Config
from jax_fa3._fp8_quantize import per_token, to_e4m3

P_OFFSET_LOG2 = 6  # FA3's Max_offset idea (FA3 uses 8): P is quantized as e4m3(2^6 · P)
# Lazy running max (log2 units; cuda/flash_fwd/fp8/softmax.h kFp8LazyMaxMarginLog2): a row's max
# moves only when a key tile's scores exceed it by more than this, so P <= 2^2.8 and
# 2^6 · P <= 445.7 < 448: e4m3's range still holds it.
LAZY_MAX_MARGIN_LOG2 = 2.8

_HIGHEST = lax.Precision.HIGHEST
_LOG2E = 1.4426950408889634


def visible_pairs(query, key, s_q, s_k, window_left, window_right):
  """Whether query positions `query` may see key positions `key` (broadcast together): both real,
  inside the window (docs/CONTRACTS.md; bottom-right alignment)."""
  diagonal = query + (s_k - s_q)
  visible = (key < s_k) & (query < s_q)
  if window_left >= 0:
    visible &= key >= diagonal - window_left
  if window_right >= 0:
    visible &= key <= diagonal + window_right
  return visible


def tiles(x, tile, axis):
  """Splits `axis` (padded with zeros to a multiple of tile) into (n_tiles, tile)."""
  n = -(-x.shape[axis] // tile)
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, n * tile - x.shape[axis])
  x = jnp.pad(x, pad)
  return x.reshape(x.shape[:axis] + (n, tile) + x.shape[axis + 1:])


def _key_tiles(x, block_k):
  """(b, s_k, h_k, e) -> (n_tiles, b, block_k, h_k, e), zero-padded."""
  return jnp.moveaxis(tiles(x, block_k, 1), 1, 0)


def emulated_forward(q8, k8, v8, q_scale, k_scale, v_scale, cfg: Fp8Config, v_mean=None):
  """(out bf16, lse f32) of the kernel on quantized inputs (see the module docstring).

  v_mean: float32 (b, h_k, d) that v was centred by (added back to rows that see a key), or None.

  All query rows at once (rows are independent, so query blocking cannot change the numerics;
  memory is O(s_q · (d + tile_k)) per head), an online softmax over key tiles of cfg.tile_k, last
  tile first (the kernel's order).
  """
  b, s_q, h, d = q8.shape
  s_k, h_k = k8.shape[1], k8.shape[2]
  g = h // h_k  # query head i uses kv head i // g
  att = cfg.attention
  block_k = max(1, min(cfg.tile_k, s_k))  # a shorter sequence: one tile, same numerics
  f32 = jnp.float32
  # Row descale in the log2 domain: softmax_scale · log2(e) · q_scale of the row's block.
  row = per_token(q_scale, cfg.block_size, s_q) * f32(att.softmax_scale * _LOG2E)
  row = row[..., 0].reshape(b, s_q, h_k, g)
  row = jnp.einsum("bqhg->bhgq", row)[..., None]  # (b, h_k, g, s_q, 1)
  q = q8.astype(f32).reshape(b, s_q, h_k, g, d)
  k_tiles = _key_tiles(k8.astype(f32), block_k)  # (n, b, bk, h_k, d)
  col_tiles = _key_tiles(per_token(k_scale, cfg.block_size, s_k), block_k)[..., 0]
  v_tiles = _key_tiles(v8.astype(f32), block_k)
  p_offset = f32(2.0 ** P_OFFSET_LOG2)

  def step(carry, inputs):
    row_max, row_sum, acc = carry  # (b, h_k, g, s_q) x2, (b, h_k, g, s_q, d)
    k_tile, col_tile, v_tile, tile_index = inputs
    raw = jnp.einsum("bqhgd,bkhd->bhgqk", q, k_tile, precision=_HIGHEST)  # exact products
    col = jnp.einsum("bkh->bhk", col_tile)[:, :, None, None, :]  # (b, h_k, 1, 1, bk)
    scores = raw * (row * col)  # descaled, log2 domain: the kernel's per-(row, key) coefficient
    visible = visible_pairs(jnp.arange(s_q)[:, None],
                            tile_index * block_k + jnp.arange(block_k)[None, :], s_q, s_k,
                            att.window_left, att.window_right)
    scores = jnp.where(visible, scores, -jnp.inf)
    tile_max = jnp.maximum(row_max, scores.max(axis=-1))
    # The lazy max: kept unless exceeded by more than the margin (-inf - -inf is NaN: kept).
    new_max = jnp.where(tile_max - row_max > f32(LAZY_MAX_MARGIN_LOG2), tile_max, row_max)
    # A row that has seen nothing yet has max -inf: shift by 0 so exp2(-inf - shift) = 0.
    shift = jnp.where(jnp.isneginf(new_max), 0.0, new_max)
    rescale = jnp.exp2(row_max - shift)
    probs = jnp.exp2(scores - shift[..., None])
    probs8 = to_e4m3(probs * p_offset).astype(f32)  # e4m3(2^6 · P), P <= 2^2.8
    row_sum = row_sum * rescale + probs8.sum(axis=-1) / p_offset  # of the quantized P
    acc = acc * rescale[..., None] + jnp.einsum("bhgqk,bkhd->bhgqd", probs8, v_tile,
                                               precision=_HIGHEST)
    return (new_max, row_sum, acc), None

  stats = (b, h_k, g, s_q)
  init = (jnp.full(stats, -jnp.inf, f32), jnp.zeros(stats, f32), jnp.zeros(stats + (d,), f32))
  (row_max, row_sum, acc), _ = lax.scan(
      step, init, (k_tiles, col_tiles, v_tiles, jnp.arange(k_tiles.shape[0])), reverse=True)
  empty = row_sum == 0  # no visible key: output 0, lse +inf
  safe_sum = jnp.where(empty, 1.0, row_sum)
  v_descale = v_scale[:, :, None, None] / p_offset  # (b, h_k, 1, 1)
  out = acc * (v_descale / safe_sum)[..., None]
  if v_mean is not None:
    out = out + v_mean.astype(f32)[:, :, None, None, :]
  out = jnp.where(empty[..., None], 0.0, out)
  lse = jnp.where(empty, jnp.inf, (row_max + jnp.log2(safe_sum)) * f32(math.log(2.0)))
  out = jnp.einsum("bhgqd->bqhgd", out).reshape(b, s_q, h, d).astype(jnp.bfloat16)
  return out, lse.reshape(b, h, s_q)
