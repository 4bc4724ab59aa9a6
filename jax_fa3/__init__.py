"""jax_fa3: FlashAttention-3 for JAX on NVIDIA Hopper GPUs.

On an sm_90 GPU with the compiled extension, attention runs in our own warp-specialized
TMA + wgmma kernels through the XLA FFI; elsewhere the same API runs a blocked pure-JAX path
(announced once on the `jax_fa3` logger). Flax layers live in `jax_fa3.flax` (imported on use).
"""
from jax_fa3._ffi import build_config, kernels_available, kernels_unavailable_reason
from jax_fa3.attention import flash_attention
from jax_fa3.fp8 import dequantize_fp8, flash_attention_fp8, quantize_fp8
from jax_fa3.hadamard import hadamard_transform
from jax_fa3.kvcache import flash_attention_with_kvcache
from jax_fa3.varlen import flash_attention_varlen
from jax_fa3.ring import (ring_attention, sequence_parallel_attention, zigzag_indices,
                          zigzag_permute, zigzag_unpermute)

__all__ = [
    "build_config",
    "dequantize_fp8",
    "flash_attention",
    "flash_attention_fp8",
    "flash_attention_varlen",
    "flash_attention_with_kvcache",
    "hadamard_transform",
    "kernels_available",
    "kernels_unavailable_reason",
    "quantize_fp8",
    "ring_attention",
    "sequence_parallel_attention",
    "zigzag_indices",
    "zigzag_permute",
    "zigzag_unpermute",
]
__version__ = "0.1.0"


def __getattr__(name):
  if name == "flax":  # `jax_fa3.flax` without importing flax for users who do not need it
    import importlib  # noqa: PLC0415
    return importlib.import_module("jax_fa3.flax")
  raise AttributeError(f"module 'jax_fa3' has no attribute {name!r}")
