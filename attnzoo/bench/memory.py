"""Peak memory of one call, and a rough estimate used to avoid starting calls that cannot fit.

CUDA: the caching allocator's ``max_memory_allocated`` minus what was allocated before the call.

CPU: :class:`LiveTensorBytes`, a TorchDispatchMode that sees every ATen op's outputs and counts the
bytes of each storage it has not seen before until that storage is freed (a weakref finalizer on
the storage), so the peak is the high-water mark of tensor memory created by the call: activations
saved by autograd, gradients, temporaries and outputs, but not the inputs that existed before.
What it cannot see: scratch buffers a single C++/Triton kernel allocates internally without
returning them (e.g. SDPA's per-thread tiles on CPU, the Triton interpreter's numpy arrays).
tracemalloc does not see torch's allocator and process RSS mixes in the allocator's caching, hence
this choice.
"""
from __future__ import annotations

import time
import weakref
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..ops.sizes import Shape

CPU_METHOD = "live tensor bytes (TorchDispatchMode storage tracking; excludes inputs and kernel-internal scratch)"
CUDA_METHOD = "torch.cuda.max_memory_allocated minus memory allocated before the call"


class LiveTensorBytes(TorchDispatchMode):
    """Tracks ``current`` and ``peak`` bytes of tensor storages created while the mode is active."""

    def __init__(self):
        super().__init__()
        self.current = 0
        self.peak = 0
        self._live: dict[int, int] = {}

    def _release(self, key: int, nbytes: int) -> None:
        if self._live.pop(key, None) is not None:
            self.current -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # outputs that alias an input (views, in-place ops, out=) allocate nothing new
        seen_inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                       if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes == 0 or key in seen_inputs or key in self._live:
                continue
            self._live[key] = nbytes
            self.current += nbytes
            self.peak = max(self.peak, self.current)
            weakref.finalize(storage, self._release, key, nbytes)
        return out


def peak_memory_bytes(fn: Callable[[], object], device: torch.device) -> int:
    """Peak bytes allocated while ``fn()`` runs, above what was allocated before it."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device) - before)
    tracker = LiveTensorBytes()
    with tracker:
        fn()
    return int(tracker.peak)


def timed_peak_cpu(fn: Callable[[], object]) -> tuple[float, int]:
    """(seconds, peak bytes) of one call run under the tracker: for calls so slow that the tracker's
    per-op overhead (microseconds) is noise, one run gives both numbers."""
    tracker = LiveTensorBytes()
    with tracker:
        start = time.perf_counter()
        fn()
        seconds = time.perf_counter() - start
    return seconds, int(tracker.peak)


def memory_method(device: torch.device) -> str:
    return CUDA_METHOD if torch.device(device).type == "cuda" else CPU_METHOD


def estimate_reference_bytes(variant: str, shape: Shape, mode: str, causal: bool, itemsize: int = 4,
                             kind: str | None = None, **kwargs) -> int:
    """Rough peak of the eager reference (which materialises N x N, or N x N x |A| for OT; each variant
    declares its estimate in its record), used only to skip calls that would exhaust host memory (the
    kernel's OOM would be the OS killing us)."""
    from .. import registry
    resolved = registry.resolve(variant, **({} if kind is None else {"kind": kind}))
    return resolved.record.reference_bytes(shape, mode == "fwd+bwd", resolved.causal(causal), itemsize, **kwargs)
