"""Flax integration of jax_fa3.

- `dot_product_attention`: an `attention_fn` for flax.linen.MultiHeadDotProductAttention and
  flax.nnx.MultiHeadAttention; options via functools.partial (causal, window_size, softcap, fp8).
- `MultiHeadAttention`: flax.nnx.MultiHeadAttention on jax_fa3 (same parameter tree).
- `linen.MultiHeadDotProductAttention`: the linen layer (same parameter names as Flax's).
"""
from jax_fa3.flax import linen
from jax_fa3.flax.attention_fn import dot_product_attention
from jax_fa3.flax.nnx_layers import Fp8RotationSigns, MultiHeadAttention
from jax_fa3.flax.rotation import ROTATION_COLLECTION, random_rotation_signs

__all__ = [
    "Fp8RotationSigns",
    "MultiHeadAttention",
    "ROTATION_COLLECTION",
    "dot_product_attention",
    "linen",
    "random_rotation_signs",
]
