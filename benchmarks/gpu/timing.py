"""Timing one case: median milliseconds of the forward and of forward + backward, and the peak
memory one call adds. On CUDA with ``triton.testing.do_bench`` (CUDA events, L2 flushed between
runs, median); on CPU (the script's dry run) with perf_counter over a few calls."""
from __future__ import annotations

import time

import torch


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn, device, leaves=(), warmup_ms: float = 10, rep_ms: float = 40) -> float:
    if device.type == "cuda":
        import triton.testing
        return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, grad_to_none=list(leaves),
                                             return_mode="median"))
    samples = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return sorted(samples)[1]


def peak_extra_mb(fn, device) -> float:
    """Memory one call allocates beyond what was allocated before it (outputs and saved tensors
    included), MB; NaN on CPU."""
    if device.type != "cuda":
        return float("nan")
    _sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    _sync(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2 ** 20


def _timed_once(fn, device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return (time.perf_counter() - start) * 1e3


def _steady_ms(fn, device, leaves, warmup_ms, rep_ms, single_call_ms) -> tuple[float, bool]:
    """(median ms, sampled): one synchronised call first; a call slower than ``single_call_ms`` is
    that one sample (do_bench would repeat it for seconds), a faster one goes to do_bench."""
    once = _timed_once(fn, device)
    if once > single_call_ms:
        return once, False
    return median_ms(fn, device, leaves, warmup_ms, rep_ms), True


def measure(built, device, directions=("fwd", "fwd+bwd"), warmup_ms=10, rep_ms=40, single_call_ms=150.0) -> dict:
    """{"fwd": ms, "fwd+bwd": ms, "first_call_s": s, "mem_fwd_mb", "mem_fwd_bwd_mb"}; rows slower than
    ``single_call_ms`` per call are one synchronised call ("single_call": true)."""
    out = {}
    start = time.perf_counter()
    with torch.no_grad():
        built.forward()  # compile / autotune / first launch, outside every sample
    _sync(device)
    out["first_call_s"] = time.perf_counter() - start
    if "fwd" in directions:
        with torch.no_grad():
            out["fwd"], sampled = _steady_ms(built.forward, device, (), warmup_ms, rep_ms, single_call_ms)
            out["mem_fwd_mb"] = peak_extra_mb(built.forward, device)
        if not sampled:
            out["single_call"] = True
    if "fwd+bwd" in directions and any(t.requires_grad for t in built.leaves):
        probe = built.forward()
        grad = torch.randn_like(probe)
        del probe

        def step():
            built.forward().backward(grad)
        step()  # the backward's first launch (compile / autotune)
        _sync(device)
        out["fwd+bwd"], sampled = _steady_ms(step, device, built.leaves, warmup_ms, rep_ms, single_call_ms)
        if not sampled:
            out["single_call"] = True
        for t in built.leaves:
            t.grad = None
        out["mem_fwd_bwd_mb"] = peak_extra_mb(step, device)
        for t in built.leaves:
            t.grad = None
    return out
