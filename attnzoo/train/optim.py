"""AdamW (no weight decay on biases, norms, position embedding and class token) with a
per-step linear warmup + cosine schedule."""
from __future__ import annotations

import math

import torch
from torch import nn

from .config import OptimConfig


def build_optimizer(model: nn.Module, cfg: OptimConfig, fused: bool = False) -> torch.optim.AdamW:
    """``fused``: torch's single-kernel AdamW (CUDA): the same update, one launch for all parameters."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim <= 1 or name.endswith(("pos_embed", "cls_token")) else decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), **({"fused": True} if fused else {}))


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
