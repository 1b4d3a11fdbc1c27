"""Training throughput of a config, measured with the training loop's own code:

    images_per_second("configs/vit_fashion_mnist.yaml", device="cuda", steps=20)

builds the model, the optimizer, the schedule and the device-resident data exactly as ``train``
does (torch.compile, bf16 autocast, channels-last, fused AdamW as configured), runs warm-up steps
(compilation happens there), then times ``steps`` training steps through ``loop.train_one_epoch``
and a pass of evaluation batches through ``loop.evaluate``. The data are generated images of the
dataset's shape (``synthetic=True``, or when the dataset's files are absent); their content does
not change the speed. Runs on CPU too (use a few steps there)."""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Optional

import torch

from ..bench.timing import profile_steps
from . import distributed as D
from .config import load_config
from .data import Splits, augmentation, build_loaders, load_splits
from .datasets import DataNotFoundError, dataset_info, synthetic_split
from .loop import (Graphs, compile_choice, compile_model, evaluate, memory_format, model_from_config, optimizer_for,
                   train_one_epoch)
from .optim import build_scheduler, match_lr_kind


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_profile(run_steps, n: int, device: torch.device, rows: int = 15) -> dict:
    """Where ``n`` training steps spend their time (the harness's profiler, ``bench.timing.profile_steps``,
    on ``run_steps()``, which runs all n): the busiest operators by self time on the host and on the
    device, and how many kernel launches, host waits and copies a step makes (a small model whose steps
    take far longer than its FLOPs allow is bound by one of these)."""
    seconds = []
    profiled = profile_steps(lambda: seconds.append(run_steps()), device, n, rows, together=True)
    counts = {key: profiled.get(key, 0.0) for key in ("launches_per_step", "host_waits_per_step", "copies_per_step")}
    return {"steps": n, "ms_per_step": 1e3 * seconds[0] / n, **counts,
            **{key: profiled[key] for key in ("host_table", "device_table") if key in profiled}}


def images_per_second(config_path: str, device: str = "cuda", steps: int = 20, synthetic: bool = True,
                      warmup: int = 5, overrides: Optional[list[str]] = None, eval_batches: int = 4,
                      profile_steps: int = 0) -> dict:
    """Train images/s of the config's training step (data assembly included) and an estimate of a
    full epoch (training split plus evaluation split at the measured rates). ``overrides``: extra
    ``--set`` strings, e.g. ``["train.compile=blocks", "train.batch_size=256"]``. ``profile_steps``
    > 0 profiles that many more steps after the measurement (``step_profile``; key "profile")."""
    if steps < 1 or warmup < 0 or eval_batches < 1 or profile_steps < 0:
        raise ValueError(f"steps and eval_batches must be >= 1, warmup and profile_steps >= 0, got {steps}, "
                         f"{eval_batches}, {warmup}, {profile_steps}")
    cfg = load_config(config_path, list(overrides or []) + [f"train.device={device}", "train.progress=false"])
    info = D.DistInfo(device=D.pick_device(cfg.train.device))
    dev = info.device
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    ds = dataset_info(cfg.data.dataset)
    bs = cfg.train.batch_size
    full_train = min(cfg.data.train_subset or ds.train_size, ds.train_size)
    full_test = min(cfg.data.test_subset or ds.test_size, ds.test_size)
    data_kind = "synthetic"
    splits = None
    if not synthetic:
        try:
            splits = load_splits(cfg)
            data_kind = "real"
            full_train, full_test = splits.train[1].shape[0], splits.test[1].shape[0]
        except DataNotFoundError:
            splits = None
    if splits is None:  # enough generated images for every step, at least one of each class per batch
        n_train = max(bs, (warmup + max(steps, profile_steps)) * bs)
        splits = Splits(synthetic_split(cfg.data.dataset, True, n_train),
                        synthetic_split(cfg.data.dataset, False, eval_batches * cfg.train.eval_batch_size),
                        ds, "test")
    data = build_loaders(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, pipeline="device")),
                         device=dev, splits=splits)

    torch.manual_seed(cfg.train.seed)
    model = model_from_config(cfg, ds).to(dev, memory_format=memory_format(cfg, dev))
    optimizer = optimizer_for(model, cfg, dev)
    scheduler = build_scheduler(optimizer, cfg.optim, math.ceil(full_train / bs), cfg.train.epochs)
    match_lr_kind(optimizer, scheduler)
    compile_model(model, cfg, dev)
    graphs = Graphs(model, optimizer, data, cfg, dev, 1)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)

    def run_steps(n: int, epoch: int) -> float:
        cfg.train.max_steps_per_epoch = n
        data.train.set_epoch(epoch)
        _sync(dev)
        t0 = time.perf_counter()
        train_one_epoch(model, data.train, optimizer, scheduler, cfg, info, epoch, graphs.train)
        _sync(dev)
        return time.perf_counter() - t0

    t0 = time.perf_counter()
    if warmup:
        run_steps(warmup, 0)
    evaluate(model, data.test, cfg, info, graphs.eval)  # the evaluation graph compiles here
    if graphs.on:
        evaluate(model, data.test, cfg, info, graphs.eval)  # ... and is captured here (after a warm-up pass)
    warmup_s = time.perf_counter() - t0
    train_s = run_steps(steps, 1)
    _sync(dev)
    t0 = time.perf_counter()
    evaluate(model, data.test, cfg, info, graphs.eval)
    _sync(dev)
    eval_s = time.perf_counter() - t0
    n_eval = data.test.n_images

    t0 = time.perf_counter()  # the data pipeline alone: assembling the same number of batches
    batches = 0
    for _ in data.train:
        batches += 1
        if batches >= steps:
            break
    _sync(dev)
    data_s = time.perf_counter() - t0

    profiled = step_profile(lambda: run_steps(profile_steps, 2), profile_steps, dev) if profile_steps else None

    train_ips = steps * bs / train_s
    eval_ips = n_eval / eval_s
    epoch_s = full_train / train_ips + full_test / eval_ips
    return {
        "config": str(config_path), "model": cfg.model.name, "attention": cfg.model.attention,
        "dataset": cfg.data.dataset, "data": data_kind, "device": str(dev),
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__, "batch_size": bs, "steps": steps, "warmup_steps": warmup,
        "compile": compile_choice(cfg, dev) or "off", "compile_mode": cfg.train.compile_mode,
        "graph": graphs.status(), "lr": float(optimizer.param_groups[0]["initial_lr"]),
        "amp_bf16": bool(cfg.train.amp and dev.type == "cuda"), "channels_last": memory_format(cfg, dev) == torch.channels_last,
        "augment": augmentation(cfg, ds) is not None, "partner_prob": cfg.data.partner_prob if cfg.model.name == "otvit" else 0.0,
        "parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "train_images_per_s": train_ips, "eval_images_per_s": eval_ips,
        "data_images_per_s": batches * bs / max(data_s, 1e-9),
        "epoch_seconds_estimate": epoch_s, "epoch_images_per_s": full_train / epoch_s,
        "epoch_train_images": full_train, "epoch_eval_images": full_test,
        "warmup_seconds": warmup_s,
        "peak_memory_bytes": torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None,
        **({"profile": profiled} if profiled else {}),
    }


def main(argv=None) -> int:
    import argparse
    import json
    p = argparse.ArgumentParser(prog="python -m attnzoo.train.throughput",
                                description="training images/s of a config (attnzoo.train.throughput)")
    p.add_argument("configs", nargs="+")
    p.add_argument("--device", default="cuda")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--real-data", action="store_true", help="the dataset's files when present")
    p.add_argument("--profile-steps", type=int, default=0, help="profile this many more steps and print the tables")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = p.parse_args(argv)
    for path in args.configs:
        try:
            result = images_per_second(path, args.device, args.steps, not args.real_data, args.warmup, args.overrides,
                                       profile_steps=args.profile_steps)
        except (ValueError, FileNotFoundError) as e:  # bad arguments, config or data: one line, as attnzoo train
            p.exit(2, f"{p.prog}: error: {e}\n")
        tables = result.get("profile", {})
        print(json.dumps({k: v for k, v in result.items() if k != "profile"}), flush=True)
        if tables:
            print(json.dumps({k: v for k, v in tables.items() if not k.endswith("_table")}))
            for key in ("host_table", "device_table"):
                if key in tables:
                    print(tables[key])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
