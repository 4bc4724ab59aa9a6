"""Pure-JAX emulation of the FP8 attention backward's numerics (the numerics `backward="fp8"` is
defined by): the CPU path, and the oracle of the Hopper kernel (`jax_fa3_flash_bwd_fp8`,
cuda/flash_bwd/fp8_traits.cuh), whose operands `jax_fa3._fp8_backward` builds from the same
`backward_rows` and `dequantized_keys`.

Three of the backward's five GEMMs take e4m3 operands: S = q·k (the forward's own quantized,
rotated q8 and k8, so the scores are exactly the forward's), dV = Pᵀ·dO and dK = dSᵀ·q. The other
two keep 16-bit operands: dP = dO·vᵀ, because its error enters dS = P·(dP − D) through a
cancellation (in fp8 it raised the dq and dk errors by 40% on FlashAttention-3's outlier inputs,
where the three above add 0% to dq, 4% to dk and 28% to dv over backward="bf16"; d = 128,
s = 1024), and dQ = dS·k for now, since in fp8 it needs dS in the other orientation (it would add
2% to dq). Per query row i (q's rows are visited in
tiles of BACKWARD_TILE_Q(d) rows, the kernel's kBlockM; key rows j):

- dO is quantized in blocks of DOUT_BLOCK tokens (e4m3 values dO8, scale s_dO(i) of row i's
  block); r_i = s_dO(i) / s_max, s_max the largest scale over the (batch, kv head)'s query heads
  and blocks of nonzero dO (r_i = 0 where row i's block is zero).
- P'_ij = exp2(S_ij·softmax_scale·log2(e) − (lse_i − ln(2^P_PRESCALE_LOG2 · r_i))·log2(e)), 0
  where masked: P scaled so that Σ_i P'_ij·dO8_i·s_max/2^8 is dV; P' <= 2^8 < 448 fits e4m3
  without a running maximum (r is folded into the LSE row the kernel loads anyway).
- dV = (Σ_i e4m3(P'_ij)·dO8_i) · s_max / 2^8.
- dP_ij = dO_i·v_j in float32 from dO and v in 16 bits; D_i = Σ dO_i·out_i (− dlse_i);
  dS'_ij = P'_ij·(dP_ij − D_i) (= 2^8·r_i·dS_ij).
- dQ_i = (Σ_j dS'_ij·k̃_j) / (2^8·r_i) · softmax_scale (0 where r_i = 0), with dS' rounded to
  16 bits and k̃ the dequantized k8 in 16 bits (the inputs' type, or bfloat16 for float32 inputs).
- dK: y_ji = dS'_ij · w_i, w_i = q_scale(i) / (2^8·r_i), is quantized per key row j with a lazy
  running maximum over the query tiles in the kernel's order (the query heads sharing the kv
  head, then the tiles): M_j moves to a tile's max |y_ji| only when that exceeds both
  M_j·2^LAZY_MAX_MARGIN_LOG2 and MIN_RUNNING_MAX, and the accumulator row is then multiplied by
  M_old/M_new; the tile adds Σ_i e4m3((dS'_ij · w_i) · (2^Y_PRESCALE_LOG2 / M_j))·q8_i, so
  |values| <= 2^(6+2.8) < 448. The floor keeps 2^6 / M_j finite, and multiplying y, not w_i, by it
  keeps every product finite: no 0·inf where dS' = 0 (masked keys) or w_i = 0 (padding rows);
  a key row whose |y| never exceeds 2^-100 gets dK = 0. dK = acc · M_j / 2^6 · softmax_scale.

dq and dk are returned in the rotated basis the kernel multiplies in (`jax_fa3.fp8` rotates them
back). Every e4m3 product is exact and accumulates in float32 here; the tensor cores keep ~13
mantissa bits of each fp8 product sum, and the kernel's exp2 and reciprocals differ by ulps, so
compare a kernel with this to a tolerance, not bitwise.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from typing import NamedTuple

from jax_fa3._config import Fp8Config
from jax_fa3._fp8_emulation import LAZY_MAX_MARGIN_LOG2, tiles, visible_pairs
from jax_fa3._fp8_quantize import block_amax, per_token, quantize_blocks, to_e4m3

DOUT_BLOCK = 64  # tokens per dO scale
P_PRESCALE_LOG2 = 8  # P' = 2^8 · r · P <= 256
Y_PRESCALE_LOG2 = 6  # dK operand: 2^6 · y / M <= 2^(6 + LAZY_MAX_MARGIN_LOG2) = 445.7
MIN_RUNNING_MAX = 2.0**-100  # dK operand: M only moves above it (2^6 / M stays finite)

_HIGHEST = lax.Precision.HIGHEST
_LOG2E = 1.4426950408889634


def backward_tile_q(d: int) -> int:
  """Query rows per tile of the backward kernel (cuda/flash_bwd/params.h block_m_for_bucket): the
  granule of the dK operand's running maximum."""
  return 128 if d <= 64 else 64


def operand_dtype(dtype):
  """The 16-bit operand type of dP and dQ: the inputs' where they are 16-bit, else bfloat16."""
  return dtype if dtype in (jnp.bfloat16, jnp.float16) else jnp.bfloat16


class BackwardRows(NamedTuple):
  """What the backward needs per query row (b, h, s_q) float32, and dO in e4m3."""
  do8: jax.Array      # (b, s_q, h, d) e4m3: dO in blocks of DOUT_BLOCK tokens
  lse2: jax.Array     # (LSE - ln(2^8 r)) * log2(e); +inf where r = 0 or the row saw no key
  delta: jax.Array    # D = sum dO * out (- dlse)
  unscale: jax.Array  # 1 / (2^8 r), 0 where r = 0
  s_max: jax.Array    # (b, h_k): the largest dO block scale of the kv head's query heads


def backward_rows(out, lse, dout, h_k, dlse=None) -> BackwardRows:
  """dO quantized, r folded into the LSE row, D (module docstring)."""
  b, s_q, h, _ = dout.shape
  f32 = jnp.float32
  amax = block_amax(dout, DOUT_BLOCK)  # (b, h, n_blocks)
  do8, scales = quantize_blocks(dout, DOUT_BLOCK, amax=amax)
  real = amax != 0  # blocks with a nonzero (or NaN) dO
  group = jnp.where(real, scales, 0.0).reshape(b, h_k, h // h_k, -1)
  s_max = group.max(axis=(2, 3))  # (b, h_k)
  s_max_h = jnp.repeat(s_max, h // h_k, axis=1)[..., None]
  ratio = jnp.where(real & (s_max_h > 0), scales / jnp.where(s_max_h > 0, s_max_h, 1.0), 0.0)
  ratio = jnp.repeat(ratio, DOUT_BLOCK, axis=-1)[..., :s_q]  # r (b, h, s_q)
  delta = jnp.einsum("bqhd,bqhd->bhq", dout.astype(f32), out.astype(f32), precision=_HIGHEST)
  if dlse is not None:
    delta = delta - dlse.astype(f32)
  prescale = f32(2.0**P_PRESCALE_LOG2)
  # The LSE with r folded in, in the log2 domain the kernel's exp2 takes.
  lse2 = (lse.astype(f32) - jnp.log(prescale * ratio)) * f32(_LOG2E)
  unscale = jnp.where(ratio > 0, 1.0 / (prescale * jnp.where(ratio > 0, ratio, 1.0)), 0.0)
  return BackwardRows(do8, lse2, delta, unscale, s_max)


def dequantized_keys(k8, k_token_scale, op16):
  """k~ of the dQ GEMM: k8 times each token's scale ((b, s_k, h_k, 1)), rounded to op16."""
  return (k8.astype(jnp.float32) * k_token_scale).astype(op16)


def emulated_backward(q8, q_scale, k8, k_scale, v, out, lse, dout, cfg: Fp8Config, dlse=None):
  """(dq, dk, dv) float32 of the fp8 backward (module docstring); dq and dk in the rotated basis.

  q8, q_scale, k8, k_scale: the fp8 forward's quantized (rotated) q and k, scales (b, h, blocks)
  in blocks of cfg.block_size; v, dout: (b, s, h, d) 16-bit; out, lse: the fp8 forward's results.
  """
  b, s_q, h, d = q8.shape
  s_k, h_k = k8.shape[1], k8.shape[2]
  g = h // h_k
  att = cfg.attention
  tile = backward_tile_q(d)
  f32 = jnp.float32
  scale = f32(att.softmax_scale)
  op16 = operand_dtype(v.dtype)

  do8, lse2, delta, unscale, s_max = backward_rows(out, lse, dout, h_k, dlse)
  do8 = do8.astype(f32)
  dout32 = dout.astype(f32)
  prescale = f32(2.0**P_PRESCALE_LOG2)
  q_row_scale = per_token(q_scale, cfg.block_size, s_q)[..., 0]  # (b, s_q, h)
  q_row_scale = jnp.swapaxes(q_row_scale, 1, 2)  # (b, h, s_q)
  k_token_scale = per_token(k_scale, cfg.block_size, s_k)  # (b, s_k, h_k, 1)
  k_col_scale = jnp.swapaxes(k_token_scale[..., 0], 1, 2)  # (b, h_k, s_k)
  k_used = dequantized_keys(k8, k_token_scale, op16).astype(f32)

  def by_group(x):  # (b, h, ...) -> (b, h_k, g, ...)
    return x.reshape((b, h_k, g) + x.shape[2:])

  def query_major(x):  # (b, s_q, h, e) -> (b, h_k, g, s_q, e)
    return by_group(jnp.einsum("bqhe->bhqe", x))

  # The kernel's visiting order per kv head: the g query heads, each tile by tile.
  def steps(x, axis=3):  # (b, h_k, g, s_q, ...) -> (g·n_tiles, b, h_k, tile, ...)
    x = tiles(x, tile, axis)  # (b, h_k, g, n, tile, ...)
    x = jnp.moveaxis(jnp.moveaxis(x, 2, 0), 3, 1)  # (g, n, b, h_k, tile, ...)
    return x.reshape((-1,) + x.shape[2:])

  n_tiles = -(-s_q // tile)
  xs = dict(
      q8=steps(query_major(q8.astype(f32))), do8=steps(query_major(do8)),
      do=steps(query_major(dout32)),
      q_scale=steps(by_group(q_row_scale)), lse2=steps(by_group(lse2)),
      delta=steps(by_group(delta)), unscale=steps(by_group(unscale)),
      row0=jnp.tile(jnp.arange(n_tiles) * tile, g))
  k8_t = jnp.einsum("bkhd->bhkd", k8.astype(f32))
  k_used_t = jnp.einsum("bkhd->bhkd", k_used)
  v_t = jnp.einsum("bkhd->bhkd", v.astype(op16).astype(f32))
  coef = scale * f32(_LOG2E) * k_col_scale  # (b, h_k, s_k)
  key = jnp.arange(s_k)[None, :]
  margin = f32(2.0**LAZY_MAX_MARGIN_LOG2)
  y_prescale = f32(2.0**Y_PRESCALE_LOG2)

  def step(carry, x):
    dv_acc, dk_acc, running = carry  # (b, h_k, s_k, d) x2, (b, h_k, s_k)
    query = x["row0"] + jnp.arange(tile)[:, None]
    visible = visible_pairs(query, key, s_q, s_k, att.window_left, att.window_right)
    raw = jnp.einsum("bhqd,bhkd->bhqk", x["q8"], k8_t, precision=_HIGHEST)  # exact products
    logits = raw * (x["q_scale"][..., None] * coef[:, :, None, :]) - x["lse2"][..., None]
    p = jnp.where(visible, jnp.exp2(logits), 0.0)  # P' (b, h_k, tile, s_k)
    dv_acc = dv_acc + jnp.einsum("bhqk,bhqd->bhkd", to_e4m3(p).astype(f32), x["do8"],
                                 precision=_HIGHEST)
    dp = jnp.einsum("bhqd,bhkd->bhqk", x["do"].astype(op16).astype(f32), v_t,
                    precision=_HIGHEST)
    ds = p * (dp - x["delta"][..., None])  # dS' = 2^8 r dS
    dq = jnp.einsum("bhqk,bhkd->bhqd", ds.astype(op16).astype(f32), k_used_t,
                    precision=_HIGHEST) * (x["unscale"] * scale)[..., None]
    w = x["q_scale"] * x["unscale"]  # (b, h_k, tile): q's scale over 2^8 r, per query row
    tile_max = (jnp.abs(ds) * w[..., None]).max(axis=2)  # max |y| per key row
    moved = tile_max > jnp.maximum(running * margin, f32(MIN_RUNNING_MAX))
    new_running = jnp.where(moved, tile_max, running)
    safe = jnp.where(new_running > 0, new_running, 1.0)
    rescale = jnp.where(moved & (running > 0), running / safe, jnp.where(moved, 0.0, 1.0))
    # The kernel's order: y = dS' · w_i, then one product by 2^6 / M per element.
    y8 = to_e4m3((ds * w[..., None]) * (y_prescale / safe)[:, :, None, :]).astype(f32)
    dk_acc = dk_acc * rescale[..., None] + jnp.einsum("bhqk,bhqd->bhkd", y8, x["q8"],
                                                      precision=_HIGHEST)
    return (dv_acc, dk_acc, new_running), dq

  zeros = jnp.zeros((b, h_k, s_k, d), f32)
  (dv_acc, dk_acc, running), dq_steps = lax.scan(
      step, (zeros, zeros, jnp.zeros((b, h_k, s_k), f32)), xs)
  dv = dv_acc * (s_max / prescale)[:, :, None, None]
  dk = dk_acc * (running / y_prescale * scale)[..., None]
  # dq_steps (g·n, b, h_k, tile, d) -> (b, s_q, h, d)
  dq = dq_steps.reshape((g, n_tiles) + dq_steps.shape[1:])
  dq = jnp.einsum("gnbhtd->bhgntd", dq).reshape(b, h, n_tiles * tile, d)[:, :, :s_q]
  to_bshd = lambda x: jnp.einsum("bhsd->bshd", x)
  return to_bshd(dq), to_bshd(dk), to_bshd(dv)

