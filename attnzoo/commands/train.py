"""attnzoo train CONFIG.yaml [--set key=value ...] [--resume [PATH]] [--data-dir DIR].

Exit status: 0 when training ran (or stopped at --time-budget with its checkpoint written, or a
resumed run already holds train.epochs epochs: "nothing left to train"), 2 for bad input, data or
checkpoints (one ``error:`` line), 130 when interrupted (Ctrl-C: one line saying what was kept)."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

HELP = "train a ViT / OT-ViT with any attention variant (runs under torchrun for DDP)"


def add_arguments(parser) -> None:
    parser.add_argument("config", help="YAML config, e.g. configs/vit_fashion_mnist.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help='override a config field, e.g. --set model.attention="sinkhorn(n_iters=5)" '
                             "--set train.epochs=10 (repeatable; values parsed as YAML)")
    parser.add_argument("--resume", nargs="?", const="auto", default=None, metavar="PATH",
                        help="continue from a checkpoint: a run dir, checkpoints/last.json or a .safetensors "
                             "(no PATH: the config's train.out_dir)")
    parser.add_argument("--allow-config-change", action="store_true",
                        help="with --resume: accept settings that differ from the checkpoint's (learning rate, seed, "
                             "batch size, epochs, ...); the run then differs from an uninterrupted one, and the changes "
                             "are recorded in metrics.json")
    parser.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                        help="stop after the last epoch expected to end within SECONDS (checkpoint written; "
                             "--resume continues)")
    parser.add_argument("--data-dir", default=None, help="folder holding a local copy of the dataset (must exist)")
    parser.add_argument("--out-dir", default=None, help="where metrics, curves and checkpoints go")


def run(args) -> int:
    from ..train import CheckpointError, DataNotFoundError, load_config, train
    from ..train.checkpoint import newest_pointer
    overrides = list(args.overrides)
    if args.data_dir is not None:
        overrides.append(f"data.data_dir={json.dumps(args.data_dir)}")
    if args.out_dir:
        overrides.append(f"train.out_dir={json.dumps(args.out_dir)}")
    if args.allow_config_change and not args.resume:
        print("attnzoo train: error: --allow-config-change only applies with --resume", file=sys.stderr)
        return 2
    if args.time_budget is not None and not args.time_budget > 0:
        print(f"attnzoo train: error: --time-budget must be > 0 seconds, got {args.time_budget}", file=sys.stderr)
        return 2
    deadline = None if args.time_budget is None else time.time() + args.time_budget
    cfg = None
    try:
        cfg = load_config(args.config, overrides)
        resume = cfg.train.out_dir if args.resume == "auto" else args.resume
        train(cfg, resume=resume, allow_config_change=args.allow_config_change, deadline=deadline)
    except (ValueError, TypeError, FileNotFoundError, CheckpointError, DataNotFoundError) as e:
        print(f"attnzoo train: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: say what was kept and how to go on, without a traceback
        if cfg is None:
            raise
        ckpt = Path(cfg.train.out_dir) / "checkpoints"
        kept = (f"the last finished epoch is in {ckpt} (--resume continues; the epoch cut short is trained again)"
                if newest_pointer(ckpt) is not None else "no epoch had finished, so there is no checkpoint")
        print(f"\nattnzoo train: interrupted; {kept}", file=sys.stderr)
        return 130
    return 0
