"""The fused rotate + quantize CUDA pass against the pure-JAX rotation and quantization (Hopper GPU).

Outputs are NaN-poisoned before the kernel runs (JAX_FA3_DEBUG_POISON_OUTPUTS=1): an element the
kernel forgot to write would stay NaN. Without rotation the pass must agree with XLA's
quantization bit for bit; with it, the butterflies are those of the pure-JAX transform in the same
order, so only the final 1/sqrt(d) product may round differently (one float32 ulp), which moves
an e4m3 value by at most one step and only where the float32 value sits on a rounding tie.
"""
import os

os.environ["JAX_FA3_DEBUG_POISON_OUTPUTS"] = "1"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from jax_fa3 import _fp8_quantize, fp8  # noqa: E402
from jax_fa3.hadamard import hadamard_reference  # noqa: E402
from ffi_probe import ffi_error_message  # noqa: E402
from kernel_targets import (ROTATE_QUANTIZE_FP8, describe, kernel_targets,  # noqa: E402
                            run_on_kernels)

pytestmark = pytest.mark.gpu


def _inputs(seed, shape, dtype):
  """N(0,1) with 0.1% outliers of N(0,100) (the FP8 accuracy experiment's inputs), and one
  head's blocks scaled apart so block scales differ by orders of magnitude."""
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
  x = jax.random.normal(k1, shape, jnp.float32)
  x = x + 10.0 * jax.random.normal(k2, shape) * jax.random.bernoulli(k3, 0.001, shape)
  ramp = jnp.exp2(jnp.linspace(-12.0, 6.0, shape[1]))[None, :, None, None]
  x = x.at[:, :, :1].multiply(ramp)
  return x.astype(dtype)


def _signs(d):
  return jax.random.rademacher(jax.random.PRNGKey(d), (d,), dtype=jnp.float32)


def _pure_jax(x, signs, rotate, block_size, mean=None):
  """The CPU path's numerics, computed on the CPU: XLA on the GPU compiles `_quantize` for long
  blocks into code whose products differ in the last bit (1-10 e4m3 values per 1e5 moved by a
  step on the H200), while XLA:CPU agrees with exact IEEE float32 (checked against NumPy).
  mean: (b, h, d) subtracted after the rotation (v's centring)."""
  cpu = jax.devices("cpu")[0]
  with jax.default_device(cpu):
    x = jax.device_put(x, cpu).astype(jnp.float32)
    if rotate:
      x = hadamard_reference(x, jax.device_put(signs, cpu))
    if mean is not None:
      x = x - jax.device_put(mean, cpu)[:, None]
    return _fp8_quantize.quantize_blocks(x, block_size)


def _fused(x, signs, rotate, block_size):
  fn = jax.jit(lambda x, s: _fp8_quantize.rotate_quantize(x, s, rotate, block_size))
  return run_on_kernels(fn, x, signs, expected=ROTATE_QUANTIZE_FP8)


def _assert_within_one_e4m3_step(got, want):
  got = np.asarray(got.astype(jnp.float32))
  want = np.asarray(want.astype(jnp.float32))
  assert not np.isnan(got).any()
  diff = np.abs(got - want)
  # One e4m3 step: 2^-3 of the power of two at or below the larger magnitude (2^-9 subnormal).
  mag = np.maximum(np.abs(got), np.abs(want))
  step = np.where(mag >= 2.0**-6, 2.0 ** (np.floor(np.log2(np.maximum(mag, 2.0**-6))) - 3), 2.0**-9)
  assert (diff <= step).all(), float((diff / step).max())
  moved = float((diff > 0).mean())
  assert moved < 1e-3, moved  # ties are rare: a value moves only where float32 rounding differs


@pytest.mark.parametrize("d", [32, 64, 96, 128, 192, 256])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("block_size,seqlen", [(64, 200), (48, 200), (1000, 200), (300, 700),
                                               (None, 600)])
def test_matches_pure_jax(d, dtype, block_size, seqlen):
  """Ragged last blocks; blocks of > 256 tokens (300, None) take the chunked two-launch path."""
  _check_against_pure_jax(_inputs(d, (2, seqlen, 3, d), dtype), block_size)


@pytest.mark.parametrize("d", [160, 224])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("block_size,seqlen", [(64, 200), (48, 200), (64, 64)])
def test_staged_block_head_dims(d, dtype, block_size, seqlen):
  """d = 160 and 224 take two passes a CTA (rotate_quantize_staged_block_kernel) with idle lanes
  in the last pass, as d = 192 does: whole, ragged and single blocks."""
  _check_against_pure_jax(_inputs(d + 7, (2, seqlen, 3, d), dtype), block_size)


@pytest.mark.parametrize("d", [32, 64, 96, 128])
def test_odd_number_of_one_pass_blocks(d):
  """64-token blocks of 16-bit inputs run two per CTA (rotate_quantize_one_pass_kernel): 3 heads
  of 3 blocks each (the last one 2 tokens) leave the last CTA a single block."""
  _check_against_pure_jax(_inputs(d + 1, (1, 130, 3, d), jnp.bfloat16), 64)


def _check_against_pure_jax(x, block_size):
  signs = _signs(x.shape[-1])
  for rotate in (False, True):
    values, scales = _fused(x, signs, rotate, block_size)
    ref_values, ref_scales = _pure_jax(x, signs, rotate, block_size)
    assert values.dtype == _fp8_quantize.E4M3 and values.shape == x.shape
    assert scales.shape == ref_scales.shape
    if not rotate:
      np.testing.assert_array_equal(np.asarray(scales), np.asarray(ref_scales))
      np.testing.assert_array_equal(np.asarray(values).view(np.uint8),
                                    np.asarray(ref_values).view(np.uint8))
    else:
      np.testing.assert_allclose(np.asarray(scales), np.asarray(ref_scales), rtol=2e-7, atol=0)
      _assert_within_one_e4m3_step(values, ref_values)


def _fused_keys_transposed(x):
  return run_on_kernels(_fp8_quantize.quantize_v_kernel_layout, x, expected=ROTATE_QUANTIZE_FP8)


@pytest.mark.parametrize("d", [32, 64, 96, 128, 192, 256])
@pytest.mark.parametrize("seqlen", [1, 100, 128, 129, 300, 1000])
def test_keys_transposed_is_the_plain_pass_in_the_kernel_layout(d, seqlen):
  """v's quantization in the fp8 kernel's V layout: bit for bit the plain pass's values, padded
  and permuted by the XLA function (poisoned outputs: the padding keys must be written too)."""
  x = _inputs(d + seqlen, (2, seqlen, 3, d), jnp.bfloat16)
  vt, scales = _fused_keys_transposed(x)
  values, ref_scales = _fused(x, _signs(d), False, None)
  assert vt.dtype == _fp8_quantize.E4M3 and vt.shape == (2, 3, d, -(-seqlen // 32) * 32)
  np.testing.assert_array_equal(np.asarray(scales), np.asarray(ref_scales)[..., 0])  # (b, h)
  np.testing.assert_array_equal(np.asarray(vt).view(np.uint8),
                                np.asarray(_fp8_quantize.kernel_v_layout(values)).view(np.uint8))


@pytest.mark.parametrize("d", [32, 96, 128, 256])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("seqlen", [1, 77, 300, 1000])
def test_centred_v_matches_pure_jax(d, dtype, seqlen):
  """v's centring (_fp8_emulation.py): v less its mean over the keys, quantized with one scale per
  head, in the plain layout (the chunked passes) and in the kernel's: bit for bit XLA's
  quantization of the same float32 differences, amax and padding included (poisoned outputs)."""
  x = (_inputs(d + seqlen + 5, (2, seqlen, 3, d), jnp.float32) + 3.0).astype(dtype)
  mean = jax.jit(_fp8_quantize.mean_over_keys)(x)
  assert float(jnp.mean(mean)) > 2.0  # a real shift (the case the centring is for)
  ref_values, ref_scales = _pure_jax(x, None, False, None, mean)
  fn = jax.jit(lambda x, m: _fp8_quantize.rotate_quantize(x, _signs(d), False, None, m))
  assert _fp8_quantize.ROTATE_QUANTIZE_TARGET in fn.lower(x, mean).as_text()
  values, scales = fn(x, mean)
  np.testing.assert_array_equal(np.asarray(scales), np.asarray(ref_scales))
  np.testing.assert_array_equal(np.asarray(values).view(np.uint8),
                                np.asarray(ref_values).view(np.uint8))
  vt, vt_scales = jax.jit(_fp8_quantize.quantize_v_kernel_layout)(x, mean)
  np.testing.assert_array_equal(np.asarray(vt_scales), np.asarray(ref_scales)[..., 0])
  np.testing.assert_array_equal(np.asarray(vt).view(np.uint8),
                                np.asarray(_fp8_quantize.kernel_v_layout(ref_values)).view(np.uint8))
  # The centred values span e4m3's range on their own: amax(|v - mean|) is 448 · scale (one key
  # alone is its own mean: all zeros, scale 1).
  expected_amax = 448.0 if seqlen > 1 else 0.0
  assert float(jnp.max(jnp.abs(values.astype(jnp.float32)))) == expected_amax


@pytest.mark.parametrize("d", [32, 96, 128, 256])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("seqlen", [1, 77, 128, 129, 1000, 4097])
def test_centre_in_the_pass_matches_pure_jax(d, dtype, seqlen):
  """The pass taking v's mean itself (per-chunk column sums, maxima and minima, folded in chunk
  order): the mean is XLA's up to the summation order, and the values and the scale are bit for
  bit XLA's quantization of v less that mean, in the kernel's layout (poisoned outputs); the
  scale from the column extremes is the amax of the differences exactly."""
  x = (_inputs(d + seqlen + 7, (2, seqlen, 3, d), jnp.float32) + 3.0).astype(dtype)
  fn = jax.jit(_fp8_quantize.centre_v_kernel_layout)
  assert _fp8_quantize.ROTATE_QUANTIZE_TARGET in fn.lower(x).as_text()
  vt, scales, mean = fn(x)
  want = np.asarray(jax.jit(_fp8_quantize.mean_over_keys)(x), np.float64)
  # float32 sums of up to 4097 values near 3 in two orders: a few float32 ulps of the values
  # apart (absolute: a column whose mean is near 0 has lost its leading digits in either order).
  scale = float(jnp.max(jnp.abs(x.astype(jnp.float32))))
  np.testing.assert_allclose(np.asarray(mean, np.float64), want, rtol=0, atol=8e-7 * scale)
  ref_values, ref_scales = _pure_jax(x, None, False, None, mean)
  np.testing.assert_array_equal(np.asarray(scales), np.asarray(ref_scales)[..., 0])
  np.testing.assert_array_equal(np.asarray(vt).view(np.uint8),
                                np.asarray(_fp8_quantize.kernel_v_layout(ref_values)).view(np.uint8))


def test_centre_in_the_pass_special_heads():
  """A head with a NaN: mean, scale and values as XLA's (NaN mean, scale 1); a constant head:
  mean exact, all values zero, scale 1; the other heads untouched."""
  x = np.asarray(_inputs(3, (1, 300, 3, 64), jnp.float32)) + 2.0
  x[0, 17, 0, 5] = np.nan
  x[0, :, 1, :] = 1.25
  x = jnp.asarray(x)
  vt, scales, mean = run_on_kernels(_fp8_quantize.centre_v_kernel_layout, x, expected=ROTATE_QUANTIZE_FP8)
  mean, scales = np.asarray(mean), np.asarray(scales)
  assert np.isnan(mean[0, 0, 5]) and scales[0, 0] == 1.0
  np.testing.assert_array_equal(mean[0, 1], 1.25)
  assert scales[0, 1] == 1.0 and np.all(np.asarray(vt)[0, 1].view(np.uint8) == 0)
  ref_values, ref_scales = _pure_jax(x[:, :, 2:], None, False, None, jnp.asarray(mean[:, 2:]))
  np.testing.assert_array_equal(scales[:, 2:], np.asarray(ref_scales)[..., 0])
  np.testing.assert_array_equal(np.asarray(vt)[:, 2:].view(np.uint8),
                                np.asarray(_fp8_quantize.kernel_v_layout(ref_values)).view(np.uint8))


def test_keys_transposed_vmap_folds_into_batch():
  x = _inputs(9, (6, 200, 2, 64), jnp.float16).reshape(3, 2, 200, 2, 64)
  vt = run_on_kernels(jax.vmap(lambda x: _fp8_quantize.quantize_v_kernel_layout(x)[0]), x,
                      expected=ROTATE_QUANTIZE_FP8)
  for i in range(3):
    np.testing.assert_array_equal(np.asarray(vt[i]).view(np.uint8),
                                  np.asarray(_fused_keys_transposed(x[i])[0]).view(np.uint8))


def test_centre_in_the_pass_vmap_folds_into_batch():
  """Under vmap the centring pass runs once on the folded batch: each lane's values, scale and
  mean are those of its own call (the chunks never cross a (batch, head))."""
  x = (_inputs(11, (6, 300, 2, 64), jnp.bfloat16) + 1.5).reshape(3, 2, 300, 2, 64)
  vt, scales, mean = run_on_kernels(jax.vmap(_fp8_quantize.centre_v_kernel_layout), x,
                                    expected=ROTATE_QUANTIZE_FP8)
  for i in range(3):
    vt_i, scales_i, mean_i = run_on_kernels(_fp8_quantize.centre_v_kernel_layout, x[i],
                                            expected=ROTATE_QUANTIZE_FP8)
    np.testing.assert_array_equal(np.asarray(vt[i]).view(np.uint8),
                                  np.asarray(vt_i).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(scales[i]), np.asarray(scales_i))
    np.testing.assert_array_equal(np.asarray(mean[i]), np.asarray(mean_i))


def test_special_blocks_match_pure_jax():
  """An all-zero block (scale 1), a block with a NaN (scale 1, NaN only where the NaN was) and
  a block beyond e4m3's range."""
  x = _inputs(7, (1, 192, 2, 128), jnp.float32)
  x = x.at[0, :64, 0].set(0.0).at[0, 70, 1, 5].set(jnp.nan).at[0, 128:, 0].multiply(1e6)
  values, scales = _fused(x, _signs(128), False, 64)
  ref_values, ref_scales = _pure_jax(x, None, False, 64)
  np.testing.assert_array_equal(np.asarray(scales), np.asarray(ref_scales))
  assert float(scales[0, 0, 0]) == 1.0 and float(scales[0, 1, 1]) == 1.0
  got, want = (np.asarray(a.astype(jnp.float32)) for a in (values, ref_values))
  np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
  assert int(np.isnan(got).sum()) == 1
  np.testing.assert_array_equal(np.nan_to_num(got), np.nan_to_num(want))


def test_public_quantize_and_fp8_attention_use_the_fused_pass():
  x = _inputs(3, (2, 256, 4, 128), jnp.bfloat16)
  values, scales = run_on_kernels(lambda x: fp8.quantize_fp8(x, block_size=64), x,
                                  expected=ROTATE_QUANTIZE_FP8)
  ref_values, ref_scales = _pure_jax(x, None, False, 64)
  np.testing.assert_array_equal(np.asarray(scales), np.asarray(ref_scales))
  np.testing.assert_array_equal(np.asarray(values).view(np.uint8),
                                np.asarray(ref_values).view(np.uint8))
  import jax_fa3  # noqa: PLC0415
  hlo = jax.jit(jax_fa3.flash_attention_fp8).lower(x, x, x).as_text()
  # q and k rotated, v (one scale per head)
  assert kernel_targets(hlo)[ROTATE_QUANTIZE_FP8] == 3, describe(hlo)


def test_vmap_folds_into_batch():
  x = _inputs(5, (6, 130, 2, 64), jnp.bfloat16).reshape(3, 2, 130, 2, 64)
  signs = _signs(64)
  fn = lambda x: _fp8_quantize.rotate_quantize(x, signs, True, 64)
  values, scales = run_on_kernels(jax.vmap(fn), x, expected=ROTATE_QUANTIZE_FP8)
  for i in range(3):
    v_i, s_i = run_on_kernels(fn, x[i], expected=ROTATE_QUANTIZE_FP8)
    np.testing.assert_array_equal(np.asarray(values[i]).view(np.uint8), np.asarray(v_i).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(scales[i]), np.asarray(s_i))
  # Per-lane signs take the XLA path lane by lane.
  lane_signs = jnp.stack([signs, -signs, signs])
  per_lane = jax.jit(jax.vmap(lambda x, s: _fp8_quantize.rotate_quantize(x, s, True, 64)))(x, lane_signs)
  ref = _pure_jax(x[1], -signs, True, 64)
  # (the XLA path rotates with the CUDA Hadamard kernel, whose butterfly order differs)
  np.testing.assert_allclose(np.asarray(per_lane[1][1]), np.asarray(ref[1]), rtol=1e-5)


_FFI_CALL = """
    def call(x, values_shape, scales_shape, block_size=64, rotate=True, signs_len=None,
             keys_transposed=False, mean_shape=(0,), centre=False, mean_out_shape=(0,),
             workspace=0):
      d = x.shape[-1]
      types = (jax.ShapeDtypeStruct(values_shape, jnp.float8_e4m3fn),
               jax.ShapeDtypeStruct(scales_shape, jnp.float32),
               jax.ShapeDtypeStruct(mean_out_shape, jnp.float32),
               jax.ShapeDtypeStruct((workspace,), jnp.float32))
      return jax.ffi.ffi_call("jax_fa3_rotate_quantize_fp8", types)(
          x, jnp.ones((signs_len or d,), jnp.float32), jnp.zeros(mean_shape, jnp.float32),
          rotate=np.bool_(rotate), block_size=np.int32(block_size),
          keys_transposed=np.bool_(keys_transposed), centre=np.bool_(centre))
"""


@pytest.mark.parametrize("body,expected", [
    ("x = jnp.ones((1, 64, 2, 48), jnp.bfloat16)\n    "
     "result = lambda: call(x, x.shape, (1, 2, 1))", "head_dim must be a multiple of 32"),
    ("x = jnp.ones((1, 64, 2, 64), jnp.bfloat16)\n    "
     "result = lambda: call(x, x.shape, (1, 2, 1), block_size=0)", "block_size must be >= 1"),
    ("x = jnp.ones((1, 64, 2, 64), jnp.bfloat16)\n    "
     "result = lambda: call(x, x.shape, (1, 2, 2))", "scales must have shape (1, 2, 1)"),
    ("x = jnp.ones((1, 64, 2, 64), jnp.bfloat16)\n    "
     "result = lambda: call(x, x.shape, (1, 2, 1), signs_len=32)", "signs must have shape (64,)"),
    ("x = jnp.ones((64, 2, 64), jnp.bfloat16)\n    "
     "result = lambda: call(x, x.shape, (1, 2, 1))", "x must be (batch, seqlen, heads, head_dim)"),
    ("x = jnp.ones((1, 100, 2, 64), jnp.bfloat16)\n    "
     "result = lambda: call(x, (1, 2, 64, 128), (1, 2, 2), keys_transposed=True)",
     "keys_transposed needs one block per head"),
    ("x = jnp.ones((1, 100, 2, 64), jnp.bfloat16)\n    "
     "result = lambda: call(x, x.shape, (1, 2, 1), block_size=100, keys_transposed=True)",
     "keys-transposed values must have shape (batch, heads, head_dim, seqlen rounded up to 32) = "
     "(1, 2, 64, 128)"),
    ("x = jnp.ones((1, 64, 2, 64), jnp.bfloat16)\n    "
     "result = lambda: call(x, x.shape, (1, 2, 1), mean_shape=(1, 64, 2))",
     "mean must have shape (1, 2, 64) (batch, heads, head_dim) or be empty"),
    ("x = jnp.ones((1, 64, 2, 64), jnp.bfloat16)\n    "
     "result = lambda: call(x, x.shape, (1, 2, 1), centre=True, mean_shape=(1, 2, 64), "
     "mean_out_shape=(1, 2, 64), workspace=384)", "centre takes no mean operand"),
    ("x = jnp.ones((1, 100, 2, 64), jnp.bfloat16)\n    "
     "result = lambda: call(x, x.shape, (1, 2, 1), block_size=100, centre=True, "
     "mean_out_shape=(1, 2, 64), workspace=384)", "centre takes rotate = false"),
    ("x = jnp.ones((1, 100, 2, 64), jnp.bfloat16)\n    "
     "result = lambda: call(x, x.shape, (1, 2, 2), rotate=False, centre=True, "
     "mean_out_shape=(1, 2, 64), workspace=384)", "centre needs one block per head"),
    ("x = jnp.ones((1, 100, 2, 64), jnp.bfloat16)\n    "
     "result = lambda: call(x, x.shape, (1, 2, 1), block_size=100, rotate=False, centre=True, "
     "mean_out_shape=(2, 64), workspace=384)", "mean_out must have shape (1, 2, 64)"),
    ("x = jnp.ones((1, 200, 2, 64), jnp.bfloat16)\n    "
     "result = lambda: call(x, x.shape, (1, 2, 1), block_size=200, rotate=False, centre=True, "
     "mean_out_shape=(1, 2, 64), workspace=384)", "workspace must hold 768 float32"),
])
def test_handler_rejects_bad_calls_with_ffi_error(body, expected):
  message = ffi_error_message(_FFI_CALL + "\n    " + body + "\n")
  assert expected in message, message
