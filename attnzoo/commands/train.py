"""attnzoo train CONFIG.yaml [--set key=value ...] [--resume [PATH]] [--data-dir DIR]."""
from __future__ import annotations

import sys

HELP = "train a ViT / OT-ViT with any attention variant (runs under torchrun for DDP)"


def add_arguments(parser) -> None:
    parser.add_argument("config", help="YAML config, e.g. configs/vit_fashion_mnist.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help='override a config field, e.g. --set model.attention="sinkhorn(n_iters=5)" '
                             "--set train.epochs=10 (repeatable; values parsed as YAML)")
    parser.add_argument("--resume", nargs="?", const="auto", default=None, metavar="PATH",
                        help="continue from a checkpoint: a run dir, checkpoints/last.json or a .safetensors "
                             "(no PATH: the config's train.out_dir)")
    parser.add_argument("--data-dir", default=None, help="folder holding a local copy of the dataset")
    parser.add_argument("--out-dir", default=None, help="where metrics, curves and checkpoints go")


def run(args) -> int:
    from ..train import CheckpointError, DataNotFoundError, load_config, train
    overrides = list(args.overrides)
    if args.data_dir:
        overrides.append(f"data.data_dir={args.data_dir}")
    if args.out_dir:
        overrides.append(f"train.out_dir={args.out_dir}")
    try:
        cfg = load_config(args.config, overrides)
        resume = cfg.train.out_dir if args.resume == "auto" else args.resume
        train(cfg, resume=resume)
    except (ValueError, TypeError, FileNotFoundError, CheckpointError, DataNotFoundError) as e:
        print(f"attnzoo train: error: {e}", file=sys.stderr)
        return 2
    return 0
