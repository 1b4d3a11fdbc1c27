"""The softmax family on CPU: time and peak memory of the memory-efficient paths vs the eager reference.

Three measurements, all side by side in one run on this machine (fp32, 1 thread by default):

  main       fwd+bwd, B=1, H=4, D=64, N in {1024, 2048, 4096}: for each variant (softmax, l2,
             fenchel, sigmoid, relu) and each backend that can run it (reference, cpu, torch),
             median time and peak memory. Each (variant, backend, N) runs in a freshly forked child
             and peak memory is the growth of the child's peak RSS (getrusage ru_maxrss) during
             one fwd+bwd, counted from the RSS after the inputs exist and after a small warm-up
             call (so library code pages are already loaded). RSS counts what the OS gave the
             process, including freed memory malloc keeps: an upper bound on live tensors.
  crossover  small shapes, in-process: where each backend starts to beat the reference (the
             thresholds `auto` uses: SMALL_CALL_ELEMENTS in attnzoo/ops/kernels/blockwise.py).
  blocks     the blockwise path's block sizes at N = 2048.

Fenchel runs with a learnable per-key log-preference log_u of shape (B, H, 1, N) (paper 004's
context preference), so its gradient is part of the backward.

    .venv/bin/python benchmarks/fused_softmax_family.py            # all three, writes JSON + PNG
    .venv/bin/python benchmarks/fused_softmax_family.py --mode main --sizes 1024
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

VARIANTS = {
    "softmax": ("reference", "cpu", "torch"),
    "l2": ("reference", "cpu", "torch"),
    "fenchel": ("reference", "cpu", "torch"),
    "sigmoid": ("reference", "cpu"),
    "relu": ("reference", "cpu"),
}
ROOT = Path(__file__).resolve().parents[1]


def _inputs(variant, B, H, N, D, grad=True):
    import torch
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, N, D, generator=g).requires_grad_(grad) for _ in range(3))
    kw = {}
    if variant == "fenchel":
        kw["log_u"] = (0.1 * torch.randn(B, H, 1, N, generator=g)).requires_grad_(grad)
    return (q, k, v), kw


def _call(variant, backend, qkv, kw, backward=True):
    import torch

    import attnzoo.functional as AF
    if backend == "torch" and variant == "fenchel":
        # the dispatcher declines SDPA for a log_u that needs a gradient on CPU (SDPA would take its
        # math kernel); call the kernel directly to measure what that decision avoids
        from attnzoo.ops.fenchel.backends import fenchel_torch
        q = qkv[0]
        out = fenchel_torch(*qkv, scale=q.shape[-1] ** -0.5, **kw)
    else:
        out = AF.VARIANT_FUNCTIONS[variant](*qkv, backend=backend, **kw)
    if backward:
        leaves = list(qkv) + [t for t in kw.values() if isinstance(t, torch.Tensor) and t.requires_grad]
        torch.autograd.grad(out.sum(), leaves)
    return out


def _rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(variant, backend, N, reps, threads, B=1, H=4, D=64):
    """Runs in a fresh process: peak RSS growth of one fwd+bwd, then the median of reps timings."""
    import gc

    import torch
    torch.set_num_threads(threads)
    small, small_kw = _inputs(variant, B, H, 128, D)
    _call(variant, backend, small, small_kw)
    qkv, kw = _inputs(variant, B, H, N, D)
    del small, small_kw
    gc.collect()
    rss0 = _rss_bytes()
    max0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    _call(variant, backend, qkv, kw)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss0
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        _call(variant, backend, qkv, kw)
        times.append(time.perf_counter() - t0)
    return {"variant": variant, "backend": backend, "N": N, "peak_mb": peak / 2**20,
            "rss_before_mb": rss0 / 2**20, "maxrss_before_mb": max0 / 2**20,
            "time_s": statistics.median(times), "times_s": times}


def _in_child(fn, *args):
    """Run fn(*args) in a forked child (fresh peak-RSS counter, modules already imported: importing
    torch again per measurement cost a minute on the shared machine) and return its result."""
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()

    def target():
        try:
            queue.put(("ok", fn(*args)))
        except BaseException as e:  # report, don't hang the parent
            queue.put(("error", repr(e)))

    proc = ctx.Process(target=target)
    proc.start()
    status, result = queue.get()
    proc.join()
    if status != "ok":
        raise RuntimeError(f"measurement {args} failed: {result}")
    return result


def run_main(args):
    import torch
    torch.set_num_threads(args.threads)
    import attnzoo.functional  # noqa: F401  (imported once, before forking)
    rows = []
    for N in args.sizes:
        for variant in args.variants:
            for backend in VARIANTS[variant]:
                reps = args.reps if N < 4096 else max(1, args.reps - 1)
                row = _in_child(worker, variant, backend, N, reps, args.threads)
                rows.append(row)
                print(f"N={N:5d} {variant:8s} {backend:9s} time {row['time_s']:7.3f} s  peak {row['peak_mb']:8.1f} MB",
                      flush=True)
    for row in rows:
        ref = next(r for r in rows if r["variant"] == row["variant"] and r["N"] == row["N"]
                   and r["backend"] == "reference")
        row["time_vs_reference"] = row["time_s"] / ref["time_s"]
        row["memory_vs_reference"] = row["peak_mb"] / max(ref["peak_mb"], 1e-9)
    return rows


def _time(fn, reps):
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def run_crossover(args):
    import torch
    torch.set_num_threads(args.threads)
    rows = []
    for B, H, sizes in ((1, 4, (16, 64, 128, 256, 512, 1024)), (8, 4, (16, 64, 128, 256, 512))):
        for N in sizes:
            for variant in args.variants:
                qkv, kw = _inputs(variant, B, H, N, 64)
                for backend in VARIANTS[variant]:
                    for backward in (False, True):
                        reps = 5 if B * H * N * N <= 2**20 else 2
                        if backward:
                            t = _time(lambda: _call(variant, backend, qkv, kw), reps)
                        else:
                            with torch.no_grad():
                                t = _time(lambda: _call(variant, backend, qkv, kw, backward=False), reps)
                        rows.append({"variant": variant, "backend": backend, "B": B, "H": H, "N": N,
                                     "backward": backward, "time_s": t})
                ts = {r["backend"]: r["time_s"] for r in rows[-2 * len(VARIANTS[variant]):] if r["backward"]}
                print(f"B={B} H={H} N={N:5d} {variant:8s} fwd+bwd " +
                      "  ".join(f"{b} {t * 1e3:8.2f} ms" for b, t in ts.items()), flush=True)
    return rows


def run_blocks(args):
    import torch

    import attnzoo.ops.kernels.blockwise as BW
    torch.set_num_threads(args.threads)
    rows = []
    qkv, kw = _inputs("softmax", 1, 4, 2048, 64)
    for bq, bk in ((128, 512), (256, 256), (256, 512), (256, 1024), (512, 512), (1024, 1024)):
        BW.DEFAULT_BLOCK_Q, BW.DEFAULT_BLOCK_K = bq, bk
        for variant in ("softmax", "sigmoid"):
            t = _time(lambda: _call(variant, "cpu", qkv, kw), args.reps)
            rows.append({"variant": variant, "block_q": bq, "block_k": bk, "N": 2048, "time_s": t})
            print(f"blocks {bq:5d} x {bk:5d} {variant:8s} {t:.3f} s", flush=True)
    return rows


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    variants = sorted({r["variant"] for r in rows}, key=list(VARIANTS).index)
    fig, axes = plt.subplots(2, len(variants), figsize=(3.2 * len(variants), 6), squeeze=False)
    for col, variant in enumerate(variants):
        for backend in VARIANTS[variant]:
            rs = sorted((r for r in rows if r["variant"] == variant and r["backend"] == backend), key=lambda r: r["N"])
            if not rs:
                continue
            ns = [r["N"] for r in rs]
            axes[0][col].plot(ns, [r["time_s"] for r in rs], marker="o", label=backend)
            axes[1][col].plot(ns, [r["peak_mb"] for r in rs], marker="o", label=backend)
        axes[0][col].set_title(variant)
        for row, label in ((0, "fwd+bwd time (s)"), (1, "peak RSS growth (MB)")):
            ax = axes[row][col]
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("N")
            if col == 0:
                ax.set_ylabel(label)
            ax.legend(fontsize=7)
    fig.suptitle("CPU, fp32, B=1, H=4, D=64, 1 thread: blockwise 'cpu' and SDPA 'torch' vs eager reference")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=("all", "main", "crossover", "blocks"), default="all")
    p.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads (the machine is shared: 1)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "cpu")
    args = p.parse_args(argv)
    import torch
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"machine": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
            "threads": args.threads, "torch": torch.__version__, "dtype": "float32",
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "command": "python benchmarks/fused_softmax_family.py " + " ".join(sys.argv[1:]),
            "note": "2 cores shared with other jobs while measuring: times are noisy; ratios come from one run"}
    if args.mode in ("all", "blocks"):
        rows = run_blocks(args)
        (args.out / "blockwise_block_sizes.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    if args.mode in ("all", "crossover"):
        rows = run_crossover(args)
        (args.out / "dispatch_crossover.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    if args.mode in ("all", "main"):
        rows = run_main(args)
        (args.out / "fused_softmax_family.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        plot(rows, args.out / "fused_softmax_family.png")


if __name__ == "__main__":
    main()
