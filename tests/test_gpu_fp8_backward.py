"""The fp8 (e4m3) backward kernel `jax_fa3_flash_bwd_fp8` on Hopper (GPU only).

Every case starts from the fp8 forward kernel's own residuals (out, lse, the e4m3 rotated q8 and
k8 and their scales per token, `fp8.FP8_FORWARD_QUANTIZED`), runs the backward kernel (the
compiled program must call it: tests/kernel_targets.py) and compares its dq, dk, dv (float32, in
the rotated basis) with
1. the pure-JAX emulation that defines the numerics (`jax_fa3._fp8_backward_emulation`), run on
   the host CPU on the same residuals, and, end to end through `jax.grad`,
2. the float64 gradients of exact attention (tests/oracle.py).

Tolerance against the emulation (argued from the emulation's docstring; to be replaced by the
measured margins once the H200 has run it). The two compute the same roundings of the same
operands and differ only where the hardware does: (a) the fp8 wgmma keeps ~13-14 mantissa bits
of its partial sums (the fp8 forward's tests: ~1e-4 relative on S), so the exp2 argument of P'
moves by ~1e-3 absolute (|S * scale * log2 e| <~ 10 here) and P' by ~7e-4 relative; (b) ex2.approx
and the FFMA order move it by ~1e-6 more, MUFU.RCP the dK operand's 2^6 / M by 2 ulp. dq sees
this directly, plus the 16-bit rounding of dS' flipping now and then: ~1e-3 relative. dv and dk
sum e4m3 roundings of P' and y: a perturbation of 7e-4 relative flips an element's rounding
with probability ~7e-4 / 2^-3.5 ~ 1%, by one e4m3 step (~9% of it), so the RMS of the sums moves
by ~sqrt(0.01) * 0.09 ~ 1e-2 of their RMS at most (the fp8 error itself, kernel or emulation vs
exact, is ~5e-2). Hence RMS(kernel - emulation) <= 1e-2 RMS(emulation) for dq and 2e-2 for dk,
dv; a wrong permutation, scale or mask is off by O(1).
That bound is relative to the emulation's own dq and dk, which fails where dS = P (dP - D) is
only the float32 rounding of the cancellation: with one key (s_k = 1) P = 1 and out = v exactly
(v centred by its own mean, v8 = 0), so dP = D = dO.v and the exact dq and dk are 0; the
emulation's (~1e-8) and the kernel's are the rounding noise of two different summation orders
(on the H100 the kernel's dq was 2-3x the emulation's RMS away from it, as NumPy's orders and a
truncating tensor-core model are on the CPU). Hence a floor, `_cancellation_floors`: the RMS
noise of dP - D (~2 sqrt(d) 2^-23 of the sum of |products|) carried into dq and dk, added in
quadrature (independent sources). It moves the bound by <= 1.1% where dS is not degenerate
(window (0, 0) at d = 128; < 0.05% typically) and stays below 1e-4 absolute with one key, where
a key past s_k leaking into dQ would add O(0.1).
Against float64, the gradient of the fp8 function is dominated by the forward's fp8 error; the
kernel's extra ~1e-2 adds in quadrature to the emulation's ~5e-2 (a factor 1.02).
All kernel outputs are NaN-poisoned before the kernel runs (JAX_FA3_DEBUG_POISON_OUTPUTS=1), so an
unwritten element fails the finiteness checks.
"""
import functools
import os

os.environ["JAX_FA3_DEBUG_POISON_OUTPUTS"] = "1"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from jax_fa3 import _fp8_backward, fp8  # noqa: E402
from jax_fa3._config import AttentionConfig, Fp8Config  # noqa: E402
from ffi_probe import ffi_error_message  # noqa: E402
from kernel_targets import (FLASH_BWD, FLASH_BWD_FP8, FLASH_FWD_FP8,  # noqa: E402
                            compile_on_kernels, compiled_text, kernel_targets, run_on_kernels)
from oracle import attention_oracle_grads, visibility_mask  # noqa: E402
from outlier_inputs import outlier_qkv_dout  # noqa: E402

pytestmark = pytest.mark.gpu

DQ_TOL, DKV_TOL = 1e-2, 2e-2  # RMS(kernel - emulation) / RMS(emulation): module docstring


def _cpu():
  return jax.devices("cpu")[0]


def _rms(x):
  return float(np.sqrt(np.mean(np.square(np.asarray(x, np.float64)))))


def _rel(got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def _floats(seed, b, s_q, s_k, h, h_k, d, dtype=jnp.bfloat16):
  rng = np.random.default_rng(seed)
  make = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)
  return make(b, s_q, h, d), make(b, s_k, h_k, d), make(b, s_k, h_k, d), make(b, s_q, h, d)


def _config(d, causal=False, window=(-1, -1), deterministic=False, incoherent=True):
  left, right = window
  if causal:
    right = 0
  att = AttentionConfig(softmax_scale=d**-0.5, window_left=left, window_right=right,
                        deterministic=deterministic)
  return Fp8Config(att, block_size=64, incoherent=incoherent)


def _residuals(q, k, v, cfg):
  """What the backward starts from: the fp8 forward kernel's out (in q's dtype), lse, q8, q's
  scales per token, k8, k's scales per token."""
  signs = jax.random.rademacher(jax.random.PRNGKey(q.shape[-1]), (q.shape[-1],),
                                dtype=jnp.float32)
  fn = jax.jit(lambda *a: fp8._fp8_from_float(*a, cfg, fp8.FP8_FORWARD_QUANTIZED))
  return run_on_kernels(fn, q, k, v, signs, expected=FLASH_FWD_FP8)


def _kernel_fn(cfg):
  return jax.jit(lambda q8, k8, v, out, lse, dout, q_rows, k_rows: _fp8_backward.fp8_backward(
      q8, k8, v, out, lse, dout, q_rows, k_rows, cfg))


def _kernel(residuals, v, dout, cfg):
  out, lse, q8, q_rows, k8, k_rows = residuals
  args = (q8, k8, v, out, lse, dout, q_rows, k_rows)
  return run_on_kernels(_kernel_fn(cfg), *args, expected=FLASH_BWD_FP8), args


def _emulated(args, cfg, dlse=None):
  on_cpu = [jax.device_put(x, _cpu()) for x in args]
  with jax.default_device(_cpu()):
    dlse = None if dlse is None else jax.device_put(dlse, _cpu())
    emulate = jax.jit(functools.partial(_fp8_backward._emulate, cfg=cfg))
    return emulate(*on_cpu, dlse)


def _cancellation_floors(args, cfg):
  """The RMS noise of dq and dk that the float32 rounding of dP - D leaves (module docstring):
  scale * sum_j P_ij * delta_ij * |k~_j| and scale * sum_i P_ij * delta_ij * |q_i|, float64, with
  delta_ij = 2 sqrt(d) 2^-23 (|dO_i|.|v_j| + |dO_i|.|out_i|): each of the two dot products takes
  at most d roundings (truncations on the tensor cores: at most 2^-23 of a partial sum, d / 8 of
  them at most, one per k-group) of partial sums no larger than the sum of |products|, random in
  sign on the CPU (sqrt(d) 2^-24), biased on the GPU (d / 8 2^-23 <= sqrt(d) 2^-23 for d <= 64,
  1.4x that at 128); the factor 2 covers the kernel's and the emulation's together."""
  q8, k8, v, out, lse, dout, q_rows, k_rows = (np.asarray(x, np.float64) for x in args)
  b, s_q, h, d = q8.shape
  s_k, h_k = k8.shape[1], k8.shape[2]
  g = h // h_k
  q = q8 * np.swapaxes(q_rows, 1, 2)[..., None]  # dequantized, rotated (b, s_q, h, d)
  k = np.repeat(k8 * np.swapaxes(k_rows, 1, 2)[..., None], g, axis=2)  # (b, s_k, h, d)
  scale = cfg.attention.softmax_scale
  visible = visibility_mask(s_q, s_k, cfg.window_left, cfg.window_right) & np.isfinite(
      lse)[..., None]
  with np.errstate(invalid="ignore", over="ignore"):
    p = np.where(visible, np.exp(scale * np.einsum("bqhd,bkhd->bhqk", q, k) - lse[..., None]), 0.)
  dot_sizes = (np.einsum("bqhd,bkhd->bhqk", np.abs(dout), np.abs(np.repeat(v, g, axis=2)))
               + np.einsum("bqhd,bqhd->bhq", np.abs(dout), np.abs(out))[..., None])
  weight = p * (2 * np.sqrt(d) * 2.0**-23) * dot_sizes  # P_ij delta_ij (b, h, s_q, s_k)
  dq_floor = scale * np.einsum("bhqk,bkhd->bqhd", weight, np.abs(k))
  dk_floor = scale * np.einsum("bhqk,bqhd->bkhd", weight, np.abs(q))
  return dq_floor, dk_floor.reshape(b, s_k, h_k, g, d).sum(axis=3)


def _check(seed, b, s_q, s_k, h, h_k, d, dtype=jnp.bfloat16, **config):
  """Kernel vs emulation on the fp8 forward kernel's residuals; returns the kernel's grads, the
  backward's arguments and the config."""
  cfg = _config(d, **config)
  q, k, v, dout = _floats(seed, b, s_q, s_k, h, h_k, d, dtype)
  (dq, dk, dv), args = _kernel(_residuals(q, k, v, cfg), v, dout.astype(v.dtype), cfg)
  for got, shape in ((dq, q.shape), (dk, k.shape), (dv, v.shape)):
    assert got.dtype == jnp.float32 and got.shape == shape
    assert np.all(np.isfinite(np.asarray(got))), "non-finite gradient (unwritten or NaN)"
  want = _emulated(args, cfg)
  dq_floor, dk_floor = _cancellation_floors(args, cfg)
  for name, got, ref, tol, floor in (("dq", dq, want[0], DQ_TOL, _rms(dq_floor)),
                                     ("dk", dk, want[1], DKV_TOL, _rms(dk_floor)),
                                     ("dv", dv, want[2], DKV_TOL, 0.0)):
    scale = max(_rms(ref), 1e-30)
    err = _rms(np.asarray(got, np.float64) - np.asarray(ref, np.float64))
    # Independent error sources: their RMS add in quadrature (module docstring).
    assert err <= np.hypot(tol * scale, floor), (name, err / scale, floor / scale)
  return (dq, dk, dv), args, cfg


# Every instantiation (buckets 64 and 128, bf16 and fp16 dO / V / K~); 32 and 96 run in the
# next bucket up with zero-filled columns; float32 inputs take bfloat16 16-bit operands.
@pytest.mark.parametrize("d", [64, 128, 32, 96])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_head_dims_and_dtypes(d, dtype):
  _check(d, 2, 257, 391, 4, 2, d, dtype, causal=d % 64 == 0)


# Ragged lengths (no multiple of the 64- or 128-row tiles, of the 128-key blocks or of the 32
# rows the transposed operands are padded to), a single row or key, more keys than rows and
# fewer: rows that see no key (causal, s_q > s_k) get P' = 0.
# The cases alternate between the buckets (d = 64: 128-row tiles, d = 128: 64-row tiles).
@pytest.mark.parametrize("s_q,s_k,d", [(1, 1, 64), (63, 65, 128), (200, 333, 64),
                                       (1000, 129, 128), (129, 1000, 64), (1, 700, 128),
                                       (700, 1, 64)])
@pytest.mark.parametrize("causal", [False, True])
def test_ragged_lengths(s_q, s_k, d, causal):
  _check(s_q + 3 * s_k + d, 2, s_q, s_k, 4, 2, d, causal=causal)


@pytest.mark.parametrize("window,d", [((64, 0), 64), ((100, 30), 128), ((-1, 17), 64),
                                      ((0, 0), 128), ((5, 5), 64), ((300, -1), 128)])
def test_windows(window, d):
  _check(7 + d, 1, 700, 900, 4, 2, d, window=window)


# GQA: dK and dV summed over the query heads of a kv head in the CTA, the dK operand's running
# maxima carried across them (the emulation's order: heads, then tiles).
@pytest.mark.parametrize("h,h_k,d", [(8, 1, 64), (8, 2, 128), (6, 3, 64), (4, 4, 128)])
def test_gqa(h, h_k, d):
  _check(h * 10 + h_k + d, 2, 333, 300, h, h_k, d, causal=True)


def test_without_rotation_and_with_block_outliers():
  # incoherent=False, and dO blocks of very different magnitudes (r spans 2^-12..1, one block
  # all zero: r = 0, P' = 0 and dq = 0 there): the prescales and the dK operand's lazy maxima
  # move, and dO8 carries its block scales through r.
  cfg = _config(128, causal=True, incoherent=False)
  q, k, v, dout = _floats(5, 2, 500, 500, 4, 2, 128)
  dout = dout.at[0, 64:128].set(0).at[1, :64, 1].multiply(2.0**-12).at[1, 200:260].multiply(30.0)
  (dq, dk, dv), args = _kernel(_residuals(q, k, v, cfg), v, dout, cfg)
  np.testing.assert_array_equal(np.asarray(dq)[0, 64:128], 0.0)
  want = _emulated(args, cfg)
  for got, ref, tol in zip((dq, dk, dv), want, (DQ_TOL, DKV_TOL, DKV_TOL)):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert np.all(np.isfinite(got))
    assert _rms(got - ref) <= tol * _rms(ref), _rms(got - ref) / _rms(ref)


@pytest.mark.parametrize("d", [64, 128])
def test_key_far_below_every_row_maximum_stays_finite(d):
  # Keys 1.. sit 90 nats below key 0 for every query: P' ~1e-39 (subnormal), the dK operand's
  # block maximum is far below 2^-122 and 2^6 / M would overflow: the running maximum only moves
  # above 2^-100 (fp8_dk_operand.cuh, the emulation's MIN_RUNNING_MAX). dK stays finite and
  # matches the emulation.
  s = 256
  cfg = _config(d)
  gap = 90.0
  q8 = jnp.ones((1, s, 1, d), jnp.float8_e4m3fn)
  k8 = jnp.full((1, s, 1, d), -1.0, jnp.float8_e4m3fn).at[:, 0].set(1.0)
  q_rows = jnp.ones((1, 1, s), jnp.float32)
  k_rows = jnp.full((1, 1, s), gap / (2 * d * cfg.attention.softmax_scale), jnp.float32)
  _, _, v, dout = _floats(5, 1, s, s, 1, 1, d)
  lse = jnp.full((1, 1, s), gap / 2 + np.log1p((s - 1) * np.exp(-gap)), jnp.float32)
  probs = np.exp(np.where(np.arange(s) == 0, gap / 2, -gap / 2) - float(lse[0, 0, 0]))
  out = jnp.asarray(np.broadcast_to(probs @ np.asarray(v[0, :, 0], np.float64), (1, s, 1, d)),
                    v.dtype)
  args = (q8, k8, v, out, lse, dout, q_rows, k_rows)
  got = run_on_kernels(_kernel_fn(cfg), *args, expected=FLASH_BWD_FP8)
  want = _emulated(args, cfg)
  # With key 0 taking all the weight, the exact dq and dk are ~0: both sides return the rounding
  # noise of dP - D, bounded as in _check.
  dq_floor, dk_floor = _cancellation_floors(args, cfg)
  for name, g, w, tol, floor in (("dq", got[0], want[0], DQ_TOL, _rms(dq_floor)),
                                 ("dk", got[1], want[1], DKV_TOL, _rms(dk_floor)),
                                 ("dv", got[2], want[2], DKV_TOL, 0.0)):
    assert np.all(np.isfinite(np.asarray(g))), name
    assert np.all(np.isfinite(np.asarray(w))), name
    err = _rms(np.asarray(g, np.float64) - np.asarray(w, np.float64))
    assert err <= np.hypot(tol * max(_rms(w), 1e-30), floor), (name, err, floor)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_deterministic_repeats_bit_for_bit(d, dtype):
  # GQA, ragged, causal: dQ partials of several K blocks meet in one Q block, added in K-block
  # order under deterministic=True (dK and dV are summed in registers, deterministic always).
  first, args, cfg = _check(11 + d, 2, 700, 700, 8, 2, d, dtype, causal=True,
                            deterministic=True)
  fn = _kernel_fn(cfg)
  for _ in range(2):
    for a, b in zip(first, fn(*args)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_gradients_through_lse():
  # return_lse with an lse cotangent: D - dlse enters dS' (the kernel takes D from the caller).
  cfg = _config(64, causal=True)
  q, k, v, dout = _floats(21, 1, 300, 300, 4, 2, 64)
  out, lse, q8, q_rows, k8, k_rows = _residuals(q, k, v, cfg)
  dlse = jnp.asarray(np.random.default_rng(3).standard_normal(lse.shape), jnp.float32)
  args = (q8, k8, v, out, lse, dout, q_rows, k_rows)
  fn = jax.jit(lambda *a: _fp8_backward.fp8_backward(*a[:-1], cfg, dlse=a[-1]))
  got = run_on_kernels(fn, *args, dlse, expected=FLASH_BWD_FP8)
  want = _emulated(args, cfg, dlse)
  for g, w, tol in zip(got, want, (DQ_TOL, DKV_TOL, DKV_TOL)):
    assert _rms(np.asarray(g, np.float64) - np.asarray(w, np.float64)) <= tol * _rms(w)


def test_vmap_folds_into_the_batch():
  # The fold rule, bit for bit: the kernel call vmapped over two lanes of identical operands
  # against one call per lane. deterministic=True: the atomic dQ adds of deterministic=False moved
  # 0.4% of dq by an ulp between two runs on the H100.
  cfg = _config(128, deterministic=True)
  q, k, v, dout = _floats(31, 2, 200, 260, 4, 2, 128)
  args = _kernel(_residuals(q, k, v, cfg), v, dout, cfg)[1]
  operands = jax.jit(lambda *a: _fp8_backward.kernel_operands(*a, cfg))(*args)
  stacked = [jnp.stack([x, x[::-1]]) for x in operands]  # two lanes: the batch, and reversed
  call = _fp8_backward.kernel_backward(cfg)
  got = run_on_kernels(jax.jit(jax.vmap(call)), *stacked, expected=FLASH_BWD_FP8)
  for lane in range(2):
    one = jax.jit(call)(*[x[lane] for x in stacked])
    for a, b in zip(got, one):
      np.testing.assert_array_equal(np.asarray(a)[lane], np.asarray(b))


def test_vmap_of_the_whole_backward():
  # vmap of fp8_backward itself: the operands' row reductions (D = rowsum(dO o O), the dO8
  # scales) are compiled for another shape there, and XLA may sum in another order, so a row's
  # D can move by an ulp (on the H200: 0.19% of dq by <= 5e-6 absolute). Bounded by float32
  # rounding of those sums, far below the fp8 tolerances.
  cfg = _config(128, deterministic=True)
  q, k, v, dout = _floats(31, 2, 200, 260, 4, 2, 128)
  args = _kernel(_residuals(q, k, v, cfg), v, dout, cfg)[1]
  stacked = [jnp.stack([x, x[::-1]]) for x in args]
  fn = jax.jit(jax.vmap(lambda *a: _fp8_backward.fp8_backward(*a, cfg)))
  got = run_on_kernels(fn, *stacked, expected=FLASH_BWD_FP8)
  for lane in range(2):
    one = _kernel_fn(cfg)(*[x[lane] for x in stacked])
    for a, b in zip(got, one):
      a, b = np.asarray(a, np.float64)[lane], np.asarray(b, np.float64)
      assert _rms(a - b) <= 1e-5 * _rms(b)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_public_gradients_against_float64(causal, d):
  """jax.grad through flash_attention_fp8(backward="fp8") on the kernels (the fp8 forward, then
  this backward: no 16-bit backward in the program) against exact attention's float64
  gradients, next to backward="bf16" on the same kernels. The CPU emulation measured "fp8" /
  "bf16" errors of 0.99-1.01 (dq), 1.03-1.11 (dk), 1.20-1.39 (dv) on these inputs
  (tests/test_fp8_backward.py); the kernel's own ~1e-2 adds in quadrature to ~5e-2."""
  q, k, v, dout = outlier_qkv_dout(d, (1, 512, 2, d))
  want = attention_oracle_grads(q, k, v, dout, softmax_scale=d**-0.5,
                                window_right=0 if causal else -1)

  def grads(backward):
    loss = lambda q, k, v: jnp.sum(
        fp8.flash_attention_fp8(q, k, v, causal=causal, backward=backward).astype(jnp.float32)
        * dout.astype(jnp.float32))
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

  compiled = compile_on_kernels(grads("fp8"), q, k, v, expected={FLASH_FWD_FP8, FLASH_BWD_FP8})
  assert FLASH_BWD not in kernel_targets(compiled.as_text())
  got = compiled(q, k, v)
  bf16 = run_on_kernels(grads("bf16"), q, k, v, expected={FLASH_FWD_FP8, FLASH_BWD})
  for i, (name, bound) in enumerate((("dq", 1.06), ("dk", 1.14), ("dv", 1.5))):
    assert got[i].dtype == jnp.bfloat16 and np.all(np.isfinite(np.asarray(got[i], np.float32)))
    err, ref_err = _rel(got[i], want[i]), _rel(bf16[i], want[i])
    assert err < bound * ref_err and err < 0.12, (name, err, ref_err)


def test_head_dim_without_kernel_takes_the_emulation():
  # d = 256 has an fp8 forward kernel but no fp8 backward kernel: the emulation runs on the GPU.
  d = 256
  cfg = _config(d)
  q, k, v, dout = _floats(d, 1, 100, 100, 2, 2, d)
  out, lse, q8, q_rows, k8, k_rows = _residuals(q, k, v, cfg)
  args = (q8, k8, v, out, lse, dout, q_rows, k_rows)
  assert FLASH_BWD_FP8 not in kernel_targets(compiled_text(_kernel_fn(cfg), *args))
  got = _kernel_fn(cfg)(*args)
  assert all(np.all(np.isfinite(np.asarray(x))) for x in got)


_FFI_CALL = """
    f8 = lambda *s: jnp.ones(s, jnp.float8_e4m3fn)
    bf = lambda *s: jnp.ones(s, jnp.bfloat16)
    f32 = lambda *s: jnp.ones(s, jnp.float32)
    def call(b=1, s=8, h=4, h_k=4, d=64, q8=None, q8_t=None, k=None, rows=None, k_scale=None,
             dv_scale=None, dq_shape=None, ws=1 << 20, softmax_scale=0.125):
      s_t, s_pad = -(-s // 32) * 32, -(-s // 128) * 128
      args = (q8 if q8 is not None else f8(b, s, h, d), q8_t if q8_t is not None else f8(b, h, d, s_t),
              f8(b, s, h_k, d), k if k is not None else bf(b, s, h_k, d), bf(b, s, h_k, d),
              bf(b, s, h, d), f8(b, h, d, s_t), rows if rows is not None else f32(b, h, s_pad),
              f32(b, h, s_pad), f32(b, h, s_pad), f32(b, h, s_pad), f32(b, h, s),
              k_scale if k_scale is not None else f32(b, h_k, s),
              dv_scale if dv_scale is not None else f32(b, h_k))
      res = (jax.ShapeDtypeStruct(dq_shape or (b, s, h, d), jnp.float32),
             jax.ShapeDtypeStruct((b, s, h_k, d), jnp.float32),
             jax.ShapeDtypeStruct((b, s, h_k, d), jnp.float32),
             jax.ShapeDtypeStruct((ws,), jnp.uint8))
      return lambda: jax.ffi.ffi_call("jax_fa3_flash_bwd_fp8", res)(
          *args, softmax_scale=np.float32(softmax_scale), window_left=np.int32(-1),
          window_right=np.int32(-1), deterministic=np.bool_(False))
"""


@pytest.mark.parametrize("body,expected", [
    ("result = call(q8=bf(1, 8, 4, 64))", "q8 must be float8_e4m3fn"),
    ("result = call(h=4, h_k=3)", "heads"),
    ("result = call(k=f32(1, 8, 4, 64))", "k (k8 dequantized) must be bfloat16 or float16"),
    ("result = call(d=48)", None),  # valid (d = 48 runs in the d64 kernel): no error
    ("result = call(d=40)", "no fp8 backward kernel for head dim 40"),
    ("result = call(q8_t=f8(1, 4, 64, 8))", "q8_t must have shape (b, h, d, s_q rounded up to "
     "32) = (1, 4, 64, 32)"),
    ("result = call(rows=f32(1, 4, 8))", "lse_log2 must have shape (b, h, s_q rounded up to "
     "128) = (1, 4, 128)"),
    ("result = call(k_scale=f32(1, 4, 1))", "k_scale must have shape (b, h_k, s_k) = (1, 4, 8)"),
    ("result = call(dv_scale=f32(1, 4, 1))", "dv_scale must have shape (b, h_k) = (1, 4)"),
    ("result = call(dq_shape=(1, 8, 4, 32))", "result dq must have q8's shape"),
    ("result = call(ws=16)", "workspace"),
    ("result = call(softmax_scale=0.0)", "softmax_scale"),
])
def test_ffi_handler_rejects_bad_calls(body, expected):
  if expected is None:  # a valid call, for contrast: the probe then reports no error
    with pytest.raises(AssertionError, match="NO ERROR"):
      ffi_error_message(_FFI_CALL + "\n    " + body + "\n")
    return
  message = ffi_error_message(_FFI_CALL + "\n    " + body + "\n")
  assert expected in message, message
