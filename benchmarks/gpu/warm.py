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


def _warm_speed(device: str, label: str, shape_fields: dict) -> str:
    import torch

    from .cases import Shape, attnzoo_cases, baseline_cases
    dev = torch.device(device)
    shape = Shape(**{**shape_fields, "dtype": getattr(torch, shape_fields["dtype"])})
    case = next(c for c in baseline_cases(dev) + attnzoo_cases(dev) if c.label == label)
    built = case.build(shape, dev, True)
    with torch.no_grad():
        built.forward()
    out = built.forward()
    out.backward(torch.randn_like(out))
    return label


def _warm_correctness(device: str, variant: str, spec: dict, backend: str, shape: tuple, dtype: str) -> str:
    import torch

    from .correctness import check_any
    check_any(variant, spec, backend, shape, getattr(torch, dtype), torch.device(device))
    return f"{variant}/{backend}"


def _warm_train(device: str, spec: str, batch: int) -> str:
    import torch

    from .train_speed import images_per_second
    images_per_second(spec, torch.device(device), batch, warmup=1, steps=1)
    return spec


def _warm_compile(device: str, name: str) -> str:
    import torch

    from .compile_check import check
    check(name, torch.device(device))
    return name


def _warm_paper(device: str, label: str) -> str:
    from .paper_speed import RUNS, images_per_second
    _, config, overrides = next(r for r in RUNS if r[0] == label)
    images_per_second(config, device=device, steps=1, warmup=1, overrides=overrides)
    return label


WARMERS = {"speed": _warm_speed, "correctness": _warm_correctness, "train": _warm_train, "compile": _warm_compile,
           "paper": _warm_paper}


def _job(kind: str, args: tuple) -> tuple:
    start = time.time()
    try:
        name = WARMERS[kind](*args)
        return kind, name, time.time() - start, None
    except Exception as e:  # noqa: BLE001 - the main process records the failure itself
        return kind, str(args[1]), time.time() - start, f"{type(e).__name__}: {e}"[:200] + traceback.format_exc()[-300:]


def warm(jobs: list, workers: int, deadline: float, log) -> dict:
    """Run ``jobs`` ((kind, args) pairs, args starting with the device) on ``workers`` processes until
    done or ``deadline``; returns counts, failures and the seconds each kind took in all."""
    done, failed, seconds = 0, [], {}
    ctx = multiprocessing.get_context("spawn")
    pool = cf.ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_worker_init)
    futures = [pool.submit(_job, kind, args) for kind, args in jobs]
    try:
        for fut in cf.as_completed(futures, timeout=max(1.0, deadline - time.time())):
            kind, name, took, error = fut.result()
            seconds[kind] = seconds.get(kind, 0.0) + took
            done += 1
            if error:
                failed.append((kind, name, error))
    except cf.TimeoutError:
        log(f"warm: deadline reached with {len(jobs) - done} of {len(jobs)} jobs left")
    finally:
        processes = list((getattr(pool, "_processes", None) or {}).values())
        pool.shutdown(wait=False, cancel_futures=True)
        for proc in processes:  # a worker still compiling is stopped, not waited for
            proc.terminate()
    log(f"warm: {done} jobs done, {len(failed)} failed")
    return {"jobs": len(jobs), "done": done, "failed": failed[:20],
            "worker_seconds": {k: round(v, 1) for k, v in seconds.items()}}
