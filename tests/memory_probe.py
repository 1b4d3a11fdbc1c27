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


class PeakAllocated:
    """The most bytes held at once by tensors allocated inside the ``with`` block, beyond what was held at
    its start (``peak``), exactly, from torch.profiler's allocation records: each carries the running total
    of allocated bytes, so the first one's total minus its own size is the start. Temporaries freed before
    the next allocation do not add up; ones alive together do."""

    def __enter__(self):
        from torch.profiler import ProfilerActivity, profile
        self.peak = None
        self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._profile.__enter__()
        return self

    def __exit__(self, *exc):
        import json
        import os
        import tempfile
        self._profile.__exit__(*exc)
        if exc[0] is not None:
            return False
        fd, path = tempfile.mkstemp(suffix=".json")
        os.close(fd)
        try:
            self._profile.export_chrome_trace(path)
            with open(path) as f:
                events = json.load(f)["traceEvents"]
        finally:
            os.remove(path)
        records = [e["args"] for e in events if e.get("name") == "[memory]"]
        start = records[0]["Total Allocated"] - records[0]["Bytes"] if records else 0
        self.peak = max((r["Total Allocated"] for r in records), default=start) - start
        return False
