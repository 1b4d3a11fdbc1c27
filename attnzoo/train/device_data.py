"""The device-resident pipeline: a whole split lives on the training device as uint8 (zero-padded
once when random crops are on), and each batch is assembled there: the epoch's order
(``shard_order``), crops and flips (one gather), OT-ViT's same-class partners (table lookups) and
normalisation (a lookup in a 256-entry table per channel). No worker processes, no host-to-device copy per batch and no host sync: every
random number comes from the counter-based streams, computed on the device once per epoch for
every image.

Batches equal those of the DataLoader pipeline (``data.ImageDataset`` / ``PartnerDataset`` under an
``EpochShardSampler``) for the same seed, bit for bit: same order, same crops and flips, same
partners, the same normalisation table."""
from __future__ import annotations

import math
from typing import Optional

import torch

from .augment import CropFlip, crop_flip_gather, pad_split
from .normalize import normalization_table, normalize
from .datasets import DatasetInfo
from .samplers import SameClassPartnerSampler, shard_order


class DeviceTrainData:
    """Training batches (images, labels) or, with ``partner_prob``, (images, labels, partner
    images, has_partner); ``batch_size`` is this process's share of the global batch."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, info: DatasetInfo, device: torch.device, *,
                 batch_size: int, seed: int = 0, crop: Optional[CropFlip] = None,
                 partner_prob: Optional[float] = None, rank: int = 0, world: int = 1,
                 channels_last: bool = False) -> None:
        if images.dim() != 4 or images.dtype != torch.uint8 or images.shape[0] != labels.shape[0]:
            raise ValueError(f"images must be uint8 (N, C, H, W) with N = len(labels), got {images.dtype} "
                             f"{tuple(images.shape)} and {tuple(labels.shape)} labels")
        self.device = torch.device(device)
        self.crop = crop if crop is not None and crop.active else None
        self.size = tuple(images.shape[-2:])
        self.images = pad_split(images, self.crop.pad if self.crop else 0).to(self.device)
        self.labels = labels.to(self.device, torch.int64)
        self.table = normalization_table(info, self.device)
        self.batch_size, self.seed, self.rank, self.world = batch_size, int(seed), rank, world
        self.n_images = labels.shape[0]
        self.partners = (None if partner_prob is None else
                         SameClassPartnerSampler(self.labels, prob=partner_prob, seed=seed))
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        self.epoch = 0
        self._draws = None   # (epoch, draws of that epoch)
        # CUDA graphs read the draws from fixed addresses: later epochs are copied into the first's tensors
        self.fixed_buffers = False

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return math.ceil(math.ceil(self.n_images / self.world) / self.batch_size)

    def draws(self, epoch: int) -> dict:
        """Every image's random choices for an epoch, drawn at once (a few dozen integer kernels per
        epoch rather than per batch): crop offsets, flips, partner and whether it has one."""
        if self._draws is not None and self._draws[0] == epoch:
            return self._draws[1]
        every = torch.arange(self.n_images, device=self.device)
        out = {}
        if self.crop is not None:
            out["top"], out["left"], out["flipped"] = self.crop.draw(self.seed, epoch, every)
        if self.partners is not None:
            out["partner"], out["has"] = self.partners.partners(every, epoch)
        if self.fixed_buffers and self._draws is not None:
            for key, value in out.items():
                self._draws[1][key].copy_(value)
            out = self._draws[1]
        self._draws = (epoch, out)
        return out

    def pixels(self, index: torch.Tensor, epoch: int) -> torch.Tensor:
        """Normalised (B, C, H, W) float32 images ``index``, cropped and flipped for ``epoch``."""
        if self.crop is None:
            raw = self.images[index]
        else:
            d = self.draws(epoch)
            raw = crop_flip_gather(self.images, index, d["top"][index], d["left"][index], d["flipped"][index],
                                   self.size)
        return normalize(raw, self.table).contiguous(memory_format=self.memory_format)

    def batch(self, index: torch.Tensor, epoch: int) -> tuple:
        x, y = self.pixels(index, epoch), self.labels[index]
        if self.partners is None:
            return x, y
        d = self.draws(epoch)
        partner, has = d["partner"][index], d["has"][index]
        p = torch.where(has[:, None, None, None], self.pixels(partner, epoch), 0.0)
        return x, y, p, has

    def order(self, epoch: int) -> torch.Tensor:
        """This process's image indices for ``epoch``, in training order (on the device)."""
        return shard_order(self.seed, epoch, self.n_images, self.rank, self.world, device=self.device)

    def __iter__(self):
        epoch = self.epoch
        order = self.order(epoch)
        for start in range(0, order.numel(), self.batch_size):
            yield self.batch(order[start:start + self.batch_size], epoch)


class DeviceEvalData:
    """Evaluation batches (images, labels) of this process's share (rank, rank + world, ...), in order."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, info: DatasetInfo, device: torch.device, *,
                 batch_size: int, rank: int = 0, world: int = 1, channels_last: bool = False) -> None:
        self.device = torch.device(device)
        index = torch.arange(rank, labels.shape[0], world)
        self.images = images[index].to(self.device)
        self.labels = labels[index].to(self.device, torch.int64)
        self.table = normalization_table(info, self.device)
        self.batch_size = batch_size
        self.n_images = labels.shape[0]
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format

    def __len__(self) -> int:
        return math.ceil(self.labels.shape[0] / self.batch_size)

    def pixels(self, index: torch.Tensor) -> torch.Tensor:
        """Normalised (B, C, H, W) images ``index`` of this process's share."""
        return normalize(self.images[index], self.table).contiguous(memory_format=self.memory_format)

    def __iter__(self):
        for start in range(0, self.labels.shape[0], self.batch_size):
            x = normalize(self.images[start:start + self.batch_size], self.table)
            yield x.contiguous(memory_format=self.memory_format), self.labels[start:start + self.batch_size]
