"""Per-epoch metrics: CSV and JSON files and a PNG of the curves."""
from __future__ import annotations

import csv
import json
from pathlib import Path

from .checkpoint import _atomic_write


def write_metrics(out_dir: Path, history: list[dict], summary: dict) -> None:
    out_dir = Path(out_dir)
    if not history:
        return
    fields = list(history[0])

    def write_csv(p):
        with open(p, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=fields)
            w.writeheader()
            w.writerows(history)

    _atomic_write(out_dir / "metrics.csv", write_csv)
    _atomic_write(out_dir / "metrics.json",
                  lambda p: Path(p).write_text(json.dumps({**summary, "epochs": history}, indent=2)))


def plot_curves(history: list[dict], path: Path, title: str = "") -> None:
    """Loss (train/test) and accuracy (train/test) against epoch."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = [h["epoch"] for h in history]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    for key, label in (("train_loss", "train"), ("test_loss", "test")):
        ax_loss.plot(epochs, [h[key] for h in history], marker="o", label=label)
    for key, label in (("train_acc", "train"), ("test_acc", "test")):
        ax_acc.plot(epochs, [h[key] for h in history], marker="o", label=label)
    _finish_two_panels(fig, ax_loss, ax_acc, "", title, path)


def plot_comparison(runs: dict[str, list[dict]], path: Path, title: str = "") -> None:
    """Test accuracy and train loss of several runs on one figure (e.g. ViT vs OT-ViT)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    for name, history in runs.items():
        epochs = [h["epoch"] for h in history]
        style = dict(marker="o", ls="-" if name.startswith(("vit", "ViT")) else "--")
        ax_loss.plot(epochs, [h["test_loss"] for h in history], label=name, **style)
        ax_acc.plot(epochs, [h["test_acc"] for h in history], label=name, **style)
    _finish_two_panels(fig, ax_loss, ax_acc, "test ", title, path)


def plot_seed_curves(groups: dict[str, list[list[dict]]], path: Path, title: str = "", split: str = "test") -> None:
    """Test (or validation: ``split``) accuracy and loss per epoch of several models with several
    seeds each: every seed as a thin line, the mean over seeds as a thick one (epochs that all
    seeds reached)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4.2))
    for k, (name, histories) in enumerate(groups.items()):
        color = f"C{k}"
        for history in histories:
            epochs = [h["epoch"] for h in history]
            ax_loss.plot(epochs, [h["test_loss"] for h in history], color=color, alpha=0.3, lw=0.8)
            ax_acc.plot(epochs, [h["test_acc"] for h in history], color=color, alpha=0.3, lw=0.8)
        common = min(len(h) for h in histories)
        if common:
            epochs = [h["epoch"] for h in histories[0][:common]]
            for ax, key in ((ax_loss, "test_loss"), (ax_acc, "test_acc")):
                mean = [sum(h[i][key] for h in histories) / len(histories) for i in range(common)]
                ax.plot(epochs, mean, color=color, lw=2, label=f"{name} (mean of {len(histories)})")
    _finish_two_panels(fig, ax_loss, ax_acc, f"{split} ", title, path)


def _finish_two_panels(fig, ax_loss, ax_acc, prefix: str, title: str, path) -> None:
    """Labels, grid and legend of the loss/accuracy pair, then an atomic PNG write."""
    import matplotlib.pyplot as plt

    ax_loss.set(xlabel="epoch", ylabel=f"{prefix}cross-entropy", title=f"{prefix}loss")
    ax_acc.set(xlabel="epoch", ylabel=f"{prefix}accuracy", title=f"{prefix}accuracy")
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    _atomic_write(Path(path), lambda p: fig.savefig(p, dpi=120, format="png"))
    plt.close(fig)
