"""The fp8 quantization passes: q and k rotated (optionally) and quantized to e4m3 with one
float32 scale per block of tokens, v centred by its mean over the keys and quantized with one
scale per head, optionally straight into the fp8 kernel's V layout.

Each pass is one fused CUDA kernel on a Hopper GPU (`jax_fa3_rotate_quantize_fp8`: one read of
the bf16/fp16/fp32 input, the Hadamard butterflies in registers, one e4m3 write) and an XLA
computation elsewhere: a float32 copy, `hadamard_transform`, then the block quantization. The two
agree bit for bit on scales and, without rotation, on values (centred or not); the fused
butterflies are those of `hadamard_transform`'s pure-JAX form in the same order, and only the last
rounding of the 1/sqrt(d) factor can differ from XLA's (one float32 ulp, so an e4m3 value rarely
moves by one step). The quantization itself is defined in `scale_from_amax` and `to_e4m3`.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_fa3 import _ffi
from jax_fa3.hadamard import hadamard_transform

E4M3 = jnp.float8_e4m3fn
E4M3_MAX = 448.0
FP8_INPUT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
# The fused rotate + quantize pass (cuda/quantize/rotate_quantize.h): 32 elements of a row per
# lane, head_dim a multiple of 32 up to 256, float32/bfloat16/float16 inputs, any block size.
ROTATE_QUANTIZE_TARGET = "jax_fa3_rotate_quantize_fp8"
ROTATE_QUANTIZE_MAX_DIM = 256

_TINY = float(np.finfo(np.float32).tiny)


def scale_from_amax(amax):
  """float32 scale = amax · float32(1/448), 1.0 where amax == 0, at least float32's smallest normal.

  A product with the float32-rounded reciprocal, not a division: XLA rewrites a division by a
  constant into exactly that, so we define it so and the CUDA quantizer does the same.
  """
  amax = amax.astype(jnp.float32)
  scale = jnp.maximum(amax * jnp.float32(1.0 / E4M3_MAX), jnp.float32(_TINY))
  return jnp.where(amax > 0, scale, jnp.float32(1.0))


def to_e4m3(x):
  """Round float32 x to e4m3 (nearest even), saturating to ±448 (NaN stays NaN).

  The rounding is done here, on float32 bits, and the cast then only converts exact e4m3 values:
  older XLA converted float32 -> float8 through float16 (double rounding: 1-ulp differences on
  ~0.3% of elements under JAX 0.6), and the kernel's cvt.rn.satfinite is single-rounded RNE.
  """
  x = jnp.clip(x.astype(jnp.float32), -E4M3_MAX, E4M3_MAX)
  # Normal range (|x| >= 2^-6): keep 3 of float32's 23 mantissa bits, ties to even.
  bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
  lsb = (bits >> 20) & 1
  normal = jax.lax.bitcast_convert_type((bits + jnp.uint32(0x7FFFF) + lsb) & jnp.uint32(0xFFF00000),
                                        jnp.float32)
  # Subnormal range: multiples of 2^-9 (x * 2^9 is exact; jnp.round rounds half to even).
  subnormal = jnp.round(x * jnp.float32(512.0)) * jnp.float32(1.0 / 512.0)
  rounded = jnp.where(jnp.abs(x) < jnp.float32(2.0**-6), subnormal, normal)
  return jnp.where(jnp.isnan(x), x, rounded).astype(E4M3)


def per_token(scales, block_size, seqlen):
  """(b, h, n_blocks) scales -> (b, seqlen, h, 1): the scale of each token's block."""
  expanded = jnp.repeat(scales, block_size, axis=-1)[..., :seqlen]
  return jnp.swapaxes(expanded, 1, 2)[..., None]


def block_amax(x, block_size):
  """max |x| per (batch, head, block of tokens): float32 (b, h, n_blocks); block_size None: one
  block. A NaN makes its block's amax NaN on every backend (XLA:CPU's max drops NaN, XLA:GPU's
  and the CUDA pass's keep it)."""
  b, s, h, d = x.shape
  block = s if block_size is None else block_size
  n = -(-s // block)
  padded = jnp.pad(jnp.abs(x.astype(jnp.float32)), ((0, 0), (0, n * block - s), (0, 0), (0, 0)))
  blocks = padded.reshape(b, n, block, h, d)
  amax = jnp.where(jnp.isnan(blocks).any(axis=(2, 4)), jnp.nan, blocks.max(axis=(2, 4)))  # (b, n, h)
  return jnp.swapaxes(amax, 1, 2)


def quantize_blocks(x, block_size, amax=None):
  """(values e4m3 (b, s, h, d), scales f32 (b, h, n_blocks)); block_size None: one block.
  amax: block_amax(x, block_size), when the caller has it already."""
  s = x.shape[1]
  block = s if block_size is None else block_size
  xf = x.astype(jnp.float32)
  scales = scale_from_amax(block_amax(x, block_size) if amax is None else amax)  # (b, h, n)
  # The reciprocal is taken per block, then multiplied (the kernel's contract, explicit here so
  # that it does not hang on XLA's simplifier rewriting x / broadcast(scale)).
  values = to_e4m3(xf * per_token(1.0 / scales, block, s))
  return values, scales


def no_mean():
  """The mean operand of a pass that subtracts none (an empty array: the CUDA pass's 'none')."""
  return jnp.zeros((0,), jnp.float32)


def xla_rotate_quantize(x, signs, rotate: bool, block_size, mean=None):
  """mean: (b, h, d) float32 subtracted after the rotation; None or empty (`no_mean`): none."""
  x = x.astype(jnp.float32)
  if rotate:
    x = hadamard_transform(x, signs=signs)
  if mean is not None and mean.size:
    x = x - mean[:, None]
  return quantize_blocks(x, block_size)


def fused_quantize_supported(x, block_size) -> bool:
  d = x.shape[-1]
  return (x.shape[1] > 0 and d % 32 == 0 and 32 <= d <= ROTATE_QUANTIZE_MAX_DIM
          and any(x.dtype == np.dtype(t) for t in FP8_INPUT_DTYPES)
          and _ffi.kernels_available() and _ffi.has_target(ROTATE_QUANTIZE_TARGET))


# The kernel's V layout (cuda/flash_fwd/fp8/layout.h, fp8_key_of_slot): slot c of each group of
# 32 keys holds key KEY_OF_SLOT[c].
KEY_PAD = 32
KEY_OF_SLOT = tuple(16 * (c // 16) + 8 * ((c % 4) // 2) + 2 * ((c % 16) // 4) + c % 2
                    for c in range(KEY_PAD))


def _key_bit_of_slot_bit() -> tuple[int, ...]:
  """KEY_OF_SLOT permutes the five bits of the index: slot bit i is key bit [i] (checked)."""
  bits = KEY_PAD.bit_length() - 1
  of = tuple(KEY_OF_SLOT[1 << i].bit_length() - 1 for i in range(bits))
  assert sorted(of) == list(range(bits)) and all(
      KEY_OF_SLOT[c] == sum(1 << of[i] for i in range(bits) if c >> i & 1) for c in range(KEY_PAD))
  return of


_KEY_BIT_OF_SLOT_BIT = _key_bit_of_slot_bit()


def kernel_v_layout(values):
  """e4m3 (b, s, h, d) -> the fp8 kernel's V layout (b, h, d, s_pad): keys last, padded with
  zeros to s_pad = s rounded up to 32, permuted inside each group of 32 (KEY_OF_SLOT). What the
  CUDA pass writes in its keys-transposed mode; here for vmap lanes that take the XLA path.

  The permutation is one of the index's bits, so a reshape and a transpose (no gather: its
  index array would be a constant the traced function closes over, which custom_partitioning
  rejects: `assert not closed_call.consts`)."""
  b, s, h, d = values.shape
  s_pad = -(-s // KEY_PAD) * KEY_PAD
  bits = len(_KEY_BIT_OF_SLOT_BIT)
  padded = jnp.pad(values, ((0, 0), (0, s_pad - s), (0, 0), (0, 0)))
  # Key axis -> (group, key bit 4, ..., key bit 0); the slot axes (slot bit 4, ..., 0) take the
  # key-bit axes they name, then go last.
  split = padded.reshape((b, s_pad // KEY_PAD) + (2,) * bits + (h, d))
  key_axis = lambda j: 2 + bits - 1 - j  # the axis of key bit j
  slot_axes = tuple(key_axis(_KEY_BIT_OF_SLOT_BIT[i]) for i in reversed(range(bits)))
  out = jnp.transpose(split, (0, 2 + bits, 3 + bits, 1) + slot_axes)
  return out.reshape(b, h, d, s_pad)


def _xla_quantize_kernel_v_layout(x, signs, mean, rotate: bool):
  values, scales = xla_rotate_quantize(x, signs, rotate, None, mean)
  return kernel_v_layout(values), scales


# Tokens per chunk of the CUDA pass's chunked kernels (cuda/quantize/rotate_quantize.h,
# kRotateQuantizeChunkTokens): sizes the centring workspace.
ROTATE_QUANTIZE_CHUNK_TOKENS = 128


def fused_rotate_quantize(rotate: bool, block_size: int | None, keys_transposed: bool = False,
                           centre: bool = False):
  """The CUDA pass as a function of (x, signs32, mean) -> (values, scales, mean_out); vmap folds
  a mapped axis into the batch.

  mean: (b, h, d) float32 to subtract before quantizing, or empty (`no_mean`) for none.
  keys_transposed (one block per head only): values come back in the fp8 kernel's V layout
  (b, h, d, s_pad), see `kernel_v_layout`.
  centre (one block per head only, mean empty, no rotation): the pass takes each head's float32
  mean over its tokens itself (`mean_over_keys`'s, up to the summation order), subtracts it and
  returns it as mean_out (b, h, d); else mean_out is empty.
  """
  assert not (keys_transposed or centre) or block_size is None
  assert not (centre and rotate)

  def xla_lane(x, s, m):
    if centre:
      m = mean_over_keys(x)
    if keys_transposed:
      values, scales = _xla_quantize_kernel_v_layout(x, s, m, rotate=rotate)
    else:
      values, scales = xla_rotate_quantize(x, s, rotate, block_size, m)
    return values, scales, m if centre else no_mean()

  @jax.custom_batching.custom_vmap
  def call(x, signs32, mean):
    b, s, h, d = x.shape
    block = s if block_size is None else min(block_size, s)  # the same blocks
    values_shape = (b, h, d, -(-s // KEY_PAD) * KEY_PAD) if keys_transposed else x.shape
    chunks = -(-s // ROTATE_QUANTIZE_CHUNK_TOKENS)
    result_types = (jax.ShapeDtypeStruct(values_shape, E4M3),
                    jax.ShapeDtypeStruct((b, h, -(-s // block)), jnp.float32),
                    jax.ShapeDtypeStruct((b, h, d) if centre else (0,), jnp.float32),
                    jax.ShapeDtypeStruct((b * h * chunks * 3 * d,) if centre else (0,),
                                         jnp.float32))
    values, scales, mean_out, _ = _ffi.call(
        ROTATE_QUANTIZE_TARGET, result_types, x, signs32, mean, rotate=np.bool_(rotate),
        block_size=np.int32(block),
        keys_transposed=np.bool_(keys_transposed), centre=np.bool_(centre))
    return values, scales, mean_out

  @call.def_vmap
  def _rule(axis_size, in_batched, x, signs32, mean):
    x_batched, signs_batched, mean_batched = in_batched
    if signs_batched:  # a rotation per lane: the XLA path, lane by lane
      in_axes = (0 if x_batched else None, 0, 0 if mean_batched else None)
      values, scales, mean_out = jax.vmap(xla_lane, in_axes=in_axes)(x, signs32, mean)
      return (values, scales, mean_out if centre else no_mean()), (True, True, centre)
    fold = lambda a: a.reshape((axis_size * a.shape[1],) + a.shape[2:])
    spread = lambda a: jnp.broadcast_to(a[None], (axis_size,) + a.shape)
    x = fold(x if x_batched else spread(x))
    if mean.size:  # per (batch, head) like x; an empty one stays empty
      mean = fold(mean if mean_batched else spread(mean))
    values, scales, mean_out = call(x, signs32, mean)
    unfold = lambda a: a.reshape((axis_size, a.shape[0] // axis_size) + a.shape[1:])
    return ((unfold(values), unfold(scales), unfold(mean_out) if centre else mean_out),
            (True, True, centre))

  return call


def rotate_quantize(x, signs32, rotate: bool, block_size, mean=None):
  """(values, scales) of x, rotated by H·diag(signs32) first when `rotate`, then less `mean`
  ((b, h, d) float32) when given.

  One fused CUDA pass on a Hopper GPU where it applies (`fused_quantize_supported`), else XLA:
  a float32 copy, `hadamard_transform`, then `quantize_blocks`. Same numerics (module docstring).
  """
  mean = no_mean() if mean is None else mean
  xla = lambda x, s, m: xla_rotate_quantize(x, s, rotate, block_size, m)
  if not fused_quantize_supported(x, block_size):
    return xla(x, signs32, mean)
  fused = fused_rotate_quantize(rotate, block_size)
  return lax.platform_dependent(x, signs32, mean, cuda=lambda *a: fused(*a)[:2], default=xla)


def mean_over_keys(v):
  """float32 (b, h_k, d): v's mean over the keys, by which the call from floats centres v."""
  return jnp.sum(v.astype(jnp.float32), axis=1) / jnp.float32(max(v.shape[1], 1))


@functools.partial(jax.jit, static_argnums=(4, 5))
def rotate_and_quantize(q, k, v, signs, incoherent: bool, block_size: int):
  """The seven inputs of `_fp8_forward.fp8_forward` from floats: q and k rotated (when
  `incoherent`) and quantized per block of tokens, v centred by its mean over the keys and
  quantized with one scale per head; that mean comes last."""
  q8, q_scale = rotate_quantize(q, signs, incoherent, block_size)
  k8, k_scale = rotate_quantize(k, signs, incoherent, block_size)
  v_mean = mean_over_keys(v)
  v8, v_scale = rotate_quantize(v, signs, False, None, v_mean)
  return q8, k8, v8, q_scale, k_scale, v_scale[..., 0], v_mean


def quantize_v_kernel_layout(v, v_mean=None):
  """(vt, v_scale (b, h_k)): v (less v_mean (b, h_k, d) when given) quantized (one scale per
  head, no rotation) by the CUDA pass straight into the fp8 kernel's V layout (b, h_k, d, s_pad);
  GPU only."""
  vt, v_scale, _ = fused_rotate_quantize(False, None, keys_transposed=True)(
      v, jnp.ones(v.shape[-1:], jnp.float32), no_mean() if v_mean is None else v_mean)
  return vt, v_scale[..., 0]


def centre_v_kernel_layout(v):
  """(vt, v_scale (b, h_k), v_mean (b, h_k, d)): v centred by its mean over the keys, both taken
  by the CUDA pass straight into the fp8 kernel's V layout; GPU only.

  One read of v gives per-chunk column sums, maxima and minima, hence the mean μ and the scale:
  amax(|v - μ|) = max over columns of max(max - μ, μ - min), exact since float32 subtraction is
  monotonic. A second read quantizes v - μ.
  """
  vt, v_scale, v_mean = fused_rotate_quantize(False, None, keys_transposed=True, centre=True)(
      v, jnp.ones(v.shape[-1:], jnp.float32), no_mean())
  return vt, v_scale[..., 0], v_mean

