"""Collect finished runs into one results folder: each run's metrics and curves, a comparison plot
and a summary table. ``python -m attnzoo.train.compare OUT_DIR NAME=RUN_DIR [NAME=RUN_DIR ...]``

``seed_table`` summarises several seeds per model as paper 004 reports them: the mean test
accuracy with a 95% confidence interval (Student's t, n - 1 degrees of freedom), beside the
paper's numbers, and each model's difference from the first: paired by seed (the same seed gives
both models the same data order, crops, flips and dropout seeds, so the per-seed differences are
the natural sample: Student's t on them) and, unpaired, with Welch's interval."""
from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
from pathlib import Path
from typing import Optional

from .metrics import plot_comparison


def t_quantile(level: float, dof: float) -> float:
    """The two-sided ``level`` quantile of Student's t with ``dof`` degrees of freedom."""
    from scipy.stats import t
    return float(t.ppf(0.5 + level / 2, dof))


def confidence_interval(values: list[float], level: float = 0.95) -> tuple[float, Optional[float]]:
    """(mean, half-width of the ``level`` interval for the mean); no half-width for one value."""
    n = len(values)
    if n == 0:
        raise ValueError("no values to summarise")
    mean = statistics.fmean(values)
    if n < 2:
        return mean, None
    return mean, t_quantile(level, n - 1) * statistics.stdev(values) / math.sqrt(n)


def welch_difference(a: list[float], b: list[float], level: float = 0.95) -> tuple[float, Optional[float]]:
    """(mean(b) - mean(a), half-width of Welch's ``level`` interval); None below two values each."""
    diff = statistics.fmean(b) - statistics.fmean(a)
    if len(a) < 2 or len(b) < 2:
        return diff, None
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    if va + vb == 0:
        return diff, 0.0
    dof = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    return diff, t_quantile(level, dof) * math.sqrt(va + vb)


def paired_difference(a: dict, b: dict, level: float = 0.95) -> tuple[Optional[float], Optional[float], list]:
    """(mean of b[s] - a[s] over the seeds s both have, half-width of the ``level`` t-interval,
    those seeds); (None, None, []) without a common seed, no half-width for one."""
    seeds = [s for s in a if s in b]
    if not seeds:
        return None, None, []
    diffs = [b[s] - a[s] for s in seeds]
    mean, half = confidence_interval(diffs, level)
    return mean, half, seeds


def _signed(mean: float, half: Optional[float]) -> str:
    return f"{mean:+.4f}" + ("" if half is None else f" ± {half:.4f}")


def _pm(mean: float, half: Optional[float], digits: int = 4) -> str:
    return f"{mean:.{digits}f}" + ("" if half is None else f" ± {half:.{digits}f}")


def seed_table(groups: dict[str, list[dict]], paper: Optional[dict] = None, level: float = 0.95) -> dict:
    """``groups``: model name -> the metrics.json of each of its seeds (in ``attnzoo train``'s
    format); ``paper``: name -> {"mean": ..., "ci": ...} (optional). Returns the rows and a
    markdown table: final and best test accuracy, mean and ``level`` CI half-width, train images/s,
    epochs; then each model's difference from the first model."""
    paper = paper or {}
    rows, first = [], None
    for name, runs in groups.items():
        final = [r["final_test_acc"] for r in runs]
        best = [r["best_test_acc"] for r in runs]
        mean, half = confidence_interval(final, level)
        best_mean, best_half = confidence_interval(best, level)
        speeds = [statistics.fmean(e["images_per_s"] for e in r["epochs"]) for r in runs if r["epochs"]]
        row = {"name": name, "seeds": [r["config"]["train"]["seed"] for r in runs], "final_test_acc": final,
               "mean": mean, "ci": half, "best_mean": best_mean, "best_ci": best_half,
               "train_images_per_s": statistics.fmean(speeds) if speeds else None,
               "epochs": sorted({r["epochs_done"] for r in runs}),
               "evaluated_on": sorted({r.get("evaluated_on", "test") for r in runs}),
               "paper": paper.get(name)}
        by_seed = dict(zip(row["seeds"], final))
        if first is None:
            first = (name, final, by_seed)
        else:
            row["minus_first"], row["minus_first_ci"] = welch_difference(first[1], final, level)
            row["paired"], row["paired_ci"], row["paired_seeds"] = paired_difference(first[2], by_seed, level)
        rows.append(row)
    on = "/".join(sorted({e for r in rows for e in r["evaluated_on"]}))
    pct = f"{level:.0%}"
    lines = [f"| model | seeds | final {on} acc (mean ± {pct} CI) | best {on} acc | paper | epochs | train img/s |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        p = r["paper"]
        paper_cell = "" if not p else _pm(p["mean"], p.get("ci"), 3)
        speed = "" if r["train_images_per_s"] is None else f"{r['train_images_per_s']:,.0f}"
        lines.append(f"| {r['name']} | {len(r['seeds'])} ({', '.join(map(str, r['seeds']))}) | "
                     f"{_pm(r['mean'], r['ci'])} | {_pm(r['best_mean'], r['best_ci'])} | {paper_cell} | "
                     f"{'/'.join(map(str, r['epochs']))} | {speed} |")
    diffs = [r for r in rows if "minus_first" in r]
    if diffs:
        lines += ["", f"| difference (final acc) | paired by seed: mean ± {pct} CI | unpaired: mean ± {pct} CI "
                      f"(Welch) | paper |", "|---|---|---|---|"]
        for r in diffs:
            pa, pb = rows[0]["paper"], r["paper"]
            paper_diff = f"{pb['mean'] - pa['mean']:+.3f}" if pa and pb else ""
            paired = "" if r["paired"] is None else \
                f"{_signed(r['paired'], r['paired_ci'])} ({len(r['paired_seeds'])} seeds)"
            lines.append(f"| {r['name']} − {rows[0]['name']} | {paired} | "
                         f"{_signed(r['minus_first'], r['minus_first_ci'])} | {paper_diff} |")
    return {"level": level, "rows": rows, "markdown": "\n".join(lines) + "\n"}


def collect(out_dir: Path, runs: dict[str, Path], title: str = "") -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    histories, summary = {}, {}
    for name, run in runs.items():
        metrics = json.loads((run / "metrics.json").read_text())
        histories[name] = metrics["epochs"]
        for f in ("metrics.csv", "metrics.json", "curves.png"):
            if (run / f).is_file():
                shutil.copyfile(run / f, out_dir / f"{name}_{f}")
        last = metrics["epochs"][-1]
        summary[name] = {"final_test_acc": last["test_acc"], "best_test_acc": metrics["best_test_acc"],
                         "epochs": metrics["epochs_done"], "parameters": metrics["parameters"],
                         "train_images_per_s": round(sum(h["images_per_s"] for h in metrics["epochs"]) / len(metrics["epochs"]), 1)}
    groups: dict[str, list[float]] = {}
    for name, row in summary.items():  # "vit_seed1" -> "vit"
        groups.setdefault(name.split("_seed")[0], []).append(row["final_test_acc"])
    summary["by_model"] = {g: {"runs": len(a), "mean_final_test_acc": statistics.fmean(a),
                               "std_final_test_acc": statistics.stdev(a) if len(a) > 1 else None}
                           for g, a in groups.items()}
    plot_comparison(histories, out_dir / "comparison.png", title=title)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("out_dir")
    p.add_argument("runs", nargs="+", metavar="NAME=RUN_DIR")
    p.add_argument("--title", default="")
    args = p.parse_args(argv)
    runs = {}
    for item in args.runs:
        name, sep, path = item.partition("=")
        if not sep:
            p.error(f"expected NAME=RUN_DIR, got {item!r}")
        runs[name] = Path(path)
    print(json.dumps(collect(Path(args.out_dir), runs, args.title), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
