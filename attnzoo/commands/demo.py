"""attnzoo demo (what ``make demo`` runs): a small ViT on Fashion-MNIST for a few minutes on a CPU,
then the test accuracy and where the curves and checkpoints are."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

HELP = "train a small ViT on Fashion-MNIST for a few minutes (make demo)"
DEBIAN_PACKAGE = "dataset-fashion-mnist"


def add_arguments(parser) -> None:
    parser.add_argument("--config", default=None, help="config to train (default: configs/demo.yaml)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config field, as in attnzoo train")
    parser.add_argument("--data-dir", default=None, help="folder holding the Fashion-MNIST .gz files")
    parser.add_argument("--no-install", action="store_true",
                        help="never run apt-get; download through torchvision when the files are missing")


def default_config() -> Path:
    for root in (Path.cwd(), Path(__file__).resolve().parents[2]):
        if (root / "configs" / "demo.yaml").is_file():
            return root / "configs" / "demo.yaml"
    raise FileNotFoundError("configs/demo.yaml not found: run from the attnzoo checkout or pass --config")


def fashion_mnist_present(data_dir) -> bool:
    from ..train.datasets import FASHION_FILES, fashion_mnist_dirs
    return any(all((d / f).is_file() for f in FASHION_FILES[True] + FASHION_FILES[False])
               for d in fashion_mnist_dirs(data_dir))


def ensure_fashion_mnist(data_dir, allow_install: bool = True, log=print) -> None:
    """Install the Debian package when the files are missing, apt-get exists and we are root;
    otherwise leave it to torchvision's download (the loader does that, or says how to get the data)."""
    if fashion_mnist_present(data_dir):
        return
    can_apt = allow_install and shutil.which("apt-get") and hasattr(os, "geteuid") and os.geteuid() == 0
    if not can_apt:
        log("Fashion-MNIST not found locally: downloading it through torchvision")
        return
    log(f"Fashion-MNIST not found: apt-get install -y {DEBIAN_PACKAGE}")
    cmd = ["apt-get", "install", "-y", DEBIAN_PACKAGE]
    if subprocess.run(cmd).returncode != 0:
        subprocess.run(["apt-get", "update"])
        if subprocess.run(cmd).returncode != 0:
            log("apt-get failed: falling back to torchvision's download")


def run(args) -> int:
    from ..train import CheckpointError, DataNotFoundError, load_config, train
    overrides = list(args.overrides)
    if args.data_dir:
        overrides.append(f"data.data_dir={args.data_dir}")
    try:
        cfg = load_config(args.config or default_config(), overrides)
        if cfg.data.dataset == "fashion_mnist" and not cfg.data.synthetic:
            ensure_fashion_mnist(cfg.data.data_dir, allow_install=not args.no_install)
        summary = train(cfg)
    except (ValueError, TypeError, FileNotFoundError, CheckpointError, DataNotFoundError) as e:
        print(f"attnzoo demo: error: {e}", file=sys.stderr)
        return 2
    out = Path(cfg.train.out_dir)
    print(f"\nattnzoo demo: {summary['model']} ({summary['attention']}, {summary['parameters'] / 1e6:.2f}M parameters) "
          f"on {summary['dataset']}: test accuracy {summary['final_test_acc']:.4f} after {summary['epochs_done']} "
          f"epochs (best {summary['best_test_acc']:.4f})")
    print(f"  curves:      {out / 'curves.png'}")
    print(f"  metrics:     {out / 'metrics.csv'}, {out / 'metrics.json'}")
    print(f"  checkpoints: {out / 'checkpoints'} (last.json, best.json -> .safetensors weights + .state.pt)")
    return 0
