"""The random ±1 signs of the FP8 layers' Hadamard rotation (incoherent processing).

A layer draws them once at init and keeps them with its weights (not trainable), so a restored
checkpoint computes exactly what was trained: the rotation diag(signs)·H is applied to q and k
before fp8 quantization; q·k is unchanged in exact arithmetic while outliers are spread out.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

# linen: the variable collection holding the signs (never 'params', so optimizers skip them).
ROTATION_COLLECTION = "fp8_rotation"
ROTATION_NAME = "signs"


def random_rotation_signs(rng, head_dim: int):
  """(head_dim,) float32 of independent, equally likely ±1."""
  return jax.random.rademacher(rng, (head_dim,), dtype=jnp.float32)
