"""jax_fa3.hadamard_transform: orthonormal Walsh–Hadamard transform over the last axis.

For a last axis of length d = p·m, p the largest power of two dividing d, the transform is
block-diagonal: each of the m contiguous blocks of p elements is multiplied by H_p / sqrt(p)
(the full transform when d is a power of two; three blocks of 32 for d=96, of 64 for d=192).
It is orthogonal for every d, which is all incoherent processing needs: rotating q and k by the
same orthogonal R leaves q·k unchanged. An optional ±1 vector `signs` is applied first
(x -> H·diag(signs)·x), giving a random orthogonal rotation when the signs are random;
`inverse=True` undoes it (x -> diag(signs)·H·x, the transpose, since H is symmetric).
`out_dtype` rounds a float32 transform once to bfloat16 or float16 on the way out (what a float32
gradient rotated back into its parameter's dtype needs), without a separate conversion pass.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_fa3 import _ffi

_KERNEL_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
MAX_KERNEL_DIM = 8192


def hadamard_block_size(d: int) -> int:
  """The size p of the diagonal blocks used for a last axis of length d."""
  return d & (-d)


def hadamard_reference(x, signs, inverse=False, out_dtype=None):
  d = x.shape[-1]
  p = hadamard_block_size(d)
  compute = jnp.float64 if x.dtype == jnp.float64 else jnp.float32
  y = x.astype(compute)
  if signs is not None and not inverse:
    y = y * signs.astype(compute)
  lead = y.shape[:-1]
  # Butterfly stage h: pairs (j, j + h) inside each group of 2h; log2(p) stages, O(d log d).
  h = 1
  while h < p:
    y = y.reshape(lead + (d // (2 * h), 2, h))
    a, b = y[..., 0, :], y[..., 1, :]
    y = jnp.stack([a + b, a - b], axis=-2)
    h *= 2
  y = y.reshape(lead + (d,)) * (1.0 / np.sqrt(p))
  if signs is not None and inverse:
    y = y * signs.astype(compute)
  return y.astype(x.dtype if out_dtype is None else out_dtype)


def _hadamard_kernel(apply_signs: bool, inverse: bool = False, out_dtype=None):
  """The CUDA kernel treats every leading axis as rows, so a vmapped x is just more rows."""

  @jax.custom_batching.custom_vmap
  def call(x, signs32):
    result = jax.ShapeDtypeStruct(x.shape, x.dtype if out_dtype is None else out_dtype)
    return _ffi.call("jax_fa3_hadamard", result, x, signs32,
                     apply_signs=np.bool_(apply_signs), signs_after=np.bool_(inverse))

  @call.def_vmap
  def _rule(axis_size, in_batched, x, signs32):
    x_batched, signs_batched = in_batched
    if not x_batched:
      x = jnp.broadcast_to(x[None], (axis_size,) + x.shape)
    if signs_batched:  # per-lane signs: an unsigned transform, and the signs applied here
      lane_signs = signs32.reshape((axis_size,) + (1,) * (x.ndim - 2) + signs32.shape[-1:])
      ones = jnp.ones(signs32.shape[-1:], jnp.float32)
      result_dtype = x.dtype if out_dtype is None else out_dtype
      if inverse:
        y = _hadamard_kernel(False)(x, ones)
        return (y.astype(jnp.float32) * lane_signs).astype(result_dtype), True
      x = (x.astype(jnp.float32) * lane_signs).astype(x.dtype)
      return _hadamard_kernel(False, out_dtype=out_dtype)(x, ones), True
    return call(x, signs32), True

  return call


def hadamard_transform(x, *, signs=None, inverse=False, out_dtype=None):
  """Orthonormal (block-diagonal when d is not a power of two) Walsh–Hadamard transform.

  Args:
    x: array (..., d), float32/float64/bfloat16/float16, d >= 1.
    signs: optional (d,) array (normally ±1) multiplied into x before the transform.
    inverse: the inverse of the transform with these signs, x -> diag(signs)·H·x (the signs
      multiply the transform's output; without signs H is its own inverse).
    out_dtype: the result's dtype: x's (None), or bfloat16 / float16 for a float32 x (the
      float32 transform rounded once).
  Returns:
    array of x's shape, in out_dtype.
  """
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise TypeError(f"x must be a JAX or NumPy array, got {type(x).__name__}")
  if x.ndim < 1 or x.shape[-1] < 1:
    raise ValueError(f"x must have rank >= 1 and a non-empty last axis, got shape {x.shape}")
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"x must have a floating dtype, got {x.dtype}")
  if not isinstance(inverse, (bool, np.bool_)):
    raise TypeError(f"inverse must be a bool, got {type(inverse).__name__}")
  if out_dtype is not None:
    try:
      out_dtype = np.dtype(out_dtype)
    except TypeError:
      raise TypeError(f"out_dtype must be a dtype, got {out_dtype!r}") from None
    narrowing = (np.dtype(x.dtype) == np.dtype(jnp.float32)
                 and out_dtype in (np.dtype(jnp.bfloat16), np.dtype(jnp.float16)))
    if out_dtype == np.dtype(x.dtype):
      out_dtype = None
    elif not narrowing:
      raise ValueError(f"out_dtype must be x's dtype ({x.dtype}), or bfloat16 / float16 for a "
                       f"float32 x; got {out_dtype} for {x.dtype}")
  d = x.shape[-1]
  if signs is not None:
    if not hasattr(signs, "shape") or tuple(signs.shape) != (d,):
      raise ValueError(f"signs must have shape ({d},) to match the last axis of x, "
                       f"got {getattr(signs, 'shape', type(signs).__name__)}")
  if np.dtype(x.dtype) not in _KERNEL_DTYPES or d > MAX_KERNEL_DIM or not _ffi.kernels_available():
    return hadamard_reference(x, signs, inverse, out_dtype)
  apply_signs = signs is not None
  signs32 = (jnp.asarray(signs, jnp.float32) if apply_signs else jnp.ones((d,), jnp.float32))

  inverse = bool(inverse) and apply_signs
  return jax.lax.platform_dependent(
      x, signs32, cuda=_hadamard_kernel(apply_signs, inverse, out_dtype),
      default=lambda x, s: hadamard_reference(x, signs, inverse, out_dtype))
