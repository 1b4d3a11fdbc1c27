"""AdamW (no weight decay on biases, norms, position embedding and class token) with a
per-step linear warmup + cosine schedule."""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from .config import OptimConfig


def build_optimizer(model: nn.Module, cfg: OptimConfig, fused: bool = False, lr: Optional[float] = None,
                    capturable: bool = False) -> torch.optim.AdamW:
    """``fused``: torch's single-kernel AdamW (CUDA): the same update, one launch for all parameters.
    ``lr``: the learning rate (default ``cfg.lr``; the training loop passes ``config.effective_lr``).
    ``capturable``: the update reads the learning rate and the step count from tensors on the
    parameters' device and never waits for the device, so it can be captured in a CUDA graph: the
    fused kernel with a tensor learning rate (torch's ``capturable=True`` on CUDA; on the CPU, where
    nothing is captured, the fused CPU kernel reads them in place too); the scheduler then writes the
    rate into that tensor."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim <= 1 or name.endswith(("pos_embed", "cls_token")) else decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    lr = cfg.lr if lr is None else lr
    if capturable:
        device = next(model.parameters()).device
        return torch.optim.AdamW(groups, lr=torch.tensor(lr, device=device), betas=tuple(cfg.betas), fused=True,
                                 capturable=device.type == "cuda")
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(cfg.betas), **({"fused": True} if fused else {}))


def current_lr(optimizer) -> float:
    """The first group's learning rate as a number (a device tensor when capturable: one read)."""
    lr = optimizer.param_groups[0]["lr"]
    return float(lr) if isinstance(lr, torch.Tensor) else lr


def warmup_cosine(total_steps: int, warmup_steps: int, min_ratio: float):
    """lr multiplier at step s: s / warmup during warmup, then cosine from 1 down to min_ratio."""
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


def build_scheduler(optimizer, cfg: OptimConfig, steps_per_epoch: int, epochs: int):
    total = max(1, steps_per_epoch * epochs)
    warmup = int(round(cfg.warmup_epochs * steps_per_epoch))
    min_ratio = cfg.min_lr / cfg.lr if cfg.lr > 0 else 0.0
    return torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(total, warmup, min_ratio))


def match_lr_kind(optimizer, scheduler) -> None:
    """After loading a saved state: the learning rates back in the form this optimizer uses (a device
    tensor when capturable, else numbers: a state saved by the other kind of step loads into
    either), and the scheduler's base rates as numbers."""
    capturable = optimizer.defaults.get("capturable") or (
        optimizer.defaults.get("fused") and isinstance(optimizer.defaults.get("lr"), torch.Tensor))
    for group in optimizer.param_groups:
        device = group["params"][0].device
        for key in ("lr", "initial_lr"):
            if key not in group:
                continue
            value = float(group[key]) if isinstance(group[key], torch.Tensor) else group[key]
            group[key] = torch.tensor(value, device=device) if capturable else value
    scheduler.base_lrs = [float(b) for b in scheduler.base_lrs]
    scheduler._last_lr = [current_lr(optimizer)] + [float(g["lr"]) for g in optimizer.param_groups[1:]]
