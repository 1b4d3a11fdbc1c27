"""Wall time of one call: one rule on every device (``time_call``), median and spread of the samples.

1. First call, synchronised: the warm-up. It pays for torch.compile, Triton JIT and autotuning,
   allocator growth; its time is kept as ``first_call_s`` but never used as a sample.
2. Second call, synchronised: the call's steady cost ``t2``.
   - ``t2 > max_call_seconds``: stop here (:class:`CallTooSlow`; the runner records the row as
     skipped with both times);
   - ``t2 > once_above_seconds``: ``t2`` is the only sample;
   - ``t2 > slow_call_seconds``, or any call on CPU: more calls timed one by one (``time.perf_counter``
     on CPU, a pair of CUDA events on GPU), ``t2`` counted as the first sample (unless a probe ran
     with it, see ``time_call``), as many as fill
     ``target_seconds``, at least ``min_repeats`` and at most ``max_repeats``;
   - a fast CUDA call: ``triton.testing.do_bench`` (CUDA events, L2 cache flushed between runs; it
     runs the call ~8 times before its first sample, harmless only for fast calls), CUDA events
     when Triton is missing.
Every call can be given a hard limit (``limit()``, seconds, or None): see ``guard.interrupt_after``.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional

import torch

from .guard import interrupt_after


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


@dataclass(frozen=True)
class TimingRule:
    warmup: int = 1                      # warm-up calls (the first call is one); extra ones only for fast calls
    min_repeats: int = 3
    max_repeats: int = 10
    target_seconds: float = 1.0          # repeats fill about this long
    max_call_seconds: float = math.inf   # second call slower than this: CallTooSlow
    once_above_seconds: float = math.inf  # second call slower than this: it is the only sample
    slow_call_seconds: float = 0.2       # CUDA: slower than this, timed with events instead of do_bench


@dataclass
class Timing:
    stats: TimeStats
    first_call_s: float
    second_call_s: float
    method: str                          # "once", "repeats" or "do_bench"
    probed: Any = None                   # what the probe of the second call returned (e.g. peak bytes)


class CallTooSlow(Exception):
    """The second (steady) call - or the first of an eager call - took longer than max_call_seconds."""

    def __init__(self, seconds: float, first_call_s: float, limit: float, from_first: bool = False):
        super().__init__(f"measured {seconds:.3g} s per call > max_call_seconds={limit:g}")
        self.seconds = seconds
        self.first_call_s = first_call_s
        self.limit = limit
        self.from_first = from_first   # measured on the first call (eager), no second call made


def _cuda(device) -> bool:
    return torch.device(device).type == "cuda"


def _timed(fn: Callable[[], Any], device, limit: Optional[float]) -> tuple[float, Any]:
    """(seconds, fn's return) of one synchronised call, interrupted past ``limit`` seconds."""
    with interrupt_after(limit):
        if _cuda(device):
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        out = fn()
        if _cuda(device):
            torch.cuda.synchronize(device)
        return time.perf_counter() - start, out


def _event_timed(fn: Callable[[], Any], device, limit: Optional[float]) -> float:
    with interrupt_after(limit):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / 1e3


def _do_bench(fn: Callable[[], Any], limit: Optional[float]) -> Optional[list[float]]:
    try:
        from triton.testing import do_bench
    except ImportError:
        return None
    with interrupt_after(limit):
        return [m / 1e3 for m in do_bench(fn, warmup=25, rep=100, return_mode="all")]


def time_call(fn: Callable[[], Any], device="cpu", rule: TimingRule = TimingRule(), *,
              limit: Callable[[], Optional[float]] = lambda: None,
              probe: Optional[Callable[[float], Optional[Callable[[], Any]]]] = None, eager: bool = False) -> Timing:
    """Time ``fn`` by the rule in this module's docstring. ``limit()`` gives the seconds the next call
    may take (None: no limit). ``probe(first_call_s)`` may return a function to run, and time, as the
    second call instead of ``fn`` (it must call ``fn``): its return value lands in ``Timing.probed``.
    ``eager``: ``fn`` compiles nothing (an eager reference), so a first call slower than
    max_call_seconds already is its steady cost: CallTooSlow without a second call."""
    first, _ = _timed(fn, device, limit())
    if eager and first > rule.max_call_seconds:
        raise CallTooSlow(first, first, rule.max_call_seconds, from_first=True)
    for _ in range(rule.warmup - 1):
        if first > rule.once_above_seconds:
            break
        _timed(fn, device, limit())
    second_fn = probe(first) if probe is not None else None
    second, probed = _timed(second_fn or fn, device, limit())
    if second > rule.max_call_seconds:
        raise CallTooSlow(second, first, rule.max_call_seconds)
    if second > rule.once_above_seconds:
        return Timing(summarize([second]), first, second, "once", probed)
    if _cuda(device) and second <= rule.slow_call_seconds:
        samples = _do_bench(fn, limit())
        if samples:
            return Timing(summarize(samples), first, second, "do_bench", probed)
    repeats = int(min(rule.max_repeats, max(rule.min_repeats, math.ceil(rule.target_seconds / max(second, 1e-9)))))
    # a probed second call carries the probe's overhead: a sample only when it is the only one
    samples = [] if second_fn is not None else [second]
    while len(samples) < repeats:
        samples.append(_event_timed(fn, device, limit()) if _cuda(device) else _timed(fn, device, limit())[0])
    return Timing(summarize(samples), first, second, "repeats", probed)

