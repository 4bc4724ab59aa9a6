"""FP8 (e4m3) attention forward: block quantization and incoherent processing.

Public entry points: `quantize_fp8`, `dequantize_fp8` and `flash_attention_fp8`.

Numerics (the contract the CUDA kernel `jax_fa3_flash_fwd_fp8` implements, and that the pure-JAX
path emulates: same e4m3 rounding, same blocks, same scales):

1. Incoherent processing (optional, on by default): q and k are multiplied by the same orthogonal
   matrix R = H·diag(signs) over head_dim (`hadamard_transform`, computed in float32 from the
   inputs). q·k is unchanged in exact arithmetic; an outlier coordinate is spread over all of them.
   V is not rotated.
2. Centring of v (the call from floats; pre-quantized v may pass its own `v_mean`): μ = the
   float32 mean of v over the keys per (batch, kv-head, dim) (`_v_mean`; on Hopper the fused pass
   below takes it itself, the same sum in another order), and v - μ (float32) is what gets
   quantized. The fp8 tensor cores add each P·V product into the float32 accumulator
   with about 13 mantissa bits (aligned to the larger exponent, truncated): where V's values
   share a sign nothing cancels, the accumulator grows with the keys and O came out 7% low at 4k
   keys for V ~ N(2, 1) (H200) before this step; centred, V's terms cancel as zero-mean V's do.
   Quantization: q and k get one float32 scale per (batch, head, block of `block_size` tokens)
   (default 64); v - μ gets one scale per (batch, kv-head). A scale is amax(|block|) · float32(1/448)
   (448 being e4m3's largest finite value; 1.0 for an all-zero block, and never below float32's
   smallest normal) and the values are e4m3(clip(x · (1/scale), -448, 448)): a product with the
   correctly rounded float32 reciprocal (what XLA makes of x / scale anyway; a true division
   rounds differently on ~1e-4 of the elements), round to nearest even, saturating (CUDA's
   `__NV_SATFINITE`).
3. Scores: S = (q8 · k8) in float32 (each e4m3×e4m3 product is exact), then descaled per element by
   the product (softmax_scale · log2(e) · q_scale[row block]) · k_scale[column block], which the
   kernel folds into its exp2 FFMA (one coefficient per row and 32-key group when block_size is a
   multiple of 32).
4. Softmax: online over key tiles (`EMULATION_TILE_K` = 128 keys here; the kernel's kBlockN there),
   visited last tile first, as the kernel does (P is quantized relative to the running max, so the
   tile order changes which e4m3 values P rounds to: in another order the output differs by ~3%
   RMS, the size of the fp8 error itself),
   P = exp(S - running max) computed in the exp2 domain as the kernel does. The running max is
   lazy (`LAZY_MAX_MARGIN_LOG2`): a row's max moves to a key tile's larger maximum only if that
   exceeds it by more than 2.8 in log2 units, so that the kernel rescales O on jumps only (the
   row's P, relative to the stale max, is then at most 2^2.8). P is quantized as e4m3(2^6 · P):
   FlashAttention-3's `Max_offset` shift (an exact power of two, so no per-row or per-tile scale
   is needed), 6 here instead of FA3's 8 so that P ∈ [0, 2^2.8] fits e4m3's range
   [2^-9, 445.7] (P below 2^-16 rounds to zero, below 2^-12 is subnormal). The row sum is
   accumulated from the quantized P, the weights that multiply V (the kernel sums them on the
   tensor cores; FA3 sums the float32 P before quantization), so each output row is a weighted
   mean of V's rows whose weights sum to one.
5. O = (Σ P8 · v8) · v_scale / (2^6 · row sum) + μ, accumulated in float32 (the weights sum to
   one, so adding μ back is exact for any μ), rounded to bfloat16 (the kernel's output type), then
   cast to q's dtype. LSE is float32, natural log: running max + ln(row sum), the log-sum-exp of
   the descaled scores with each term rounded as P8 is (so within ln(1 + 2^-4) of the exact one
   for the row's normal-range terms; the kernel's exp2 differs from the exact one by a few float32
   ulps, which moves a term across an e4m3 rounding boundary now and then: the kernel's LSE then
   differs from this emulation's by up to one e4m3 step of that term). A row that sees no key:
   LSE +inf and output 0.

On a Hopper GPU, steps 1–2 for q and k run as one fused CUDA pass (`jax_fa3_rotate_quantize_fp8`:
one read of the bf16/fp16/fp32 input, the butterflies in registers, one e4m3 write) instead of
XLA's float32 copy, transform and quantization; its quantization is the pure-JAX one bit for bit
(scales and, without rotation, values, centred or not), and its butterflies are those of
`hadamard_transform`'s pure-JAX form in the same order; only the last rounding of the 1/sqrt(d)
factor can differ from XLA's (one float32 ulp, so an e4m3 value rarely moves by one step). v's
quantization (one CUDA pass: per-chunk column sums, maxima and minima give μ and the scale,
amax(|v - μ|) = max over columns of max(max - μ, μ - min), exact since float32 subtraction is
monotonic; then the quantization of v - μ) writes the kernel's V layout
directly (keys contiguous, permuted inside groups of 32, zero-padded to a multiple of 32:
`_keys_transposed`), so the kernel skips the transpose pre-pass it runs on pre-quantized v (same
bytes, so the same output bit for bit). The remaining differences
are float32 operation order, the key tile width (the running max at which P is quantized) and the
Hopper fp8 tensor-core accumulator, whose internal precision is below float32: compare the kernel
with this emulation to a tolerance, not bitwise. (Without a mask the kernel may split the tiles of
its last round over two CTAs, `cuda/flash_fwd/tail_split.h`: P is still quantized against the
whole tile's running max, and only the accumulation order of O changes.)

Gradients are straight-through: the custom_vjp backward recomputes the bf16/fp16/fp32 forward
(`_ops.forward`) on the unquantized, unrotated inputs and runs `_ops.backward` on them, so the
gradient equals exactly that of `flash_attention` at the same inputs.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_fa3 import _ffi, _ops, sharding
from jax_fa3._batching import fold_vmap_into_batch
from jax_fa3._config import AttentionConfig
from jax_fa3._validation import (attention_config, check_array, check_attention_dtypes,
                                 check_attention_shapes, check_bool, check_softmax_scale,
                                 check_window)
from jax_fa3.hadamard import hadamard_transform

E4M3 = jnp.float8_e4m3fn
E4M3_MAX = 448.0
P_OFFSET_LOG2 = 6  # FA3's Max_offset idea (FA3 uses 8): P is quantized as e4m3(2^6 · P)
# Lazy running max (log2 units; cuda/flash_fwd/fp8_softmax.h kFp8LazyMaxMarginLog2): a row's max
# moves only when a key tile's scores exceed it by more than this, so P <= 2^2.8 and
# 2^6 · P <= 445.7 < 448: e4m3's range still holds it.
LAZY_MAX_MARGIN_LOG2 = 2.8
DEFAULT_BLOCK_SIZE = 64
EMULATION_TILE_K = 128
FP8_INPUT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
KERNEL_TARGET = "jax_fa3_flash_fwd_fp8"
# The fused rotate + quantize pass (cuda/quantize/rotate_quantize.h): 32 elements of a row per
# lane, head_dim a multiple of 32 up to 256, float32/bfloat16/float16 inputs, any block size.
ROTATE_QUANTIZE_TARGET = "jax_fa3_rotate_quantize_fp8"
ROTATE_QUANTIZE_MAX_DIM = 256
DEFAULT_SEED = 0  # key=None means jax.random.PRNGKey(DEFAULT_SEED)

_HIGHEST = lax.Precision.HIGHEST
_TINY = float(np.finfo(np.float32).tiny)
_LOG2E = 1.4426950408889634


@dataclasses.dataclass(frozen=True)
class Fp8Config:
  """Static options of one fp8 attention call (hashable: a custom_vjp nondiff argument)."""

  attention: AttentionConfig
  block_size: int = DEFAULT_BLOCK_SIZE
  incoherent: bool = True
  return_lse: bool = False
  tile_k: int = EMULATION_TILE_K
  # On the GPU, v's quantization pass writes the kernel's transposed V layout itself (no V
  # pre-pass inside the kernel call). False: quantize v as is and let the kernel transpose it
  # (what pre-quantized inputs get); benchmarks time both.
  transpose_v_in_quantize: bool = True

  # The attention options the partitioner's plan reads (jax_fa3.sharding.plan_partition).
  @property
  def window_left(self) -> int:
    return self.attention.window_left

  @property
  def window_right(self) -> int:
    return self.attention.window_right


# ---------------------------------------------------------------------------------------------
# Quantization
# ---------------------------------------------------------------------------------------------

def _check_block_size(block_size, allow_none: bool) -> int | None:
  if block_size is None:
    if allow_none:
      return None
    return DEFAULT_BLOCK_SIZE
  if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)):
    raise TypeError(f"block_size must be a positive int{' or None' if allow_none else ''}, "
                    f"got {block_size!r}")
  if block_size < 1:
    raise ValueError(f"block_size must be a positive int, got {block_size}")
  return int(block_size)


def _scale_from_amax(amax):
  """float32 scale = amax · float32(1/448), 1.0 where amax == 0, at least float32's smallest normal.

  A product with the float32-rounded reciprocal, not a division: XLA rewrites a division by a
  constant into exactly that, so we define it so and the CUDA quantizer does the same.
  """
  amax = amax.astype(jnp.float32)
  scale = jnp.maximum(amax * jnp.float32(1.0 / E4M3_MAX), jnp.float32(_TINY))
  return jnp.where(amax > 0, scale, jnp.float32(1.0))


def _to_e4m3(x):
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


def _per_token(scales, block_size, seqlen):
  """(b, h, n_blocks) scales -> (b, seqlen, h, 1): the scale of each token's block."""
  per_token = jnp.repeat(scales, block_size, axis=-1)[..., :seqlen]
  return jnp.swapaxes(per_token, 1, 2)[..., None]


def _quantize(x, block_size):
  """(values e4m3 (b, s, h, d), scales f32 (b, h, n_blocks)); block_size None: one block."""
  b, s, h, d = x.shape
  block = s if block_size is None else block_size
  n = -(-s // block)
  xf = x.astype(jnp.float32)
  padded = jnp.pad(jnp.abs(xf), ((0, 0), (0, n * block - s), (0, 0), (0, 0)))
  blocks = padded.reshape(b, n, block, h, d)
  # A NaN makes its block's amax NaN, hence scale 1.0, on every backend (XLA:CPU's max drops NaN,
  # XLA:GPU's and the CUDA pass's keep it).
  amax = jnp.where(jnp.isnan(blocks).any(axis=(2, 4)), jnp.nan, blocks.max(axis=(2, 4)))  # (b, n, h)
  scales = _scale_from_amax(jnp.swapaxes(amax, 1, 2))  # (b, h, n)
  # The reciprocal is taken per block, then multiplied (the contract above, explicit here so
  # that it does not hang on XLA's simplifier rewriting x / broadcast(scale)).
  values = _to_e4m3(xf * _per_token(1.0 / scales, block, s))
  return values, scales


def _no_mean():
  """The mean operand of a pass that subtracts none (an empty array: the CUDA pass's 'none')."""
  return jnp.zeros((0,), jnp.float32)


def _xla_rotate_quantize(x, signs, rotate: bool, block_size, mean=None):
  """mean: (b, h, d) float32 subtracted after the rotation; None or empty (`_no_mean`): none."""
  x = x.astype(jnp.float32)
  if rotate:
    x = hadamard_transform(x, signs=signs)
  if mean is not None and mean.size:
    x = x - mean[:, None]
  return _quantize(x, block_size)


def _fused_quantize_supported(x, block_size) -> bool:
  d = x.shape[-1]
  return (x.shape[1] > 0 and d % 32 == 0 and 32 <= d <= ROTATE_QUANTIZE_MAX_DIM
          and any(x.dtype == np.dtype(t) for t in FP8_INPUT_DTYPES)
          and _ffi.kernels_available() and _ffi.has_target(ROTATE_QUANTIZE_TARGET))


# The kernel's V layout (cuda/flash_fwd/fp8_layout.h, fp8_key_of_slot): slot c of each group of
# 32 keys holds key KEY_OF_SLOT[c].
KEY_PAD = 32
KEY_OF_SLOT = tuple(16 * (c // 16) + 8 * ((c % 4) // 2) + 2 * ((c % 16) // 4) + c % 2
                    for c in range(KEY_PAD))


def _keys_transposed(values):
  """e4m3 (b, s, h, d) -> the fp8 kernel's V layout (b, h, d, s_pad): keys last, padded with
  zeros to s_pad = s rounded up to 32, permuted inside each group of 32 (KEY_OF_SLOT). What the
  CUDA pass writes in its keys-transposed mode; here for vmap lanes that take the XLA path."""
  b, s, h, d = values.shape
  s_pad = -(-s // KEY_PAD) * KEY_PAD
  padded = jnp.pad(values, ((0, 0), (0, s_pad - s), (0, 0), (0, 0)))
  slots = (np.arange(s_pad) // KEY_PAD) * KEY_PAD + np.asarray(KEY_OF_SLOT)[np.arange(s_pad) % KEY_PAD]
  return jnp.transpose(padded[:, slots], (0, 2, 3, 1))


def _xla_quantize_keys_transposed(x, signs, mean, rotate: bool):
  values, scales = _xla_rotate_quantize(x, signs, rotate, None, mean)
  return _keys_transposed(values), scales


# Tokens per chunk of the CUDA pass's chunked kernels (cuda/quantize/rotate_quantize.h,
# kRotateQuantizeChunkTokens): sizes the centring workspace.
ROTATE_QUANTIZE_CHUNK_TOKENS = 128


def _fused_rotate_quantize(rotate: bool, block_size: int | None, keys_transposed: bool = False,
                           centre: bool = False):
  """The CUDA pass as a function of (x, signs32, mean) -> (values, scales, mean_out); vmap folds
  a mapped axis into the batch.

  mean: (b, h, d) float32 to subtract before quantizing, or empty (`_no_mean`) for none.
  keys_transposed (one block per head only): values come back in the fp8 kernel's V layout
  (b, h, d, s_pad), see `_keys_transposed`.
  centre (one block per head only, mean empty, no rotation): the pass takes each head's float32
  mean over its tokens itself (`_v_mean`'s, up to the summation order), subtracts it and returns
  it as mean_out (b, h, d); else mean_out is empty.
  """
  assert not (keys_transposed or centre) or block_size is None
  assert not (centre and rotate)
  _ffi.ensure_registered()

  def xla_lane(x, s, m):
    if centre:
      m = _v_mean(x)
    if keys_transposed:
      values, scales = _xla_quantize_keys_transposed(x, s, m, rotate=rotate)
    else:
      values, scales = _xla_rotate_quantize(x, s, rotate, block_size, m)
    return values, scales, m if centre else _no_mean()

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
    values, scales, mean_out, _ = jax.ffi.ffi_call(ROTATE_QUANTIZE_TARGET, result_types)(
        x, signs32, mean, rotate=np.bool_(rotate), block_size=np.int32(block),
        keys_transposed=np.bool_(keys_transposed), centre=np.bool_(centre))
    return values, scales, mean_out

  @call.def_vmap
  def _rule(axis_size, in_batched, x, signs32, mean):
    x_batched, signs_batched, mean_batched = in_batched
    if signs_batched:  # a rotation per lane: the XLA path, lane by lane
      in_axes = (0 if x_batched else None, 0, 0 if mean_batched else None)
      values, scales, mean_out = jax.vmap(xla_lane, in_axes=in_axes)(x, signs32, mean)
      return (values, scales, mean_out if centre else _no_mean()), (True, True, centre)
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


def _rotate_quantize(x, signs32, rotate: bool, block_size, mean=None):
  """(values, scales) of x, rotated by H·diag(signs32) first when `rotate`, then less `mean`
  ((b, h, d) float32) when given.

  One fused CUDA pass on a Hopper GPU where it applies (`_fused_quantize_supported`), else XLA:
  a float32 copy, `hadamard_transform`, then `_quantize`. Same numerics (the module docstring).
  """
  mean = _no_mean() if mean is None else mean
  xla = lambda x, s, m: _xla_rotate_quantize(x, s, rotate, block_size, m)
  if not _fused_quantize_supported(x, block_size):
    return xla(x, signs32, mean)
  _ffi.ensure_registered()
  fused = _fused_rotate_quantize(rotate, block_size)
  return lax.platform_dependent(x, signs32, mean, cuda=lambda *a: fused(*a)[:2], default=xla)


def _v_mean(v):
  """float32 (b, h_k, d): v's mean over the keys, by which the call from floats centres v."""
  return jnp.sum(v.astype(jnp.float32), axis=1) / jnp.float32(max(v.shape[1], 1))


@functools.partial(jax.jit, static_argnums=(1,))
def _quantize_jit(x, block_size):
  return _rotate_quantize(x, jnp.ones(x.shape[-1:], jnp.float32), False, block_size)


def _check_4d_float(name, x, allowed):
  check_array(name, x, rank=4)
  if not any(x.dtype == np.dtype(t) for t in allowed):
    names = ", ".join(np.dtype(t).name for t in allowed)
    raise TypeError(f"{name} must have a floating dtype in ({names}), got {x.dtype}")


def quantize_fp8(x, *, block_size=DEFAULT_BLOCK_SIZE):
  """Quantizes x to e4m3 with one float32 scale per (batch, head, block of tokens).

  For each block of `block_size` consecutive tokens of one (batch, head) — the last block may be
  shorter — `scale = amax(|block|) · float32(1/448)` (448 = e4m3's largest finite value; an all-zero block
  gets scale 1.0, and no scale is below float32's smallest normal) and
  `values = e4m3(clip(float32(x) · (1/scale), -448, 448))`, rounding to nearest even. Every element of a
  block is therefore represented with e4m3's relative precision (a step of 2^-3 relative to the
  power of two below it, so a rounding error of at most 2^-4 relative) unless it is more than
  2^15 times smaller than the block's largest (e4m3's subnormal range). A NaN gives its block scale
  1.0 (values NaN where x is NaN); an infinity gives an infinite scale (values 0, NaN at the inf).

  Args:
    x: (batch, seqlen, heads, head_dim), float32/bfloat16/float16/float64 (quantized from its
      float32 value).
    block_size: tokens per scale (default 64); None for one scale per (batch, head).

  Returns:
    (values, scales): values float8_e4m3fn with x's shape; scales float32
    (batch, heads, ceil(seqlen / block_size)). `dequantize_fp8(values, scales,
    block_size=block_size)` approximates x.
  """
  _check_4d_float("x", x, FP8_INPUT_DTYPES + (jnp.float64,))
  block_size = _check_block_size(block_size, allow_none=True)
  return _quantize_jit(x, block_size)


def _check_quantized(name, values, scales, block_size, allow_per_head=False):
  """Validates a (values, scales) pair; returns scales as (b, h, n_blocks)."""
  check_array(f"{name} values", values, rank=4)
  if values.dtype != np.dtype(E4M3):
    raise TypeError(f"{name} values must be float8_e4m3fn, got {values.dtype}")
  check_array(f"{name} scales", scales)
  if scales.dtype != np.dtype(jnp.float32):
    raise TypeError(f"{name} scales must be float32, got {scales.dtype}")
  b, s, h, _ = values.shape
  n = -(-s // (s if block_size is None else block_size))
  expected = (b, h, n)
  if allow_per_head and tuple(scales.shape) == (b, h):
    return scales[..., None]
  if tuple(scales.shape) != expected:
    how = ("one scale per (batch, head): quantize_fp8(v, block_size=None)" if block_size is None
           else f"block_size={block_size}")
    raise ValueError(f"{name} scales must have shape {expected} (batch, heads, blocks) for "
                     f"values of shape {values.shape} with {how}, got {tuple(scales.shape)}")
  return scales


def dequantize_fp8(values, scales, *, block_size=DEFAULT_BLOCK_SIZE, dtype=jnp.float32):
  """The inverse of quantize_fp8: float32(values) * scale of each token's block, cast to dtype.

  Args:
    values: float8_e4m3fn (batch, seqlen, heads, head_dim).
    scales: float32 (batch, heads, ceil(seqlen / block_size)).
    block_size: the block size used to quantize (default 64; None for one block per head).
    dtype: result dtype (default float32).
  """
  block_size = _check_block_size(block_size, allow_none=True)
  scales = _check_quantized("x", values, scales, block_size)
  block = values.shape[1] if block_size is None else block_size
  return (values.astype(jnp.float32) * _per_token(scales, block, values.shape[1])).astype(dtype)


# ---------------------------------------------------------------------------------------------
# The fp8 forward: kernel or emulation
# ---------------------------------------------------------------------------------------------

def _visible(s_q, s_k, window_left, window_right, key_start, block_k):
  """(s_q, block_k) bool: query i may see key key_start + j (docs/CONTRACTS.md; padded keys never)."""
  query = jnp.arange(s_q)[:, None]
  key = key_start + jnp.arange(block_k)[None, :]
  diagonal = query + (s_k - s_q)  # bottom-right alignment
  visible = key < s_k
  if window_left >= 0:
    visible &= key >= diagonal - window_left
  if window_right >= 0:
    visible &= key <= diagonal + window_right
  return visible


def _key_tiles(x, block_k):
  """(b, s_k, h_k, e) -> (n_tiles, b, block_k, h_k, e), zero-padded."""
  b, s, h_k, e = x.shape
  n = -(-s // block_k)
  x = jnp.pad(x, ((0, 0), (0, n * block_k - s), (0, 0), (0, 0)))
  return jnp.moveaxis(x.reshape(b, n, block_k, h_k, e), 1, 0)


def _emulated_forward(q8, k8, v8, q_scale, k_scale, v_scale, cfg: Fp8Config, v_mean=None):
  """Pure-JAX emulation of the kernel's numerics (see the module docstring). -> (out bf16, lse).

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
  row = _per_token(q_scale, cfg.block_size, s_q) * f32(att.softmax_scale * _LOG2E)
  row = row[..., 0].reshape(b, s_q, h_k, g)
  row = jnp.einsum("bqhg->bhgq", row)[..., None]  # (b, h_k, g, s_q, 1)
  q = q8.astype(f32).reshape(b, s_q, h_k, g, d)
  k_tiles = _key_tiles(k8.astype(f32), block_k)  # (n, b, bk, h_k, d)
  col_tiles = _key_tiles(_per_token(k_scale, cfg.block_size, s_k), block_k)[..., 0]
  v_tiles = _key_tiles(v8.astype(f32), block_k)
  p_offset = f32(2.0 ** P_OFFSET_LOG2)

  def step(carry, inputs):
    row_max, row_sum, acc = carry  # (b, h_k, g, s_q) x2, (b, h_k, g, s_q, d)
    k_tile, col_tile, v_tile, tile_index = inputs
    raw = jnp.einsum("bqhgd,bkhd->bhgqk", q, k_tile, precision=_HIGHEST)  # exact products
    col = jnp.einsum("bkh->bhk", col_tile)[:, :, None, None, :]  # (b, h_k, 1, 1, bk)
    scores = raw * (row * col)  # descaled, log2 domain: the kernel's per-(row, key) coefficient
    visible = _visible(s_q, s_k, att.window_left, att.window_right, tile_index * block_k,
                       block_k)
    scores = jnp.where(visible, scores, -jnp.inf)
    tile_max = jnp.maximum(row_max, scores.max(axis=-1))
    # The lazy max: kept unless exceeded by more than the margin (-inf - -inf is NaN: kept).
    new_max = jnp.where(tile_max - row_max > f32(LAZY_MAX_MARGIN_LOG2), tile_max, row_max)
    # A row that has seen nothing yet has max -inf: shift by 0 so exp2(-inf - shift) = 0.
    shift = jnp.where(jnp.isneginf(new_max), 0.0, new_max)
    rescale = jnp.exp2(row_max - shift)
    probs = jnp.exp2(scores - shift[..., None])
    probs8 = _to_e4m3(probs * p_offset).astype(f32)  # e4m3(2^6 · P), P <= 2^2.8
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


KERNEL_HEAD_DIM_BUCKETS = (64, 128, 256)  # cuda/flash_fwd/flash_fwd_fp8.h kFp8HeadDimBuckets


def _kernel_forward(cfg: Fp8Config, v_transposed: bool = False):
  """The kernel call; v_transposed: v is already in its layout (b, h_k, d, s_pad)."""
  _ffi.ensure_registered()
  att = cfg.attention

  def call(q8, k8, v8, q_scale, k_scale, v_scale, v_mean):
    b, s_q, h, d = q8.shape
    s_k, h_k = k8.shape[1], k8.shape[2]
    # V transposed unless v arrives so, the k scales (k_col), the tail split's slots: the size lives
    # in C++ only (flash_fwd_fp8_workspace_bytes), which the handler checks the buffer against.
    masked = att.window_left >= 0 or att.window_right >= 0
    workspace = max(16, _ffi.flash_fwd_fp8_workspace_bytes(b, s_q, s_k, h, h_k, d, masked,
                                                          v_transposed))
    result_types = (jax.ShapeDtypeStruct(q8.shape, jnp.bfloat16),
                    jax.ShapeDtypeStruct((b, h, s_q), jnp.float32),
                    # scratch (transposed V, expanded k scales), dropped: XLA allocates it with
                    # the call's temporaries (the FFI ScratchAllocator gave nothing on the H200)
                    jax.ShapeDtypeStruct((workspace,), jnp.uint8))
    out, lse, _ = jax.ffi.ffi_call(KERNEL_TARGET, result_types)(
        q8, k8, v8, q_scale, k_scale, v_scale, v_mean, softmax_scale=np.float32(att.softmax_scale),
        window_left=np.int32(att.window_left), window_right=np.int32(att.window_right),
        block_size=np.int32(cfg.block_size), v_transposed=np.bool_(v_transposed))
    return out, lse

  return fold_vmap_into_batch(call)


def _kernel_bucket(d: int) -> int | None:
  """The compiled fp8 head-dim bucket that runs head dim d (None: no kernel for d)."""
  if d % 16 != 0:
    return None
  compiled = _ffi.build_config().get("head_dims", ())
  for bucket in KERNEL_HEAD_DIM_BUCKETS:
    if d <= bucket and str(bucket) in compiled:
      return bucket
  return None


def _kernel_unavailable_reason(d: int | None = None) -> str | None:
  if not _ffi.kernels_available():
    return _ffi.kernels_unavailable_reason()
  if not _ffi.has_target(KERNEL_TARGET):
    return f"this build has no {KERNEL_TARGET} kernel"
  if d is not None and _kernel_bucket(d) is None:
    return (f"no fp8 kernel for head_dim {d} in this build (needs a multiple of 16 up to a "
            f"compiled bucket of {KERNEL_HEAD_DIM_BUCKETS}; JAX_FA3_HEAD_DIMS at build time)")
  return None


@functools.partial(jax.jit, static_argnums=(7,))
def _fp8_forward_jit(q8, k8, v8, q_scale, k_scale, v_scale, v_mean, cfg: Fp8Config):
  def emulate(*args):
    return _emulated_forward(*args[:6], cfg, v_mean=args[6])
  reason = _kernel_unavailable_reason(q8.shape[-1])
  if reason is not None:
    _ffi.announce_once(f"fp8:{reason}", f"jax_fa3: emulating the fp8 attention kernel in pure "
                       f"JAX: {reason}")
    return emulate(q8, k8, v8, q_scale, k_scale, v_scale, v_mean)
  _ffi.ensure_registered()
  return lax.platform_dependent(q8, k8, v8, q_scale, k_scale, v_scale, v_mean,
                                cuda=_kernel_forward(cfg), default=emulate)


def fp8_forward(q8, k8, v8, q_scale, k_scale, v_scale, cfg: Fp8Config, v_mean=None):
  """(out bf16, lse f32) from quantized inputs: v_scale (b, h_k), v_mean float32 (b, h_k, d) that
  v was centred by (None: 0). Kernel on Hopper, else emulated."""
  # Only the attention options, block size and tile shape the computation (one compilation for
  # rotated and unrotated inputs, with or without a returned lse).
  cfg = dataclasses.replace(cfg, incoherent=False, return_lse=False)
  if v_mean is None:
    b, _, h_k, d = k8.shape
    v_mean = jnp.zeros((b, h_k, d), jnp.float32)
  return _fp8_forward_jit(q8, k8, v8, q_scale, k_scale, v_scale, v_mean, cfg)


@functools.partial(jax.jit, static_argnums=(4, 5))
def _rotate_and_quantize(q, k, v, signs, incoherent: bool, block_size: int):
  """The seven inputs of `fp8_forward` from floats: v centred by its mean (module docstring)."""
  q8, q_scale = _rotate_quantize(q, signs, incoherent, block_size)
  k8, k_scale = _rotate_quantize(k, signs, incoherent, block_size)
  v_mean = _v_mean(v)
  v8, v_scale = _rotate_quantize(v, signs, False, None, v_mean)
  return q8, k8, v8, q_scale, k_scale, v_scale[..., 0], v_mean


def _v_transposed_by_quantize(v, cfg: Fp8Config) -> bool:
  """Whether the user's call from floats runs v's quantization in the kernel's V layout: the
  fp8 kernel and the fused pass both apply, and the config asks for it."""
  return (cfg.transpose_v_in_quantize and _kernel_unavailable_reason(v.shape[-1]) is None
          and _fused_quantize_supported(v, None))


def _quantize_v_kernel_layout(v, v_mean=None):
  """(vt, v_scale (b, h_k)): v (less v_mean (b, h_k, d) when given) quantized (one scale per
  head, no rotation) by the CUDA pass straight into the fp8 kernel's V layout (b, h_k, d, s_pad);
  GPU only."""
  vt, v_scale, _ = _fused_rotate_quantize(False, None, keys_transposed=True)(
      v, jnp.ones(v.shape[-1:], jnp.float32), _no_mean() if v_mean is None else v_mean)
  return vt, v_scale[..., 0]


def _centre_v_kernel_layout(v):
  """(vt, v_scale (b, h_k), v_mean (b, h_k, d)): v centred by its mean over the keys, both taken
  by the CUDA pass (one read of v for the mean, the amax and the column extremes, one more for
  the quantization) straight into the fp8 kernel's V layout; GPU only."""
  vt, v_scale, v_mean = _fused_rotate_quantize(False, None, keys_transposed=True, centre=True)(
      v, jnp.ones(v.shape[-1:], jnp.float32), _no_mean())
  return vt, v_scale[..., 0], v_mean


def _kernel_from_float(q, k, v, signs, cfg: Fp8Config):
  """The GPU branch: q, k quantized as everywhere, v centred straight into the kernel's layout."""
  q8, q_scale = _rotate_quantize(q, signs, cfg.incoherent, cfg.block_size)
  k8, k_scale = _rotate_quantize(k, signs, cfg.incoherent, cfg.block_size)
  vt, v_scale, v_mean = _centre_v_kernel_layout(v)
  return _kernel_forward(cfg, v_transposed=True)(q8, k8, vt, q_scale, k_scale, v_scale, v_mean)


def _float_path(q, k, v, signs, cfg: Fp8Config):
  *quantized, v_mean = _rotate_and_quantize(q, k, v, signs, cfg.incoherent, cfg.block_size)
  return fp8_forward(*quantized, cfg, v_mean=v_mean)


@functools.partial(jax.jit, static_argnums=(4,))
def _kernel_from_float_jit(q, k, v, signs, cfg: Fp8Config):
  _ffi.ensure_registered()
  return lax.platform_dependent(q, k, v, signs,
                                cuda=functools.partial(_kernel_from_float, cfg=cfg),
                                default=functools.partial(_float_path, cfg=cfg))


def _fp8_from_float_local(q, k, v, signs, cfg: Fp8Config):
  """The call from floats on one device's blocks (the partitioned op's local body; cfg arrives
  with return_lse off, see _fp8_from_float)."""
  if _v_transposed_by_quantize(v, cfg):
    out, lse = _kernel_from_float_jit(q, k, v, signs, cfg)
  else:
    out, lse = _float_path(q, k, v, signs, cfg)
  return out.astype(q.dtype), lse


# The call from floats as one partitioned op (jax_fa3.sharding): under a sharded jit its CUDA
# passes would otherwise be opaque to XLA (operands all-gathered), and the pure-JAX path's
# reshapes do not type-check on Explicit meshes. Batch and heads stay sharded (scales are per
# (batch, head, block), so each shard quantizes exactly as the whole would); a sequence split
# is gathered (blocks of tokens share a scale, and v's scale spans the whole sequence).
FP8_FORWARD = sharding.AttentionOp("flash_fwd_fp8", ("q", "kv", "kv", "vec"), ("q", "row"),
                                   _fp8_from_float_local, split_queries=False)


def _fp8_from_float(q, k, v, signs, cfg: Fp8Config):
  out, lse = sharding.call_partitioned(FP8_FORWARD, (q, k, v, signs),
                                       dataclasses.replace(cfg, return_lse=False))
  return out, lse


# ---------------------------------------------------------------------------------------------
# Differentiation: straight-through to the unquantized attention
# ---------------------------------------------------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _fp8_attention(q, k, v, signs, cfg: Fp8Config):
  return _fp8_from_float(q, k, v, signs, cfg)


def _fp8_attention_fwd(q, k, v, signs, cfg):
  return _fp8_from_float(q, k, v, signs, cfg), (q, k, v, signs)


def _fp8_attention_bwd(cfg, residuals, cotangents):
  q, k, v, signs = residuals
  dout, dlse = cotangents
  # The bf16 backward recomputes P = exp(S - lse) from the unquantized scores, so it needs the lse
  # (and out, for D = rowsum(dO·O)) of the unquantized forward: the fp8 ones differ by the fp8
  # error and would give a P that does not sum to one.
  out, lse = _ops.forward(q, k, v, cfg.attention)
  dq, dk, dv = _ops.backward(q, k, v, out, lse, dout.astype(q.dtype), cfg.attention,
                             dlse=dlse if cfg.return_lse else None)
  return dq, dk, dv, jnp.zeros_like(signs)


_fp8_attention.defvjp(_fp8_attention_fwd, _fp8_attention_bwd)


# ---------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------

def _is_pair(x) -> bool:
  return isinstance(x, (tuple, list))


def _random_signs(key, d):
  if key is None:
    key = jax.random.PRNGKey(DEFAULT_SEED)
  try:
    return jax.random.rademacher(key, (d,), dtype=jnp.float32)
  except (TypeError, ValueError) as e:
    raise TypeError(f"key must be a JAX PRNG key (jax.random.key or jax.random.PRNGKey), "
                    f"got {getattr(key, 'dtype', type(key).__name__)} "
                    f"{getattr(key, 'shape', '')}: {e}") from None


def _check_signs(signs, d):
  check_array("signs", signs)
  if tuple(signs.shape) != (d,):
    raise ValueError(f"signs must have shape ({d},) (head_dim), got {tuple(signs.shape)}")
  if not jnp.issubdtype(signs.dtype, jnp.floating) and not jnp.issubdtype(signs.dtype,
                                                                          jnp.integer):
    raise TypeError(f"signs must be a float or int array of ±1, got {signs.dtype}")
  if not isinstance(signs, jax.core.Tracer):
    values = np.asarray(signs)
    if not np.all(np.abs(values) == 1):
      raise ValueError("signs must contain only +1 and -1 (otherwise the rotation is not "
                       "orthogonal and q·k changes)")
  return jnp.asarray(signs, jnp.float32)


def flash_attention_fp8(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1),
                        incoherent=True, block_size=None, key=None, signs=None,
                        return_lse=False, v_mean=None):
  """Attention with q, k, v quantized to FP8 (e4m3): FlashAttention-3's FP8 forward.

  q and k are rotated by the same random orthogonal matrix H·diag(signs) (incoherent processing,
  `hadamard_transform`), then q and k are quantized to e4m3 with one float32 scale per (batch,
  head, block of `block_size` tokens) and v, centred by its mean over the keys, with one scale
  per (batch, kv-head); the attention runs on the fp8 values (P quantized as e4m3(2^6·P)),
  accumulates in float32, adds v's mean back and returns bfloat16 from the kernel. See the
  docstring of `jax_fa3.fp8` for the exact numerics; without a Hopper GPU and the fp8 kernel, a
  pure-JAX path emulates them exactly (announced once on the `jax_fa3` logger).

  Args:
    q: (batch, seqlen_q, heads, head_dim) float32/bfloat16/float16; or a pair (values, scales)
      from `quantize_fp8(q, block_size=block_size)`.
    k, v: (batch, seqlen_k, heads_k, head_dim), like q (heads a multiple of heads_k: GQA/MQA).
      Pre-quantized: k as `quantize_fp8(k, block_size=block_size)`, v as
      `quantize_fp8(v, block_size=None)` (scales (batch, heads_k, 1) or (batch, heads_k)).
      Either all three are arrays or all three are pairs; pairs need `incoherent=False` (rotate
      q and k with `hadamard_transform(x, signs=...)` before quantizing them) and are not
      differentiable.
    softmax_scale, causal, window_size: as for `flash_attention` (default scale 1/sqrt(head_dim)).
    incoherent: rotate q and k before quantizing (default True). `key`/`signs` are ignored when
      False.
    block_size: tokens per q/k scale (default 64). On the GPU kernel, multiples of 32 run its
      fast path (one k scale per 32-key group, folded into the exp2 coefficient); any other size
      is exact too but descales every score separately (slower).
    key: JAX PRNG key for the random ±1 signs (default `jax.random.PRNGKey(0)`, so that calls
      are deterministic; pass your own key to re-draw the rotation).
    signs: (head_dim,) array of ±1 to use instead of drawing them from `key` (e.g. a stored
      model variable); give `key` or `signs`, not both.
    return_lse: also return the float32 (batch, heads, seqlen_q) natural-log log-sum-exp of the
      (fp8) scores.
    v_mean: pre-quantized v only: the (batch, heads_k, head_dim) float32 mean that v was centred
      by before `quantize_fp8` (v quantized as v - v_mean[:, None]); it is added back to every
      output row that sees a key. Centre v whose values share a sign: the fp8 tensor cores
      accumulate P·V with about 13 mantissa bits, so an uncentred V with a large mean comes out
      low at long sequences (docs/CONTRACTS.md). Arrays are centred by the call itself.

  Returns:
    out (batch, seqlen_q, heads, head_dim) in q's dtype (bfloat16 for pre-quantized inputs), or
    (out, lse) when return_lse.

  Gradients are straight-through: the backward is that of `flash_attention` (bf16/fp16/fp32) at
  the unquantized, unrotated inputs — it recomputes their forward, then runs its backward.

  Under a sharded jit (Auto or Explicit meshes) batch and head shards run locally and give the
  unsharded result bit for bit; a sequence split is gathered first (quantization blocks and v's
  per-head scale span the sequence). Inside shard_map / pmap it runs per device as is.
  """
  pairs = [_is_pair(x) for x in (q, k, v)]
  causal = check_bool("causal", causal)
  incoherent = check_bool("incoherent", incoherent)
  return_lse = check_bool("return_lse", return_lse)
  if any(pairs):
    return _flash_attention_prequantized(q, k, v, pairs, softmax_scale=softmax_scale,
                                         causal=causal, window_size=window_size,
                                         incoherent=incoherent, block_size=block_size,
                                         return_lse=return_lse, v_mean=v_mean)
  if v_mean is not None:
    raise ValueError("v_mean is for pre-quantized v (a (values, scales) pair); a float v is "
                     "centred by the call itself")
  check_attention_shapes(q, k, v)
  check_attention_dtypes(q, k, v, allowed=FP8_INPUT_DTYPES)
  att = attention_config(q, k, v, softmax_scale=softmax_scale, causal=causal,
                         window_size=window_size, softcap=0.0, deterministic=False)
  cfg = Fp8Config(att, block_size=_check_block_size(block_size, allow_none=False),
                  incoherent=incoherent, return_lse=return_lse)
  d = q.shape[-1]
  if incoherent:
    if signs is not None and key is not None:
      raise ValueError("give key (to draw random signs) or signs, not both")
    signs = _check_signs(signs, d) if signs is not None else _random_signs(key, d)
  else:
    signs = jnp.ones((d,), jnp.float32)  # unused
  out, lse = _fp8_attention(q, k, v, signs, cfg)
  return (out, lse) if return_lse else out


def _check_v_mean(v_mean, k8):
  if v_mean is None:
    return None
  b, _, h_k, d = k8.shape
  check_array("v_mean", v_mean)
  if not jnp.issubdtype(v_mean.dtype, jnp.floating):
    raise TypeError(f"v_mean must be a floating array (used as float32), got {v_mean.dtype}")
  if tuple(v_mean.shape) != (b, h_k, d):
    raise ValueError(f"v_mean must have shape {(b, h_k, d)} (batch, heads_k, head_dim), got "
                     f"{tuple(v_mean.shape)}")
  return jnp.asarray(v_mean, jnp.float32)


def _flash_attention_prequantized(q, k, v, pairs, *, softmax_scale, causal, window_size,
                                  incoherent, block_size, return_lse, v_mean):
  if not all(pairs):
    raise TypeError("q, k and v must be all arrays or all (values, scales) pairs from "
                    "quantize_fp8, got " + ", ".join(
                        f"{n}={'pair' if p else 'array'}" for n, p in zip("qkv", pairs)))
  for name, x in (("q", q), ("k", k), ("v", v)):
    if len(x) != 2:
      raise TypeError(f"pre-quantized {name} must be a (values, scales) pair, got {len(x)} items")
  if incoherent:
    raise ValueError("pre-quantized q and k cannot be rotated here: rotate them with "
                     "hadamard_transform(x, signs=...) before quantize_fp8 and pass "
                     "incoherent=False")
  block_size = _check_block_size(block_size, allow_none=False)
  (q8, q_scale), (k8, k_scale), (v8, v_scale) = q, k, v
  check_attention_shapes(q8, k8, v8)
  q_scale = _check_quantized("q", q8, q_scale, block_size)
  k_scale = _check_quantized("k", k8, k_scale, block_size)
  v_scale = _check_quantized("v", v8, v_scale, None, allow_per_head=True)
  v_mean = _check_v_mean(v_mean, k8)
  left, right = check_window(window_size)
  if causal:
    if right > 0:
      raise ValueError(f"causal=True means window_size right = 0; got window_size={window_size!r}")
    right = 0
  att = AttentionConfig(softmax_scale=check_softmax_scale(softmax_scale, q8.shape[-1]),
                        window_left=left, window_right=right)
  cfg = Fp8Config(att, block_size=block_size, incoherent=False, return_lse=return_lse)
  out, lse = fp8_forward(q8, k8, v8, q_scale, k_scale, v_scale[..., 0], cfg, v_mean=v_mean)
  return (out, lse) if return_lse else out
