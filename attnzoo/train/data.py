"""The data of a training run: the splits (real or generated, subsets, a validation hold-out), and
two pipelines that give the same batches for the same seed:

- ``device`` (default, ``device_data.py``): the split resident on the training device as uint8,
  order, crops, flips and partners computed there per batch; no worker processes.
- ``loader``: a torch DataLoader over per-sample datasets (``ImageDataset``, ``PartnerDataset``),
  optionally with worker processes; the reference the device pipeline is tested against.

Both draw every random number from the counter-based streams of (seed, epoch, index)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch.utils.data import DataLoader

from .augment import CropFlip, crop_flip_one
from .config import TrainConfig
from .datasets import DatasetInfo, dataset_info, load_split, synthetic_split
from .device_data import DeviceEvalData, DeviceTrainData
from .normalize import normalization_table, normalize
from .samplers import EpochAware, EpochShardSampler, EvalShardSampler, SameClassPartnerSampler

SUBSET_SEED = 12345      # the same subset for every model and seed, so reduced runs stay comparable
VALIDATION_SEED = 54321  # the same validation hold-out for every model and seed


class ImageDataset(EpochAware):
    """uint8 images -> normalised float tensors; ``crop`` (a CropFlip or None) draws its crop and
    flip from (seed, epoch, index)."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, info: DatasetInfo,
                 crop: Optional[CropFlip] = None, seed: int = 0) -> None:
        if images.dim() != 4 or images.dtype != torch.uint8 or images.shape[0] != labels.shape[0]:
            raise ValueError(f"images must be uint8 (N, C, H, W) with N = len(labels), got {images.dtype} "
                             f"{tuple(images.shape)} and {tuple(labels.shape)} labels")
        self.images, self.labels, self.info = images, labels, info
        self.crop, self.seed = (crop if crop is not None and crop.active else None), seed
        self.table = normalization_table(info)

    def __len__(self) -> int:
        return self.labels.shape[0]

    def image(self, index: int) -> torch.Tensor:
        x = self.images[index]
        if self.crop is not None:
            top, left, flipped = self.crop.draw(self.seed, self.epoch, index)
            x = crop_flip_one(x, top, left, flipped, self.crop.pad)
        return normalize(x, self.table)

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
class Splits:
    train: tuple            # (uint8 images (N, C, H, W), int64 labels (N,))
    test: tuple             # the evaluation split: the test set, or the validation hold-out
    info: DatasetInfo
    evaluates_on: str       # "test" or "validation"


def _fixed_subset(images, labels, n: Optional[int], seed: int):
    """(kept, rest) for a fixed random choice of n of the images (all when n is None or too big)."""
    if n is None or n >= labels.shape[0]:
        return (images, labels), (images[:0], labels[:0])
    if n <= 0:
        raise ValueError(f"subset sizes must be positive, got {n}")
    idx = torch.randperm(labels.shape[0], generator=torch.Generator().manual_seed(seed))
    keep, rest = idx[:n], idx[n:]
    return (images[keep], labels[keep]), (images[rest], labels[rest])


def load_splits(cfg: TrainConfig) -> Splits:
    """The train and evaluation splits as uint8 tensors on the CPU. ``data.validation_size`` holds
    out a fixed random part of the training split and evaluates on it (the test split is not read:
    a search over training choices then never sees the test set)."""
    d = cfg.data
    info = dataset_info(d.dataset)
    if d.synthetic:
        train = synthetic_split(d.dataset, True, d.synthetic_train_size)
    else:
        train = load_split(d.dataset, True, d.data_dir, d.download, d.verify)
    if d.validation_size:
        if d.validation_size >= train[1].shape[0]:
            raise ValueError(f"data.validation_size ({d.validation_size}) must be smaller than the training split "
                             f"({train[1].shape[0]} images)")
        test, train = _fixed_subset(*train, d.validation_size, VALIDATION_SEED)
        evaluates_on = "validation"
    else:
        test = (synthetic_split(d.dataset, False, d.synthetic_test_size) if d.synthetic
                else load_split(d.dataset, False, d.data_dir, d.download, d.verify))
        evaluates_on = "test"
    train, _ = _fixed_subset(*train, d.train_subset, SUBSET_SEED)
    test, _ = _fixed_subset(*test, d.test_subset, SUBSET_SEED)
    return Splits(train, test, info, evaluates_on)


def augmentation(cfg: TrainConfig, info: DatasetInfo) -> Optional[CropFlip]:
    """The configured crop / flip, flips only where the dataset allows them (never for digits)."""
    d = cfg.data
    crop = CropFlip(pad=d.crop_padding, flip=d.flip and info.hflip)
    return crop if d.augment and crop.active else None


def uses_partners(cfg: TrainConfig) -> bool:
    return cfg.model.name == "otvit" and cfg.data.partner_prob > 0


def build_datasets(cfg: TrainConfig, splits: Optional[Splits] = None):
    """(train dataset, test dataset, info) of the loader pipeline."""
    splits = splits or load_splits(cfg)
    seed, info = cfg.train.seed, splits.info
    train_set: EpochAware = ImageDataset(*splits.train, info, crop=augmentation(cfg, info), seed=seed)
    if uses_partners(cfg):
        train_set = PartnerDataset(train_set, prob=cfg.data.partner_prob, seed=seed)
    return train_set, ImageDataset(*splits.test, info), info


class LoaderTrainData:
    """A DataLoader epoch by epoch: ``set_epoch`` reaches the sampler and the dataset."""

    def __init__(self, loader: DataLoader, sampler: EpochShardSampler, dataset: EpochAware) -> None:
        self.loader, self.sampler, self.dataset = loader, sampler, dataset
        self.n_images = len(dataset)

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)
        self.dataset.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        return iter(self.loader)


class LoaderEvalData:
    def __init__(self, loader: DataLoader) -> None:
        self.loader, self.n_images = loader, len(loader.dataset)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        return iter(self.loader)


@dataclass
class Loaders:
    train: object           # LoaderTrainData or device_data.DeviceTrainData
    test: object            # LoaderEvalData or device_data.DeviceEvalData
    info: DatasetInfo
    evaluates_on: str = "test"


def local_batch(cfg: TrainConfig, world: int) -> int:
    bs = cfg.train.batch_size
    if bs % world:
        raise ValueError(f"train.batch_size ({bs}) must be divisible by the number of processes ({world})")
    return bs // world


def pipeline(cfg: TrainConfig) -> str:
    return "device" if cfg.data.pipeline == "auto" else cfg.data.pipeline


def build_loaders(cfg: TrainConfig, rank: int = 0, world: int = 1, device=None,
                  splits: Optional[Splits] = None) -> Loaders:
    """The run's batches; the global batch ``train.batch_size`` is split evenly across the
    ``world`` processes (each takes every world-th image of the global batch)."""
    lb = local_batch(cfg, world)
    splits = splits or load_splits(cfg)
    if pipeline(cfg) == "device":
        dev = torch.device("cpu") if device is None else torch.device(device)
        channels_last = cfg.train.channels_last and dev.type == "cuda"  # as the loop's memory_format
        train = DeviceTrainData(*splits.train, splits.info, dev, batch_size=lb, seed=cfg.train.seed,
                                crop=augmentation(cfg, splits.info),
                                partner_prob=cfg.data.partner_prob if uses_partners(cfg) else None,
                                rank=rank, world=world, channels_last=channels_last)
        test = DeviceEvalData(*splits.test, splits.info, dev, batch_size=max(1, cfg.train.eval_batch_size // world),
                              rank=rank, world=world, channels_last=channels_last)
        return Loaders(train, test, splits.info, splits.evaluates_on)
    train_set, test_set, info = build_datasets(cfg, splits)
    sampler = EpochShardSampler(len(train_set), seed=cfg.train.seed, rank=rank, world=world)
    common = dict(num_workers=cfg.data.num_workers, persistent_workers=False,
                  generator=torch.Generator().manual_seed(cfg.train.seed))  # keeps the global RNG untouched
    train = DataLoader(train_set, batch_size=lb, sampler=sampler, drop_last=False, **common)
    test = DataLoader(test_set, batch_size=max(1, cfg.train.eval_batch_size // world),
                      sampler=EvalShardSampler(len(test_set), rank, world), **common)
    return Loaders(LoaderTrainData(train, sampler, train_set), LoaderEvalData(test), info, splits.evaluates_on)
