"""Tiny configs on generated data for the training tests (seconds on a CPU)."""
from __future__ import annotations

import pytest

from attnzoo.train.config import apply_overrides, from_dict

TINY_MODEL = {"embed_dim": 16, "depth": 2, "num_heads": 2, "mlp_ratio": 2.0, "dropout": 0.0}
PATCH = {"fashion_mnist": 7, "cifar10": 8, "cifar100": 8}  # 16 patches per image


def tiny_config(out_dir, model="vit", dataset="fashion_mnist", overrides=(), **sections):
    data = {
        "model": {"name": model, "patch_size": PATCH[dataset], **TINY_MODEL},
        "data": {"dataset": dataset, "synthetic": True, "synthetic_train_size": 32, "synthetic_test_size": 16},
        "optim": {"lr": 1e-3, "warmup_epochs": 0.5},
        "train": {"epochs": 1, "batch_size": 8, "eval_batch_size": 16, "seed": 0, "device": "cpu",
                  "progress": False, "plot": False, "out_dir": str(out_dir)},
    }
    for section, values in sections.items():
        data[section].update(values)
    return from_dict(apply_overrides(data, list(overrides)))



@pytest.fixture
def no_system_datasets(tmp_path_factory, monkeypatch):
    """Behave as on a machine without Fashion-MNIST and without network: the Debian folder points at
    an empty place and torchvision's download fails at once."""
    from attnzoo.train import datasets as DS

    monkeypatch.setattr(DS, "DEBIAN_FASHION_MNIST", tmp_path_factory.mktemp("no_datasets") / "fashion-mnist")

    def offline(*args, **kwargs):
        raise RuntimeError("no network in the tests")
    import torchvision.datasets
    for name in ("FashionMNIST", "CIFAR10", "CIFAR100"):
        monkeypatch.setattr(torchvision.datasets, name, offline)


def copy_run(run, tmp_path):
    """A copy of a finished or interrupted run folder under tmp_path (each test resumes its own copy)."""
    import shutil
    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run"
