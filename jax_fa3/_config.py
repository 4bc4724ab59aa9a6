"""The static (hashable) descriptions of one attention call (bf16/fp16/fp32, and fp8), shared by
every layer below the API."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  """Validated attention options.

  `causal` has already been folded into `window_right = 0`; a window bound of -1 is unbounded.
  """

  softmax_scale: float
  window_left: int = -1
  window_right: int = -1
  softcap: float = 0.0
  deterministic: bool = False
  # A promise about the masks' segment ids: non-decreasing along the queries and along the keys
  # (varlen's sequence indices). Each id's keys are then one run found by binary search, and
  # the kernels run without first checking that segments are contiguous (a device-side check
  # whose fallback, a lax.cond, stalls the host on the GPU). The reference ignores it.
  sorted_segments: bool = False

  @property
  def is_causal(self) -> bool:
    return self.window_left < 0 and self.window_right == 0

  def kwargs(self) -> dict:
    """Keyword arguments of the reference implementation."""
    return dict(softmax_scale=self.softmax_scale, window_left=self.window_left,
                window_right=self.window_right, softcap=self.softcap)


DEFAULT_BLOCK_SIZE = 64  # fp8: tokens per q/k quantization scale
EMULATION_TILE_K = 128  # fp8: keys per tile of the emulation's online softmax (kernel: kBlockN)


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

  # The attention options the partitioner's plan reads (jax_fa3._partitioning.plan_partition).
  @property
  def window_left(self) -> int:
    return self.attention.window_left

  @property
  def window_right(self) -> int:
    return self.attention.window_right
