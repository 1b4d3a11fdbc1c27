"""Every timing of the benchmark harness, one module: a call (``time_call``), a kernel's forward and
forward + backward (``time_directions``), a training step (``time_steps``, ``host_seconds``) and
what a step launches (``profile_steps``).

``time_call``: wall time of one call, one rule on every device:

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

A training step is timed differently: steps run back to back with one synchronisation per block of
steps (as in training, the host queues the next step while the GPU runs the last), and the host's
own share of a step is timed apart (``host_seconds``: the step started on an idle GPU, timed until
its last call returns, without waiting for the GPU).
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


def p20_p80(xs: list[float]) -> tuple[float, float]:
    """The 20th and 80th percentiles, interpolated between the samples (numpy's "linear" rule)."""
    if len(xs) == 1:
        return xs[0], xs[0]
    cuts = statistics.quantiles(xs, n=5, method="inclusive")
    return cuts[0], cuts[3]


def summarize(samples: list[float]) -> TimeStats:
    if not samples:
        raise ValueError("summarize needs at least one timing sample")
    xs = sorted(float(x) for x in samples)
    p20, p80 = p20_p80(xs)
    return TimeStats(median=statistics.median(xs), p20=p20, p80=p80,
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
    do_bench_warmup_ms: float = 25       # triton.testing.do_bench's warm-up and measurement windows
    do_bench_rep_ms: float = 100


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


def _do_bench(fn: Callable[[], Any], limit: Optional[float], rule: TimingRule, grad_to_none=None
              ) -> Optional[list[float]]:
    try:
        from triton.testing import do_bench
    except ImportError:
        return None
    extra = {"grad_to_none": grad_to_none} if grad_to_none else {}
    with interrupt_after(limit):
        return [m / 1e3 for m in do_bench(fn, warmup=rule.do_bench_warmup_ms, rep=rule.do_bench_rep_ms,
                                          return_mode="all", **extra)]


def time_call(fn: Callable[[], Any], device="cpu", rule: TimingRule = TimingRule(), *,
              limit: Callable[[], Optional[float]] = lambda: None,
              probe: Optional[Callable[[float], Optional[Callable[[], Any]]]] = None, eager: bool = False,
              grad_to_none: Optional[list] = None) -> Timing:
    """Time ``fn`` by the rule in this module's docstring. ``limit()`` gives the seconds the next call
    may take (None: no limit). ``probe(first_call_s)`` may return a function to run, and time, as the
    second call instead of ``fn`` (it must call ``fn``): its return value lands in ``Timing.probed``.
    ``eager``: ``fn`` compiles nothing (an eager reference), so a first call slower than
    max_call_seconds already is its steady cost: CallTooSlow without a second call. ``grad_to_none``:
    tensors whose ``.grad`` do_bench resets between runs (a backward that accumulates)."""
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
        samples = _do_bench(fn, limit(), rule, grad_to_none)
        if samples:
            return Timing(summarize(samples), first, second, "do_bench", probed)
    repeats = int(min(rule.max_repeats, max(rule.min_repeats, math.ceil(rule.target_seconds / max(second, 1e-9)))))
    # a probed second call carries the probe's overhead: a sample only when it is the only one
    samples = [] if second_fn is not None else [second]
    while len(samples) < repeats:
        samples.append(_event_timed(fn, device, limit()) if _cuda(device) else _timed(fn, device, limit())[0])
    return Timing(summarize(samples), first, second, "repeats", probed)



# -- a kernel's forward and forward + backward (the GPU kernel measurement, benchmarks/gpu_speed.py) --

# a call slower than 0.15 s is its one sample (do_bench would repeat it for seconds); faster calls get
# do_bench's short windows; the CPU dry run takes the middle of three calls
KERNEL_RULE = TimingRule(min_repeats=3, max_repeats=3, target_seconds=0.0, once_above_seconds=0.15,
                         slow_call_seconds=0.15, do_bench_warmup_ms=10, do_bench_rep_ms=40)


def time_directions(forward: Callable[[], torch.Tensor], leaves: list, device, directions=("fwd", "fwd+bwd"),
                    rule: TimingRule = KERNEL_RULE) -> dict:
    """Median milliseconds of ``forward()`` under no_grad ("fwd") and of ``forward().backward(g)``
    ("fwd+bwd", when a leaf needs a gradient), each by ``time_call``'s rule, with the memory one call
    adds on CUDA: {"fwd", "fwd+bwd", "first_call_s", "mem_fwd_mb", "mem_fwd_bwd_mb", "single_call"}."""
    from .memory import peak_memory_bytes
    device = torch.device(device)
    out: dict = {}

    def megabytes(fn) -> float:
        return peak_memory_bytes(fn, device) / 2 ** 20 if device.type == "cuda" else float("nan")

    if "fwd" in directions:
        def fwd():
            with torch.no_grad():
                forward()
        timing = time_call(fwd, device, rule)
        out.update({"fwd": timing.stats.median * 1e3, "first_call_s": timing.first_call_s,
                    "mem_fwd_mb": megabytes(fwd)})
        if timing.method == "once":
            out["single_call"] = True
    if "fwd+bwd" in directions and any(t.requires_grad for t in leaves):
        probe = forward()
        grad = torch.randn_like(probe)
        del probe

        def step():
            forward().backward(grad)
        timing = time_call(step, device, rule, grad_to_none=list(leaves))
        out["fwd+bwd"] = timing.stats.median * 1e3
        out.setdefault("first_call_s", timing.first_call_s)
        if timing.method == "once":
            out["single_call"] = True
        for t in leaves:
            t.grad = None
        out["mem_fwd_bwd_mb"] = megabytes(step)
        for t in leaves:
            t.grad = None
    return out


# -- a training step (the model benchmark) ---------------------------------------------------------

def _sync(device) -> None:
    if _cuda(device):
        torch.cuda.synchronize(device)


def time_steps(step: Callable[[], Any], device, steps: int, blocks: int) -> TimeStats:
    """Seconds per step: ``blocks`` blocks of ``steps`` steps each, synchronised once per block, so
    the host queues a step while the GPU still runs the one before, as in training."""
    per_step = []
    for _ in range(blocks):
        _sync(device)
        start = time.perf_counter()
        for _ in range(steps):
            step()
        _sync(device)
        per_step.append((time.perf_counter() - start) / steps)
    return summarize(per_step)


def host_seconds(step: Callable[[], Any], device, n: int) -> TimeStats:
    """The host's share of a step: each of ``n`` steps starts on an idle GPU and is timed until its
    last call returns, without waiting for the GPU. Close to the step time: the step is bound by the
    host (Python, dispatch and launches); far below it: by the GPU."""
    samples = []
    for _ in range(n):
        _sync(device)
        start = time.perf_counter()
        step()
        samples.append(time.perf_counter() - start)
        _sync(device)
    return summarize(samples)


LAUNCH_EVENTS = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")
GRAPH_LAUNCH_EVENTS = ("cudaGraphLaunch",)
HOST_WAIT_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
COPY_EVENTS = ("cudaMemcpyAsync", "cudaMemcpy")


def profile_steps(step: Callable[[], Any], device, n: int, rows: int = 0, *, together: bool = False) -> dict:
    """What ``n`` steps do, per step, read from torch.profiler: kernel launches, CUDA-graph launches
    and host-device copies (CUDA), the aten ops dispatched (every device; nested calls counted, e.g.
    aten::linear and the aten::addmm it calls), the host's time inside profiled calls
    (``op_host_ms_per_step``), host waits, the GPU's busy time (the kernels' total), and with
    ``rows`` the busiest operators by self time on the host and on the device. ``together``: one
    call of ``step`` runs all ``n`` steps (a training loop's epoch cut to n steps)."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if _cuda(device) else [])
    _sync(device)
    with profile(activities=activities) as prof:
        for _ in range(1 if together else n):
            step()
        _sync(device)
    events = prof.key_averages()

    def count(names) -> float:
        return sum(e.count for e in events if e.key in names) / n

    # the host time inside profiled calls (torch ops, CUDA API calls, attnzoo's custom ops with their
    # Python), waits for the GPU left out; Python between ops is not in it (host_seconds has it all)
    op_host_us = sum(e.self_cpu_time_total for e in events if e.key not in HOST_WAIT_EVENTS)
    out = {"profiled_steps": n, "aten_ops_per_step": sum(e.count for e in events if e.key.startswith("aten::")) / n,
           "op_host_ms_per_step": op_host_us / n / 1e3}
    if _cuda(device):
        from torch.autograd import DeviceType
        device_key = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"
        # the kernels' own events (not the CPU ops that launched them, which carry the same time again)
        kernels = [e for e in events if getattr(e, "device_type", None) == DeviceType.CUDA]
        out.update(launches_per_step=count(LAUNCH_EVENTS), graph_launches_per_step=count(GRAPH_LAUNCH_EVENTS),
                   host_waits_per_step=count(HOST_WAIT_EVENTS) - 1 / n,   # less the closing synchronisation
                   copies_per_step=count(COPY_EVENTS),
                   device_ms_per_step=sum(getattr(e, device_key) for e in kernels) / n / 1e3)
        if rows:
            out["device_table"] = events.table(sort_by=device_key, row_limit=rows)
    if rows:
        out["host_table"] = events.table(sort_by="self_cpu_time_total", row_limit=rows)
    return out
