"""The one rule that skips a hopeless row before running it (``attnzoo bench`` and the GPU
measurement): a row's time per call is predicted from the same row at the largest smaller N
measured, scaled by the ratio of their FLOP counts (``flops``: the variant's own formula, so linear
attention grows with N, the quadratic variants with N squared, at a fixed batch x N with N)."""
from __future__ import annotations

from typing import Hashable, Optional


class Extrapolation:
    """``record(key, n, flops, seconds)`` what a row measured, ``predict(key, n, flops)`` the seconds
    the same row (``key``: everything but N) should take at ``n``, or None when no smaller N was measured."""

    def __init__(self) -> None:
        self._measured: dict[Hashable, dict[int, tuple[int, float]]] = {}

    def record(self, key: Hashable, n: int, flops: int, seconds: float) -> None:
        self._measured.setdefault(key, {})[n] = (flops, seconds)

    def predict(self, key: Hashable, n: int, flops: int) -> Optional[float]:
        measured = self._measured.get(key, {})
        smaller = [m for m in measured if m < n]
        if not smaller:
            return None
        base_flops, seconds = measured[max(smaller)]
        return seconds * flops / max(base_flops, 1)
