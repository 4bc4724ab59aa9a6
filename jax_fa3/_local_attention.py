"""Attention forward/backward on one device: the Hopper kernels where they apply, else the
pure-JAX reference.

Dispatch happens at trace time; `jax.lax.platform_dependent` keeps a computation lowered for the
CPU on the reference path even on a machine with a Hopper GPU. Sharded arrays reach these
functions through the partitioning rules (`jax_fa3._partitioning`, wired up in
`jax_fa3.attention`), which hand them one device's blocks.
"""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from jax_fa3 import _ffi, _key_ranges, reference
from jax_fa3._batching import fold_vmap_into_batch
from jax_fa3._config import AttentionConfig

HEAD_DIM_BUCKETS = (64, 96, 128, 192, 256)
_KERNEL_DTYPES = {np.dtype(jnp.bfloat16): "bf16", np.dtype(jnp.float16): "fp16"}


def head_dim_bucket(head_dim: int) -> int:
  return next(b for b in HEAD_DIM_BUCKETS if b >= head_dim)


# The backward kernel runs by default on Hopper (tests/test_gpu_backward.py holds it to a float64
# oracle; speed in benchmarks/RESULTS.md). JAX_FA3_BWD_KERNEL=0 sends gradients to the pure-JAX
# backward instead (e.g. to bisect a suspected kernel problem).
BACKWARD_KERNEL_ENV = "JAX_FA3_BWD_KERNEL"


def backward_kernel_enabled() -> bool:
  return os.environ.get(BACKWARD_KERNEL_ENV, "1") != "0"


def _kernel_unsupported_reason(target: str, q) -> str | None:
  """None if `target` can run this call on the GPU, else the reason it cannot."""
  if not _ffi.kernels_available():
    return _ffi.kernels_unavailable_reason()
  if target.startswith("jax_fa3_flash_bwd") and not backward_kernel_enabled():
    return f"{BACKWARD_KERNEL_ENV}=0: the backward uses the pure-JAX path"
  if not _ffi.has_target(target):
    return f"this build has no {target} kernel"
  dtype = _KERNEL_DTYPES.get(np.dtype(q.dtype))
  if dtype is None:
    return f"the kernels run bfloat16/float16; {q.dtype} inputs use the pure-JAX path"
  return _not_compiled_reason(q.shape[-1], dtype)


def _not_compiled_reason(head_dim: int, dtype: str) -> str | None:
  """None if head_dim's bucket and dtype ('bf16', 'fp16') are in this build, else the reason."""
  config = _ffi.build_config()
  bucket = head_dim_bucket(head_dim)
  if str(bucket) not in config.get("head_dims", ()) or dtype not in config.get("dtypes", ()):
    return (f"head_dim bucket {bucket} / {dtype} was not compiled into this build "
            f"(JAX_FA3_HEAD_DIMS / JAX_FA3_DTYPES at build time)")
  return None


def _use_kernel(target: str, q) -> bool:
  reason = _kernel_unsupported_reason(target, q)
  if reason is not None:
    _ffi.announce_once(reason, f"jax_fa3: using the pure-JAX attention path: {reason}")
    return False
  return True


def window_attrs(cfg: AttentionConfig) -> dict:
  return dict(softmax_scale=np.float32(cfg.softmax_scale), softcap=np.float32(cfg.softcap),
              window_left=np.int32(cfg.window_left), window_right=np.int32(cfg.window_right))


# The kernels' targets by their key operands after the inputs: none (whole rows), the row
# bounds (one operand, _row_bounds; with the window) or per-query key ranges (the two operands of
# _key_ranges.kernel_operands; the ranges replace the window). The backward takes no bounds.
_FORWARD_TARGETS = {0: "jax_fa3_flash_fwd", 1: "jax_fa3_flash_fwd_row_bounds",
                    2: "jax_fa3_flash_fwd_key_ranges"}
_BACKWARD_TARGETS = {0: "jax_fa3_flash_bwd", 2: "jax_fa3_flash_bwd_key_ranges"}
_ROW_BOUNDS, _KEY_RANGES = 1, 2  # keys of the two dicts: the masked variants' operand counts


def _forward_results(q):
  """A forward kernel's results: out like q, lse float32 (b, h, s_q)."""
  b, s_q, h, _ = q.shape
  return (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, h, s_q), jnp.float32))


def _forward_kernel(cfg: AttentionConfig):
  """(q, k, v, *key_operands) -> (out, lse) on the kernel: key_operands empty (whole rows), the
  row bounds, or the (ranges, covers) of _key_ranges.kernel_operands."""
  def call(q, k, v, *key_operands):
    return _ffi.call(_FORWARD_TARGETS[len(key_operands)], _forward_results(q), q, k, v,
                     *key_operands, **window_attrs(cfg))

  return fold_vmap_into_batch(call)


def _backward_kernel(cfg: AttentionConfig):
  """(q, k, v, out, lse, dout, *key_ranges) -> (dq, dk, dv) on the kernel; key_ranges as
  _forward_kernel's."""
  def call(q, k, v, out, dout, lse, *key_ranges):
    b, s_q, h, d = q.shape
    workspace = _ffi.flash_bwd_workspace_bytes(b, h, s_q, d, cfg.deterministic)
    result_types = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)) + (
        jax.ShapeDtypeStruct((workspace,), jnp.uint8),)
    dq, dk, dv, _ = _ffi.call(_BACKWARD_TARGETS[len(key_ranges)], result_types, q, k, v, out,
                              dout, lse, *key_ranges,
                              deterministic=np.bool_(cfg.deterministic), **window_attrs(cfg))
    return dq, dk, dv

  batched = fold_vmap_into_batch(call)
  return lambda q, k, v, out, lse, dout, *key_ranges: batched(q, k, v, out, dout, lse,
                                                               *key_ranges)


def forward_local(q, k, v, cfg: AttentionConfig):
  """(out, lse) on one device: out like q, lse (batch, heads, seqlen_q) float32."""
  def ref(q, k, v):
    return reference.attention_forward(q, k, v, **cfg.kwargs())

  if not _use_kernel("jax_fa3_flash_fwd", q):
    return ref(q, k, v)
  _ffi.check_kernel_sizes(q.shape, k.shape)
  return jax.lax.platform_dependent(q, k, v, cuda=_forward_kernel(cfg), default=ref)


def backward_local(q, k, v, out, lse, dout, cfg: AttentionConfig, dlse=None):
  """(dq, dk, dv) on one device given the forward's out and lse; `dlse` is the cotangent of a
  returned lse."""
  def ref(q, k, v, out, lse, dout):
    if dlse is None:
      return reference.attention_backward(q, k, v, out, lse, dout, **cfg.kwargs())
    return reference.attention_backward(q, k, v, out, lse, dout, dlse=dlse, **cfg.kwargs())

  if dlse is not None or not _use_kernel("jax_fa3_flash_bwd", q):
    # The kernels take no lse cotangent yet: gradients through a returned lse use the reference.
    return ref(q, k, v, out, lse, dout)
  _ffi.check_kernel_sizes(q.shape, k.shape)
  return jax.lax.platform_dependent(q, k, v, out, lse, dout, cuda=_backward_kernel(cfg),
                                    default=ref)


# Padded and packed batches: per-row lengths and mask diagonals (q_lengths, kv_lengths,
# diagonals; see `reference.attention_forward`'s masks), optionally followed by segment ids. They
# run on the kernels' key-range variants (cuda/common/key_ranges.h), which skip the tiles no query
# sees: every mask is folded into one interval of keys per query (jax_fa3._key_ranges). Segment
# ids qualify when each query's segment is one contiguous run of keys (packed documents, padding
# with its own id); otherwise the call takes the pure-JAX path, decided on the device (lax.cond;
# skipped where the caller promises sorted ids, AttentionConfig.sorted_segments).
# They run by default on Hopper (tests/test_gpu_masked.py holds them to the plain kernels bit for
# bit and to the float64 oracle); JAX_FA3_MASKED_KERNELS=0 sends these calls to the pure-JAX path.
MASKED_KERNELS_ENV = "JAX_FA3_MASKED_KERNELS"


def masked_kernels_enabled() -> bool:
  return os.environ.get(MASKED_KERNELS_ENV, "1") != "0"


def masked_kernels_would_run(q) -> bool:
  """Whether padded or packed attention at q's shape and dtype takes the kernels (nothing
  announced)."""
  return (masked_kernels_enabled()
          and _kernel_unsupported_reason(_FORWARD_TARGETS[_KEY_RANGES], q) is None)


def _use_masked_kernel(target: str, q) -> bool:
  if not masked_kernels_enabled():
    if _ffi.kernels_available():
      reason = (f"{MASKED_KERNELS_ENV}=0: padded and packed batches (sequence lengths, segment "
                f"ids) use the pure-JAX path")
      _ffi.announce_once(reason, f"jax_fa3: {reason}")
    return False
  return _use_kernel(target, q)


def use_decode_kernel(target: str, q) -> bool:
  """Whether a decode target (jax_fa3._cache_attention) runs q on the kernels (announced when
  not)."""
  return _use_masked_kernel(target, q)


def _row_bounds(masks):
  """The masks (q_lengths, kv_lengths, diagonals), all (b,), as the kernels' row bounds: int32
  (b, 3), one (q_len, k_len, diag) per row (cuda/common/key_ranges.h)."""
  return jnp.stack([jnp.asarray(m, jnp.int32) for m in masks], axis=1)


def _takes_row_bounds(masks, forward_target: str | None) -> bool:
  """Whether masks are one (q_len, k_len, diag) per row (no segment ids, no per-query
  diagonals) and this build's forward_target takes them (None: a backward, which does not)."""
  return (forward_target is not None and len(masks) == 3 and jnp.ndim(masks[2]) == 1
          and _ffi.has_target(forward_target))


def _on_key_ranges(kernel, ref, cfg: AttentionConfig, num_arrays: int, s_k: int | None = None,
                   bounds_target: str | None = None):
  """The cuda branch over (*arrays, *masks), arrays[0] being q and arrays[1] k (or s_k given:
  the keys per row, for a paged cache): `kernel(*arrays, bounds)` with the row bounds where
  `bounds_target` (a forward's) takes them, else `kernel(*arrays, ranges, covers)` with the
  masks' key ranges, or, when segment ids are not contiguous runs of keys, `ref(*arrays,
  *masks)`."""
  def run(*arrays_and_masks):
    arrays, masks = arrays_and_masks[:num_arrays], arrays_and_masks[num_arrays:]
    if _takes_row_bounds(masks, bounds_target):
      return kernel(*arrays, _row_bounds(masks))
    s_q, s_k_rows = arrays[0].shape[1], arrays[1].shape[1] if s_k is None else s_k
    lo, hi, exact = _key_ranges.row_ranges(masks, s_q, s_k_rows, cfg.window_left,
                                           cfg.window_right, cfg.sorted_segments)
    operands = _key_ranges.kernel_operands(lo, hi, s_k_rows)
    if len(masks) == 3 or cfg.sorted_segments:  # always one interval per query
      return kernel(*arrays, *operands)
    return jax.lax.cond(exact, lambda: kernel(*arrays, *operands), lambda: ref(*arrays, *masks))

  return run


def forward_local_masked(q, k, v, *masks_and_cfg):
  """forward_local over a padded or packed batch: `*masks, cfg` with masks as above."""
  *masks, cfg = masks_and_cfg

  def ref(q, k, v, *masks):
    return reference.attention_forward(q, k, v, masks=masks, **cfg.kwargs())

  if not _use_masked_kernel(_FORWARD_TARGETS[_KEY_RANGES], q):
    return ref(q, k, v, *masks)
  _ffi.check_kernel_sizes(q.shape, k.shape)
  cuda = _on_key_ranges(_forward_kernel(cfg), ref, cfg, 3,
                        bounds_target=_FORWARD_TARGETS[_ROW_BOUNDS])
  return jax.lax.platform_dependent(q, k, v, *masks, cuda=cuda, default=ref)


def backward_local_masked(q, k, v, out, lse, dout, *masks_and_cfg, dlse=None):
  """backward_local with the forward's masks: `*masks, cfg`."""
  *masks, cfg = masks_and_cfg

  def ref(q, k, v, out, lse, dout, *masks):
    return reference.attention_backward(q, k, v, out, lse, dout, dlse=dlse, masks=masks,
                                        **cfg.kwargs())

  # The kernels take no lse cotangent: gradients through a returned lse use the reference.
  if dlse is not None or not _use_masked_kernel(_BACKWARD_TARGETS[_KEY_RANGES], q):
    return ref(q, k, v, out, lse, dout, *masks)
  _ffi.check_kernel_sizes(q.shape, k.shape)
  cuda = _on_key_ranges(_backward_kernel(cfg), ref, cfg, 6)
  return jax.lax.platform_dependent(q, k, v, out, lse, dout, *masks, cuda=cuda, default=ref)


# A paged KV cache read in place (forward only): the key-range kernel fetches each K/V block from
# its page, which needs the page size to be a multiple of the kernel's key block (one TMA box per
# block). FORWARD_KEY_BLOCK copies cuda/common/buckets.h's forward_key_block (tests/
# test_cuda_layouts.py holds the two equal).
PAGED_TARGET = "jax_fa3_flash_fwd_paged"
PAGED_BOUNDS_TARGET = "jax_fa3_flash_fwd_paged_row_bounds"
FORWARD_KEY_BLOCK = {64: 160, 96: 144, 128: 128, 192: 112, 256: 80}


def forward_key_block(head_dim: int) -> int:
  """Keys per K/V block of the key-range forward kernel at this head dim."""
  return FORWARD_KEY_BLOCK[head_dim_bucket(head_dim)]


def paged_in_place(q, page_size: int) -> bool:
  """Whether a paged cache with pages of `page_size` keys is read in place on the kernel for q
  (nothing announced)."""
  return (masked_kernels_would_run(q) and _ffi.has_target(PAGED_TARGET)
          and page_size % forward_key_block(q.shape[-1]) == 0)


def gather_pages(pool, table):
  """(b, pages_per_seq * page_size, h_k, d): each row's pages in order (indices clamped)."""
  b, pages = table.shape
  rows = jnp.clip(table.astype(jnp.int32), 0, pool.shape[0] - 1)
  return pool[rows].reshape((b, pages * pool.shape[1]) + pool.shape[2:])


def forward_paged(q, k_pool, v_pool, table, masks, cfg: AttentionConfig):
  """(out, lse) of q over a paged cache: pools (num_pages, page_size, h_k, d), table int32
  (b, pages_per_seq), masks (q_lengths, kv_lengths, diagonals) over the rows' logical keys. On
  the paged kernel (callers checked `paged_in_place`); a computation lowered elsewhere gathers
  the pages and runs the reference. Forward only; one device's part of the partitioned op
  `jax_fa3._cache_attention.PAGED_FORWARD`."""
  s_k = table.shape[1] * k_pool.shape[1]

  def ref(q, k_pool, v_pool, table, *masks):
    keys, values = gather_pages(k_pool, table), gather_pages(v_pool, table)
    return reference.attention_forward(q, keys, values, masks=masks, **cfg.kwargs())

  # Arguments in _on_key_ranges' order: the arrays (table among them), then the row bounds or
  # the ranges and covers.
  def paged_call(q, k_pool, v_pool, table, *key_operands):
    target = PAGED_BOUNDS_TARGET if len(key_operands) == 1 else PAGED_TARGET
    return _ffi.call(target, _forward_results(q), q, k_pool, v_pool, *key_operands,
                     table.astype(jnp.int32), **window_attrs(cfg))

  def gathered_call(q, k_pool, v_pool, table, *key_operands):
    # vmap over the pools themselves: each lane's pages gathered, on the key-range kernel.
    keys, values = gather_pages(k_pool, table), gather_pages(v_pool, table)
    return _forward_kernel(cfg)(q, keys, values, *key_operands)

  def on_pages(*arrays_and_key_operands):
    has_batch = (True, False, False) + (True,) * (len(arrays_and_key_operands) - 3)
    return fold_vmap_into_batch(paged_call, has_batch=has_batch,
                                unfolded=gathered_call)(*arrays_and_key_operands)

  kernel = _on_key_ranges(on_pages, ref, cfg, 4, s_k=s_k, bounds_target=PAGED_BOUNDS_TARGET)
  _ffi.check_kernel_sizes(q.shape, (q.shape[0], s_k) + k_pool.shape[2:])
  return jax.lax.platform_dependent(q, k_pool, v_pool, table, *masks, cuda=kernel, default=ref)
