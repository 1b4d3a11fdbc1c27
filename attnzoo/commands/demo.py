"""attnzoo demo (what ``make demo`` runs): a few attention variants trained side by side on a CPU in
about a minute, then a table (accuracy, time, images/s) and one PNG of the test curves.

It runs offline and never touches the system: the data is scikit-learn's handwritten digits (1797
8x8 images inside the scikit-learn wheel), or Fashion-MNIST when its files are already on disk.
When they are not, the demo prints the command that installs them; it never runs it."""
from __future__ import annotations

import json
import re
import shutil
import sys
import time
from pathlib import Path

from . import UsageError

HELP = "train a few attention variants side by side on a CPU in about a minute (make demo)"
DEFAULT_VARIANTS = ("softmax", "sinkhorn", "otvit")
OTVIT = "otvit"  # OT-ViT: softmax layers, OT attention in the last one (paper 004 sec 9)
CONFIGS = {"digits": "demo.yaml", "fashion_mnist": "demo_fashion_mnist.yaml"}


def add_arguments(parser) -> None:
    parser.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS), metavar="SPEC",
                        help="ViT attention specs (e.g. sigmoid 'sinkhorn(n_iters=5)') and/or 'otvit' "
                             f"(default: {' '.join(DEFAULT_VARIANTS)})")
    parser.add_argument("--dataset", choices=["auto", *CONFIGS], default="auto",
                        help="auto (default): Fashion-MNIST when its files are on disk, else the digits")
    parser.add_argument("--data-dir", default=None, help="a folder holding the four Fashion-MNIST .gz files "
                        "(must exist; implies Fashion-MNIST)")
    parser.add_argument("--epochs", type=int, default=None, help="epochs per variant (default: the config's)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config field for every variant, as in attnzoo train")
    parser.add_argument("--out", default="runs/demo", help="output folder (default: runs/demo)")


def config_dir() -> Path:
    for root in (Path.cwd(), Path(__file__).resolve().parents[2]):
        if (root / "configs" / CONFIGS["digits"]).is_file():
            return root / "configs"
    raise UsageError("configs/demo.yaml not found: run from the attnzoo checkout")


def pick_dataset(choice: str, data_dir) -> tuple[str, str]:
    """(dataset, a line for the user): Fashion-MNIST only from files already on disk. A --data-dir
    must exist and hold the files: it asks for Fashion-MNIST (the digits read no folder)."""
    from ..train.datasets import FASHION_MNIST_INSTALL, fashion_mnist_dirs, fashion_mnist_present
    if data_dir is not None:
        if choice == "digits":
            raise UsageError(f"--data-dir {data_dir!r} cannot be used with --dataset digits: the digits ship inside "
                             f"scikit-learn and read no folder; drop --data-dir")
        if not Path(data_dir).is_dir():
            raise UsageError(f"--data-dir {data_dir!r} does not exist or is not a folder")
        if not fashion_mnist_present(data_dir):
            raise UsageError(f"--data-dir {data_dir!r} holds no Fashion-MNIST files (looked for the four .gz files in "
                             f"{[str(d) for d in fashion_mnist_dirs(data_dir)]}); to install them: "
                             f"{FASHION_MNIST_INSTALL}")
    present = fashion_mnist_present(data_dir)
    how = f"{FASHION_MNIST_INSTALL} (or --data-dir DIR holding its four .gz files)"
    if choice == "fashion_mnist" and not present:
        raise UsageError(f"Fashion-MNIST is not installed; to install it: {how}")
    if choice == "digits" or (choice == "auto" and not present):
        note = "" if choice == "digits" else f"; for Fashion-MNIST instead: {how}, then run the demo again"
        return "digits", f"data: scikit-learn's handwritten digits (1797 8x8 images shipped with scikit-learn){note}"
    return "fashion_mnist", "data: Fashion-MNIST (files found on disk)"


def run_label(variant: str) -> str:
    return "OT-ViT" if variant == OTVIT else f"ViT {variant}"


def run_dir_name(variant: str) -> str:
    return OTVIT if variant == OTVIT else "vit-" + re.sub(r"[^A-Za-z0-9_.=-]+", "_", variant).strip("_")


def plan_runs(args, dataset: str) -> list[tuple[str, object]]:
    """[(variant, TrainConfig)]: every config loaded and checked before any data is read."""
    from ..train import load_config
    base = config_dir() / CONFIGS[dataset]
    common = list(args.overrides)
    if args.data_dir is not None and dataset != "digits":
        common.append(f"data.data_dir={json.dumps(args.data_dir)}")
    if args.epochs is not None:
        common.append(f"train.epochs={args.epochs}")
    if len(set(args.variants)) != len(args.variants):
        raise UsageError(f"--variants lists a variant twice: {args.variants}")
    runs = []
    for v in args.variants:
        model = [f"model.name={OTVIT}"] if v == OTVIT else ["model.name=vit", f"model.attention={json.dumps(v)}"]
        out = Path(args.out) / run_dir_name(v)
        # one PNG for the whole demo: the runs' own curves are off; metrics and checkpoints stay
        fixed = model + [f"train.out_dir={json.dumps(str(out))}", "train.plot=false", "train.progress=false"]
        try:
            runs.append((v, load_config(base, common + fixed)))
        except ValueError as e:
            raise UsageError(f"{run_label(v)}: {e}") from None
    return runs


def train_with_bar(variant: str, cfg, index: int, total: int) -> dict:
    from tqdm.auto import tqdm

    from ..train import train
    bar = tqdm(total=cfg.train.epochs, desc=f"[{index}/{total}] {run_label(variant)}", unit="epoch",
               dynamic_ncols=True, file=sys.stderr)

    def on_epoch(row):
        bar.set_postfix(test_acc=f"{row['test_acc']:.3f}", img_s=f"{row['images_per_s']:.0f}", refresh=False)
        bar.update(1)

    # the demo trains afresh every time: a run it trained before in this folder is replaced (train
    # itself refuses to replace a run it was not asked to resume)
    shutil.rmtree(Path(cfg.train.out_dir) / "checkpoints", ignore_errors=True)
    t0 = time.perf_counter()
    try:
        summary = train(cfg, log=lambda *a, **k: None, on_epoch=on_epoch)
    finally:
        bar.close()
    history = json.loads((Path(cfg.train.out_dir) / "metrics.json").read_text())["epochs"]
    train_s = sum(h["train_time_s"] for h in history)
    images = sum(h["images_per_s"] * h["train_time_s"] for h in history)
    return {"label": run_label(variant), "model": cfg.model.name, "attention": cfg.model.attention,
            "parameters": summary["parameters"], "epochs": summary["epochs_done"],
            "final_test_acc": summary["final_test_acc"], "best_test_acc": summary["best_test_acc"],
            "train_seconds": train_s, "wall_seconds": time.perf_counter() - t0,
            "train_images_per_s": images / max(train_s, 1e-9), "history": history, "out_dir": cfg.train.out_dir}


COLUMNS = [("run", "label", "{}"), ("params", "parameters", "{:,}"), ("epochs", "epochs", "{}"),
           ("test acc", "final_test_acc", "{:.3f}"), ("best acc", "best_test_acc", "{:.3f}"),
           ("train s", "train_seconds", "{:.1f}"), ("wall s", "wall_seconds", "{:.1f}"),
           ("train img/s", "train_images_per_s", "{:.0f}")]


def markdown_table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(c for c, _, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(f.format(r[k]) for _, k, f in COLUMNS) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def print_table(rows: list[dict], title: str) -> None:
    from rich.console import Console
    from rich.table import Table
    table = Table(title=title)
    for name, _, _ in COLUMNS:
        table.add_column(name, justify="left" if name == "run" else "right", no_wrap=True)
    for r in rows:
        table.add_row(*(f.format(r[k]) for _, k, f in COLUMNS))
    console = Console()
    (console if console.is_terminal else Console(width=120)).print(table)  # pipes and logs: no folding


def run(args) -> int:
    import platform

    import torch

    from ..train.checkpoint import _atomic_write
    from ..train.metrics import plot_comparison
    dataset, note = pick_dataset(args.dataset, args.data_dir)
    runs = plan_runs(args, dataset)
    otvit = " (OT-ViT: softmax layers, OT attention in the last one)" if OTVIT in args.variants else ""
    threads = runs[0][1].train.threads or torch.get_num_threads()
    print(f"attnzoo demo: {len(runs)} models on {dataset}, {runs[0][1].train.device}, "
          f"{threads} thread{'' if threads == 1 else 's'}{otvit}", flush=True)
    print(note, flush=True)
    rows = [train_with_bar(v, cfg, i + 1, len(runs)) for i, (v, cfg) in enumerate(runs)]
    out = Path(args.out)
    threads = torch.get_num_threads()  # what training ran with
    title = f"attnzoo demo on {dataset} ({platform.machine()}, {threads} thread{'' if threads == 1 else 's'})"
    print_table(rows, title)
    plot_comparison({r["label"]: r["history"] for r in rows}, out / "test_curves.png", title=f"{dataset}: test curves")
    summary = {"dataset": dataset, "threads": threads, "torch": torch.__version__,
               "machine": platform.machine(), "runs": rows}
    _atomic_write(out / "summary.json", lambda p: Path(p).write_text(json.dumps(summary, indent=2)))
    _atomic_write(out / "summary.md", lambda p: Path(p).write_text(f"{title}\n\n{markdown_table(rows)}"))
    print(f"test curves: {out / 'test_curves.png'}")
    print(f"table: {out / 'summary.md'} (and summary.json); each run's metrics and checkpoints: "
          f"{', '.join(str(Path(r['out_dir'])) for r in rows)}")
    return 0
