"""The shortest correct use of jax_fa3: the function, an nnx layer, and a Flax drop-in."""
import functools

import jax
import jax.numpy as jnp
from flax import nnx

import jax_fa3
import jax_fa3.flax

dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32  # kernels: bf16/fp16
q, k, v = jax.random.normal(jax.random.key(0), (3, 2, 512, 8, 64), dtype)  # (batch, seq, heads, dim)

out = jax.jit(functools.partial(jax_fa3.flash_attention, causal=True))(q, k, v)
print("flash_attention:", out.shape, out.dtype)

# A Flax nnx layer with the parameter tree of flax.nnx.MultiHeadAttention.
layer = jax_fa3.flax.MultiHeadAttention(num_heads=8, in_features=512, causal=True,
                                        dtype=dtype, rngs=nnx.Rngs(0))
x = jax.random.normal(jax.random.key(1), (2, 512, 512), dtype)
print("MultiHeadAttention:", nnx.jit(lambda layer, x: layer(x))(layer, x).shape)

# Or keep Flax's own layer and swap only its attention function.
flax_layer = nnx.MultiHeadAttention(
    num_heads=8, in_features=512, decode=False, dtype=dtype, rngs=nnx.Rngs(0),
    attention_fn=functools.partial(jax_fa3.flax.dot_product_attention, causal=True))
print("attention_fn drop-in:", nnx.jit(lambda layer, x: layer(x))(flax_layer, x).shape)
