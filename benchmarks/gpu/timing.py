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


def measure(built, device, directions=("fwd", "fwd+bwd"), warmup_ms=10, rep_ms=40) -> dict:
    """{"fwd": ms, "fwd+bwd": ms, "first_call_s": s, "mem_fwd_mb", "mem_fwd_bwd_mb"}."""
    out = {}
    start = time.perf_counter()
    with torch.no_grad():
        built.forward()  # compile / autotune / first launch, outside every sample
    _sync(device)
    out["first_call_s"] = time.perf_counter() - start
    if "fwd" in directions:
        with torch.no_grad():
            out["fwd"] = median_ms(built.forward, device, (), warmup_ms, rep_ms)
            out["mem_fwd_mb"] = peak_extra_mb(built.forward, device)
    if "fwd+bwd" in directions and any(t.requires_grad for t in built.leaves):
        probe = built.forward()
        grad = torch.randn_like(probe)
        del probe

        def step():
            built.forward().backward(grad)
        step()  # the backward's first launch (compile / autotune)
        _sync(device)
        out["fwd+bwd"] = median_ms(step, device, built.leaves, warmup_ms, rep_ms)
        for t in built.leaves:
            t.grad = None
        out["mem_fwd_bwd_mb"] = peak_extra_mb(step, device)
        for t in built.leaves:
            t.grad = None
    return out
