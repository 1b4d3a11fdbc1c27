"""The training loop: ``train(cfg, resume=None)``. Runs alone or under torchrun (DDP)."""
from __future__ import annotations

import contextlib
import math
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from tqdm.auto import tqdm

from ..models import build_model, count_parameters
from . import distributed as D
from .checkpoint import (CheckpointError, check_resumable, load_checkpoint, remove_stale_temporaries, restore,
                         save_checkpoint)
from .config import TrainConfig, check, model_kwargs
from .data import build_loaders
from .datasets import dataset_info
from .metrics import plot_curves, write_metrics
from .optim import build_optimizer, build_scheduler


def epoch_seed(seed: int, epoch: int, rank: int) -> int:
    """Dropout RNG is reseeded from (seed, epoch, rank) at every epoch start, so an epoch's randomness
    never depends on how the run got there (resumed or not)."""
    return (seed * 1_000_003 + epoch * 1009 + rank) % (2 ** 63)


def model_from_config(cfg: TrainConfig, info) -> torch.nn.Module:
    return build_model(cfg.model.name, **model_kwargs(cfg.model, info))


def _forward(model, batch, device):
    """(logits, labels) for a (images, labels[, partners, has_partner]) batch."""
    images, labels = batch[0].to(device, non_blocking=True), batch[1].to(device, non_blocking=True)
    if len(batch) == 4:
        partners, has = batch[2].to(device), batch[3].to(device)
        return model(images, templates=partners, template_mask=has), labels
    return model(images), labels


def _autocast(cfg: TrainConfig, device: torch.device):
    if cfg.train.amp and device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def evaluate(model, loader, cfg: TrainConfig, info: D.DistInfo) -> tuple[float, float]:
    model.eval()
    loss_sum = correct = count = 0.0
    with torch.no_grad(), _autocast(cfg, info.device):
        for batch in loader:
            logits, labels = _forward(model, batch[:2], info.device)
            loss_sum += F.cross_entropy(logits.float(), labels, reduction="sum").item()
            correct += (logits.argmax(-1) == labels).sum().item()
            count += labels.numel()
    loss_sum, correct, count = D.all_sum([loss_sum, correct, count], info)
    return loss_sum / max(count, 1), correct / max(count, 1)


def train_one_epoch(model, loader, optimizer, scheduler, cfg: TrainConfig, info: D.DistInfo, epoch: int):
    model.train()
    t0 = time.perf_counter()
    loss_sum = correct = count = 0.0
    steps = len(loader) if cfg.train.max_steps_per_epoch is None else min(len(loader), cfg.train.max_steps_per_epoch)
    bar = tqdm(total=steps, desc=f"epoch {epoch + 1}/{cfg.train.epochs}", leave=False, dynamic_ncols=True,
               disable=not (cfg.train.progress and info.is_main),
               mininterval=1.0 if sys.stderr.isatty() else 60.0)  # keep nohup logs short
    for step, batch in enumerate(loader):
        if step >= steps:
            break
        with _autocast(cfg, info.device):
            logits, labels = _forward(model, batch, info.device)
            loss = F.cross_entropy(logits.float(), labels, label_smoothing=cfg.optim.label_smoothing)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"non-finite training loss {loss.item()} at epoch {epoch + 1}, step {step}; "
                                     f"try a lower optim.lr or optim.grad_clip")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.optim.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        optimizer.step()
        scheduler.step()
        n = labels.numel()
        loss_sum += loss.item() * n
        correct += (logits.argmax(-1) == labels).sum().item()
        count += n
        elapsed = time.perf_counter() - t0
        bar.set_postfix(loss=f"{loss_sum / count:.4f}", acc=f"{correct / count:.4f}",
                        img_s=f"{count * info.world / elapsed:.0f}", lr=f"{scheduler.get_last_lr()[0]:.2e}",
                        refresh=False)  # the bar redraws on update(), at most every mininterval
        bar.update(1)
    bar.close()
    loss_sum, correct, count = D.all_sum([loss_sum, correct, count], info)
    elapsed = time.perf_counter() - t0
    return {"train_loss": loss_sum / max(count, 1), "train_acc": correct / max(count, 1),
            "train_time_s": elapsed, "images_per_s": count / max(elapsed, 1e-9)}


def _rng_state(device: torch.device) -> dict:
    state = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def _print(*args, **kw):
    print(*args, **kw, flush=True)  # epoch lines show up promptly in nohup logs


def train(cfg: TrainConfig, resume: Optional[str] = None, log=_print,
          on_epoch: Optional[Callable[[dict], None]] = None) -> dict:
    """Train as configured; ``resume``: a run dir / checkpoint to continue from. ``on_epoch(row)`` is
    called on the main process after each epoch with that epoch's metrics. Returns the summary."""
    info = D.setup(cfg.train.device)
    try:
        return _train(cfg, resume, info, log if info.is_main else (lambda *a, **k: None),
                      on_epoch if info.is_main else None)
    finally:
        D.cleanup(info)


def _train(cfg: TrainConfig, resume, info: D.DistInfo, log, on_epoch=None) -> dict:
    check(cfg)  # every value, before any data is read or file written
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    out_dir = Path(cfg.train.out_dir)
    torch.manual_seed(cfg.train.seed)
    # the model first: the loaders leave the global RNG untouched, so the order changes no number
    model = model_from_config(cfg, dataset_info(cfg.data.dataset)).to(info.device)
    loaders = build_loaders(cfg, info.rank, info.world)
    optimizer = build_optimizer(model, cfg.optim)
    steps = len(loaders.train)
    if cfg.train.max_steps_per_epoch is not None:
        steps = min(steps, cfg.train.max_steps_per_epoch)
    scheduler = build_scheduler(optimizer, cfg.optim, steps, cfg.train.epochs)
    start_epoch, history, best_acc = 0, [], -math.inf
    if resume:
        weights, state = load_checkpoint(resume)
        check_resumable(state, cfg.to_dict(), resume)
        restore(model, optimizer, scheduler, weights, state, resume)
        try:
            _set_rng_state(state["rng"], info.device)
        except (KeyError, TypeError, RuntimeError) as e:
            raise CheckpointError(f"checkpoint {resume}: its RNG state is unusable ({type(e).__name__}: {e})") from None
        start_epoch, history, best_acc = state["epoch"], list(state["history"]), state["best_acc"]
        log(f"resumed from {resume} after epoch {start_epoch}")
    n_params = count_parameters(model)
    log(f"{cfg.model.name} ({cfg.model.attention}) {n_params / 1e6:.2f}M parameters on {info.device}"
        f"{f' x{info.world} processes' if info.world > 1 else ''}; {len(loaders.train_set)} train / "
        f"{len(loaders.test.dataset)} test images of {cfg.data.dataset}{' (synthetic)' if cfg.data.synthetic else ''}")
    if info.is_main:  # temporaries of a process killed while writing this run directory
        for folder in (out_dir, out_dir / "checkpoints"):
            remove_stale_temporaries(folder)
    net = DistributedDataParallel(model, device_ids=[info.device.index] if info.device.type == "cuda" else None) \
        if info.world > 1 else model
    summary = {}
    for epoch in range(start_epoch, cfg.train.epochs):
        loaders.train_sampler.set_epoch(epoch)
        loaders.train_set.set_epoch(epoch)
        torch.manual_seed(epoch_seed(cfg.train.seed, epoch, info.rank))
        row = {"epoch": epoch + 1, **train_one_epoch(net, loaders.train, optimizer, scheduler, cfg, info, epoch)}
        row["test_loss"], row["test_acc"] = evaluate(model, loaders.test, cfg, info)
        row["lr"] = scheduler.get_last_lr()[0]
        history.append(row)
        is_best = row["test_acc"] > best_acc
        best_acc = max(best_acc, row["test_acc"])
        log(f"epoch {epoch + 1}/{cfg.train.epochs}: train loss {row['train_loss']:.4f} acc {row['train_acc']:.4f} | "
            f"test loss {row['test_loss']:.4f} acc {row['test_acc']:.4f} | {row['images_per_s']:.0f} img/s")
        summary = {"model": cfg.model.name, "attention": cfg.model.attention, "dataset": cfg.data.dataset,
                   "parameters": n_params, "world_size": info.world, "best_test_acc": best_acc,
                   "final_test_acc": row["test_acc"], "epochs_done": epoch + 1, "config": cfg.to_dict()}
        if info.is_main:
            state = {"epoch": epoch + 1, "step": scheduler.last_epoch, "best_acc": best_acc,
                     "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                     "rng": _rng_state(info.device), "history": history, "config": cfg.to_dict()}
            save_checkpoint(out_dir / "checkpoints", epoch + 1, model.state_dict(), state, is_best=is_best)
            write_metrics(out_dir, history, summary)
            if cfg.train.plot:
                plot_curves(history, out_dir / "curves.png",
                            title=f"{cfg.model.name} ({cfg.model.attention}) on {cfg.data.dataset}")
            if on_epoch is not None:
                on_epoch(row)
        D.barrier(info)
    if info.is_main and summary:
        log(f"best test accuracy {best_acc:.4f}; metrics in {out_dir}/metrics.csv, curves in {out_dir}/curves.png, "
            f"checkpoints in {out_dir}/checkpoints/ (last.json, best.json)")
    return summary
