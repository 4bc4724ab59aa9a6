"""flash_attention_fp8(backward="fp8"): the fp8 backward's numerics (jax_fa3._fp8_backward_emulation)
against independent float64 models, its accuracy on FlashAttention-3's outlier inputs, the API,
and the operands its kernel is handed (jax_fa3._fp8_backward), through a NumPy model of the
kernel's algorithm."""
import functools

import jax
import jax.export  # a submodule JAX 0.6 does not import with jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_fa3
from jax_fa3 import _fp8_backward_emulation as emulation
from jax_fa3 import _fp8_backward, _fp8_forward, _fp8_quantize, _validation, fp8
from jax_fa3._config import Fp8Config
from jax_fa3.fp8 import flash_attention_fp8
from oracle import attention_oracle_grads, visibility_mask
from outlier_inputs import outlier_qkv_dout


def _normal(seed, *shapes, dtype=jnp.bfloat16):
  rng = np.random.default_rng(seed)
  return [jnp.asarray(rng.standard_normal(s), dtype) for s in shapes]


def _rel(got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def _config(q, k, v, causal=False, window=(-1, -1), incoherent=True):
  att = _validation.attention_config(q, k, v, softmax_scale=None, causal=causal,
                                     window_size=window, softcap=0.0, deterministic=False)
  return Fp8Config(att, incoherent=incoherent)


def _forward(q, k, v, signs, cfg):
  """The fp8 forward's out, lse and quantized rotated q, k (what the backward starts from)."""
  out, lse = flash_attention_fp8(q, k, v, causal=cfg.attention.is_causal, signs=signs,
                                 window_size=(cfg.window_left, cfg.window_right)
                                 if not cfg.attention.is_causal else (-1, -1),
                                 incoherent=cfg.incoherent, return_lse=True)
  q8, q_scale = _fp8_quantize.rotate_quantize(q, signs, cfg.incoherent, cfg.block_size)
  k8, k_scale = _fp8_quantize.rotate_quantize(k, signs, cfg.incoherent, cfg.block_size)
  return out, lse, q8, q_scale, k8, k_scale


def _float64_backward_at_operands(q_used, k_used, v, out, lse, dout, cfg):
  """The gradient of attention at the (dequantized, rotated) operands, started from the given out
  and lse, in float64 and without any rounding: what the emulation computes when its e4m3
  roundings are taken away."""
  q_used, k_used, v, out, dout = (np.asarray(x, np.float64) for x in (q_used, k_used, v, out, dout))
  lse = np.asarray(lse, np.float64)
  b, s_q, h, d = q_used.shape
  s_k, h_k = k_used.shape[1], k_used.shape[2]
  g = h // h_k
  k_full, v_full = np.repeat(k_used, g, axis=2), np.repeat(v, g, axis=2)
  scale = cfg.attention.softmax_scale
  visible = visibility_mask(s_q, s_k, cfg.window_left, cfg.window_right)
  scores = scale * np.einsum("bqhd,bkhd->bhqk", q_used, k_full)
  with np.errstate(invalid="ignore"):
    probs = np.where(visible & np.isfinite(lse)[..., None], np.exp(scores - lse[..., None]), 0.0)
  delta = np.einsum("bqhd,bqhd->bhq", dout, out)
  dscores = probs * (np.einsum("bqhd,bkhd->bhqk", dout, v_full) - delta[..., None])
  dq = scale * np.einsum("bhqk,bkhd->bqhd", dscores, k_full)
  dk = scale * np.einsum("bhqk,bqhd->bkhd", dscores, q_used)
  dv = np.einsum("bhqk,bqhd->bkhd", probs, dout)
  fold = lambda x: x.reshape(b, s_k, h_k, g, d).sum(axis=3)
  return dq, fold(dk), fold(dv)


def _without_rounding(monkeypatch):
  """The emulation with its e4m3 roundings (P', the dK operand, dO) taken away; scales kept."""
  monkeypatch.setattr(emulation, "to_e4m3", lambda x: x)
  real = _fp8_quantize.quantize_blocks

  def exact_blocks(x, block, amax=None):
    _, scales = real(x, block, amax=amax)
    return x.astype(jnp.float32) / _fp8_quantize.per_token(scales, block, x.shape[1]), scales

  monkeypatch.setattr(emulation, "quantize_blocks", exact_blocks)


@pytest.mark.parametrize("d,s_q,s_k,causal,window", [
    (64, 300, 260, True, (-1, -1)),  # 128-row tiles; the first 40 rows see no key
    (128, 200, 230, False, (40, 10)),  # 64-row tiles, a band
])
def test_scale_folding_is_exact_without_rounding(monkeypatch, d, s_q, s_k, causal, window):
  # The dO block ratios r, s_max, the lazy per-key maxima of the dK operand and the unscaling of
  # dq only move powers and ratios around: without the e4m3 roundings the emulation is the float64
  # gradient at the operands, up to the 16-bit dS and k of the dq GEMM (~2^-9 each; a misplaced
  # factor is O(1)). dO has an all-zero block and a block 2^-12 times the others (r = 0, and r
  # tiny), the ratios the prescales exist for.
  _without_rounding(monkeypatch)
  q, k, v, dout = _normal(d, (2, s_q, 4, d), (2, s_k, 2, d), (2, s_k, 2, d), (2, s_q, 4, d))
  dout = dout.at[0, 64:128].set(0).at[1, :64, 1].multiply(2.0**-12)
  signs = jax.random.rademacher(jax.random.PRNGKey(d), (d,), dtype=jnp.float32)
  cfg = _config(q, k, v, causal=causal, window=window)
  out, lse, q8, q_scale, k8, k_scale = _forward(q, k, v, signs, cfg)
  got = emulation.emulated_backward(q8, q_scale, k8, k_scale, v, out, lse, dout, cfg)
  used = [np.asarray(_fp8_forward.dequantized(x8, s, cfg, jnp.float32)) for x8, s in
          ((q8, q_scale), (k8, k_scale))]
  want = _float64_backward_at_operands(*used, v, out, lse, dout, cfg)
  assert np.isinf(np.asarray(lse)).any() == causal
  for name, a, b in zip(("dq", "dk", "dv"), got, want):
    assert np.all(np.isfinite(np.asarray(a))), name
    assert _rel(a, b) < 5e-3, (name, _rel(a, b))


def test_dk_operand_stays_finite_for_a_key_far_below_every_row_maximum():
  # Every query sees key 1.. about 90 nats below key 0: their P' is ~1e-39 (float32 subnormals),
  # so those keys' dK-operand maximum M is far below 2^-122 and 2^6 / M overflows to inf. M only
  # moves above MIN_RUNNING_MAX and the operand is (dS' w) * (2^6 / M): dK stays finite (those
  # keys' dK, ~1e-39 relative, rounds to 0 in e4m3).
  d, s = 64, 128
  q, k, v, dout = _normal(7, (1, s, 1, d), (1, s, 1, d), (1, s, 1, d), (1, s, 1, d))
  cfg = _config(q, k, v)
  blocks = -(-s // cfg.block_size)
  q8 = jnp.ones((1, s, 1, d), jnp.float8_e4m3fn)
  k8 = jnp.full((1, s, 1, d), -1.0, jnp.float8_e4m3fn).at[:, 0].set(1.0)
  q_scale = jnp.ones((1, 1, blocks), jnp.float32)
  gap = 90.0  # nats between key 0 and the others: 2 * 64 * k_scale * softmax_scale
  k_scale = jnp.full((1, 1, blocks), gap / (2 * d * cfg.attention.softmax_scale), jnp.float32)
  scores = np.where(np.arange(s) == 0, gap / 2, -gap / 2)  # the same for every query
  lse = np.full((1, 1, s), gap / 2 + np.log1p((s - 1) * np.exp(-gap)), np.float32)
  probs = np.exp(scores - lse[0, 0, 0])
  out = jnp.asarray(np.einsum("k,kd->d", probs, np.asarray(v[0, :, 0], np.float64))[None, None, None]
                    * np.ones((1, s, 1, 1)), jnp.bfloat16)
  dq, dk, dv = emulation.emulated_backward(q8, q_scale, k8, k_scale, v, out, jnp.asarray(lse),
                                           dout, cfg)
  for name, x in (("dq", dq), ("dk", dk), ("dv", dv)):
    assert np.all(np.isfinite(np.asarray(x))), name


def _grads(q, k, v, dout, **kwargs):
  loss = lambda q, k, v, dout: jnp.sum(flash_attention_fp8(q, k, v, **kwargs).astype(jnp.float32)
                                       * dout.astype(jnp.float32))
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v, dout)


@pytest.mark.parametrize("causal", [False, True])
def test_accuracy_on_outlier_inputs(causal):
  # Errors relative to exact attention's float64 gradients, s = 512, h = 2, d = 128, seeds 0-4:
  # "fp8" / "bf16" = 0.99-1.01 (dq), 1.03-1.11 (dk), 1.20-1.39 (dv), since the fp8 forward's own
  # error (out, lse, the quantized q and k) dominates both; fp8's errors are 5-8% (bf16 backward
  # at the unquantized inputs: 0.3%), and the rotation lowers each of them, by 1.01-1.49x.
  q, k, v, dout = outlier_qkv_dout(0, (1, 512, 2, 128))
  want = attention_oracle_grads(q, k, v, dout, softmax_scale=128**-0.5,
                                window_right=0 if causal else -1)
  fp8_rot = _grads(q, k, v, dout, causal=causal, backward="fp8")
  fp8_plain = _grads(q, k, v, dout, causal=causal, backward="fp8", incoherent=False)
  bf16_rot = _grads(q, k, v, dout, causal=causal, backward="bf16")
  for i, (name, bound) in enumerate((("dq", 1.05), ("dk", 1.12), ("dv", 1.45))):
    err = _rel(fp8_rot[i], want[i])
    assert err < bound * _rel(bf16_rot[i], want[i]), (name, err, _rel(bf16_rot[i], want[i]))
    assert err < _rel(fp8_plain[i], want[i]), (name, err, _rel(fp8_plain[i], want[i]))
    assert err < 0.12, (name, err)


def test_gradients_are_the_emulation_rotated_back():
  # The custom_vjp path: the forward's q8 and k8, the emulation, dq and dk rotated back
  # (diag(signs)·H), in the inputs' dtypes; no gradient into the signs.
  q, k, v, dout = _normal(3, (2, 96, 4, 64), (2, 80, 2, 64), (2, 80, 2, 64), (2, 96, 4, 64))
  signs = jax.random.rademacher(jax.random.PRNGKey(5), (64,), dtype=jnp.float32)
  loss = lambda q, k, v, s: jnp.sum(
      flash_attention_fp8(q, k, v, causal=True, signs=s, backward="fp8").astype(jnp.float32)
      * dout.astype(jnp.float32))
  got = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, signs)
  cfg = _config(q, k, v, causal=True)
  out, lse, q8, q_scale, k8, k_scale = _forward(q, k, v, signs, cfg)
  dq, dk, dv = jax.jit(functools.partial(emulation.emulated_backward, cfg=cfg))(
      q8, q_scale, k8, k_scale, v, out, lse, dout)
  back = lambda x: (jax_fa3.hadamard_transform(x) * signs).astype(jnp.bfloat16)
  for a, b in zip(got[:3], (back(dq), back(dk), dv.astype(jnp.bfloat16))):
    assert a.dtype == jnp.bfloat16
    # Two compilations fuse the float32 work differently: a few elements round to the
    # neighbouring bfloat16 (measured 2 of 20480).
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    ulp = np.spacing(np.abs(b).astype(ml_dtypes.bfloat16)).astype(np.float32)
    assert np.all(np.abs(a - b) <= ulp)
    assert np.mean(a != b) < 1e-3
  np.testing.assert_array_equal(np.asarray(got[3]), 0.0)


def test_gradients_through_lse_and_float32_inputs():
  # dlse enters as D - dlse; float32 inputs take bfloat16 16-bit operands. Linear in out and lse,
  # so "fp8" and "bf16" receive the same cotangents: they agree to the fp8 error (measured 2-3%).
  q, k, v = _normal(12, (1, 150, 2, 32), (1, 150, 1, 32), (1, 150, 1, 32), dtype=jnp.float32)
  weights = jnp.linspace(-1.0, 1.0, q.size).reshape(q.shape)

  def loss(backward, q, k, v):
    out, lse = flash_attention_fp8(q, k, v, return_lse=True, backward=backward)
    return jnp.sum(out * weights) + jnp.sum(lse[..., :40])

  g = jax.grad(functools.partial(loss, "fp8"), argnums=(0, 1, 2))(q, k, v)
  g_ref = jax.grad(functools.partial(loss, "bf16"), argnums=(0, 1, 2))(q, k, v)
  for a, b in zip(g, g_ref):
    assert a.dtype == jnp.float32
    assert 0 < _rel(a, b) < 8e-2, _rel(a, b)


def test_backward_starts_from_the_forwards_quantized_operands():
  # The forward hands its e4m3 q and k and their per-token scales to the backward (one byte an
  # element saved instead of two, no second quantization): one partitioned forward and one
  # backward in the program, and the residuals hold q and k only as float8.
  q, k, v, dout = _normal(4, (1, 70, 2, 32), (1, 70, 2, 32), (1, 70, 2, 32), (1, 70, 2, 32))
  loss = lambda q: jnp.sum(flash_attention_fp8(q, k, v, backward="fp8").astype(jnp.float32))
  jaxpr = str(jax.make_jaxpr(jax.grad(loss))(q))
  assert jaxpr.count("custom_partitioning[") == 2, jaxpr.count("custom_partitioning[")
  _, vjp = jax.vjp(lambda q, k: flash_attention_fp8(q, k, v, backward="fp8"), q, k)
  saved = [x for x in jax.tree.leaves(vjp) if hasattr(x, "shape") and x.shape == q.shape]
  assert {str(x.dtype) for x in saved} == {"float8_e4m3fn", "bfloat16"}  # q8, k8; v, out
  assert sum(x.dtype == jnp.bfloat16 for x in saved) == 2


def _kernel_model(operands, cfg, s_q, s_k, h_k):
  """The fp8 backward kernel's algorithm (cuda/flash_bwd/fp8_traits.cuh, consumer_key_major.cuh)
  on its operands as `jax_fa3._fp8_backward.kernel_operands` lays them out, in float32 NumPy:
  q8ᵀ and dO8ᵀ read back through the row permutation the kernel's packed A operands imply
  (KEY_OF_SLOT), the padded row vectors read per query tile, the per-key lazy maxima of the dK
  operand (cuda/flash_bwd/fp8_dk_operand.cuh) kept over (query head, tile), dq, dk, dv scaled on
  the way out as the postprocess and the epilogue do."""
  f32 = np.float32
  e4m3 = lambda x: np.asarray(_fp8_quantize.to_e4m3(x), f32)
  op16 = operands[4].dtype  # v's: the 16-bit type dS' is rounded to for dQ
  round16 = lambda x: np.asarray(jnp.asarray(x).astype(op16).astype(jnp.float32), f32)
  (q8, q8_t, k8, k_used, v16, do16, do8_t, lse2, delta, q_scale, dk_coef, dq_scale, k_scale,
   dv_scale) = (np.asarray(x.astype(jnp.float32) if x.dtype != jnp.float32 else x, f32)
                for x in operands)
  b, _, h, d = q8.shape
  s_t = q8_t.shape[-1]
  slot = np.arange(s_t)
  row_of_slot = slot // 32 * 32 + np.asarray(_fp8_quantize.KEY_OF_SLOT)[slot % 32]
  do8 = np.zeros_like(do8_t)
  do8[..., row_of_slot] = do8_t  # (b, h, d, s_t), rows in order again
  q8_back = np.zeros_like(q8_t)
  q8_back[..., row_of_slot] = q8_t
  np.testing.assert_array_equal(q8_back[..., :s_q], np.einsum("bqhd->bhdq", q8))
  np.testing.assert_array_equal(q8_back[..., s_q:], 0.0)
  tile = emulation.backward_tile_q(d)
  s_pad = lse2.shape[-1]
  assert s_pad % tile == 0 and s_pad - s_q < tile and s_t == -(-s_q // 32) * 32
  pad_rows = lambda x: np.pad(x, ((0, s_pad - x.shape[0]),) + ((0, 0),) * (x.ndim - 1))
  score_log2 = f32(cfg.attention.softmax_scale) * f32(1.4426950408889634)
  margin = f32(2.0**2.8)
  visible = np.pad(visibility_mask(s_q, s_k, cfg.window_left, cfg.window_right),
                   ((0, s_pad - s_q), (0, 0)))  # padded rows see nothing
  dq = np.zeros((b, s_q, h, d), f32)
  dk = np.zeros((b, s_k, h_k, d), f32)
  dv = np.zeros((b, s_k, h_k, d), f32)
  g = h // h_k
  for bb in range(b):
    for hk in range(h_k):
      key_coef = score_log2 * k_scale[bb, hk]  # (s_k,)
      running, inv = np.zeros(s_k, f32), np.full(s_k, f32(64.0))
      dk_acc, dv_acc = np.zeros((s_k, d), f32), np.zeros((s_k, d), f32)
      for qh in range(hk * g, hk * g + g):
        q_rows = pad_rows(q8[bb, :, qh])
        do_rows = pad_rows(do16[bb, :, qh])
        do8_rows = np.pad(do8[bb, qh].T, ((0, max(0, s_pad - s_t)), (0, 0)))[:s_pad]
        dq_rows = np.zeros((s_pad, d), f32)
        for m in range(s_pad // tile):
          r = slice(m * tile, m * tile + tile)
          s_t_block = k8[bb, :, hk] @ q_rows[r].T  # S^T (keys, rows): exact e4m3 products
          coef = q_scale[bb, qh, r][None, :] * key_coef[:, None]
          with np.errstate(over="ignore", invalid="ignore"):
            p = np.where(visible[r].T, np.exp2(s_t_block * coef - lse2[bb, qh, r][None, :]), 0.0)
          p = p.astype(f32)
          dv_acc += e4m3(p) @ do8_rows[r]
          dp = v16[bb, :, hk] @ do_rows[r].T
          ds = (p * (dp - delta[bb, qh, r][None, :])).astype(f32)
          dq_rows[r] = round16(ds).T @ k_used[bb, :, hk]
          w = dk_coef[bb, qh, r][None, :]
          block_max = (np.abs(ds) * w).max(axis=1)
          moved = block_max > np.maximum(running * margin, f32(2.0**-100))
          rescale = np.where(moved, np.where(running > 0, running / np.where(moved, block_max, 1),
                                             0.0), 1.0).astype(f32)
          running = np.where(moved, block_max, running).astype(f32)
          inv = np.where(moved, f32(64.0) / np.where(moved, block_max, 1), inv).astype(f32)
          dk_acc = dk_acc * rescale[:, None] + e4m3((ds * w) * inv[:, None]) @ q_rows[r]
        dq[bb, :, qh] = dq_rows[:s_q] * dq_scale[bb, qh][:, None]
      dk[bb, :, hk] = dk_acc * (running / f32(64.0) * f32(cfg.attention.softmax_scale))[:, None]
      dv[bb, :, hk] = dv_acc * dv_scale[bb, hk]
  return dq, dk, dv


@pytest.mark.parametrize("d,s_q,s_k,h,h_k,causal,window", [
    (64, 150, 200, 4, 2, True, (-1, -1)),    # 128-row tiles, rows that see no key
    (128, 70, 130, 2, 1, False, (40, 10)),   # 64-row tiles, a band, GQA
    (32, 33, 40, 2, 2, False, (-1, -1)),     # d below its bucket
])
def test_kernel_operands_reproduce_the_emulation(d, s_q, s_k, h, h_k, causal, window):
  # What the fp8 backward kernel is handed (jax_fa3._fp8_backward.kernel_operands), run through a
  # NumPy model of the kernel's algorithm, gives the emulation's gradients: the transposed,
  # permuted copies, the padding, the row vectors and the final factors are the ones its
  # numerics need. The two differ in float32 operation order only.
  q, k, v, dout = _normal(d + s_q, (2, s_q, h, d), (2, s_k, h_k, d), (2, s_k, h_k, d),
                          (2, s_q, h, d))
  dout = dout.at[1, :64].multiply(2.0**-10)  # r < 1 for some rows
  signs = jax.random.rademacher(jax.random.PRNGKey(d), (d,), dtype=jnp.float32)
  cfg = _config(q, k, v, causal=causal, window=window)
  out, lse, q8, q_scale, k8, k_scale = _forward(q, k, v, signs, cfg)
  q_rows = _fp8_forward.token_scales(q_scale, cfg.block_size, s_q)
  k_rows = _fp8_forward.token_scales(k_scale, cfg.block_size, s_k)
  operands = _fp8_backward.kernel_operands(q8, k8, v, out, lse, dout, q_rows, k_rows, cfg)
  b, tile = 2, emulation.backward_tile_q(d)
  s_pad, s_t = -(-s_q // tile) * tile, -(-s_q // 32) * 32
  expected = [((b, s_q, h, d), jnp.float8_e4m3fn), ((b, h, d, s_t), jnp.float8_e4m3fn),
              ((b, s_k, h_k, d), jnp.float8_e4m3fn), ((b, s_k, h_k, d), jnp.bfloat16),
              ((b, s_k, h_k, d), jnp.bfloat16), ((b, s_q, h, d), jnp.bfloat16),
              ((b, h, d, s_t), jnp.float8_e4m3fn)] + [((b, h, s_pad), jnp.float32)] * 4 + [
              ((b, h, s_q), jnp.float32), ((b, h_k, s_k), jnp.float32), ((b, h_k), jnp.float32)]
  assert [(x.shape, x.dtype) for x in operands] == [(s, np.dtype(t)) for s, t in expected]
  lse2, delta, q_pad, w_pad = (np.asarray(x) for x in operands[7:11])
  assert np.all(np.isposinf(lse2[..., s_q:])) and not np.any(delta[..., s_q:])
  assert not np.any(q_pad[..., s_q:]) and not np.any(w_pad[..., s_q:])
  got = _kernel_model(operands, cfg, s_q, s_k, h_k)
  want = emulation.emulated_backward(q8, q_scale, k8, k_scale, v, out, lse, dout, cfg)
  for name, a, b_ in zip(("dq", "dk", "dv"), got, want):  # measured: at most 9e-7 (dq)
    assert _rel(a, b_) < 1e-5, (name, _rel(a, b_))


@pytest.mark.parametrize("return_lse", [False, True])
def test_gpu_program_traces_on_cpu(monkeypatch, return_lse):
  """The program a Hopper GPU would run for jax.grad(backward="fp8"), lowered here for platform
  CUDA (jax.export; nothing runs), kernels faked present: the backward's partitioned op calls
  the fp8 backward kernel, and what it traces closes over no constant array (custom_partitioning
  asserts `not closed_call.consts`: the kernel's transposed operands once took a gather with a
  NumPy index array, which failed on the GPU only, the CPU tracing the emulation alone); vmap
  folds into one such program."""
  from jax_fa3 import _ffi  # noqa: PLC0415
  monkeypatch.setattr(_ffi, "kernels_available", lambda: True)
  monkeypatch.setattr(_ffi, "has_target", lambda name: True)
  monkeypatch.setattr(_ffi, "ensure_registered", lambda: None)
  monkeypatch.setattr(_ffi, "build_config", lambda: {"head_dims": ("64", "128")})
  # Sizes from the extension (not needed here: the program is only lowered).
  monkeypatch.setattr(_ffi, "flash_fwd_fp8_workspace_bytes", lambda *a: 1024)
  monkeypatch.setattr(_ffi, "flash_bwd_fp8_workspace_bytes", lambda *a: 1024)
  targets = (_fp8_quantize.ROTATE_QUANTIZE_TARGET, _fp8_forward.KERNEL_TARGET,
             _fp8_backward.KERNEL_TARGET, "jax_fa3_hadamard")
  checks = [jax.export.DisabledSafetyCheck.custom_call(t) for t in targets]
  q, k, v, dout = _normal(8, (2, 200, 4, 64), (2, 260, 2, 64), (2, 260, 2, 64), (2, 200, 4, 64))

  def loss(q, k, v):
    out = flash_attention_fp8(q, k, v, causal=True, backward="fp8", return_lse=return_lse)
    if return_lse:
      out, lse = out
      return jnp.sum(out.astype(jnp.float32) * dout) + jnp.sum(jnp.sin(lse))
    return jnp.sum(out.astype(jnp.float32) * dout)

  def lowered(fn, *args):
    return jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)(
        *args).mlir_module()

  grads = jax.grad(loss, argnums=(0, 1, 2))
  text = lowered(grads, q, k, v)
  assert text.count(f"@{_fp8_backward.KERNEL_TARGET}(") == 1
  assert "@jax_fa3_flash_bwd(" not in text
  stack = lambda x: jnp.stack([x, x])
  text = lowered(jax.vmap(grads), *map(stack, (q, k, v)))
  assert text.count(f"@{_fp8_backward.KERNEL_TARGET}(") == 1
