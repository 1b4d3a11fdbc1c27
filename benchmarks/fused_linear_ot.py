"""CPU benchmark of the fused linear and OT attention paths against the eager reference.

fp32, forward + backward, B=1, H=4, D=64, one thread. Each (case, backend) runs in its own child
process so its peak memory is measured cleanly: the child resets the kernel's peak-RSS counter
(/proc/self/clear_refs) after building its inputs and reports VmHWM - RSS after the run, i.e. the
extra memory the attention forward + backward needed at its peak.

    .venv/bin/python benchmarks/fused_linear_ot.py               # writes benchmarks/results/cpu/fused_linear_ot.{json,png}
    .venv/bin/python benchmarks/fused_linear_ot.py --quick       # small sizes, to check the script

Cases: linear causal and non-causal at N = 4096; OT at N = 256 with |A| = 2N (N extra
templates); OT at N = 1024 with |A| = 2N on the fused path only (its reference size is computed,
not run). "cpu-tiles" is the OT cpu backend forced to send every (i, j) pair through its exact
blockwise fallback (ops/ot/tiles.py): its worst case, when no pair can use the matmul path.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

B, H, D = 1, 4, 64
ROOT = Path(__file__).resolve().parents[1]


def _rss_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def child(spec):
    import torch
    torch.set_num_threads(1)
    sys.path.insert(0, str(ROOT))
    import attnzoo.functional as AF

    torch.manual_seed(0)
    n, variant = spec["n"], spec["variant"]

    def leaf(*shape):
        return torch.randn(*shape, requires_grad=True)
    q, k, v = leaf(B, H, n, D), leaf(B, H, n, D), leaf(B, H, n, D)
    kw = {"backend": spec["backend"]}
    if spec["backend"] == "cpu-tiles":
        # worst case of the OT cpu path: every (i, j) pair through its exact blockwise fallback
        import math

        from attnzoo.ops.ot import cpu as ot_cpu
        ot_cpu.SAFE_NORMALISER = {torch.float32: math.inf}
        kw["backend"] = "cpu"
    if variant == "linear":
        kw["is_causal"] = spec["causal"]
        fn = AF.linear
    else:
        kw.update(templates_k=leaf(B, H, spec["templates"], D), templates_v=leaf(B, H, spec["templates"], D))
        fn = AF.ot
    times = []
    base = _rss_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")                                   # reset VmHWM (peak RSS) to the current RSS
    for _ in range(spec["repeats"]):
        start = time.perf_counter()
        out = fn(q, k, v, **kw)
        out.sum().backward()
        times.append(time.perf_counter() - start)
        del out
        for t in (q, k, v):
            t.grad = None
    peak = _rss_kib("VmHWM") - base
    print(json.dumps({"seconds": min(times), "all_seconds": times, "peak_mib": peak / 1024}))


def run_child(spec):
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def cases(quick):
    nl, no, nbig = (512, 64, 128) if quick else (4096, 256, 1024)
    out = []
    for causal in (False, True):
        out.append(dict(name=f"linear {'causal' if causal else 'non-causal'} N={nl}", variant="linear", n=nl,
                        causal=causal, backends=["reference", "cpu"], repeats=3))
    out.append(dict(name=f"ot N={no} |A|={2 * no}", variant="ot", n=no, templates=no,
                    backends=["reference", "cpu", "cpu-tiles"], repeats=2))
    out.append(dict(name=f"ot N={nbig} |A|={2 * nbig}", variant="ot", n=nbig, templates=nbig,
                    backends=["cpu", "cpu-tiles"], repeats=1))
    return out


def reference_ot_cube_gib(n, na):
    """Size of one (B, H, Nq, Nk, |A|) fp32 tensor; the eager reference holds about 8 of them at once
    (logits, exp, softmax, u * softmax, and their gradients)."""
    return B * H * n * n * na * 4 / 2**30


def plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["name"] for r in results]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, key, label in ((axes[0], "peak_mib", "peak extra memory (MiB)"), (axes[1], "seconds", "fwd+bwd time (s)")):
        for off, backend, colour in ((-0.27, "reference", "tab:gray"), (0.0, "cpu", "tab:blue"),
                                     (0.27, "cpu-tiles", "tab:orange")):
            xs, ys = [], []
            for i, r in enumerate(results):
                m = r["backends"].get(backend, {})
                if key in m:
                    xs.append(i + off)
                    ys.append(max(m[key], 1e-3))
            ax.bar(xs, ys, width=0.27, color=colour, label=backend)
        ax.set_yscale("log")
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, rotation=15, fontsize=8)
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle(f"attnzoo fused linear / OT vs eager reference: CPU fp32, B={B} H={H} D={D}, 1 thread")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cpu"))
    ap.add_argument("--quick", action="store_true", help="small sizes, to check the script quickly")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    results = []
    for case in cases(args.quick):
        row = {"name": case["name"], "backends": {}}
        for backend in case["backends"]:
            spec = {k: v for k, v in case.items() if k not in ("backends", "name")} | {"backend": backend}
            row["backends"][backend] = run_child(spec)
            print(case["name"], backend, row["backends"][backend], flush=True)
        ref, fused = row["backends"].get("reference", {}), row["backends"]["cpu"]
        if "seconds" in ref and "seconds" in fused:
            row["memory_ratio_cpu_over_reference"] = fused["peak_mib"] / ref["peak_mib"]
            row["time_ratio_cpu_over_reference"] = fused["seconds"] / ref["seconds"]
            tiles = row["backends"].get("cpu-tiles", {})
            if "seconds" in tiles:
                row["memory_ratio_cpu_tiles_over_reference"] = tiles["peak_mib"] / ref["peak_mib"]
                row["time_ratio_cpu_tiles_over_reference"] = tiles["seconds"] / ref["seconds"]
        if case["variant"] == "ot" and "reference" not in case["backends"]:
            row["reference_one_cube_gib"] = reference_ot_cube_gib(case["n"], 2 * case["n"])
        results.append(row)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "fused_linear_ot_quick" if args.quick else "fused_linear_ot"
    meta = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "threads": 1,
            "note": "shared machine (8 engineers on 2 cores): times are noisy, ratios are side by side in one run",
            "B": B, "H": H, "D": D, "dtype": "float32", "pass": "forward + backward",
            "command": "python benchmarks/fused_linear_ot.py" + (" --quick" if args.quick else "")}
    (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    plot(results, out / f"{stem}.png")
    print("wrote", out / f"{stem}.json", out / f"{stem}.png")


if __name__ == "__main__":
    main()
