"""A real vmap rule for kernel calls: a vmapped axis is folded into the batch axis.

An XLA FFI call only knows rank-4 (batch, seqlen, heads, head_dim) operands. Rather than looping
(`vmap_method="sequential"`) or handing the kernel a rank-5 array, the rule moves the mapped axis
next to batch and merges the two, so one kernel launch covers the whole vmapped batch.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp


def fold_vmap_into_batch(fn: Callable, has_batch: tuple | None = None,
                         unfolded: Callable | None = None) -> Callable:
  """Wraps `fn(*arrays)` whose results all have batch as axis 0, as have its arguments except
  those `has_batch` marks False (e.g. the fp8 rotation's signs, shared by the whole batch). A
  vmap that maps such an argument cannot be folded into the batch: it vmaps `unfolded` (a
  vmappable twin of fn, e.g. its unpartitioned body) instead."""

  @jax.custom_batching.custom_vmap
  def call(*args):
    return fn(*args)

  @call.def_vmap
  def _rule(axis_size, in_batched, *args):
    flags = has_batch or (True,) * len(args)
    if any(batched and not flag for batched, flag in zip(in_batched, flags)):
      if unfolded is None:
        raise NotImplementedError("vmap over an argument without a batch axis needs `unfolded`")
      in_axes = tuple(0 if batched else None for batched in in_batched)
      outs = jax.vmap(unfolded, in_axes=in_axes)(*args)
      return outs, jax.tree_util.tree_map(lambda _: True, outs)
    merged = []
    for arg, batched, flag in zip(args, in_batched, flags):
      if not flag:  # no batch axis, not mapped: shared by every lane as it is
        merged.append(arg)
        continue
      if not batched:
        arg = jnp.broadcast_to(arg[None], (axis_size,) + arg.shape)
      merged.append(arg.reshape((axis_size * arg.shape[1],) + arg.shape[2:]))
    outs = call(*merged)
    split = jax.tree_util.tree_map(
        lambda o: o.reshape((axis_size, o.shape[0] // axis_size) + o.shape[1:]), outs)
    return split, jax.tree_util.tree_map(lambda _: True, outs)

  return call
