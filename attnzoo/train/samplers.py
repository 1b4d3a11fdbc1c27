"""The order of training images and OT-ViT's same-class partners, from the counter-based streams
(``counter_rng``): each depends only on (seed, epoch, index), so they come out the same whatever
the worker count, the process count, the device (CPU loader or the device-resident pipeline), or
whether the run was interrupted and resumed."""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch.utils.data import Dataset, Sampler

from .counter_rng import SALT_PARTNER_COIN, SALT_PARTNER_PICK, below, coin, permutation, random_bits


def shard_order(seed: int, epoch: int, n: int, rank: int = 0, world: int = 1, device=None) -> torch.Tensor:
    """Process ``rank``'s training indices for an epoch, laid out like torch's DistributedSampler:
    the epoch's permutation, padded by repeating its start to a multiple of ``world``, then every
    world-th entry from ``rank``. Local batch k of every rank together = global batch k."""
    order = permutation(seed, epoch, n, device=device)
    total = math.ceil(n / world) * world
    if total > n:
        order = torch.cat([order] * math.ceil(total / n))[:total]
    return order[rank:total:world]


class EpochShardSampler(Sampler):
    """``shard_order`` as a DataLoader sampler (call ``set_epoch`` before each epoch)."""

    def __init__(self, n: int, seed: int = 0, rank: int = 0, world: int = 1) -> None:
        self.n, self.seed, self.rank, self.world = n, int(seed), rank, world
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __iter__(self):
        return iter(shard_order(self.seed, self.epoch, self.n, self.rank, self.world).tolist())

    def __len__(self) -> int:
        return math.ceil(self.n / self.world)


class SameClassPartnerSampler:
    """For training image i in epoch e: with probability ``prob`` another random training image of
    the same class (never i itself), else None. Deterministic in (seed, epoch, i).

    Tables (on the labels' device): ``order`` lists the indices grouped by class (ascending within a
    class), ``start[c]``/``count[c]`` locate class c in it and ``pos[i]`` is i's place within its
    class. The pick is uniform over the class's other members: j in [0, count - 1), skipping pos[i]."""

    def __init__(self, labels: torch.Tensor, prob: float = 0.5, seed: int = 0) -> None:
        if not 0.0 <= prob <= 1.0:
            raise ValueError(f"partner_prob must be in [0, 1], got {prob}")
        self.labels = labels.to(torch.int64)
        self.prob, self.seed = float(prob), int(seed)
        n = self.labels.numel()
        classes = int(self.labels.max()) + 1 if n else 0
        self.order = torch.argsort(self.labels, stable=True)
        self.count = torch.bincount(self.labels, minlength=classes)
        self.start = torch.cumsum(self.count, 0) - self.count
        self.pos = torch.empty_like(self.labels)
        self.pos[self.order] = torch.arange(n, device=self.labels.device) - self.start[self.labels[self.order]]

    def to(self, device) -> "SameClassPartnerSampler":
        for name in ("labels", "order", "count", "start", "pos"):
            setattr(self, name, getattr(self, name).to(device))
        return self

    def partners(self, index: torch.Tensor, epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(partner index, has_partner) for a tensor of image indices; rows without a partner get
        their own index (and False), so the result always indexes the split."""
        y = self.labels[index]
        others = self.count[y] - 1
        has = coin(random_bits(self.seed, epoch, index, SALT_PARTNER_COIN), self.prob) & (others > 0)
        j = below(random_bits(self.seed, epoch, index, SALT_PARTNER_PICK), others)
        j = j + (j >= self.pos[index]).long()
        partner = self.order[(self.start[y] + j).clamp(max=self.labels.numel() - 1)]
        return torch.where(has, partner, index), has

    def partner(self, index: int, epoch: int) -> Optional[int]:
        """One image's partner (None without one), with scalar arithmetic on the same streams."""
        if random_bits(self.seed, epoch, index, SALT_PARTNER_COIN) >= int(round(self.prob * 2 ** 32)):
            return None
        y = int(self.labels[index])
        others = int(self.count[y]) - 1
        if others < 1:
            return None
        j = below(random_bits(self.seed, epoch, index, SALT_PARTNER_PICK), others)
        if j >= int(self.pos[index]):
            j += 1
        return int(self.order[int(self.start[y]) + j])


class EvalShardSampler:
    """rank's share of 0..n-1 in order (rank, rank + world, ...): no padding, no duplicates."""

    def __init__(self, n: int, rank: int = 0, world: int = 1) -> None:
        self.indices = list(range(rank, n, world))

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)


class EpochAware(Dataset):
    epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)
