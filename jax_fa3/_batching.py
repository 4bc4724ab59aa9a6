"""A real vmap rule for kernel calls: a vmapped axis is folded into the batch axis.

An XLA FFI call only knows rank-4 (batch, seqlen, heads, head_dim) operands. Rather than looping
(`vmap_method="sequential"`) or handing the kernel a rank-5 array, the rule moves the mapped axis
next to batch and merges the two, so one kernel launch covers the whole vmapped batch.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp


def fold_vmap_into_batch(fn: Callable) -> Callable:
  """Wraps `fn(*arrays)` whose array arguments and results all have batch as axis 0."""

  @jax.custom_batching.custom_vmap
  def call(*args):
    return fn(*args)

  @call.def_vmap
  def _rule(axis_size, in_batched, *args):
    merged = []
    for arg, batched in zip(args, in_batched):
      if not batched:
        arg = jnp.broadcast_to(arg[None], (axis_size,) + arg.shape)
      merged.append(arg.reshape((axis_size * arg.shape[1],) + arg.shape[2:]))
    outs = call(*merged)
    split = jax.tree_util.tree_map(
        lambda o: o.reshape((axis_size, o.shape[0] // axis_size) + o.shape[1:]), outs)
    return split, jax.tree_util.tree_map(lambda _: True, outs)

  return call
