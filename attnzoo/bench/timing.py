"""Wall time of one call: median and spread over repeated runs after warm-up.

CPU: ``time.perf_counter`` around each call (the calls are synchronous). The number of repeats
adapts to the call's cost: enough to fill ``target_seconds``, at least ``min_repeats``, at most
``max_repeats``; a call slower than ``once_above_seconds`` is timed once (its warm-up run).
CUDA: ``triton.testing.do_bench`` (CUDA events, L2 cache flushed between runs) when Triton is
installed, else CUDA events around each call.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch


@dataclass
class TimeStats:
    median: float
    p20: float
    p80: float
    min: float
    max: float
    mean: float
    std: float
    n: int

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def spread(self) -> float:
        """Half the p20..p80 range relative to the median: the +-% printed in tables."""
        return (self.p80 - self.p20) / (2 * self.median) if self.median > 0 else 0.0


def _quantile(sorted_xs: list[float], q: float) -> float:
    if len(sorted_xs) == 1:
        return sorted_xs[0]
    pos = q * (len(sorted_xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)


def summarize(samples: list[float]) -> TimeStats:
    if not samples:
        raise ValueError("summarize needs at least one timing sample")
    xs = sorted(float(x) for x in samples)
    return TimeStats(median=statistics.median(xs), p20=_quantile(xs, 0.2), p80=_quantile(xs, 0.8),
                     min=xs[0], max=xs[-1], mean=statistics.fmean(xs),
                     std=statistics.stdev(xs) if len(xs) > 1 else 0.0, n=len(xs))


def time_cpu(fn: Callable[[], object], *, warmup: int = 1, min_repeats: int = 3, max_repeats: int = 10,
             target_seconds: float = 1.0, once_above_seconds: float = math.inf) -> TimeStats:
    first = None
    for _ in range(max(warmup, 1)):
        t0 = time.perf_counter()
        fn()
        first = time.perf_counter() - t0
    if first > once_above_seconds:
        return summarize([first])
    repeats = int(min(max_repeats, max(min_repeats, math.ceil(target_seconds / max(first, 1e-9)))))
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return summarize(samples)


def time_cuda(fn: Callable[[], object], *, warmup_ms: int = 25, rep_ms: int = 100) -> TimeStats:
    try:
        from triton.testing import do_bench
    except ImportError:
        do_bench = None
    if do_bench is not None:
        ms = do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="all")
        return summarize([m / 1e3 for m in ms])
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(max(3, rep_ms // 10)):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) / 1e3)
    return summarize(samples)
