"""Sliding windows on the blockwise CPU path: time and memory of a window of w against no window.

Each case runs in a fresh process (one thread): causal softmax attention, fp32, B = 1, H = 4, D = 64,
forward + backward on backend "cpu" (ops/kernels/blockwise.py), which visits only the key blocks in
the band. Reported: the best of --repeats wall times and CPU times (the process's own, which other
processes on a shared machine do not inflate: prefer it there), and the peak resident memory the call
added over the process's state just before it (inputs included in neither: they are made before).
Of that memory, the output and the three input gradients (4 x B H N D numbers, 16 MiB at the
defaults) are what any call returns; the rest is the attention's own temporaries, reported apart.

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
    times, cpu_times = [], []
    for _ in range(repeats):
        start, cpu_start = time.perf_counter(), time.process_time()
        out = AF.softmax(q, k, v, is_causal=True, backend="cpu", **kw)
        out.backward(grad)
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
        q.grad = k.grad = v.grad = None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    returned = 4 * q.numel() * q.element_size() / 2 ** 20  # the output and dq, dk, dv
    return {"n": n, "window": window or None, "seconds": min(times), "cpu_seconds": min(cpu_times),
            "peak_added_mib": (peak - before) / 1024, "returned_mib": returned}


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
    def own(r):  # the attention's own temporaries: the peak beyond what the call returns
        return max(r["peak_added_mib"] - r["returned_mib"], 0.0)

    for r in rows:
        print(f"N={r['n']} window={r['window']}: {r['seconds']:.3f} s wall, {r['cpu_seconds']:.3f} s CPU, "
              f"+{r['peak_added_mib']:.1f} MiB peak ({r['returned_mib']:.1f} returned, {own(r):.1f} temporaries)")
    print(f"window / no window: wall time {band['seconds'] / full['seconds']:.3f}x, "
          f"CPU time {band['cpu_seconds'] / full['cpu_seconds']:.3f}x, "
          f"peak memory added {band['peak_added_mib'] / max(full['peak_added_mib'], 1e-9):.3f}x, "
          f"temporaries {own(band) / max(own(full), 1e-9):.3f}x")


if __name__ == "__main__":
    main()
