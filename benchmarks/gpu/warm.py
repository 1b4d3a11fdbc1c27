"""Parallel warm-up: compile every kernel the measurement will launch in worker processes first.

Triton writes each compiled kernel to its on-disk cache and inductor (FlexAttention) its compiled
graphs to its own; later compiles of the same kernel in the main process load them instead of
compiling. Compiling is single-threaded per process and dominates a short GPU session, so a pool of
workers (one CUDA context each) runs every timed case and correctness case once: what the main
process then measures is unchanged, only its first calls get cheap. Autotuning still happens in the
main process (its timings are per process), on cached binaries.
"""
from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import os
import time
import traceback


def _worker_init():
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch._dynamo
    torch._dynamo.config.cache_size_limit = 256
    if hasattr(torch._dynamo.config, "recompile_limit"):
        torch._dynamo.config.recompile_limit = 256


def _warm_speed(label: str, shape_fields: dict) -> str:
    import torch

    from .cases import Shape, attnzoo_cases, baseline_cases
    device = torch.device("cuda")
    shape = Shape(**{**shape_fields, "dtype": getattr(torch, shape_fields["dtype"])})
    case = next(c for c in baseline_cases(device) + attnzoo_cases(device) if c.label == label)
    built = case.build(shape, device, True)
    with torch.no_grad():
        built.forward()
    out = built.forward()
    out.backward(torch.randn_like(out))
    torch.cuda.synchronize()
    return label


def _warm_correctness(variant: str, spec: dict, backend: str, shape: tuple, dtype: str) -> str:
    import torch

    from .correctness import check
    check(variant, spec, backend, shape, getattr(torch, dtype), torch.device("cuda"))
    return f"{variant}/{backend}"


def _job(kind: str, args: tuple) -> tuple:
    start = time.time()
    try:
        name = (_warm_speed if kind == "speed" else _warm_correctness)(*args)
        return kind, name, time.time() - start, None
    except Exception as e:  # noqa: BLE001 - the main process records the failure itself
        return kind, str(args[0]), time.time() - start, f"{type(e).__name__}: {e}"[:200] + traceback.format_exc()[-300:]


def warm(jobs: list, workers: int, deadline: float, log) -> dict:
    """Run ``jobs`` ((kind, args) pairs) on ``workers`` processes until done or ``deadline``."""
    done, failed = 0, []
    ctx = multiprocessing.get_context("spawn")
    pool = cf.ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_worker_init)
    futures = [pool.submit(_job, kind, args) for kind, args in jobs]
    try:
        for fut in cf.as_completed(futures, timeout=max(1.0, deadline - time.time())):
            kind, name, seconds, error = fut.result()
            done += 1
            if error:
                failed.append((kind, name, error))
    except cf.TimeoutError:
        log(f"warm: deadline reached with {len(jobs) - done} of {len(jobs)} jobs left")
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        for proc in list(getattr(pool, "_processes", {}).values()):
            proc.terminate()
    log(f"warm: {done} jobs done, {len(failed)} failed")
    return {"jobs": len(jobs), "done": done, "failed": failed[:20]}
