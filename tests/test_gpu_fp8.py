"""The fp8 (e4m3) forward kernel `jax_fa3_flash_fwd_fp8` on Hopper (GPU only).

Every case runs the kernel on pre-quantized inputs and compares it with
1. the pure-JAX emulation of the same numerics (`jax_fa3._fp8_emulation.emulated_forward`, on the host CPU,
   with the kernel's key tile width, so P is quantized at the same running max), and
2. a float64 reference of the unquantized attention (tests/oracle.py).

Tolerances. The kernel and the emulation quantize the same e4m3 inputs and P the same way; they
differ in (a) the fp8 tensor cores' accumulation (Hopper keeps only ~14 bits of the partial sums of
an fp8 wgmma: ~1e-4 relative on S and on Σ P·V), (b) ex2.approx vs XLA's exp2 and the float32
operation order, which flip an e4m3 rounding of P (one e4m3 step = 2^-3 relative) for the rare P
near a rounding boundary, and (c) the shared bf16 output rounding (2^-9 relative). Summed over a
row this is well below 1e-2 of the output's RMS, while the fp8 error itself (emulation vs float64)
is ~5e-2 on N(0, 1) data (tests/test_fp8.py); so:
  - RMS(kernel - emulation) <= 1e-2 · RMS(emulation)   (a wrong key permutation, scale or mask
    gives errors of order 1);
  - RMSE(kernel vs float64) <= 1.1 · RMSE(emulation vs float64) + 1e-3 · RMS(ref): independent
    errors add in quadrature, sqrt(0.05^2 + 0.01^2) = 1.02 · 0.05;
  - LSE vs the emulation: 2e-3 absolute + 1e-3 relative (S error ~1e-4 · |S|, |S| <~ 10 here) on
    all but 1% of the rows, every row within ln(1 + 2^-3) more (the row sum is that of the e4m3
    weights, and (b) moves it by one e4m3 step of a weight: `_assert_lse_close`); +inf exactly
    where the emulation (and the reference) has an empty row.
All kernel outputs are NaN-poisoned before the kernel runs (JAX_FA3_DEBUG_POISON_OUTPUTS=1), so an
unwritten element fails the finiteness checks.
"""
import dataclasses
import functools
import os

os.environ["JAX_FA3_DEBUG_POISON_OUTPUTS"] = "1"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from jax_fa3 import _fp8_emulation, _fp8_forward, _fp8_quantize, fp8  # noqa: E402
from jax_fa3._config import AttentionConfig, Fp8Config  # noqa: E402
from ffi_probe import ffi_error_message  # noqa: E402
from kernel_targets import (FLASH_FWD_FP8, ROTATE_QUANTIZE_FP8, assert_targets,  # noqa: E402
                            compiled_text, kernel_targets, run_on_kernels)
from oracle import attention_oracle  # noqa: E402

pytestmark = pytest.mark.gpu

# Key tile of the kernel per head-dim bucket (cuda/flash_fwd/fp8/flash_fwd_fp8.h kFp8BlockN): the
# emulation quantizes P against the running max of the same tiles.
KERNEL_BLOCK_N = {64: 128, 128: 128, 256: 128}


def _bucket(d):
  return next(b for b in (64, 128, 256) if d <= b)


def _cpu():
  return jax.devices("cpu")[0]


def _case(seed, b, s_q, s_k, h, h_k, d, block_size, v_mean=0.0):
  """Float inputs (host numpy) and the seven inputs of fp8_forward (on the default device), v
  centred by its mean over the keys as the call from floats does; v ~ N(v_mean, 1)."""
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((b, s_q, h, d)).astype(np.float32)
  k = rng.standard_normal((b, s_k, h_k, d)).astype(np.float32)
  v = (v_mean + rng.standard_normal((b, s_k, h_k, d))).astype(np.float32)
  q8, q_scale = fp8.quantize_fp8(jnp.asarray(q), block_size=block_size)
  k8, k_scale = fp8.quantize_fp8(jnp.asarray(k), block_size=block_size)
  mean = _fp8_quantize.mean_over_keys(jnp.asarray(v))
  v8, v_scale = fp8.quantize_fp8(jnp.asarray(v) - mean[:, None], block_size=None)
  return (q, k, v), (q8, k8, v8, q_scale, k_scale, v_scale[..., 0], mean)


def _config(d, causal, window, block_size):
  left, right = window
  if causal:
    right = 0
  att = AttentionConfig(softmax_scale=d**-0.5, window_left=left, window_right=right)
  return Fp8Config(att, block_size=block_size, incoherent=False, return_lse=False,
                       tile_k=KERNEL_BLOCK_N[_bucket(d)])


@functools.partial(jax.jit, static_argnums=(6,))
def _emulate(q8, k8, v8, q_scale, k_scale, v_scale, cfg, v_mean=None):
  return _fp8_emulation.emulated_forward(q8, k8, v8, q_scale, k_scale, v_scale, cfg, v_mean=v_mean)


def _rms(x):
  return float(np.sqrt(np.mean(np.square(x, dtype=np.float64))))


# The kernel's LSE against the emulation's: both are the running max + ln of the row sum of the
# e4m3-rounded weights e4m3(2^6 P) (_fp8_emulation.py). The kernel's exp2 (MUFU) and FFMA order
# put P a few float32 ulps (~1e-6 relative) from the emulation's exact exp2, so the two round a
# weight to different e4m3 values only when it lies that close to a rounding midpoint (about 2e-5
# of the weights, e4m3's steps being 2^-3 relative); such a flip moves the row sum by one e4m3
# step of that weight, at most 2^-3 of it, so the LSE by at most ln(1 + 2^-3), and only a row
# that the weight dominates (short rows, peaked scores) by that much. Every other row agrees to
# float32 rounding of the sums. Measured (H200, 2026-12-03, the seqlen cases below at
# d = 64, 128, 256): 25 of 276,408 rows beyond the tight tolerance, at most 7 of 8000 (and 1 of
# 504) in one case, by at most 0.015.
LSE_ATOL, LSE_RTOL = 2e-3, 1e-3
LSE_FLIP_BOUND = float(np.log1p(2.0**-3))


def _assert_lse_close(lse, emu_lse, max_flipped_fraction=0.01):
  lse, emu_lse = np.asarray(lse, np.float64), np.asarray(emu_lse, np.float64)
  off = np.abs(lse - emu_lse) - (LSE_ATOL + LSE_RTOL * np.abs(emu_lse))
  assert np.all(off <= LSE_FLIP_BOUND), float(np.max(off))  # beyond one e4m3 step of any weight
  flipped = int(np.count_nonzero(off > 0))
  assert flipped <= max(1, int(max_flipped_fraction * off.size)), (flipped, off.size)


def _check(seed, b, s_q, s_k, h, h_k, d, *, causal=False, window=(-1, -1), block_size=64,
           v_transposed=False, v_mean=0.0):
  """v_transposed: hand the kernel V already in its layout (what the user's call from floats
  does, there written by the quantization pass; here laid out by XLA) instead of running its
  pre-pass. v_mean: see _case."""
  floats, quantized = _case(seed, b, s_q, s_k, h, h_k, d, block_size, v_mean)
  cfg = _config(d, causal, window, block_size)
  if v_transposed:
    kernel = _fp8_forward.kernel_forward(cfg, v_transposed=True)
    fn = jax.jit(lambda q8, k8, v8, *rest: kernel(q8, k8, _fp8_quantize.kernel_v_layout(v8), *rest))
  else:
    fn = jax.jit(lambda *a: _fp8_forward.fp8_forward(*a[:6], cfg, v_mean=a[6]))
  out, lse = run_on_kernels(fn, *quantized, expected=FLASH_FWD_FP8)
  out2, lse2 = fn(*quantized)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(out2))  # deterministic
  np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse2))
  assert out.dtype == jnp.bfloat16 and out.shape == (b, s_q, h, d)
  assert lse.dtype == jnp.float32 and lse.shape == (b, h, s_q)

  with jax.default_device(_cpu()):
    on_cpu = [jax.device_put(x, _cpu()) for x in quantized]
    emu_out, emu_lse = _emulate(*on_cpu[:6], cfg, on_cpu[6])
  emu_out = np.asarray(emu_out, np.float64)
  emu_lse = np.asarray(emu_lse, np.float64)
  ref, ref_lse = attention_oracle(*floats, softmax_scale=cfg.attention.softmax_scale,
                                  window_left=cfg.attention.window_left,
                                  window_right=cfg.attention.window_right)
  out = np.asarray(out, np.float64)
  lse = np.asarray(lse, np.float64)
  assert np.all(np.isfinite(out)), "non-finite output (unwritten or NaN)"

  # Rows with no visible key: output 0, lse +inf (the emulation and the reference agree).
  empty = np.isposinf(emu_lse)
  np.testing.assert_array_equal(np.isposinf(lse), empty)
  np.testing.assert_array_equal(np.isposinf(ref_lse), empty)
  empty_rows = np.swapaxes(empty, 1, 2)  # (b, s_q, h)
  assert np.all(out[empty_rows] == 0)

  scale = max(_rms(ref), 1e-30)
  diff = _rms(out - emu_out)
  assert diff <= 1e-2 * max(_rms(emu_out), 1e-30), (diff, _rms(emu_out))
  kernel_err, emu_err = _rms(out - ref), _rms(emu_out - ref)
  assert kernel_err <= 1.1 * emu_err + 1e-3 * scale, (kernel_err, emu_err)
  finite = ~empty
  _assert_lse_close(lse[finite], emu_lse[finite])
  return kernel_err / scale


SEQLENS = [(1, 1), (63, 63), (65, 65), (1000, 1000), (4097, 4097), (128, 1000), (1000, 128),
           (1, 4097), (65, 4097)]


@pytest.mark.parametrize("s_q,s_k", SEQLENS)
@pytest.mark.parametrize("causal", [False, True])
def test_fp8_seqlens(s_q, s_k, causal):
  _check(s_q * 7 + s_k, 2, s_q, s_k, 4, 2, 128, causal=causal)


# d128 has two kernels (flash_fwd_fp8.h, fp8_block_m): 192-row tiles without a mask and for
# causal calls from 8192 query rows, 128-row tiles otherwise; the cases above run short causal
# calls on the 128-row one, these the 192-row one with its causal mask (ragged and bottom-right
# aligned in the second).
@pytest.mark.parametrize("s_q,s_k", [(8192, 8192), (8200, 9001)])
def test_fp8_long_causal(s_q, s_k):
  _check(s_q + s_k, 1, s_q, s_k, 2, 1, 128, causal=True)


@pytest.mark.parametrize("d", [64, 128, 256, 32, 80, 192])
@pytest.mark.parametrize("causal", [False, True])
def test_fp8_head_dims(d, causal):
  # 32 runs in the d64 kernel, 80 in d128, 192 in d256 (zero-filled padding columns).
  rel = _check(d + causal, 2, 333, 517, 4, 2, d, causal=causal)
  assert 0.02 < rel < 0.08, rel  # the fp8 error is really there and nothing else is lost


@pytest.mark.parametrize("window", [(64, 0), (100, 30), (-1, 17), (0, 0), (5, 5)])
def test_fp8_windows(window):
  _check(3, 1, 700, 900, 8, 2, 128, window=window)


@pytest.mark.parametrize("h,h_k", [(8, 1), (8, 2), (6, 6), (6, 3)])
@pytest.mark.parametrize("d", [64, 256])
def test_fp8_gqa(h, h_k, d):
  _check(h * 10 + h_k, 3, 257, 300, h, h_k, d, causal=True)


@pytest.mark.parametrize("block_size", [32, 128, 1, 100, 5000])
@pytest.mark.parametrize("causal", [False, True])
def test_fp8_block_sizes(block_size, causal):
  # 1: a scale per token; 100: blocks that straddle key tiles; 5000: one block for everything.
  _check(block_size, 2, 1000, 777, 4, 4, 128, causal=causal, block_size=block_size)


@pytest.mark.parametrize("b,h,s,causal", [(1, 1, 2048, False), (48, 16, 256, True),
                                          (24, 16, 300, False)])
def test_fp8_grid_sizes(b, h, s, causal):
  # One tile (most SMs idle) and far more tiles than SMs (persistent scheduling wraps around):
  # causal on d128's 128-row kernel, non-causal on its 192-row one, which at s_k <= 4096 also
  # releases Q's buffer early (flash_fwd_fp8.h, fp8_early_q_release).
  _check(b + h + s, b, s, s, h, h, 128, causal=causal)


def _tail_split_heads(block_m, s_q):
  """Heads (batch 1) that leave the persistent grid's last round about a quarter of the SMs' worth
  of tiles, so that the kernel splits each of them over two CTAs (cuda/flash_fwd/tail_split.h)."""
  sms = getattr(jax.devices()[0], "core_count", None)
  if not sms:
    pytest.skip("the device does not report its SM count (core_count)")
  m_blocks = -(-s_q // block_m)
  h = 2 * -(-(sms + sms // 4) // (2 * m_blocks))  # even, for GQA
  last_round = m_blocks * h % sms
  assert m_blocks * h > sms and 0 < last_round <= sms // 2, (sms, m_blocks, h)
  return h


@pytest.mark.parametrize("d,s_k,block_size,h_k_div,v_transposed", [
    (128, 1000, 64, 1, False), (64, 777, 100, 2, False), (256, 700, 64, 1, True),
    (128, 2000, 32, 2, True)])
def test_fp8_tail_split(d, s_k, block_size, h_k_div, v_transposed):
  """The last round's tiles run as two pieces on two CTAs each, the low piece after a row-max
  pass over the high piece's blocks, and the CTA that finishes second merges them (its ticket
  cleared by the pre-kernel in a workspace the poison hook fills with 0xFF): P is quantized as
  in the whole tile, so the output matches the emulation as closely as unsplit tiles do. Ragged
  keys (the max pass masks the tail), GQA, grouped and per-key k scales (block_size 100), both V
  routes, every bucket; _check runs each call twice and requires equal bits."""
  s_q = 700
  h = _tail_split_heads(128 if d == 256 else 192, s_q)
  _check(d + s_k, 1, s_q, s_k, h, h // h_k_div, d, block_size=block_size,
         v_transposed=v_transposed)


@pytest.mark.parametrize("s_q,s_k,h,h_k,d,causal", [
    (1, 1, 4, 2, 128, False), (65, 4097, 4, 2, 128, True), (1000, 1000, 4, 2, 128, False),
    (1000, 128, 8, 2, 64, True), (333, 517, 4, 2, 96, False), (257, 300, 8, 1, 256, True),
    (4097, 4097, 2, 2, 128, False), (300, 300, 6, 3, 192, False)])
def test_fp8_v_given_transposed(s_q, s_k, h, h_k, d, causal):
  """The kernel without its V pre-pass (v_transposed): ragged key counts (zero padding keys),
  GQA, every bucket, both d128 kernels."""
  _check(s_q + s_k + d, 2, s_q, s_k, h, h_k, d, causal=causal, v_transposed=True)


@pytest.mark.parametrize("d,s", [(128, 300), (64, 1000), (256, 129), (96, 77)])
def test_fp8_from_floats_v_layout_from_quantize_equals_prepass(d, s):
  """The user's call from floats quantizes v straight into the kernel's layout (no pre-pass),
  the pass taking v's mean itself; its output must equal, bit for bit, that of the kernel fed v
  less the same mean quantized as is and transposed by its pre-pass (same e4m3 values, same
  kernel)."""
  rng = np.random.default_rng(d + s)
  q, k, v = (jnp.asarray(rng.standard_normal((2, s, 4, d)), jnp.bfloat16) for _ in range(3))
  signs = jax.random.rademacher(jax.random.PRNGKey(0), (d,), dtype=jnp.float32)
  att = AttentionConfig(softmax_scale=d**-0.5, window_left=-1, window_right=0)
  cfg = Fp8Config(att, block_size=64, incoherent=True, return_lse=True)
  assert _fp8_forward.v_transposed_by_quantize(v, cfg)
  hlo = jax.jit(lambda *a: fp8._fp8_from_float(*a, cfg)).lower(q, k, v, signs).as_text()
  assert "keys_transposed = true" in hlo and "v_transposed = true" in hlo, hlo[-2000:]
  assert_targets(hlo, {FLASH_FWD_FP8, ROTATE_QUANTIZE_FP8})
  out, lse = fp8._fp8_from_float(q, k, v, signs, cfg)
  prepass = dataclasses.replace(cfg, transpose_v_in_quantize=False)
  assert not _fp8_forward.v_transposed_by_quantize(v, prepass)
  _, _, v_mean = jax.jit(_fp8_quantize.centre_v_kernel_layout)(v)
  q8, q_scale = _fp8_quantize.rotate_quantize(q, signs, True, 64)
  k8, k_scale = _fp8_quantize.rotate_quantize(k, signs, True, 64)
  v8, v_scale = _fp8_quantize.rotate_quantize(v, signs, False, None, v_mean)
  out2, lse2 = _fp8_forward.fp8_forward(q8, k8, v8, q_scale, k_scale, v_scale[..., 0], prepass,
                               v_mean=v_mean)
  assert np.all(np.isfinite(np.asarray(out, np.float32)))
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(out2, np.float32))
  np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse2))


def test_fp8_scales_are_applied_per_row_and_column():
  # Blocks whose scales differ by orders of magnitude: a kernel that used one scale per head (or
  # indexed the wrong block) would be far off the emulation.
  rng = np.random.default_rng(7)
  b, s, h, d, bs = 1, 512, 2, 128, 64
  # Scales spread over e^±2 per block (two orders of magnitude) while the scores stay O(10), so
  # the fp8 accumulator's ~1e-4 relative error keeps the kernel within 1e-2 of the emulation.
  growth = np.exp(rng.uniform(-2, 2, (1, s // bs, 1, 1))).repeat(bs, axis=1)
  q = (rng.standard_normal((b, s, h, d)) * growth).astype(np.float32)
  k = (rng.standard_normal((b, s, h, d)) * growth[:, ::-1]).astype(np.float32) * 0.3
  v = rng.standard_normal((b, s, h, d)).astype(np.float32) * 30.0
  q8, q_scale = fp8.quantize_fp8(jnp.asarray(q), block_size=bs)
  k8, k_scale = fp8.quantize_fp8(jnp.asarray(k), block_size=bs)
  v8, v_scale = fp8.quantize_fp8(jnp.asarray(v), block_size=None)
  quantized = (q8, k8, v8, q_scale, k_scale, v_scale[..., 0])
  cfg = _config(d, False, (-1, -1), bs)
  out, lse = run_on_kernels(lambda *a: _fp8_forward.fp8_forward(*a, cfg), *quantized,
                            expected=FLASH_FWD_FP8)
  with jax.default_device(_cpu()):
    emu_out, emu_lse = _emulate(*[jax.device_put(x, _cpu()) for x in quantized], cfg)
  out, emu_out = np.asarray(out, np.float64), np.asarray(emu_out, np.float64)
  assert _rms(out - emu_out) <= 1e-2 * _rms(emu_out)
  _assert_lse_close(lse, emu_lse)


@pytest.mark.parametrize("d,s,causal", [(128, 4096, False), (64, 8192, False),
                                         (256, 2048, True), (128, 8192, True)])
def test_fp8_v_with_a_mean_keeps_its_accuracy(d, s, causal):
  """The fp8 wgmma adds each P·V product into its fp32 accumulator with ~13 mantissa bits: with V
  ~ N(2, 1) uncentred, O came out 7% low at 4k keys and 15% at 8k (H200, 2026-12-03).
  Centred (_fp8_emulation.py), V's terms cancel as zero-mean V's do, and the kernel stays within
  _check's bounds of the emulation and the float64 reference, the mean added back in the
  epilogue (and in the tail split's merge: the non-causal cases split their last round)."""
  rel = _check(21 + d, 1, s, s, 4, 4, d, causal=causal, v_mean=2.0)
  assert rel < 0.03, rel  # relative to |O| ~ 2: the fp8 error of the centred part only


def test_fp8_constant_v_comes_back_exactly():
  """V constant per (head, dim): centred it quantizes to zeros and O is its mean, exactly (an
  uncentred kernel would give v · Σ e4m3(P) / Σ P, off by the P rounding and the accumulator)."""
  rng = np.random.default_rng(5)
  b, s, h, d = 1, 3000, 4, 128
  q, k = (jnp.asarray(rng.standard_normal((b, s, h, d)), jnp.bfloat16) for _ in range(2))
  level = rng.uniform(-3.0, 3.0, (1, 1, h, d))
  v = jnp.asarray(np.broadcast_to(level, (b, s, h, d)), jnp.bfloat16)
  fn = jax.jit(lambda q, k, v: fp8.flash_attention_fp8(q, k, v, causal=True))
  out = np.asarray(run_on_kernels(fn, q, k, v, expected=FLASH_FWD_FP8), np.float32)
  want = np.broadcast_to(np.asarray(v[:, :1], np.float32), out.shape)
  np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_fp8_lazy_max_follows_the_emulation(d, monkeypatch):
  # Keys whose scores grow tile by tile (the kernel visits the last tile first), so that rows'
  # maxima jump by amounts on both sides of the lazy margin (_fp8_emulation.LAZY_MAX_MARGIN_LOG2): the
  # kernel must keep or move each row's max exactly as the emulation does. P is quantized
  # relative to that max, so an emulation with the exact running max is several times farther
  # from the kernel (CPU model, tests/test_fp8.py: ~9e-3 relative) than the lazy one.
  rng = np.random.default_rng(11)
  tile = KERNEL_BLOCK_N[_bucket(d)]
  b, s, h = 1, 3 * tile + 44, 4
  growth = np.repeat(np.array([2.2, 1.6, 1.0, 1.0]), [tile, tile, tile, 44])[None, :, None, None]
  q = rng.standard_normal((b, s, h, d)).astype(np.float32)
  k = (rng.standard_normal((b, s, h, d)) * growth).astype(np.float32)
  v = rng.standard_normal((b, s, h, d)).astype(np.float32)
  q8, q_scale = fp8.quantize_fp8(jnp.asarray(q), block_size=64)
  k8, k_scale = fp8.quantize_fp8(jnp.asarray(k), block_size=64)
  v8, v_scale = fp8.quantize_fp8(jnp.asarray(v), block_size=None)
  quantized = (q8, k8, v8, q_scale, k_scale, v_scale[..., 0])
  cfg = _config(d, False, (-1, -1), 64)
  out = run_on_kernels(lambda *a: _fp8_forward.fp8_forward(*a, cfg), *quantized, expected=FLASH_FWD_FP8)
  out = np.asarray(out[0], np.float64)
  on_cpu = [jax.device_put(x, _cpu()) for x in quantized]
  with jax.default_device(_cpu()):
    lazy = np.asarray(_fp8_emulation.emulated_forward(*on_cpu, cfg)[0], np.float64)
    monkeypatch.setattr(_fp8_emulation, "LAZY_MAX_MARGIN_LOG2", 0.0)  # not jitted: traced afresh
    exact = np.asarray(_fp8_emulation.emulated_forward(*on_cpu, cfg)[0], np.float64)
  to_lazy, to_exact = _rms(out - lazy), _rms(out - exact)
  assert to_lazy <= 1e-2 * _rms(lazy), (to_lazy, _rms(lazy))
  assert to_lazy < 0.5 * to_exact, (to_lazy, to_exact)


def test_fp8_public_api_uses_the_kernel():
  rng = np.random.default_rng(1)
  q, k, v = (jnp.asarray(rng.standard_normal((2, 300, 4, 128)), jnp.bfloat16) for _ in range(3))
  fn = jax.jit(lambda q, k, v: fp8.flash_attention_fp8(q, k, v, causal=True))
  # From floats: q and k through the fused rotate + quantize pass, then the fp8 kernel.
  out = run_on_kernels(fn, q, k, v, expected={FLASH_FWD_FP8, ROTATE_QUANTIZE_FP8})
  ref, _ = attention_oracle(*(np.asarray(x, np.float64) for x in (q, k, v)), softmax_scale=128**-0.5,
                            window_right=0)
  rel = _rms(np.asarray(out, np.float64) - ref) / _rms(ref)
  assert rel < 0.08, rel


@pytest.mark.parametrize("backward", ["bf16", "recompute"])
@pytest.mark.parametrize("d,h_k,causal", [(64, 4, False), (128, 2, True), (128, 4, False),
                                          (256, 1, True)])
def test_fp8_gradients_on_kernels(backward, d, h_k, causal):
  """jax.grad of the call from floats: the fp8 forward then the bf16 backward kernel, with no bf16
  forward for backward="bf16" (it starts from the fp8 call's out and lse) and one for
  "recompute". Gradients against flash_attention's on the same kernels: "recompute" computes the
  same function (only dQ's atomic accumulation order differs: bf16 rounding, 1e-2); "bf16" is the
  gradient of the fp8 function, at the quantized q and k (3.8-4.6% from exact on the CPU
  emulation; 8e-2 as there)."""
  from jax_fa3 import attention  # noqa: PLC0415
  from kernel_targets import FLASH_BWD, FLASH_FWD  # noqa: PLC0415
  rng = np.random.default_rng(d + h_k)
  q = jnp.asarray(rng.standard_normal((2, 333, 4, d)), jnp.bfloat16)
  k, v = (jnp.asarray(rng.standard_normal((2, 333, h_k, d)), jnp.bfloat16) for _ in range(2))
  w = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)

  def grads(attn):
    # The loss and its gradients, as a training step returns them: without the loss among the
    # outputs, "recompute" needs no fp8 forward (its residuals are q, k, v) and XLA drops it.
    loss = lambda q, k, v: jnp.sum(attn(q, k, v).astype(jnp.float32) * w)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))

  fp8_grads = grads(lambda q, k, v: fp8.flash_attention_fp8(q, k, v, causal=causal,
                                                             backward=backward))
  text = compiled_text(fp8_grads, q, k, v)
  assert_targets(text, {FLASH_FWD_FP8, ROTATE_QUANTIZE_FP8, FLASH_BWD})
  assert kernel_targets(text)[FLASH_FWD] == (0 if backward == "bf16" else 1), text[-3000:]
  _, got = fp8_grads(q, k, v)
  _, want = grads(functools.partial(attention.flash_attention, causal=causal))(q, k, v)
  bound = 8e-2 if backward == "bf16" else 1e-2
  for name, g, g_ref in zip("qkv", got, want):
    g, g_ref = np.asarray(g, np.float64), np.asarray(g_ref, np.float64)
    assert np.all(np.isfinite(g)), name
    rel = np.linalg.norm(g - g_ref) / np.linalg.norm(g_ref)
    assert rel < bound, (name, rel)


def test_fp8_head_dim_without_kernel_falls_back_to_emulation():
  # d = 24 is not a multiple of 16 (fp8 TMA rows): Python routes it to the emulation.
  floats, quantized = _case(0, 1, 100, 100, 2, 2, 24, 64)
  cfg = _config(24, True, (-1, -1), 64)
  fn = jax.jit(lambda *a: _fp8_forward.fp8_forward(*a[:6], cfg, v_mean=a[6]))
  assert FLASH_FWD_FP8 not in kernel_targets(compiled_text(fn, *quantized))
  out, lse = fn(*quantized)
  with jax.default_device(_cpu()):
    emu_out, emu_lse = _emulate(*[jax.device_put(x, _cpu()) for x in quantized[:6]], cfg,
                                jax.device_put(quantized[6], _cpu()))
  # The same emulation compiled for the GPU and the CPU: float32 operation order and exp's last
  # bits differ, which can flip an e4m3 rounding of P, so the kernel-vs-emulation bounds apply.
  out, emu_out = np.asarray(out, np.float64), np.asarray(emu_out, np.float64)
  assert _rms(out - emu_out) <= 1e-2 * _rms(emu_out), (_rms(out - emu_out), _rms(emu_out))
  finite = ~np.isposinf(np.asarray(emu_lse))
  np.testing.assert_array_equal(np.isposinf(np.asarray(lse)), ~finite)
  _assert_lse_close(np.asarray(lse)[finite], np.asarray(emu_lse)[finite])


_FFI_CALL = """
    def f8(shape):
      return jnp.ones(shape, jnp.float8_e4m3fn)
    def call(q, k, v, qs, ks, vs, out_shape=None, ws=None, block_size=64, d_out=None,
             v_transposed=False, v_mean_shape=None):
      b, s_q, h, d = q.shape
      ws = ws if ws is not None else 1 << 20
      vm = jnp.zeros(v_mean_shape or (k.shape[0], k.shape[2], k.shape[3]), jnp.float32)
      res = (jax.ShapeDtypeStruct(out_shape or q.shape, jnp.bfloat16),
             jax.ShapeDtypeStruct((b, h, s_q), jnp.float32),
             jax.ShapeDtypeStruct((ws,), jnp.uint8))
      return lambda: jax.ffi.ffi_call("jax_fa3_flash_fwd_fp8", res)(
          q, k, v, qs, ks, vs, vm, softmax_scale=np.float32(0.125), window_left=np.int32(-1),
          window_right=np.int32(-1), block_size=np.int32(block_size),
          v_transposed=np.bool_(v_transposed))
    ones = lambda *s: jnp.ones(s, jnp.float32)
"""


@pytest.mark.parametrize("body,expected", [
    ("result = call(f8((1, 8, 4, 64)), f8((1, 8, 3, 64)), f8((1, 8, 3, 64)), ones(1, 4, 1), "
     "ones(1, 3, 1), ones(1, 3))", "heads"),
    ("result = call(jnp.ones((1, 8, 4, 64), jnp.bfloat16), f8((1, 8, 4, 64)), f8((1, 8, 4, 64)), "
     "ones(1, 4, 1), ones(1, 4, 1), ones(1, 4))", "q must be float8_e4m3fn"),
    ("result = call(f8((1, 8, 4, 64)), f8((1, 8, 4, 64)), f8((1, 8, 4, 64)), ones(1, 4, 2), "
     "ones(1, 4, 1), ones(1, 4))", "q_scale must have shape"),
    ("result = call(f8((1, 8, 4, 64)), f8((1, 8, 4, 64)), f8((1, 8, 4, 64)), ones(1, 4, 1), "
     "ones(1, 4, 1), ones(1, 4, 1))", "v_scale must have shape"),
    ("result = call(f8((1, 8, 4, 64)), f8((1, 8, 4, 64)), f8((1, 8, 4, 64)), ones(1, 4, 8), "
     "ones(1, 4, 8), ones(1, 4), block_size=0)", "block_size"),
    ("result = call(f8((1, 8, 4, 64)), f8((1, 8, 4, 64)), f8((1, 8, 4, 64)), ones(1, 4, 1), "
     "ones(1, 4, 1), ones(1, 4), ws=16)", "workspace"),
    ("result = call(f8((1, 8, 4, 24)), f8((1, 8, 4, 24)), f8((1, 8, 4, 24)), ones(1, 4, 1), "
     "ones(1, 4, 1), ones(1, 4))", "no fp8 kernel for head dim 24"),
    ("result = call(f8((1, 8, 4, 64)), f8((1, 8, 4, 64)), f8((1, 8, 4, 64)), ones(1, 4, 1), "
     "ones(1, 4, 1), ones(1, 4), out_shape=(1, 8, 4, 32))", "out must have q's shape"),
    ("result = call(f8((1, 8, 4, 64)), f8((1, 8, 4, 64)), f8((1, 8, 4, 64)), ones(1, 4, 1), "
     "ones(1, 4, 1), ones(1, 4), v_transposed=True)",
     "v_transposed: v must be (b, h_k, d, s_k rounded up to 32) = (1, 4, 64, 32)"),
    ("result = call(f8((1, 8, 4, 64)), f8((1, 8, 4, 64)), f8((1, 8, 4, 64)), ones(1, 4, 1), "
     "ones(1, 4, 1), ones(1, 4), v_mean_shape=(1, 4))", "v_mean must have shape (b, h_k, d) = "
     "(1, 4, 64)"),
])
def test_fp8_ffi_handler_rejects_bad_calls(body, expected):
  message = ffi_error_message(_FFI_CALL + "\n    " + body + "\n")
  assert expected in message, message
