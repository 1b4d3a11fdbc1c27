"""Parallel warm-up: compile every kernel the measurement will launch in worker processes first.

Triton writes each compiled kernel to its on-disk cache and inductor its compiled graphs to its own
(FX graph and AOT autograd caches); later compiles of the same kernel or graph in the main process
load them instead of compiling. Compiling is single-threaded per process and dominates a short GPU
session, so pools of workers (one CUDA context each) run every timed case once: what the main process
then measures is unchanged, only its first calls get cheap. Autotuning and dynamo's tracing still
happen in the main process (their results are per process), on cached binaries.

A job is (kind, function, arguments): the function is a module-level function (workers import it by
name), run as ``function(*arguments)``; the model jobs hold a model on the GPU each, so they run in a
pool of their own with fewer workers (``limits``).
"""
from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import os
import time
import traceback
from typing import Optional


def _worker_init():
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # many workers compile at once: inductor's own pool of compile processes would oversubscribe the CPU
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "2")
    import torch._dynamo
    torch._dynamo.config.cache_size_limit = 256
    if hasattr(torch._dynamo.config, "recompile_limit"):
        torch._dynamo.config.recompile_limit = 256


def warm_speed(device: str, label: str, fields: dict) -> str:
    import torch

    from attnzoo.bench import speed_grid as grid
    dev = torch.device(device)
    case = next(c for c in grid.speed_cases(dev) if c.label == label)
    prepared = case.prepare(grid.problem_from_fields(fields, dev))
    with torch.no_grad():
        prepared.forward()
    out = prepared.forward()
    out.backward(torch.randn_like(out))
    return label


def warm_correctness(device: str, variant: str, spec: dict, backend: str, shape: tuple, dtype: str) -> str:
    import torch

    from .correctness import check_any
    check_any(variant, spec, backend, shape, getattr(torch, dtype), torch.device(device))
    return f"{variant}/{backend}"


def warm_model(device: str, model: str, attention: str, mode: str, size: str, batch: Optional[int]) -> str:
    """Two training steps of one model case: the compile (and the CUDA graphs' recording) happen here."""
    import torch

    from attnzoo.bench.model_bench import Case, ModelBenchConfig, Trainer
    from attnzoo.bench.model_zoo import model_spec
    config = ModelBenchConfig(models=[model], modes=[mode], size=size, batch=batch, device=device).validate()
    trainer = Trainer(Case(model_spec(model), attention, mode), config, torch.device(device))
    for _ in range(2):
        trainer.step()
    del trainer
    # the worker takes the next case: its compiled graphs (and CUDA-graph memory pools) go now
    torch._dynamo.reset()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return f"{model}/{attention}/{mode}"


def warm_compile(device: str, name: str) -> str:
    import torch

    from .compile_check import check
    check(name, torch.device(device))
    return name


def _job(kind: str, fn, args: tuple) -> tuple:
    start = time.time()
    try:
        name = fn(*args)
        return kind, name, time.time() - start, None
    except Exception as e:  # noqa: BLE001 - the main process records the failure itself
        return kind, str(args[1]), time.time() - start, f"{type(e).__name__}: {e}"[:200] + traceback.format_exc()[-300:]


def warm(jobs: list, workers: int, deadline: float, log, limits: Optional[dict] = None) -> dict:
    """Run ``jobs`` ((kind, function, args) triples, args starting with the device) until done or
    ``deadline``: the kinds in ``limits`` each on a pool of that many workers, the rest on ``workers``
    processes; returns counts, failures and the seconds each kind took in all."""
    limits = limits or {}
    done, failed, seconds = 0, [], {}
    ctx = multiprocessing.get_context("spawn")
    pools = {}

    def pool_for(kind):
        key = kind if kind in limits else None
        if key not in pools:
            size = limits[kind] if kind in limits else workers
            pools[key] = cf.ProcessPoolExecutor(max_workers=max(1, size), mp_context=ctx, initializer=_worker_init)
        return pools[key]

    futures = [pool_for(kind).submit(_job, kind, fn, args) for kind, fn, args in jobs]
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
        for pool in pools.values():
            processes = list((getattr(pool, "_processes", None) or {}).values())
            pool.shutdown(wait=False, cancel_futures=True)
            for proc in processes:  # a worker still compiling is stopped, not waited for
                proc.terminate()
            for proc in processes:  # but its GPU memory must be back before the timed phases start
                proc.join(timeout=10)
    log(f"warm: {done} jobs done, {len(failed)} failed")
    return {"jobs": len(jobs), "done": done, "failed": failed[:20],
            "worker_seconds": {k: round(v, 1) for k, v in seconds.items()}}
