"""Datasets and loaders for training: normalisation per dataset, CIFAR augmentation (random crop
with 4-pixel padding + horizontal flip), OT-ViT's same-class partners, DDP sharding."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torchvision.transforms.v2.functional as TF
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from .config import TrainConfig
from .datasets import DatasetInfo, dataset_info, load_split, synthetic_split
from .samplers import EpochAware, EvalShardSampler, SameClassPartnerSampler, sample_generator

SUBSET_SEED = 12345  # the same subset for every model and seed, so reduced runs stay comparable


class ImageDataset(EpochAware):
    """uint8 images -> normalised float tensors; ``augment`` draws crop/flip from (seed, epoch, index)."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, info: DatasetInfo, augment: bool = False,
                 seed: int = 0) -> None:
        if images.dim() != 4 or images.dtype != torch.uint8 or images.shape[0] != labels.shape[0]:
            raise ValueError(f"images must be uint8 (N, C, H, W) with N = len(labels), got {images.dtype} "
                             f"{tuple(images.shape)} and {tuple(labels.shape)} labels")
        self.images, self.labels, self.info = images, labels, info
        self.augment, self.seed = augment, seed
        self.mean = torch.tensor(info.mean).view(-1, 1, 1)
        self.std = torch.tensor(info.std).view(-1, 1, 1)

    def __len__(self) -> int:
        return self.labels.shape[0]

    def image(self, index: int) -> torch.Tensor:
        x = self.images[index]
        if self.augment:
            g = sample_generator(self.seed, self.epoch, index, salt=0)
            pad = 4
            top, left = torch.randint(0, 2 * pad + 1, (2,), generator=g).tolist()
            flip = bool(torch.rand((), generator=g) < 0.5)
            x = TF.crop(TF.pad(x, [pad]), top, left, x.shape[-2], x.shape[-1])
            if flip:
                x = TF.horizontal_flip(x)
        return (x.float() / 255.0 - self.mean) / self.std

    def __getitem__(self, index: int):
        return self.image(index), self.labels[index]


class PartnerDataset(EpochAware):
    """(image, label, partner image, has_partner): OT-ViT's training items. Without a partner the
    partner slot holds zeros and has_partner is False (the model then ignores it)."""

    def __init__(self, base: ImageDataset, prob: float = 0.5, seed: int = 0) -> None:
        self.base = base
        self.sampler = SameClassPartnerSampler(base.labels, prob=prob, seed=seed)

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self.base.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int):
        x, y = self.base[index]
        j = self.sampler.partner(index, self.epoch)
        if j is None:
            return x, y, torch.zeros_like(x), False
        return x, y, self.base.image(j), True


@dataclass
class Loaders:
    train: DataLoader
    test: DataLoader
    train_set: EpochAware
    train_sampler: DistributedSampler
    info: DatasetInfo


def _subset(images, labels, n: Optional[int]):
    if n is None or n >= labels.shape[0]:
        return images, labels
    if n <= 0:
        raise ValueError(f"subset sizes must be positive, got {n}")
    idx = torch.randperm(labels.shape[0], generator=torch.Generator().manual_seed(SUBSET_SEED))[:n]
    return images[idx], labels[idx]


def build_datasets(cfg: TrainConfig):
    d, seed = cfg.data, cfg.train.seed
    info = dataset_info(d.dataset)
    if d.synthetic:
        train = synthetic_split(d.dataset, True, d.synthetic_train_size)
        test = synthetic_split(d.dataset, False, d.synthetic_test_size)
    else:
        train = load_split(d.dataset, True, d.data_dir, d.download)
        test = load_split(d.dataset, False, d.data_dir, d.download)
    train, test = _subset(*train, d.train_subset), _subset(*test, d.test_subset)
    augment = d.augment and d.dataset.startswith("cifar")
    train_set: EpochAware = ImageDataset(*train, info, augment=augment, seed=seed)
    if cfg.model.name == "otvit" and d.partner_prob > 0:
        train_set = PartnerDataset(train_set, prob=d.partner_prob, seed=seed)
    return train_set, ImageDataset(*test, info), info


def build_loaders(cfg: TrainConfig, rank: int = 0, world: int = 1) -> Loaders:
    """The global batch ``train.batch_size`` is split evenly across the ``world`` processes."""
    bs = cfg.train.batch_size
    if bs % world:
        raise ValueError(f"train.batch_size ({bs}) must be divisible by the number of processes ({world})")
    train_set, test_set, info = build_datasets(cfg)
    # a DistributedSampler even for one process: the same shuffled order whatever the world size
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, seed=cfg.train.seed)
    common = dict(num_workers=cfg.data.num_workers, persistent_workers=False,
                  generator=torch.Generator().manual_seed(cfg.train.seed))  # keeps the global RNG untouched
    train = DataLoader(train_set, batch_size=bs // world, sampler=sampler, drop_last=False, **common)
    test = DataLoader(test_set, batch_size=max(1, cfg.train.eval_batch_size // world),
                      sampler=EvalShardSampler(len(test_set), rank, world), **common)
    return Loaders(train, test, train_set, sampler, info)
