"""Collect finished runs into one results folder: each run's metrics and curves, a comparison plot
and a summary table. ``python -m attnzoo.train.compare OUT_DIR NAME=RUN_DIR [NAME=RUN_DIR ...]``"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
from pathlib import Path

from .metrics import plot_comparison


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
