"""The static (hashable) description of one attention call, shared by every layer below the API."""
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

  @property
  def is_causal(self) -> bool:
    return self.window_left < 0 and self.window_right == 0

  def kwargs(self) -> dict:
    """Keyword arguments of the reference implementation."""
    return dict(softmax_scale=self.softmax_scale, window_left=self.window_left,
                window_right=self.window_right, softcap=self.softcap)
