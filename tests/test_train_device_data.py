"""The device-resident data pipeline against the DataLoader pipeline, and the counter-based
randomness both draw from: the same batches for the same seed (order, crops, flips, partners,
normalisation), every draw a function of (seed, epoch, index) alone."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data.distributed import DistributedSampler

from attnzoo.train import counter_rng as R
from attnzoo.train.augment import CropFlip, crop_flip_gather, crop_flip_one, pad_split
from attnzoo.train.data import augmentation, build_loaders, load_splits, normalization_table, normalize
from attnzoo.train.datasets import dataset_info
from attnzoo.train.device_data import DeviceTrainData
from attnzoo.train.samplers import SameClassPartnerSampler, shard_order
from tests.common import needs_cuda

from .train_helpers import tiny_config, no_system_datasets  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("one_thread", "no_system_datasets")


# ---- the hash -------------------------------------------------------------------------------
def lowbias32_numpy(x: np.ndarray) -> np.ndarray:
    """lowbias32 as published (uint32 arithmetic that wraps), independent of the int64 emulation."""
    x = x.astype(np.uint32)
    with np.errstate(over="ignore"):
        x ^= x >> np.uint32(16)
        x *= np.uint32(0x7FEB352D)
        x ^= x >> np.uint32(15)
        x *= np.uint32(0x846CA68B)
        x ^= x >> np.uint32(16)
    return x


EDGE = np.array([0, 1, 2, 0xFFFF, 0x10000, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFE, 0xFFFFFFFF], dtype=np.uint64)


def test_hash_is_lowbias32_on_tensors_and_python_ints():
    rand = np.random.default_rng(0).integers(0, 2 ** 32, 5000, dtype=np.uint64)
    x = np.concatenate([EDGE, rand])
    want = lowbias32_numpy(x).astype(np.int64)
    got = R.hash32(torch.from_numpy(x.astype(np.int64)))
    assert got.dtype == torch.int64
    np.testing.assert_array_equal(got.numpy(), want)
    assert [R.hash32(int(v)) for v in x[:200]] == want[:200].tolist()


def test_bits_are_a_bijection_of_the_index_and_look_uniform():
    index = torch.arange(1 << 16)
    bits = R.random_bits(7, 3, index, R.SALT_ORDER)
    assert bits.unique().numel() == index.numel()                 # no two indices share their bits
    assert int(bits.min()) >= 0 and int(bits.max()) < 2 ** 32
    assert abs(bits.double().mean().item() / 2 ** 32 - 0.5) < 0.01
    draws = R.below(bits, 9)                                      # crop offsets: 9 values, each ~1/9
    counts = torch.bincount(draws, minlength=9).double() / index.numel()
    assert draws.min() >= 0 and draws.max() <= 8 and (counts - 1 / 9).abs().max() < 0.01
    assert [R.random_bits(7, 3, i, R.SALT_ORDER) for i in range(50)] == bits[:50].tolist()


def test_streams_differ_by_seed_epoch_and_salt():
    index = torch.arange(1000)
    base = R.random_bits(0, 0, index, R.SALT_TOP)
    for other in (R.random_bits(1, 0, index, R.SALT_TOP), R.random_bits(0, 1, index, R.SALT_TOP),
                  R.random_bits(0, 0, index, R.SALT_LEFT), R.random_bits(2 ** 32, 0, index, R.SALT_TOP)):
        assert (other == base).float().mean() < 0.01


def test_order_is_a_permutation_laid_out_like_distributed_sampler():
    for n, world in ((10, 1), (10, 3), (37, 4), (8, 8)):
        perm = R.permutation(5, 2, n)
        assert sorted(perm.tolist()) == list(range(n))
        for rank in range(world):
            layout = list(DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=False))
            assert shard_order(5, 2, n, rank, world).tolist() == [int(perm[i]) for i in layout]
    assert not torch.equal(R.permutation(5, 2, 100), R.permutation(5, 3, 100))


# ---- crops and flips ------------------------------------------------------------------------
def test_gathered_crops_equal_torchvision_crops():
    images = torch.randint(0, 256, (12, 3, 10, 7), dtype=torch.uint8)
    for crop in (CropFlip(pad=3, flip=True), CropFlip(pad=0, flip=True), CropFlip(pad=2, flip=False)):
        index = torch.tensor([0, 5, 5, 11, 3, 7, 2, 9])
        top, left, flipped = crop.draw(4, 1, index)
        got = crop_flip_gather(pad_split(images, crop.pad), index, top, left, flipped, (10, 7))
        for b, i in enumerate(index.tolist()):
            t, l, f = crop.draw(4, 1, i)
            assert (t, l, f) == (int(top[b]), int(left[b]), int(flipped[b]))
            assert torch.equal(got[b], crop_flip_one(images[i], t, l, f, crop.pad))
    assert not CropFlip(pad=0, flip=False).active


@pytest.mark.parametrize("name", ["digits", "fashion_mnist", "cifar10", "cifar100"])
def test_normalisation_is_x_over_255_minus_mean_over_std(name):
    info = dataset_info(name)
    images = torch.randint(0, 256, (3, info.channels, 5, 4), dtype=torch.uint8)
    images[0, :, 0, 0], images[0, :, 0, 1] = 0, 255
    want = (images.double() / 255 - torch.tensor(info.mean, dtype=torch.float64).view(-1, 1, 1)) \
        / torch.tensor(info.std, dtype=torch.float64).view(-1, 1, 1)
    got = normalize(images, normalization_table(info))
    assert got.dtype == torch.float32 and got.shape == images.shape
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-6)


def test_flips_only_where_the_dataset_allows(tmp_path):
    digits = tiny_config(tmp_path, overrides=["data.dataset=digits", "model.patch_size=2"], data={"augment": True})
    assert augmentation(digits, dataset_info("digits")) == CropFlip(pad=4, flip=False)
    fashion = tiny_config(tmp_path, data={"augment": True, "crop_padding": 2})
    assert augmentation(fashion, dataset_info("fashion_mnist")) == CropFlip(pad=2, flip=True)
    assert augmentation(tiny_config(tmp_path, data={"augment": False}), dataset_info("fashion_mnist")) is None
    off = tiny_config(tmp_path, data={"augment": True, "crop_padding": 0, "flip": False})
    assert augmentation(off, dataset_info("fashion_mnist")) is None


# ---- the two pipelines give the same batches --------------------------------------------------
PIPELINE_CASES = [  # (model, dataset, data overrides, world)
    ("vit", "fashion_mnist", {"augment": False}, 1),
    ("vit", "fashion_mnist", {"augment": True, "crop_padding": 2}, 1),
    ("otvit", "cifar10", {"augment": True}, 1),
    ("otvit", "cifar10", {"augment": True, "partner_prob": 1.0}, 2),
    ("otvit", "digits", {"augment": True, "crop_padding": 1}, 3),
]


def _batches(cfg, pipeline, rank, world, epoch):
    cfg.data.pipeline = pipeline
    loaders = build_loaders(cfg, rank, world)
    loaders.train.set_epoch(epoch)
    return list(loaders.train), list(loaders.test)


@pytest.mark.parametrize("model,dataset,data,world", PIPELINE_CASES)
def test_device_pipeline_gives_the_loaders_batches(tmp_path, model, dataset, data, world):
    patch = {"fashion_mnist": 7, "cifar10": 8, "digits": 2}[dataset]
    cfg = tiny_config(tmp_path, model=model, overrides=[f"data.dataset={dataset}", f"model.patch_size={patch}"],
                      data={"synthetic_train_size": 37, "synthetic_test_size": 11, **data},
                      train={"batch_size": 6, "eval_batch_size": 4, "seed": 3})
    for epoch in (0, 4):
        for rank in range(world):
            train_l, test_l = _batches(cfg, "loader", rank, world, epoch)
            train_d, test_d = _batches(cfg, "device", rank, world, epoch)
            assert len(train_l) == len(train_d) and len(test_l) == len(test_d)
            for a, b in zip(train_l + test_l, train_d + test_d):
                assert len(a) == len(b)
                for u, v in zip(a, b):
                    assert u.dtype == v.dtype and torch.equal(u, v)  # bit for bit
            if model == "otvit":
                assert any(bool(b[3].any()) for b in train_d)
    splits = load_splits(cfg)
    assert sum(b[0].shape[0] for b in train_d) * world >= splits.train[1].shape[0]


def _image_in_epoch(data: DeviceTrainData, epoch: int, i: int) -> torch.Tensor:
    """Image i as it appears in the epoch's batches."""
    data.set_epoch(epoch)
    seen = {}
    order = shard_order(data.seed, epoch, data.n_images)
    for k, start in enumerate(range(0, order.numel(), data.batch_size)):
        idx = order[start:start + data.batch_size]
        seen.update({int(j): (k, r) for r, j in enumerate(idx)})
    k, r = seen[i]
    return list(iter(data))[k][0][r]


def test_an_images_draws_depend_on_seed_epoch_and_index_only():
    """Image i's crop, flip and partner in epoch e are the same whatever the batch size (so
    whatever batch it lands in and its neighbours) and whether the pipeline was rebuilt."""
    info = dataset_info("cifar10")
    images = torch.randint(0, 256, (40, 3, 32, 32), dtype=torch.uint8)
    labels = torch.arange(40) % 4

    def build(bs, seed=1):
        return DeviceTrainData(images, labels, info, torch.device("cpu"), batch_size=bs, seed=seed,
                               crop=CropFlip(4, True), partner_prob=0.5)

    a, b = build(8), build(5)
    for epoch in (0, 2):
        for i in (0, 17, 39):
            assert torch.equal(_image_in_epoch(a, epoch, i), _image_in_epoch(b, epoch, i))
            assert torch.equal(_image_in_epoch(a, epoch, i), a.pixels(torch.tensor([i]), epoch)[0])
        assert torch.equal(a.draws(epoch)["partner"], build(3).draws(epoch)["partner"])
    every = torch.arange(40)
    moved = [not torch.equal(a.pixels(every, 0), a.pixels(every, e)) for e in (1, 2)]
    assert all(moved)                                                     # epochs differ
    assert not torch.equal(a.pixels(every, 0), build(8, seed=2).pixels(every, 0))  # seeds differ


def test_device_partners_equal_the_scalar_sampler_and_share_the_class():
    labels = torch.randint(0, 5, (300,), generator=torch.Generator().manual_seed(2))
    labels[7] = 9                                                         # a class of one: never a partner
    sampler = SameClassPartnerSampler(labels, prob=0.5, seed=4)
    for epoch in (0, 1, 6):
        partner, has = sampler.partners(torch.arange(300), epoch)
        scalar = [sampler.partner(i, epoch) for i in range(300)]
        assert [int(p) if h else None for p, h in zip(partner, has)] == scalar
        assert torch.equal(labels[partner], labels) and not bool(has[7])
        assert not bool(((partner == torch.arange(300)) & has).any())
        assert torch.equal(partner[~has], torch.arange(300)[~has])
        assert abs(has.float().mean().item() - 0.5) < 0.12


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("model,dataset,data,world", PIPELINE_CASES[1:3])
def test_cuda_pipeline_gives_the_cpu_batches(tmp_path, model, dataset, data, world):
    cfg = tiny_config(tmp_path, model=model, dataset=dataset, data={"synthetic_train_size": 300, **data},
                      train={"batch_size": 64, "eval_batch_size": 50, "seed": 3})
    cfg.data.pipeline = "device"
    cfg.train.channels_last = False
    for epoch in (0, 3):
        cpu, cuda = build_loaders(cfg), build_loaders(cfg, device="cuda")
        cpu.train.set_epoch(epoch)
        cuda.train.set_epoch(epoch)
        for a, b in zip(list(cpu.train) + list(cpu.test), list(cuda.train) + list(cuda.test)):
            for u, v in zip(a, b):
                assert v.is_cuda and torch.equal(u, v.cpu())
