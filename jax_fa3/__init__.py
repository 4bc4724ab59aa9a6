"""jax_fa3: FlashAttention-3 for JAX on NVIDIA Hopper GPUs.

On an sm_90 GPU with the compiled extension, attention runs in our own warp-specialized
TMA + wgmma kernels through the XLA FFI; elsewhere the same API runs a blocked pure-JAX path
(announced once on the `jax_fa3` logger).
"""
from jax_fa3._ffi import build_config, kernels_available, kernels_unavailable_reason
from jax_fa3.attention import flash_attention
from jax_fa3.hadamard import hadamard_transform

__all__ = [
    "build_config",
    "flash_attention",
    "hadamard_transform",
    "kernels_available",
    "kernels_unavailable_reason",
]
__version__ = "0.1.0"
