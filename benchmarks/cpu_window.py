"""Sliding windows on the blockwise CPU path: time and memory of a window of w against no window.

Each case runs in a fresh process (one thread): causal softmax attention, fp32, B = 1, H = 4, D = 64,
forward + backward on backend "cpu" (ops/kernels/blockwise.py), which visits only the key blocks in
the band. Reported: the best of --repeats wall times and CPU times (the process's own, which other
processes on a shared machine do not inflate: prefer it there), and memory counted two ways, both
over the state just before the call (the inputs are made before and counted in neither):

* tensor peak: the most bytes held by tensors the forward + backward allocated, exactly, from the
  allocation records of torch.profiler(profile_memory=True) (one extra, untimed call): independent of
  malloc's caching, so the same from run to run;
* resident peak: the process's peak RSS (ru_maxrss) added by the timed calls, what the OS saw
  (noisier: the allocator keeps or returns freed pages as it likes).

``--variant linear``: linear attention's window is compared with the same window folded into the mask
(its other backends' route, the N x N reference) instead of with no window (which linear attention
computes in O(N) by prefix sums); the window runs on backend "band" (ops/linear/band.py).

Of either, the output and the three input gradients (4 x B H N D numbers, 16 MiB at the defaults)
are what any call returns; the rest is the attention's own temporaries, reported apart.

    PYTHONPATH=$PWD python benchmarks/cpu_window.py --n 4096 --window 128 --repeats 3 \
        --out benchmarks/results/cpu/window_n4096_w128.json
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time


def tensor_peak_mib(step) -> float:
    """Peak bytes held by the tensors ``step()`` allocates (MiB), from the profiler's allocation records:
    each carries the running total, and the first one's total minus its own size is the start."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    records = [e["args"] for e in events if e.get("name") == "[memory]"]
    start = records[0]["Total Allocated"] - records[0]["Bytes"]
    return (max(r["Total Allocated"] for r in records) - start) / 2 ** 20


def one_case(n: int, window: int, repeats: int, variant: str = "softmax", backend: str = "cpu") -> dict:
    import torch

    import attnzoo.functional as AF
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, n, 64, generator=g).requires_grad_() for _ in range(3))
    grad = torch.randn(1, 4, n, 64, generator=g)
    kw = {"window_size": (window - 1, 0)} if window else {}
    # warm up the same path on a small call first: one-off runtime allocations (libraries, thread pools)
    # then stay out of the peak this case adds
    small = [t.detach()[:, :, :256].clone().requires_grad_() for t in (q, k, v)]
    attend = getattr(AF, variant)
    attend(*small, is_causal=True, backend=backend, **kw).sum().backward()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    times, cpu_times = [], []
    for _ in range(repeats):
        start, cpu_start = time.perf_counter(), time.process_time()
        out = attend(q, k, v, is_causal=True, backend=backend, **kw)
        out.backward(grad)
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
        q.grad = k.grad = v.grad = None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    def step():
        attend(q, k, v, is_causal=True, backend=backend, **kw).backward(grad)
    tensors = tensor_peak_mib(step)
    q.grad = k.grad = v.grad = None
    returned = 4 * q.numel() * q.element_size() / 2 ** 20  # the output and dq, dk, dv
    return {"variant": variant, "backend": backend, "n": n, "window": window or None, "seconds": min(times), "cpu_seconds": min(cpu_times),
            "peak_added_mib": (peak - before) / 1024, "tensor_peak_mib": tensors, "returned_mib": returned,
            "torch": torch.__version__, "threads": torch.get_num_threads()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=None, help="also write the rows and ratios to this JSON file")
    parser.add_argument("--variant", choices=("softmax", "linear"), default="softmax",
                        help="linear: the band backend against the window folded into the mask (see the module)")
    parser.add_argument("--case", type=int, default=None, help=argparse.SUPPRESS)  # internal: one case
    parser.add_argument("--backend", default="cpu", help=argparse.SUPPRESS)      # internal: the case's backend
    args = parser.parse_args()
    if args.case is not None:
        print(json.dumps(one_case(args.n, args.case, args.repeats, args.variant, args.backend)))
        return
    rows = []
    cases = ((0, "cpu"), (args.window, "cpu")) if args.variant == "softmax" else \
        ((args.window, "reference"), (args.window, "band"))
    for window, backend in cases:
        out = subprocess.run([sys.executable, __file__, "--n", str(args.n), "--repeats", str(args.repeats),
                              "--variant", args.variant, "--backend", backend, "--case", str(window)],
                             check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    full, band = rows

    def own(r, key):  # the attention's own temporaries: the peak beyond what the call returns
        return max(r[key] - r["returned_mib"], 0.0)

    def ratio(a, b):
        return a / max(b, 1e-9)

    for r in rows:
        print(f"{r['variant']} on {r['backend']}, N={r['n']} window={r['window']}: {r['seconds']:.3f} s wall, {r['cpu_seconds']:.3f} s CPU; "
              f"tensor peak +{r['tensor_peak_mib']:.2f} MiB ({r['returned_mib']:.1f} returned, "
              f"{own(r, 'tensor_peak_mib'):.2f} temporaries); resident peak +{r['peak_added_mib']:.1f} MiB "
              f"({own(r, 'peak_added_mib'):.1f} beyond the returned)")
    ratios = {"wall": ratio(band["seconds"], full["seconds"]), "cpu": ratio(band["cpu_seconds"], full["cpu_seconds"]),
              "tensor_peak": ratio(band["tensor_peak_mib"], full["tensor_peak_mib"]),
              "tensor_temporaries": ratio(own(band, "tensor_peak_mib"), own(full, "tensor_peak_mib")),
              "resident_peak": ratio(band["peak_added_mib"], full["peak_added_mib"]),
              "resident_temporaries": ratio(own(band, "peak_added_mib"), own(full, "peak_added_mib"))}
    print(("window / no window: " if args.variant == "softmax" else "band / folded mask: ") + ", ".join(f"{k} {v:.3f}x" for k, v in ratios.items()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": " ".join(["python"] + sys.argv), "rows": rows, "ratios": ratios,
                       "load_average": os.getloadavg(), "cpus": os.cpu_count()}, f, indent=1)  # a shared machine
            f.write("\n")


if __name__ == "__main__":
    main()
