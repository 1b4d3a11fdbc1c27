"""Data pipeline: the same-class partner sampler, CIFAR augmentation, the idx reader, missing data."""
from __future__ import annotations

import gzip
import struct

import numpy as np
import pytest
import torch

from attnzoo.train import datasets as DS
from attnzoo.train.augment import CropFlip
from attnzoo.train.data import ImageDataset, PartnerDataset, build_datasets
from attnzoo.train.datasets import DataNotFoundError, dataset_info, load_split, read_idx_gz
from attnzoo.train.samplers import SameClassPartnerSampler

from .train_helpers import tiny_config, no_system_datasets  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("one_thread", "no_system_datasets")

LABEL_CASES = [  # (labels, prob)
    (torch.arange(600) % 10, 0.5),
    (torch.randint(0, 3, (500,), generator=torch.Generator().manual_seed(1)), 0.5),
    (torch.arange(400) % 4, 1.0),
    (torch.arange(100) % 7, 0.0),
]


@pytest.mark.parametrize("labels,prob", LABEL_CASES)
def test_partners_are_other_images_of_the_same_class(labels, prob):
    sampler = SameClassPartnerSampler(labels, prob=prob, seed=3)
    for epoch in (0, 5):
        partners = [sampler.partner(i, epoch) for i in range(len(labels))]
        chosen = [(i, j) for i, j in enumerate(partners) if j is not None]
        assert all(labels[i] == labels[j] and i != j for i, j in chosen)
        n = len(labels)  # binomial(n, prob): 5 standard deviations
        assert abs(len(chosen) - n * prob) <= 5 * (n * prob * (1 - prob)) ** 0.5 + 1e-9
    again = SameClassPartnerSampler(labels, prob=prob, seed=3)
    assert [again.partner(i, 5) for i in range(len(labels))] == partners  # deterministic in (seed, epoch, i)


def test_partners_vary_with_the_epoch_and_cover_the_class():
    labels = torch.arange(200) % 2
    sampler = SameClassPartnerSampler(labels, prob=1.0, seed=0)
    seen = {sampler.partner(0, e) for e in range(300)}
    assert len(seen) > 50 and all(labels[j] == 0 and j != 0 for j in seen)


def test_a_lonely_image_gets_no_partner():
    sampler = SameClassPartnerSampler(torch.tensor([0, 1, 1, 2]), prob=1.0)
    assert sampler.partner(0, 0) is None and sampler.partner(3, 0) is None
    assert sampler.partner(1, 0) == 2 and sampler.partner(2, 0) == 1


def test_partner_dataset_returns_the_partners_image(tmp_path):
    cfg = tiny_config(tmp_path, model="otvit", dataset="cifar10", data={"partner_prob": 0.5})
    train_set, _, _ = build_datasets(cfg)
    assert isinstance(train_set, PartnerDataset)
    train_set.set_epoch(2)
    for i in range(len(train_set)):
        x, y, p, has = train_set[i]
        j = train_set.sampler.partner(i, 2)
        assert has == (j is not None)
        if has:
            assert train_set.base.labels[j] == y
            torch.testing.assert_close(p, train_set.base.image(j), rtol=0, atol=0)
        else:
            assert p.abs().sum() == 0
    vit_set, _, _ = build_datasets(tiny_config(tmp_path, model="vit", dataset="cifar10"))
    assert isinstance(vit_set, ImageDataset)


def test_cifar_augmentation_is_a_padded_crop_and_flip():
    info = dataset_info("cifar10")
    images = torch.randint(1, 256, (6, 3, 32, 32), dtype=torch.uint8)
    ds = ImageDataset(images, torch.zeros(6, dtype=torch.int64), info, crop=CropFlip(pad=4, flip=True), seed=0)
    mean, std = torch.tensor(info.mean).view(3, 1, 1), torch.tensor(info.std).view(3, 1, 1)
    shifts = set()
    for epoch in range(3):
        ds.set_epoch(epoch)
        for i in range(6):
            got = ds[i][0] * std + mean  # back to [0, 1]
            padded = torch.zeros(3, 40, 40)
            padded[:, 4:36, 4:36] = images[i].double() / 255
            matches = [(top, left, flip) for top in range(9) for left in range(9) for flip in (False, True)
                       if torch.allclose(got.double(), (lambda c: c.flip(-1) if flip else c)(
                           padded[:, top:top + 32, left:left + 32]).double(), atol=1e-5)]
            assert len(matches) == 1
            shifts.add(matches[0])
    assert len(shifts) > 4  # it really moves
    plain = ImageDataset(images, torch.zeros(6, dtype=torch.int64), info, crop=None)
    torch.testing.assert_close(plain[1][0], (images[1].float() / 255 - mean) / std)


def _write_idx(path, array):
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


def test_fashion_mnist_read_from_a_data_dir(tmp_path):
    rng = np.random.default_rng(0)
    imgs = {True: rng.integers(0, 256, (20, 28, 28)), False: rng.integers(0, 256, (10, 28, 28))}
    labs = {True: rng.integers(0, 10, 20), False: rng.integers(0, 10, 10)}
    for train, (img_file, lab_file) in DS.FASHION_FILES.items():
        _write_idx(tmp_path / img_file, imgs[train])
        _write_idx(tmp_path / lab_file, labs[train])
    for train in (True, False):  # generated files: not the known ones, so read unverified
        x, y = load_split("fashion_mnist", train, str(tmp_path), download=False, verify=False)
        assert x.shape == (len(labs[train]), 1, 28, 28) and x.dtype == torch.uint8
        np.testing.assert_array_equal(x[:, 0].numpy(), imgs[train])
        np.testing.assert_array_equal(y.numpy(), labs[train])
    with gzip.open(tmp_path / "bad.gz", "wb") as f:
        f.write(bytes([0, 0, 0x08, 3]) + struct.pack(">3I", 5, 28, 28) + b"\0" * 10)
    with pytest.raises(ValueError, match="truncated"):
        read_idx_gz(tmp_path / "bad.gz")


def test_missing_data_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setattr(DS, "DEBIAN_FASHION_MNIST", tmp_path / "nowhere")
    with pytest.raises(DataNotFoundError, match="apt-get install dataset-fashion-mnist"):
        load_split("fashion_mnist", True, str(tmp_path), download=False)
    with pytest.raises(DataNotFoundError, match="--data-dir"):
        load_split("cifar10", True, str(tmp_path), download=False)
    with pytest.raises(ValueError, match="data.dataset"):
        load_split("mnist", True)


def test_digits_come_from_scikit_learn_with_a_fixed_split():
    (xa, ya), (xb, yb) = load_split("digits", True), load_split("digits", False)
    assert xa.shape == (1437, 1, 8, 8) and xb.shape == (360, 1, 8, 8) and xa.dtype == torch.uint8
    assert set(ya.tolist()) == set(yb.tolist()) == set(range(10))
    from sklearn.datasets import load_digits
    raw = np.rint(load_digits().images * 255 / 16).astype(np.uint8).reshape(1797, 64)
    ours = torch.cat([xa, xb]).reshape(1797, 64).numpy()
    assert sorted(map(bytes, ours)) == sorted(map(bytes, raw))  # the two splits are the 1797 images, each once
    info = dataset_info("digits")
    x = xa.double() / 255
    assert abs(x.mean() - info.mean[0]) < 1e-3 and abs(x.std() - info.std[0]) < 1e-3
    assert torch.equal(load_split("digits", True)[0], xa)  # the same split every time
