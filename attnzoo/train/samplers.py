"""Per-sample randomness that depends only on (seed, epoch, index): augmentation and the
same-class partner choice come out the same whatever the worker count, process count, or
whether the run was interrupted and resumed."""
from __future__ import annotations

from typing import Optional

import torch
from torch.utils.data import Dataset

_MASK = (1 << 63) - 1


def sample_generator(seed: int, epoch: int, index: int, salt: int) -> torch.Generator:
    key = (((seed * 1_000_003 + epoch) * 1_000_033 + index) * 8 + salt) & _MASK
    return torch.Generator().manual_seed(key)


class SameClassPartnerSampler:
    """For training image i in epoch e: with probability ``prob`` another random training image of
    the same class (never i itself), else None. Deterministic in (seed, epoch, i)."""

    def __init__(self, labels: torch.Tensor, prob: float = 0.5, seed: int = 0) -> None:
        if not 0.0 <= prob <= 1.0:
            raise ValueError(f"partner_prob must be in [0, 1], got {prob}")
        self.labels = labels.to(torch.int64)
        self.prob, self.seed = float(prob), int(seed)
        self.members = {int(c): (self.labels == c).nonzero().squeeze(1) for c in self.labels.unique()}
        self._pos = torch.empty_like(self.labels)  # position of i within its class's member list
        for idx in self.members.values():
            self._pos[idx] = torch.arange(idx.numel())

    def partner(self, index: int, epoch: int) -> Optional[int]:
        g = sample_generator(self.seed, epoch, index, salt=1)
        if torch.rand((), generator=g).item() >= self.prob:
            return None
        members = self.members[int(self.labels[index])]
        if members.numel() < 2:
            return None
        # draw among the other members: skip over i's own position
        j = int(torch.randint(members.numel() - 1, (), generator=g))
        if j >= int(self._pos[index]):
            j += 1
        return int(members[j])


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
