"""Where the fused OT "cpu" backend starts to beat the eager "reference" on CPU (the dispatch crossover).

Both backends run side by side in one process, alternating call by call (the machine is shared, so
interleaving keeps slow spells from landing on one backend only); each row keeps the best time of
``--reps`` per backend and the median of the back-to-back ratios cpu / reference, which decides.
Times are the process's CPU time (one thread): on a shared machine wall-clock time also counts the
time other jobs hold the core, which made the thresholds move from run to run.
fp32, one thread, forward + backward (inputs require grad) and forward only (torch.no_grad()).

Grid: D in {16, 64}; Nk in {16, 50, 256, 1024}; |A| = Nk (no extra templates) or 2 Nk (Nk extra
templates, as OT-ViT's partner images give); Nq in {1, 4, 16, 64, 256, Nk} (Nq = 1 is OT-ViT's
class-token layer); B * H in {4, 256} (H = 4); plus OT-ViT's class-token layer at paper size. Shapes
whose reference cube B*H*Nq*Nk*|A| exceeds ``--max-cube`` elements are skipped (the reference holds
several such fp32 tensors).

    .venv/bin/python benchmarks/ot_dispatch_crossover.py           # results/cpu/ot_dispatch_crossover.{json,png}
    .venv/bin/python benchmarks/ot_dispatch_crossover.py --replot  # only redraw the PNG from the JSON
    .venv/bin/python benchmarks/ot_dispatch_crossover.py --quick   # a few shapes, to check the script

attnzoo/ops/ot/__init__.py uses the two thresholds derived here (``summary``) and
tests/test_fused_ot.py checks that they match the committed JSON.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
H = 4
BACKENDS = ("reference", "cpu")


def grid(quick):
    if quick:
        return [(bh, nq, nk, t, d) for bh in (4,) for d in (16,) for nk in (16, 256) for t in (0, nk)
                for nq in (1, nk)]
    # OT-ViT's class-token layer (Nq = 1, 49 patches + class token, |A| = 50 or 100 with a partner's
    # templates): the reduced CPU run (batch 64 x 4 heads, D = 16) and the paper size (128 x 8, D = 32)
    shapes = [(bh, 1, 50, t, d) for bh, d in ((1024, 32),) for t in (0, 50)]   # (256, 16) is in the grid
    for bh in (4, 256):
        for d in (16, 64):
            for nk in (16, 50, 256, 1024):
                for t in (0, nk):
                    for nq in sorted({1, 4, 16, 64, 256, nk}):
                        shapes.append((bh, nq, nk, t, d))
    return shapes


def _inputs(torch, bh, nq, nk, t, d, grad):
    gen = torch.Generator().manual_seed(0)

    def leaf(n, dim):
        return torch.randn(bh // H, H, n, dim, generator=gen).requires_grad_(grad)
    q, k, v = leaf(nq, d), leaf(nk, d), leaf(nk, d)
    kw = dict(templates_k=leaf(t, d), templates_v=leaf(t, d)) if t else {}
    return q, k, v, kw


def _timer(torch, AF, backend, q, k, v, kw, grad):
    leaves = [x for x in (q, k, v, *kw.values()) if x.requires_grad]

    def once():
        start = time.process_time()
        if grad:
            out = AF.ot(q, k, v, backend=backend, **kw)
            torch.autograd.grad(out.sum(), leaves)
        else:
            with torch.no_grad():
                AF.ot(q, k, v, backend=backend, **kw)
        return time.process_time() - start
    return once


def measure(torch, AF, shape, grad, reps):
    """Best time per backend, and the median over reps of the ratio cpu / reference of two calls made
    back to back (a slow spell of the shared machine then hits both sides of a ratio, not one backend)."""
    bh, nq, nk, t, d = shape
    q, k, v, kw = _inputs(torch, bh, nq, nk, t, d, grad)
    timers = {b: _timer(torch, AF, b, q, k, v, kw, grad) for b in BACKENDS}
    for run in timers.values():   # warm-up
        run()
    times = {b: [] for b in BACKENDS}
    for _ in range(reps):
        for b, run in timers.items():
            times[b].append(run())
    ratios = sorted(c / r for c, r in zip(times["cpu"], times["reference"]))
    return {b: min(ts) for b, ts in times.items()}, ratios[len(ratios) // 2]


def _regret(rows, threshold):
    """Summed relative time lost, over the measured shapes, by the rule with this threshold."""
    lost = 0.0
    for r in rows:
        ratio = r["cpu_over_reference"]
        lost += (1.0 if r["cube"] < threshold else ratio) / min(1.0, ratio) - 1.0
    return lost


def _best_threshold(rows):
    """The power of two whose rule loses the least time summed over the rows (the timings are noisy,
    so no single row decides); on a tie the smaller one, which keeps more calls on the lean path."""
    top = max(r["cube"] for r in rows).bit_length() + 1
    return min((2 ** e for e in range(top + 1)), key=lambda c: (round(_regret(rows, c), 6), c))


def summarise(rows):
    """Two thresholds on the cube B*H*Nq*Nk*|A|: one for a single query, one for several. With one
    query the fused path's products are matrix-vector products with nothing to gain over the
    reference's (Nk, |A|) softmax, whose cube is then no bigger than the Gram term both paths hold."""
    single = [r for r in rows if r["Nq"] == 1]
    several = [r for r in rows if r["Nq"] > 1]
    t_single, t_several = _best_threshold(single), _best_threshold(several)
    one = _best_threshold(rows)

    def rule(r):
        return "reference" if r["cube"] < (t_single if r["Nq"] == 1 else t_several) else "cpu"

    lost = sum(_regret([r], t_single if r["Nq"] == 1 else t_several) for r in rows)
    return {
        "rule": "auto on CPU prefers 'reference' when B*H*Nq*Nk*|A| < cube_threshold_single_query (Nq = 1) "
                "or < cube_threshold (Nq > 1), else 'cpu'",
        "cube_threshold": t_several,
        "cube_threshold_single_query": t_single,
        "time_lost_by_rule": lost,
        "time_lost_one_threshold": _regret(rows, one),
        "one_threshold": one,
        "time_lost_always_cpu": _regret(rows, 0),
        "time_lost_always_reference": _regret(rows, 2 * max(r["cube"] for r in rows)),
        "rows_reference_chosen": sum(rule(r) == "reference" for r in rows),
        "rows_reference_chosen_but_cpu_faster": sum(rule(r) == "reference" and r["cpu_over_reference"] < 1
                                                    for r in rows),
        "rows_cpu_chosen": sum(rule(r) == "cpu" for r in rows),
        "rows_cpu_chosen_but_reference_faster": sum(rule(r) == "cpu" and r["cpu_over_reference"] > 1 for r in rows),
        "worst_cpu_over_reference_where_cpu_chosen": max(r["cpu_over_reference"] for r in rows if rule(r) == "cpu"),
    }


def plot(result, path):
    """cpu / reference time against the cube, one query and several apart, with the two thresholds."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, summary = result["rows"], result["summary"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, single, key, title in ((axes[0], True, "cube_threshold_single_query", "one query (Nq = 1)"),
                                   (axes[1], False, "cube_threshold", "several queries (Nq > 1)")):
        for backward, marker in ((True, "o"), (False, "x")):
            rs = [r for r in rows if (r["Nq"] == 1) == single and r["backward"] == backward]
            ax.scatter([r["cube"] for r in rs], [r["cpu_over_reference"] for r in rs], marker=marker, s=18,
                       label="forward + backward" if backward else "forward")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.axvline(summary[key], color="tab:red", ls="--", label=f"auto threshold {summary[key]}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("B*H*Nq*Nk*|A| (elements of the reference's cube)")
        ax.set_title(title)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("time 'cpu' / time 'reference' (below 1: cpu faster)")
    fig.suptitle("OT attention on CPU, fp32, 1 thread: fused 'cpu' vs eager 'reference' "
                 "(median of back-to-back ratios)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "cpu" / "ot_dispatch_crossover.json")
    ap.add_argument("--quick", action="store_true", help="a few shapes, to check the script")
    ap.add_argument("--reps", type=int, default=5, help="repeats per row (3x below 2^20, fewer above 2^22)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the machine is shared: 1)")
    ap.add_argument("--max-cube", type=int, default=2 ** 24, help="skip shapes with a bigger reference cube")
    ap.add_argument("--replot", action="store_true", help="only redraw the PNG from the JSON at --out")
    args = ap.parse_args(argv)
    if args.replot:
        plot(json.loads(args.out.read_text()), args.out.with_suffix(".png"))
        return

    import torch
    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(ROOT))
    import attnzoo.functional as AF

    rows = []
    for shape in grid(args.quick):
        bh, nq, nk, t, d = shape
        cube = bh * nq * nk * (nk + t)
        if cube > args.max_cube:
            continue
        # small calls are cheap and decide the thresholds: more repeats there against the noise
        reps = 3 * args.reps if cube <= 2 ** 20 else args.reps if cube <= 2 ** 22 else max(2, args.reps // 2)
        for grad in (True, False):
            best, ratio = measure(torch, AF, shape, grad, reps)
            row = {"BH": bh, "Nq": nq, "Nk": nk, "A": nk + t, "D": d, "backward": grad, "cube": cube,
                   "reference_s": best["reference"], "cpu_s": best["cpu"], "cpu_over_reference": ratio}
            rows.append(row)
            print(f"BH={bh:3d} Nq={nq:4d} Nk={nk:4d} |A|={nk + t:4d} D={d:2d} {'fwd+bwd' if grad else 'fwd    '} "
                  f"cube={cube:9d} reference {best['reference'] * 1e3:8.2f} ms  cpu {best['cpu'] * 1e3:8.2f} ms  "
                  f"cpu/ref {row['cpu_over_reference']:.2f}", flush=True)
    meta = {"machine": platform.machine(), "threads": args.threads, "torch": torch.__version__, "dtype": "float32",
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
            "command": "python benchmarks/ot_dispatch_crossover.py" + (" --quick" if args.quick else ""),
            "reps": args.reps, "clock": "time.process_time (CPU time of the process, one thread)",
            "note": "2 cores shared with other jobs: times are noisy; both backends were measured alternately "
                    "in one process; times are the best of reps, cpu_over_reference the median of "
                    "back-to-back ratios"}
    result = {"meta": meta, "summary": summarise(rows), "rows": rows}
    print(json.dumps(result["summary"], indent=1))
    if not args.quick:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.out.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(result, indent=1))
        tmp.replace(args.out)
        plot(result, args.out.with_suffix(".png"))
        print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
