"""Sliding windows on the blockwise CPU path: time and memory of a window of w against no window.

Each case runs in a fresh process (one thread): causal softmax attention, fp32, B = 1, H = 4, D = 64,
forward + backward on backend "cpu" (ops/kernels/blockwise.py), which visits only the key blocks in
the band. Reported: the best of --repeats wall times, and the peak resident memory the call added
over the process's state just before it (inputs included in neither: they are made before).

    PYTHONPATH=$PWD python benchmarks/cpu_window.py --n 4096 --window 128
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def one_case(n: int, window: int, repeats: int) -> dict:
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
    AF.softmax(*small, is_causal=True, backend="cpu", **kw).sum().backward()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = AF.softmax(q, k, v, is_causal=True, backend="cpu", **kw)
        out.backward(grad)
        times.append(time.perf_counter() - start)
        q.grad = k.grad = v.grad = None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"n": n, "window": window or None, "seconds": min(times), "peak_added_mib": (peak - before) / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--case", type=int, default=None, help=argparse.SUPPRESS)  # internal: one case
    args = parser.parse_args()
    if args.case is not None:
        print(json.dumps(one_case(args.n, args.case, args.repeats)))
        return
    rows = []
    for window in (0, args.window):
        out = subprocess.run([sys.executable, __file__, "--n", str(args.n), "--repeats", str(args.repeats),
                              "--case", str(window)], check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    full, band = rows
    for r in rows:
        print(f"N={r['n']} window={r['window']}: {r['seconds']:.3f} s, +{r['peak_added_mib']:.1f} MiB peak")
    print(f"window / no window: time {band['seconds'] / full['seconds']:.3f}x, "
          f"peak memory added {band['peak_added_mib'] / max(full['peak_added_mib'], 1e-9):.3f}x")


if __name__ == "__main__":
    main()
