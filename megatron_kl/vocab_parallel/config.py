"""The sampler's truncation rule as configuration, without torch: :class:`Truncation` (top-k / top-p), which
``rollout.sampling`` holds and the vocab-parallel statistics apply (``vocab_parallel/truncation.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Truncation:
    """The engine's truncation rule: ``top_k`` (0: off) and ``top_p`` (1.0: off)."""

    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0 disables)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")

    def active(self, vocab_size: Optional[int] = None) -> bool:
        top_k_on = self.top_k > 0 and (vocab_size is None or self.top_k < vocab_size)
        return top_k_on or self.top_p < 1.0
