"""FP8 attention: quantization, the kernel emulation, accuracy targets (issue 5), gradients, errors.

Runs on the CPU through the pure-JAX emulation of the fp8 kernel.
"""
import functools
import re

import jax
import jax.export  # a submodule JAX 0.6 does not import with jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_fa3
from jax_fa3 import _config, _fp8_emulation, _fp8_forward, _fp8_quantize
from jax_fa3.fp8 import dequantize_fp8, flash_attention_fp8, quantize_fp8
from kernel_targets import FLASH_FWD_FP8, assert_targets, compiled_text, kernel_targets
from oracle import attention_oracle
from outlier_inputs import outlier_arrays


def _normal(seed, *shapes, dtype=jnp.bfloat16):
  rng = np.random.default_rng(seed)
  return [jnp.asarray(rng.standard_normal(s), dtype) for s in shapes]


def _rmse(x, ref):
  return float(np.sqrt(np.mean((np.asarray(x, np.float64) - ref) ** 2)))


def _f64(*xs):
  return [np.asarray(x, np.float64) for x in xs]


# ---------------------------------------------------------------------------------------------
# Quantization
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_quantize_round_trip_within_e4m3_precision(dtype):
  # e4m3 keeps 3 mantissa bits: a value in [2^e, 2^(e+1)) lies on a grid of step 2^(e-3), so
  # rounding to nearest moves it by at most 2^(e-4) <= 2^-4 |x| (relative step 2^-3, half of it).
  # Below e4m3's smallest normal, 2^-6 (in units of the block's scale), the grid is the subnormal
  # step 2^-9: an absolute error of at most 2^-10 · scale. The float32 division and product add
  # 2^-24 relative each.
  rng = np.random.default_rng(0)
  x = rng.standard_normal((2, 150, 3, 32)) * np.exp(rng.uniform(-6, 6, (2, 150, 3, 1)))
  x[0, :64, 0] = 0.0  # an all-zero block
  x = jnp.asarray(x, dtype)
  values, scales = quantize_fp8(x, block_size=64)
  assert values.dtype == jnp.float8_e4m3fn and values.shape == x.shape
  assert scales.dtype == jnp.float32 and scales.shape == (2, 3, 3)
  back = np.asarray(dequantize_fp8(values, scales, block_size=64), np.float64)
  xf = np.asarray(x, np.float64)
  scale_per_token = np.repeat(np.asarray(scales, np.float64), 64, axis=-1)[..., :150]
  scale_per_token = np.swapaxes(scale_per_token, 1, 2)[..., None]
  bound = 2.0**-4 * np.abs(xf) * (1 + 1e-6) + 2.0**-10 * scale_per_token
  assert np.all(np.abs(back - xf) <= bound)
  # The bound is tight: some elements use most of it.
  assert np.max(np.abs(back - xf) / (np.abs(xf) + 1e-30)) > 2.0**-4 * 0.9


def test_quantize_scales_and_rounding_are_exact():
  x = _normal(1, (2, 100, 4, 16), dtype=jnp.float32)[0]
  x = x.at[1, 64:, 2].set(0.0)  # the last block of (batch 1, head 2) is all zeros
  values, scales = quantize_fp8(x, block_size=32)
  assert scales.shape == (2, 4, 4)
  xf = np.asarray(x)
  amax = np.stack([np.abs(xf[:, i:i + 32]).max(axis=(1, 3)) for i in range(0, 100, 32)], -1)
  expected = np.where(amax > 0, (amax * np.float32(1 / 448)).astype(np.float32), 1.0)
  np.testing.assert_array_equal(np.asarray(scales), expected)
  assert np.asarray(scales)[1, 2, 3] == 1.0 and np.asarray(scales)[1, 2, 2] == 1.0
  # values = RNE e4m3 of the float32 quotient, bit for bit (ml_dtypes as the independent oracle).
  per_token = np.swapaxes(np.repeat(expected, 32, axis=-1)[..., :100], 1, 2)[..., None]
  oracle = (xf / per_token.astype(np.float32)).astype(ml_dtypes.float8_e4m3fn)
  np.testing.assert_array_equal(np.asarray(values).view(np.uint8), oracle.view(np.uint8))
  # Each block's largest magnitude maps to exactly ±448.
  assert np.max(np.abs(np.asarray(values, np.float32))) == 448.0
  # block_size=None: one scale per (batch, head).
  _, per_head = quantize_fp8(x, block_size=None)
  np.testing.assert_array_equal(np.asarray(per_head)[..., 0],
                                np.where(amax.max(-1) > 0, amax.max(-1) * np.float32(1 / 448), 1))


# ---------------------------------------------------------------------------------------------
# Forward numerics
# ---------------------------------------------------------------------------------------------

def _emulation_device():
  """The model tests below check the pure-JAX emulation itself, so they run it on the CPU backend
  on every machine; on a Hopper GPU tests/test_gpu_fp8.py checks the kernel against it."""
  return jax.default_device(jax.devices("cpu")[0])


def _dense_emulation(q, k, v, *, softmax_scale, block_size, signs=None, window_right=-1,
                     tile_k=None, margin=_fp8_emulation.LAZY_MAX_MARGIN_LOG2):
  """Independent NumPy/ml_dtypes model of the kernel's numerics: rotate, quantize, exact e4m3
  products, e4m3(2^6 · P), an online softmax over key tiles of tile_k (None: one tile, so the
  running max is the row max), last tile first, whose running max moves only when a tile's
  scores exceed it by more than `margin` (log2 units); v centred by its mean over the keys."""
  e4m3 = ml_dtypes.float8_e4m3fn

  def quant(x, block):
    b, s, h, d = x.shape
    block = s if block is None else block
    out, scales = np.empty_like(x), np.empty((b, h, -(-s // block)), np.float32)
    for i, start in enumerate(range(0, s, block)):
      part = x[:, start:start + block]
      amax = np.abs(part).max(axis=(1, 3))
      scale = np.where(amax > 0, amax * np.float32(1 / 448), np.float32(1)).astype(np.float32)
      scales[..., i] = scale
      out[:, start:start + block] = (part / scale[:, None, :, None]).astype(e4m3).astype(np.float32)
    return out, np.swapaxes(np.repeat(scales, block, -1)[..., :s], 1, 2)[..., None]

  q, k, v = (np.asarray(x, np.float32) for x in (q, k, v))
  if signs is not None:
    rotate = jax.jit(functools.partial(jax_fa3.hadamard_transform, signs=signs))
    q, k = (np.asarray(rotate(jnp.asarray(x))) for x in (q, k))
  q8, qs = quant(q, block_size)
  k8, ks = quant(k, block_size)
  v_mean = v.mean(axis=1, dtype=np.float64).astype(np.float32)  # centred v (_fp8_emulation.py)
  v8, vs = quant(v - v_mean[:, None], None)
  h, h_k = q.shape[2], k.shape[2]
  rep = lambda x: np.repeat(x, h // h_k, axis=2)
  scores = np.einsum("bqhd,bkhd->bhqk", q8.astype(np.float64), rep(k8).astype(np.float64))
  scores = scores * np.einsum("bqh->bhq", qs[..., 0])[..., None] * np.einsum(
      "bkh->bhk", rep(ks)[..., 0])[:, :, None, :] * softmax_scale
  s_q, s_k = q.shape[1], k.shape[1]
  if window_right >= 0:
    scores = np.where(np.arange(s_k)[None] <= np.arange(s_q)[:, None] + s_k - s_q + window_right,
                      scores, -np.inf)
  offset = 2.0 ** _fp8_emulation.P_OFFSET_LOG2
  tile_k = s_k if tile_k is None else tile_k
  scores = scores * np.log2(np.e)  # the kernel's exp2 domain
  row_max = np.full(scores.shape[:-1], -np.inf)
  row_sum = np.zeros(scores.shape[:-1])
  acc = np.zeros(scores.shape[:-1] + (v.shape[-1],))
  with np.errstate(invalid="ignore"):  # -inf - -inf: a row that has seen no key yet
    for start in reversed(range(0, s_k, tile_k)):
      tile = scores[..., start:start + tile_k]
      tile_max = np.maximum(row_max, tile.max(-1))
      new_max = np.where(tile_max - row_max > margin, tile_max, row_max)
      shift = np.where(np.isneginf(new_max), 0.0, new_max)
      rescale = np.exp2(row_max - shift)
      probs = np.exp2(tile - shift[..., None])
      probs8 = (probs * offset).astype(np.float32).astype(e4m3).astype(np.float64)
      row_sum = row_sum * rescale + probs8.sum(-1) / offset  # of the quantized P, as the kernel
      acc = acc * rescale[..., None] + np.einsum("bhqk,bkhd->bhqd", probs8,
                                                 rep(v8)[:, start:start + tile_k])
      row_max = new_max
  out = np.einsum("bhqd->bqhd", acc / (offset * row_sum[..., None]))
  return out * rep(vs)[:, 0:1, :, :] + rep(v_mean[:, None])


@pytest.mark.parametrize("incoherent,causal", [(False, False), (True, True)])
def test_emulation_matches_independent_model(incoherent, causal):
  q, k, v = _normal(2, (2, 70, 4, 32), (2, 90, 2, 32), (2, 90, 2, 32))
  signs = jnp.asarray(np.random.default_rng(3).choice([-1.0, 1.0], 32), jnp.float32)
  with _emulation_device():  # the model's rotation too: the GPU's Hadamard pass rounds differently
    out = flash_attention_fp8(q, k, v, causal=causal, incoherent=incoherent, block_size=16,
                              signs=signs if incoherent else None)
    model = _dense_emulation(q, k, v, softmax_scale=32**-0.5, block_size=16,
                             signs=signs if incoherent else None, window_right=0 if causal else -1)
  # s_k = 90 < 128 keys: one tile, so the model's P is the kernel's P; what remains is float32
  # vs float64 arithmetic (rarely flipping an e4m3 rounding of P) and the bf16 output rounding.
  assert _rmse(out, model) < 2e-3 * np.sqrt(np.mean(model**2))
  np.testing.assert_allclose(np.asarray(out, np.float64), model, atol=0.02, rtol=0.02)


def test_emulation_lazy_max_matches_tiled_model():
  # Three key tiles (300 keys, visited last first) whose scores grow tile by tile, so that rows'
  # maxima jump by amounts on both sides of the lazy margin: the emulation must keep or move each
  # row's max exactly as the model (and the kernel) does. P is quantized relative to that max, so
  # keeping a max that should move (or the reverse) changes the output by ~1e-2 of its size.
  q, k, v = _normal(9, (1, 64, 2, 32), (1, 300, 2, 32), (1, 300, 2, 32), dtype=jnp.float32)
  growth = np.repeat(np.array([2.2, 1.6, 1.0]), [128, 128, 44])[None, :, None, None]
  k = jnp.asarray(np.asarray(k) * growth, jnp.float32)
  with _emulation_device():
    out = np.asarray(flash_attention_fp8(q, k, v, incoherent=False, block_size=16), np.float64)
  kwargs = dict(softmax_scale=32**-0.5, block_size=16, tile_k=_config.EMULATION_TILE_K)
  lazy = _dense_emulation(q, k, v, **kwargs)
  exact = _dense_emulation(q, k, v, **kwargs, margin=0.0)
  # The model's max moved in some rows and stayed in others (between 0 and the margin).
  scores = np.einsum("bqhd,bkhd->bhqk", *_f64(q, k)) * 32**-0.5 * np.log2(np.e)
  first = scores[..., 256:].max(-1)
  jump = np.maximum(first, scores[..., 128:256].max(-1)) - first
  assert np.sum((jump > 0) & (jump <= _fp8_emulation.LAZY_MAX_MARGIN_LOG2)) > 10
  assert np.sum(jump > _fp8_emulation.LAZY_MAX_MARGIN_LOG2) > 10
  rms = np.sqrt(np.mean(lazy**2))
  assert _rmse(out, lazy) < 3e-3 * rms  # float32 vs float64, bf16 output rounding (~1e-3)
  assert _rmse(out, exact) > 3 * _rmse(out, lazy)


@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (20, 5))])
def test_close_to_float64_on_normal_inputs(causal, window):
  # Expected relative RMSE on N(0,1) data: e4m3 rounding has an rms relative error of about
  # 2^-3 · 0.72 / sqrt(12) ~= 0.026 (the step is 2^-4..2^-3 of the value). The scores carry two
  # such errors (q and k): ~0.037 of the score's size (~1 with the 1/sqrt(d) scale), which moves the
  # output by ~0.037 of its size; P and v add ~0.026 each: sqrt(0.037^2 + 2 · 0.026^2) ~= 0.052.
  # Measured: 0.046-0.052. We require 0.03..0.07: fp8 really is used and nothing else is lost.
  q, k, v = _normal(4, (2, 200, 4, 64), (2, 230, 2, 64), (2, 230, 2, 64))
  out, lse = flash_attention_fp8(q, k, v, causal=causal, window_size=window, return_lse=True)
  right = 0 if causal else window[1]
  ref, ref_lse = attention_oracle(*_f64(q, k, v), softmax_scale=1 / 8, window_left=window[0],
                                  window_right=right)
  assert out.dtype == jnp.bfloat16 and out.shape == q.shape
  assert lse.dtype == jnp.float32 and lse.shape == (2, 4, 200)
  rel = _rmse(out, ref) / np.sqrt(np.mean(ref**2))
  assert 0.03 < rel < 0.07, rel
  np.testing.assert_allclose(np.asarray(lse), ref_lse, atol=0.15)
  bf16 = jax_fa3.flash_attention(q, k, v, causal=causal, window_size=window)
  assert _rmse(out, np.asarray(bf16, np.float64)) / np.sqrt(np.mean(ref**2)) < 0.07


def test_empty_rows_and_output_dtypes():
  q, k, v = _normal(5, (1, 12, 2, 16), (1, 8, 1, 16), (1, 8, 1, 16), dtype=jnp.float32)
  # Window (0, 0) with s_q > s_k: the first s_q - s_k queries see no key.
  out, lse = flash_attention_fp8(q, k, v, window_size=(0, 0), return_lse=True)
  assert out.dtype == jnp.float32
  assert np.all(np.asarray(out)[:, :4] == 0) and np.all(np.isposinf(np.asarray(lse)[:, :, :4]))
  # The other rows see exactly one key: out is that key's v and lse its score, both through e4m3
  # (bounds of test_close_to_float64_on_normal_inputs: 0.07 relative RMS on out, 0.15 on lse).
  ref, ref_lse = attention_oracle(*(np.asarray(x, np.float64) for x in (q, k, v)),
                                  softmax_scale=16**-0.5, window_left=0, window_right=0)
  np.testing.assert_allclose(np.asarray(lse)[:, :, 4:], ref_lse[:, :, 4:], atol=0.15)
  assert _rmse(out[:, 4:], ref[:, 4:]) / np.sqrt(np.mean(ref[:, 4:] ** 2)) < 0.07
  out16 = flash_attention_fp8(q.astype(jnp.float16), k.astype(jnp.float16), v.astype(jnp.float16))
  assert out16.dtype == jnp.float16


def test_v_is_centred_by_its_mean():
  """v less its mean over the keys is what gets quantized, and the mean comes back in the output
  (_fp8_emulation.py): V constant per (head, dim) returns exactly (its centred values are all zero);
  a V with a large mean keeps the relative accuracy of a zero-mean one against float64, and the
  rows that see no key stay 0."""
  q, k, _ = _normal(12, (1, 40, 2, 32), (1, 300, 1, 32), (1, 300, 1, 32))
  level = np.random.default_rng(12).uniform(-3.0, 3.0, (1, 1, 1, 32))
  v = jnp.asarray(np.broadcast_to(level, (1, 300, 1, 32)), jnp.bfloat16)
  out = flash_attention_fp8(q, k, v, causal=True)
  np.testing.assert_array_equal(np.asarray(out, np.float32),
                                np.broadcast_to(np.asarray(v[:, :1], np.float32), out.shape))
  noise = _normal(13, (1, 300, 1, 32))[0]
  shifted = (noise.astype(jnp.float32) + 2.0).astype(jnp.bfloat16)
  ref, _ = attention_oracle(*_f64(q, k, shifted), softmax_scale=32**-0.5)
  ref0, _ = attention_oracle(*_f64(q, k, noise), softmax_scale=32**-0.5)
  # The error is that of the centred part: the same as for zero-mean v (shifted is noise + 2
  # rounded to bf16, so not exactly), far below |O| ~ 2.
  err = _rmse(flash_attention_fp8(q, k, shifted), ref)
  err0 = _rmse(flash_attention_fp8(q, k, noise), ref0)
  assert err < 1.5 * err0 and err < 0.02 * np.sqrt(np.mean(ref**2)), (err, err0)
  # Window (0, 0) with s_q > s_k: the first queries see no key and stay 0, mean or not.
  out = flash_attention_fp8(q[:, :40], k[:, :8], shifted[:, :8], window_size=(0, 0))
  assert np.all(np.asarray(out)[:, :32] == 0) and np.all(np.asarray(out)[:, 32:] != 0)


def test_prequantized_v_mean_is_added_back():
  q, k, v = _normal(14, (1, 50, 2, 32), (1, 60, 2, 32), (1, 60, 2, 32))
  pairs = (quantize_fp8(q), quantize_fp8(k), quantize_fp8(v, block_size=None))
  mean = jnp.asarray(np.random.default_rng(14).uniform(-1, 1, (1, 2, 32)), jnp.float32)
  plain, lse = flash_attention_fp8(*pairs, incoherent=False, return_lse=True)
  shifted, lse2 = flash_attention_fp8(*pairs, incoherent=False, return_lse=True, v_mean=mean)
  # O + mean is added in float32 before the bf16 output: against bf16(O) + mean the two differ
  # by the two bf16 roundings, each at most half a step (2^-6 for |values| < 4).
  np.testing.assert_allclose(np.asarray(shifted, np.float32),
                             np.asarray(plain, np.float32) + np.asarray(mean)[:, None],
                             atol=2.0**-6, rtol=0)
  np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse2))


@pytest.mark.parametrize("causal", [False, True])
def test_weights_sum_to_one(causal):
  """The row sum is that of the quantized P (the weights that multiply V), so a constant V,
  pre-quantized and not centred, comes back exactly from peaked rows too; with the float32 P's sum
  (FA3's) these rows were off by up to an e4m3 step of their largest weight. On the CPU (the
  emulation) even with a GPU: the kernel's fp8 PV accumulator adds with ~13 mantissa bits, which
  only centring makes invisible (tests/test_gpu_fp8.py checks its row sums through the LSE)."""
  rng = np.random.default_rng(11)
  with jax.default_device(jax.devices("cpu")[0]):
    q = jnp.asarray(3 * rng.standard_normal((2, 300, 2, 64)), jnp.float32)
    k = jnp.asarray(3 * rng.standard_normal((2, 300, 2, 64)), jnp.float32)
    v = jnp.full((2, 300, 2, 64), 1.5, jnp.float32)
    pairs = (quantize_fp8(q), quantize_fp8(k), quantize_fp8(v, block_size=None))
    out = flash_attention_fp8(*pairs, incoherent=False, causal=causal)
  np.testing.assert_array_equal(np.asarray(out, np.float32), 1.5)


def _outlier_inputs(seed, b, s, h, d):
  return outlier_arrays(np.random.default_rng(seed), (b, s, h, d), 3)


@pytest.mark.parametrize("d", [128, 256])
def test_issue5_accuracy_targets_with_outliers(d):
  # Issue 5: with the rotation, RMSE falls by >= 1.25x non-causal (>= 1.05x causal) vs block
  # quantization without it, and stays <= 1.5e-2. s=1024, h=4 (1M-4M elements, ~1-4k outliers per
  # tensor): over seeds 0-2 the measured gains are 1.44-2.15 (non-causal) and 1.21-1.39 (causal),
  # RMSE 5.9e-3..1.1e-2, so the fixed seed below is not a lucky draw.
  q, k, v = _outlier_inputs(d, 1, 1024, 4, d)
  signs = jax.random.rademacher(jax.random.PRNGKey(0), (d,), dtype=jnp.float32)
  for causal, min_gain in ((False, 1.25), (True, 1.05)):
    ref, _ = attention_oracle(*_f64(q, k, v), softmax_scale=d**-0.5,
                              window_right=0 if causal else -1)
    plain = _rmse(flash_attention_fp8(q, k, v, causal=causal, incoherent=False), ref)
    rotated = _rmse(flash_attention_fp8(q, k, v, causal=causal, signs=signs), ref)
    assert plain / rotated >= min_gain, (causal, plain, rotated)
    assert rotated <= 1.5e-2, (causal, rotated)


# ---------------------------------------------------------------------------------------------
# API: rotation, pre-quantized inputs, gradients, transformations
# ---------------------------------------------------------------------------------------------

def test_key_signs_and_prequantized_paths_agree():
  q, k, v = _normal(6, (1, 80, 4, 32), (1, 80, 2, 32), (1, 80, 2, 32))
  key = jax.random.PRNGKey(7)
  signs = jax.random.rademacher(key, (32,), dtype=jnp.float32)
  by_key = flash_attention_fp8(q, k, v, key=key)
  by_signs = flash_attention_fp8(q, k, v, signs=signs)
  np.testing.assert_array_equal(np.asarray(by_key), np.asarray(by_signs))
  # Default key = PRNGKey(0).
  np.testing.assert_array_equal(
      np.asarray(flash_attention_fp8(q, k, v)),
      np.asarray(flash_attention_fp8(q, k, v, key=jax.random.PRNGKey(0))))
  assert not np.array_equal(np.asarray(by_key), np.asarray(flash_attention_fp8(q, k, v)))
  # Rotating, centring and quantizing by hand, then passing (values, scales) pairs and v's mean:
  # the same numbers.
  rot = jax.jit(lambda x: jax_fa3.hadamard_transform(x.astype(jnp.float32), signs=signs))
  v_mean = jnp.mean(v.astype(jnp.float32), axis=1)
  centred_v = quantize_fp8(v.astype(jnp.float32) - v_mean[:, None], block_size=None)
  pre = flash_attention_fp8(quantize_fp8(rot(q)), quantize_fp8(rot(k)), centred_v,
                            incoherent=False, v_mean=v_mean)
  np.testing.assert_array_equal(np.asarray(pre), np.asarray(by_signs))
  assert pre.dtype == jnp.bfloat16
  # Without v_mean, pre-quantized v is taken as it is: uncentred v agrees to fp8 precision.
  plain = flash_attention_fp8(quantize_fp8(rot(q)), quantize_fp8(rot(k)),
                              quantize_fp8(v, block_size=None), incoherent=False)
  centred = np.asarray(by_signs, np.float64)
  assert not np.array_equal(np.asarray(plain, np.float64), centred)
  assert _rmse(plain, centred) < 0.05 * np.sqrt(np.mean(centred**2))


def _grads(attn, q, k, v, w, *extra):
  """jit(grad) of <attn(q, k, v, *extra), w> w.r.t. all of its array arguments."""
  loss = lambda *args: jnp.sum(attn(*args).astype(jnp.float32) * w)
  return jax.jit(jax.grad(loss, argnums=tuple(range(3 + len(extra)))))(q, k, v, *extra)


def _gqa_inputs():
  q, k, v = _normal(8, (2, 40, 4, 32), (2, 50, 2, 32), (2, 50, 2, 32))
  w = _normal(9, (2, 40, 4, 32), dtype=jnp.float32)[0]
  return q, k, v, w


def _partitioned_ops(fn, *args) -> int:
  return len(re.findall(r"custom_partitioning\[", str(jax.make_jaxpr(fn)(*args))))


def test_recompute_gradients_are_flash_attentions():
  # backward="recompute": flash_attention's backward at the unquantized inputs, bit-identical.
  q, k, v, w = _gqa_inputs()
  signs = jnp.ones((32,), jnp.float32)
  # Under jit, with traced signs (as the flax layers pass them).
  fp8_attn = lambda q, k, v, s: flash_attention_fp8(q, k, v, causal=True, signs=s,
                                                    backward="recompute")
  g = _grads(fp8_attn, q, k, v, w, signs)
  g_ref = _grads(functools.partial(jax_fa3.flash_attention, causal=True), q, k, v, w)
  for a, b in zip(g, g_ref):
    assert a.dtype == jnp.bfloat16 and np.all(np.isfinite(np.asarray(a, np.float32)))
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  np.testing.assert_array_equal(np.asarray(g[3]), 0.0)  # no gradient flows into the signs


def test_bf16_backward_runs_at_the_quantized_operands():
  # backward="bf16" (default): flash_attention's backward kernel at the rotated, quantized q and k
  # the fp8 kernel multiplied, given the fp8 call's own out and lse, and the gradients of q and k
  # rotated back; no second forward in the program.
  q, k, v, w = _gqa_inputs()
  signs = jnp.asarray(np.random.default_rng(3).choice([-1.0, 1.0], 32), jnp.float32)
  fp8_attn = lambda q, k, v, s: flash_attention_fp8(q, k, v, causal=True, signs=s)
  g = _grads(fp8_attn, q, k, v, w, signs)

  @jax.jit
  def by_hand(q, k, v):
    out, lse = flash_attention_fp8(q, k, v, causal=True, signs=signs, return_lse=True)
    rotate = lambda x: jax_fa3.hadamard_transform(x.astype(jnp.float32), signs=signs)
    used = [dequantize_fp8(*quantize_fp8(rotate(x)), dtype=x.dtype) for x in (q, k)]
    cfg = jax_fa3._validation.attention_config(q, k, v, softmax_scale=None, causal=True,
                                               window_size=(-1, -1), softcap=0.0,
                                               deterministic=False)
    dq, dk, dv = jax_fa3.attention.partitioned_backward(*used, v, out, lse, w.astype(q.dtype),
                                                        cfg)
    # The rotation's transpose: diag(signs)·H.
    back = lambda x: (jax_fa3.hadamard_transform(x).astype(jnp.float32) * signs).astype(x.dtype)
    return back(dq), back(dk), dv

  for a, b in zip(g, by_hand(q, k, v)):
    assert a.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  np.testing.assert_array_equal(np.asarray(g[3]), 0.0)
  # The gradient of the fp8 function differs from the exact one by about the fp8 error: measured
  # 3.8-4.6% relative here (the output: 4.7%); a gradient of the wrong function is O(1) off.
  g_exact = _grads(functools.partial(jax_fa3.flash_attention, causal=True), q, k, v, w)
  for a, b in zip(g, g_exact):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.linalg.norm(a - b) / np.linalg.norm(b) < 8e-2
  # One forward (the fp8 one) and one backward in the program; "recompute" adds the bf16 forward.
  for backward, ops in (("bf16", 2), ("recompute", 3)):
    loss = lambda q: jnp.sum(flash_attention_fp8(q, k, v, backward=backward).astype(jnp.float32))
    assert _partitioned_ops(jax.grad(loss), q) == ops, backward


def test_gradients_under_vmap_over_rotation_keys():
  # Per-lane rotations: the backward's rotate-back takes each lane's signs.
  q, k = _normal(13, (2, 40, 4, 32), (2, 40, 2, 32), dtype=jnp.float32)
  keys = jax.random.split(jax.random.PRNGKey(3), 3)
  loss = lambda q, key: jnp.sum(flash_attention_fp8(q, k, k, key=key, causal=True) ** 2)
  mapped = jax.jit(jax.vmap(jax.grad(loss), in_axes=(None, 0)))(q, keys)
  # Under vmap the lanes' signs are applied before an unsigned transform (hadamard.py), so a few
  # float32 roundings differ and now and then flip an e4m3 rounding (measured: 1e-7 to 2e-5 of
  # the gradient's norm); a lane rotated back with another lane's signs, or not at all, is O(1)
  # off.
  for lane, key in enumerate(keys):
    got, want = np.asarray(mapped[lane]), np.asarray(jax.grad(loss)(q, key))
    assert np.linalg.norm(got - want) < 1e-3 * np.linalg.norm(want)


@pytest.mark.parametrize("backward", ["bf16", "recompute"])
def test_gradients_through_lse(backward):
  q, k, v = _normal(12, (1, 24, 2, 16), (1, 24, 1, 16), (1, 24, 1, 16), dtype=jnp.float32)

  weights = jnp.linspace(-1.0, 1.0, q.size).reshape(q.shape)

  def loss(attn, q):
    # Linear in out and lse, so both paths receive the same cotangents (out**2 would not: the
    # fp8 and exact outputs differ).
    out, lse = attn(q, k, v, return_lse=True)
    return jnp.sum(out * weights) + jnp.sum(lse[..., :5])

  fp8_attn = functools.partial(flash_attention_fp8, backward=backward)
  g = jax.grad(functools.partial(loss, fp8_attn))(q)
  g_ref = jax.grad(functools.partial(loss, jax_fa3.flash_attention))(q)
  if backward == "recompute":
    np.testing.assert_array_equal(np.asarray(g), np.asarray(g_ref))
  else:  # the lse's cotangent reaches q through the quantized operands: fp8-close
    g, g_ref = np.asarray(g, np.float64), np.asarray(g_ref, np.float64)
    assert 0 < np.linalg.norm(g - g_ref) < 8e-2 * np.linalg.norm(g_ref)


def test_keys_transposed_layout():
  """The fp8 kernel's V layout (b, h, d, s_pad): slot c of each 32-key group holds key
  KEY_OF_SLOT[c] (a permutation), zeros past s. The CUDA pass's keys-transposed mode is compared
  with this function bit for bit on the GPU (tests/test_gpu_rotate_quantize.py)."""
  assert sorted(_fp8_quantize.KEY_OF_SLOT) == list(range(32))
  b, s, h, d = 2, 77, 3, 32
  values, _ = quantize_fp8(jax.random.normal(jax.random.PRNGKey(0), (b, s, h, d)), block_size=None)
  vt = np.asarray(_fp8_quantize.kernel_v_layout(values).astype(jnp.float32))
  assert vt.shape == (b, h, d, 96)
  v = np.asarray(values.astype(jnp.float32))
  for slot in range(96):
    key = 32 * (slot // 32) + _fp8_quantize.KEY_OF_SLOT[slot % 32]
    want = v[:, key] if key < s else np.zeros((b, h, d))
    np.testing.assert_array_equal(vt[..., slot], want)


def test_vmap_matches_batch():
  q, k, v = _normal(10, (3, 1, 30, 2, 16), (3, 1, 30, 2, 16), (3, 1, 30, 2, 16))
  out = jax.vmap(lambda q, k, v: flash_attention_fp8(q, k, v, causal=True))(q, k, v)
  # Per-(batch, head, block) scales: each vmapped example is quantized on its own either way.
  batch = flash_attention_fp8(q[:, 0], k[:, 0], v[:, 0], causal=True)
  np.testing.assert_array_equal(np.asarray(out[:, 0]), np.asarray(batch))


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------

_Q, _K, _V = _normal(11, (1, 8, 2, 16), (1, 8, 1, 16), (1, 8, 1, 16))


@pytest.mark.parametrize("args,kwargs,error,message", [
    ((_Q[0], _K, _V), {}, ValueError, "q must have rank 4"),
    ((_Q.astype(jnp.float64), _K.astype(jnp.float64), _V.astype(jnp.float64)), {}, TypeError,
     "float32, bfloat16, float16"),
    ((_Q, _K.astype(jnp.float32), _V), {}, TypeError, "share one dtype"),
    ((_Q, _K, _V[:, :4]), {}, ValueError, "k and v must have the same shape"),
    ((_Q[..., :12], _K[..., :12], _V[..., :12]), {}, ValueError, "multiple of 8"),
    ((_Q, _K, _V), {"block_size": 0}, ValueError, "block_size must be a positive int"),
    ((_Q, _K, _V), {"block_size": 32.0}, TypeError, "block_size must be a positive int"),
    ((_Q, _K, _V), {"incoherent": 1}, TypeError, "incoherent must be a bool"),
    ((_Q, _K, _V), {"causal": True, "window_size": (-1, 2)}, ValueError, "causal=True means"),
    ((_Q, _K, _V), {"signs": jnp.ones(8)}, ValueError, r"signs must have shape \(16,\)"),
    ((_Q, _K, _V), {"signs": 2 * jnp.ones(16)}, ValueError, "only \\+1 and -1"),
    ((_Q, _K, _V), {"signs": jnp.ones(16), "key": jax.random.PRNGKey(1)}, ValueError,
     "key .* or signs, not both"),
    ((_Q, _K, _V), {"key": 3}, TypeError, "key must be a JAX PRNG key"),
    ((_Q, _K, _V), {"backward": "fp32"}, ValueError,
     r"backward must be one of \('bf16', 'recompute', 'fp8'\), got 'fp32'"),
    ((quantize_fp8(_Q), _K, _V), {}, TypeError, "all arrays or all \\(values, scales\\) pairs"),
    ((quantize_fp8(_Q), quantize_fp8(_K), quantize_fp8(_V, block_size=None)), {}, ValueError,
     "incoherent=False"),
    ((quantize_fp8(_Q), quantize_fp8(_K), quantize_fp8(_V, block_size=4)), {"incoherent": False},
     ValueError, r"v scales must have shape \(1, 1, 1\)"),
    ((quantize_fp8(_Q, block_size=4), quantize_fp8(_K), quantize_fp8(_V, block_size=None)),
     {"incoherent": False}, ValueError, r"q scales must have shape \(1, 2, 1\)"),
    (((_Q, quantize_fp8(_Q)[1]), quantize_fp8(_K), quantize_fp8(_V, block_size=None)),
     {"incoherent": False}, TypeError, "q values must be float8_e4m3fn"),
    ((_Q, _K, _V), {"v_mean": jnp.zeros((1, 1, 16))}, ValueError, "v_mean is for pre-quantized v"),
    ((quantize_fp8(_Q), quantize_fp8(_K), quantize_fp8(_V, block_size=None)),
     {"incoherent": False, "v_mean": jnp.zeros((1, 16))}, ValueError,
     r"v_mean must have shape \(1, 1, 16\)"),
    ((quantize_fp8(_Q), quantize_fp8(_K), quantize_fp8(_V, block_size=None)),
     {"incoherent": False, "v_mean": jnp.zeros((1, 1, 16), jnp.int32)}, TypeError,
     "v_mean must be a floating array"),
    ((quantize_fp8(_Q), quantize_fp8(_K), quantize_fp8(_V, block_size=None)),
     {"incoherent": False, "v_mean": [0.0] * 16}, TypeError, "v_mean must be a JAX or NumPy array"),
])
def test_bad_inputs_raise_clear_errors(args, kwargs, error, message):
  with pytest.raises(error, match=message):
    flash_attention_fp8(*args, **kwargs)


def test_quantize_bad_inputs():
  with pytest.raises(ValueError, match="x must have rank 4"):
    quantize_fp8(jnp.ones((4, 4)))
  with pytest.raises(TypeError, match="x must have a floating dtype"):
    quantize_fp8(jnp.ones((1, 4, 1, 8), jnp.int32))
  with pytest.raises(ValueError, match="block_size must be a positive int"):
    quantize_fp8(jnp.ones((1, 4, 1, 8)), block_size=-1)
  values, scales = quantize_fp8(jnp.ones((1, 4, 1, 8)), block_size=2)
  with pytest.raises(ValueError, match=r"x scales must have shape \(1, 1, 1\)"):
    dequantize_fp8(values, scales, block_size=64)


def test_reports_emulation_path():
  # Off-GPU: the reason is the missing kernels', the call is announced, no fp8 kernel runs.
  # With the kernels: no reason at d = 128 and the compiled program calls the fp8 kernel.
  from jax_fa3 import _ffi  # noqa: PLC0415
  q = jnp.asarray(np.random.default_rng(0).standard_normal((1, 64, 2, 128)), jnp.bfloat16)
  text = compiled_text(lambda q: flash_attention_fp8(q, q, q), q)
  reason = _fp8_forward.kernel_unavailable_reason(128)
  if jax_fa3.kernels_available():
    assert reason is None
    assert_targets(text, FLASH_FWD_FP8)
  else:
    assert reason == jax_fa3.kernels_unavailable_reason() and reason
    assert f"fp8:{reason}" in _ffi._announced
    assert kernel_targets(text) == {}


# Workspace = b·h_k·s_pad·(d if V is transposed by the kernel else 0, + 4 for the per-key k
# scales) + the tail split's slots: 2·min(66, tiles // 3) without a mask and with more than one
# 128-key block, each block_m·(4·bucket + 32) bytes (block_m 192, 128 at d256), then one int
# ticket per split tile (slots / 2), padded to 16 bytes.
@pytest.mark.parametrize("b,s_q,s_k,h,h_k,d,masked,v_transposed,expected", [
    (2, 8192, 8192, 16, 16, 128, False, True,  # 1376 tiles: 66 split tiles' slots
     2 * 16 * 8192 * 4 + 132 * 192 * (4 * 128 + 32) + 272),
    (2, 8192, 8192, 16, 16, 128, True, True, 2 * 16 * 8192 * 4),  # masked: no split
    (1, 700, 777, 42, 21, 64, False, False,  # 168 tiles: a third of them
     21 * 800 * (64 + 4) + 112 * 192 * (4 * 64 + 32) + 224),
    (1, 300, 128, 8, 8, 256, False, False, 8 * 128 * (256 + 4)),  # one K/V block: no split
    (3, 5, 1000, 2, 1, 80, False, False,  # d80 in the 128 bucket, 6 tiles
     3 * 1024 * (80 + 4) + 4 * 192 * (4 * 128 + 32) + 16),
    (1, 1, 1, 1, 1, 256, False, True, 32 * 4)])
def test_kernel_workspace_formula(b, s_q, s_k, h, h_k, d, masked, v_transposed, expected):
  # The size lives in C++ only (flash_fwd_fp8_workspace_bytes, which the handler checks the
  # buffer against and _fp8_forward.kernel_forward asks for); this pins it to the documented formula
  # (docs/CONTRACTS.md) wherever the extension is built, GPU or not.
  from jax_fa3 import _ffi  # noqa: PLC0415
  if _ffi._extension()[0] is None:
    pytest.skip(f"CUDA extension not built: {_ffi._extension()[1]}")
  if _fp8_forward.kernel_bucket(d) is None:
    pytest.skip(f"no fp8 kernel for head dim {d} in this build")
  assert _ffi.flash_fwd_fp8_workspace_bytes(b, s_q, s_k, h, h_k, d, masked,
                                            v_transposed) == expected


def test_gpu_program_lowers_on_cpu(monkeypatch):
  """The program a Hopper GPU would run, lowered here for platform CUDA (jax.export; nothing
  runs): q and k through the fused rotate + quantize pass, v quantized straight into the kernel's
  V layout (b, h_k, d, s_pad), the kernel told so, with a workspace of only the per-key k scales;
  and vmap folds into one such program. The kernels' presence is faked for the trace."""
  from jax_fa3 import _ffi  # noqa: PLC0415
  if _ffi._extension()[0] is None:  # the workspace size comes from the extension
    pytest.skip(f"CUDA extension not built: {_ffi._extension()[1]}")
  monkeypatch.setattr(_ffi, "kernels_available", lambda: True)
  monkeypatch.setattr(_ffi, "has_target", lambda name: True)
  monkeypatch.setattr(_ffi, "ensure_registered", lambda: None)
  monkeypatch.setattr(_ffi, "build_config", lambda: {"head_dims": ("64", "128", "256")})
  checks = [jax.export.DisabledSafetyCheck.custom_call(t)
            for t in (_fp8_quantize.ROTATE_QUANTIZE_TARGET, _fp8_forward.KERNEL_TARGET)]
  q = jnp.ones((2, 300, 4, 128), jnp.bfloat16)
  kv = jnp.ones((2, 300, 2, 128), jnp.bfloat16)

  def lowered(fn, *args):
    return jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)(
        *args).mlir_module()

  text = lowered(lambda q, k, v: flash_attention_fp8(q, k, v, causal=True), q, kv, kv)
  calls = re.findall(r"custom_call @(\w+)\(.*?\{.*?mhlo.backend_config = \{(.*?)\}.*?-> \((.*?)\)",
                     text)
  quantize = [c for c in calls if c[0] == _fp8_quantize.ROTATE_QUANTIZE_TARGET]
  kernel = [c for c in calls if c[0] == _fp8_forward.KERNEL_TARGET]
  assert len(quantize) == 3 and len(kernel) == 1, calls
  assert sum("keys_transposed = true" in c[1] for c in quantize) == 1
  v_layout = next(c for c in quantize if "keys_transposed = true" in c[1])
  assert "tensor<2x2x128x320xf8E4M3FN>" in v_layout[2]  # (b, h_k, d, s_pad)
  # v centred by the pass itself: its mean comes back (b, h_k, d) and goes to the kernel.
  assert "centre = true" in v_layout[1] and "tensor<2x2x128xf32>" in v_layout[2]
  assert sum("centre = true" in c[1] for c in quantize) == 1
  assert "v_transposed = true" in kernel[0][1] and "window_right = 0" in kernel[0][1]
  assert f"tensor<{2 * 2 * 320 * 4}xui8>" in kernel[0][2]  # workspace: k scales per key only

  stack = lambda x: jnp.stack([x, x, x])
  text = lowered(jax.vmap(lambda q, k, v: flash_attention_fp8(q, k, v)), *map(stack, (q, kv, kv)))
  assert text.count(f"@{_fp8_forward.KERNEL_TARGET}(") == 1
  assert "tensor<6x300x4x128xbf16>" in text  # the vmapped axis folded into the batch
