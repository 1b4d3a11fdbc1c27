"""A memory property probe shared by the kernel tests (a property, not a timing)."""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class LargestOutput(TorchDispatchMode):
    """Records the largest number of elements of any tensor an aten op returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    @staticmethod
    def size(t: torch.Tensor) -> int:
        return t.numel()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, self.size(t))
        return out


class LargestAllocation(LargestOutput):
    """Records the largest storage (bytes) behind any tensor an aten op returns; views such as
    expand() of a key-padding mask share their base's storage and so count at their real size."""

    @staticmethod
    def size(t: torch.Tensor) -> int:
        return t.untyped_storage().nbytes()
