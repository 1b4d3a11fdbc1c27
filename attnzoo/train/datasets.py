"""Image datasets as uint8 tensors (N, C, H, W) + int64 labels: scikit-learn's handwritten digits
(shipped inside the scikit-learn wheel, so always available offline), Fashion-MNIST (Debian package
files, a local copy, or torchvision's download), CIFAR-10/100 (torchvision), or generated look-alikes."""
from __future__ import annotations

import contextlib
import gzip
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from .errors import DataNotFoundError
from .fashion_mnist_files import DEBIAN_FOLDER, FASHION_FILES, FASHION_MNIST_INSTALL, verify_file

# where the Debian package dataset-fashion-mnist puts the files (ATTNZOO_FASHION_MNIST_DIR: elsewhere)
DEBIAN_FASHION_MNIST = DEBIAN_FOLDER


@dataclass(frozen=True)
class DatasetInfo:
    img_size: int
    channels: int
    num_classes: int
    mean: tuple
    std: tuple     # per-channel statistics of the training images (pixel values in [0, 1])
    hflip: bool    # a mirrored image is still an image of its class (not for digits: a mirrored 2 is no 2)
    train_size: int
    test_size: int


DATASETS = {
    "digits": DatasetInfo(8, 1, 10, (0.3050,), (0.3756,), False, 1437, 360),
    "fashion_mnist": DatasetInfo(28, 1, 10, (0.2860,), (0.3530,), True, 60000, 10000),
    "cifar10": DatasetInfo(32, 3, 10, (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616), True, 50000, 10000),
    "cifar100": DatasetInfo(32, 3, 100, (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762), True, 50000, 10000),
}


def dataset_info(name: str) -> DatasetInfo:
    if name not in DATASETS:
        raise ValueError(f"data.dataset must be one of {sorted(DATASETS)}, got {name!r}")
    return DATASETS[name]


def load_split(name: str, train: bool, data_dir: Optional[str] = None, download: bool = True,
               verify: bool = True):
    """(images uint8 (N, C, H, W), labels int64 (N,)) for one split of a named dataset. ``verify``:
    check Fashion-MNIST's files against their known sizes and checksums (``fashion_mnist_files``)."""
    dataset_info(name)
    check_data_dir(name, data_dir)
    if name == "digits":
        return _digits(train)
    if name == "fashion_mnist":
        return _fashion_mnist(train, data_dir, download, verify)
    return _cifar(name, train, data_dir, download)


# ---- scikit-learn's digits --------------------------------------------------------------------
DIGITS_SPLIT_SEED = 0
DIGITS_TEST_SIZE = 360  # of 1797: 1437 train / 360 test, the same fixed split everywhere


def _digits(train: bool):
    """The UCI handwritten digits (1797 8x8 images, 17 gray levels 0..16) as uint8 0..255."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise DataNotFoundError("the digits dataset comes with scikit-learn: pip install scikit-learn") from None
    d = load_digits()
    images = torch.from_numpy(np.rint(d.images * (255.0 / 16.0))).to(torch.uint8).unsqueeze(1)
    labels = torch.from_numpy(d.target.astype(np.int64))
    order = torch.randperm(labels.shape[0], generator=torch.Generator().manual_seed(DIGITS_SPLIT_SEED))
    idx = order[DIGITS_TEST_SIZE:] if train else order[:DIGITS_TEST_SIZE]
    return images[idx].contiguous(), labels[idx]


# ---- Fashion-MNIST ---------------------------------------------------------------------------
def read_idx_gz(path: Path) -> np.ndarray:
    """An idx file (LeCun's MNIST format), gzipped: big-endian magic (0, 0, dtype 0x08, ndim), dims, uint8 data."""
    with gzip.open(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise ValueError(f"{path} is not an idx file of unsigned bytes")
    ndim = raw[3]
    dims = struct.unpack(f">{ndim}I", raw[4:4 + 4 * ndim])
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if data.size != int(np.prod(dims)):
        raise ValueError(f"{path} is truncated: header says {dims}, found {data.size} bytes")
    return data.reshape(dims)


def check_data_dir(dataset: str, data_dir: Optional[str], synthetic: bool = False) -> None:
    """A data folder that is given must exist and be one the dataset reads: DataNotFoundError /
    ValueError naming it (never a silent fallback to other files or to the digits)."""
    if data_dir is None:
        return
    where = f"data.data_dir (--data-dir) {str(data_dir)!r}"
    if not str(data_dir).strip():
        raise ValueError(f"{where} is empty; pass a folder or leave it out")
    if synthetic:
        raise ValueError(f"{where} is given, but data.synthetic is true: generated images read no files; "
                         f"drop --data-dir or set data.synthetic=false")
    if dataset == "digits":
        raise ValueError(f"{where} is given, but data.dataset=digits reads no folder (the digits ship inside "
                         f"scikit-learn); drop --data-dir, or choose a dataset that has files (fashion_mnist, cifar10, "
                         f"cifar100)")
    if not Path(data_dir).is_dir():
        raise DataNotFoundError(f"{where} does not exist or is not a folder; pass the folder that holds the "
                                f"{dataset} files")


def fashion_mnist_dirs(data_dir: Optional[str]) -> list[Path]:
    """Where the four files are looked for: the given folder (flat, ``fashion-mnist/`` or torchvision's
    ``FashionMNIST/raw/``), else the Debian package's folder."""
    if data_dir:
        root = Path(data_dir)
        return [root, root / "fashion-mnist", root / "FashionMNIST" / "raw"]
    return [DEBIAN_FASHION_MNIST]


def fashion_mnist_folder(data_dir: Optional[str] = None) -> Optional[Path]:
    """The first folder holding all four files (nothing is downloaded), or None."""
    for d in fashion_mnist_dirs(data_dir):
        if all((d / f).is_file() for f in FASHION_FILES[True] + FASHION_FILES[False]):
            return d
    return None


def fashion_mnist_present(data_dir: Optional[str] = None) -> bool:
    """True when both splits' files are on disk (nothing is downloaded)."""
    return fashion_mnist_folder(data_dir) is not None


def _fashion_mnist(train: bool, data_dir, download, verify: bool = True):
    image_file, label_file = FASHION_FILES[train]
    looked = [str(d) for d in fashion_mnist_dirs(data_dir)]
    for d in fashion_mnist_dirs(data_dir):
        if (d / image_file).is_file() and (d / label_file).is_file():
            if verify:
                for name in (image_file, label_file):
                    verify_file(d / name)
            images = read_idx_gz(d / image_file)
            labels = read_idx_gz(d / label_file)
            return torch.from_numpy(images.copy()).unsqueeze(1), torch.from_numpy(labels.astype(np.int64))
    how = (f"install the Debian package ({FASHION_MNIST_INSTALL}, files in "
           f"{DEBIAN_FASHION_MNIST}), or put {image_file} and {label_file} in a folder passed as --data-dir")
    if not download:
        raise DataNotFoundError(f"Fashion-MNIST files not found in {looked}; {how}")
    from torchvision.datasets import FashionMNIST
    root = data_dir or "data"
    try:
        with removed_on_failure(root):
            ds = FashionMNIST(root=root, train=train, download=True)
    except Exception as e:  # no network, proxy, disk...
        raise DataNotFoundError(f"Fashion-MNIST files not found in {looked}, and the download into {root!r} failed "
                                f"({last_line(e)}); {how}") from None
    return ds.data.unsqueeze(1).clone(), ds.targets.to(torch.int64).clone()


@contextlib.contextmanager
def removed_on_failure(root):
    """Run a download into ``root``; if it fails, remove what it created there (files and folders
    that were not there before: torchvision makes ``FashionMNIST/raw/`` before its first request),
    so a failed attempt leaves the disk as it found it. What was there before is never touched."""
    root = Path(root)
    existed = root.exists()
    before = set(root.rglob("*")) if existed else set()
    try:
        yield
    except BaseException:
        created = set(root.rglob("*")) - before if root.exists() else set()
        created |= set() if existed else {root}
        for path in sorted(created, key=lambda q: len(q.parts), reverse=True):  # contents before their folder
            try:
                path.rmdir() if path.is_dir() and not path.is_symlink() else path.unlink(missing_ok=True)
            except OSError:  # something else wrote there meanwhile: leave it, report the download's error
                pass
        raise


def last_line(error: BaseException) -> str:
    """An exception's message as one line: its last non-empty line (urllib's reason, where
    torchvision's message lists every mirror it tried over several lines)."""
    lines = [" ".join(line.split()) for line in str(error).splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__


# ---- CIFAR -----------------------------------------------------------------------------------
def _cifar(name, train, data_dir, download):
    from torchvision import datasets
    cls = {"cifar10": datasets.CIFAR10, "cifar100": datasets.CIFAR100}[name]
    root = data_dir or "data"
    folder = {"cifar10": "cifar-10-batches-py", "cifar100": "cifar-100-python"}[name]
    how = (f"download it where the network allows (torchvision fetches it into {root}/{folder} with "
           f"data.download: true), or copy that folder and pass its parent as --data-dir")
    try:
        with removed_on_failure(root):
            ds = cls(root=root, train=train, download=download)
    except Exception as e:
        raise DataNotFoundError(f"{name} not available under {root!r} ({last_line(e)}); {how}") from None
    images = torch.from_numpy(np.ascontiguousarray(ds.data)).permute(0, 3, 1, 2).contiguous()
    return images, torch.as_tensor(ds.targets, dtype=torch.int64)


# ---- generated look-alikes -------------------------------------------------------------------
def synthetic_split(name: str, train: bool, size: int, seed: int = 0):
    """Images of the dataset's shape: a fixed random pattern per class plus noise, so the classes
    are learnable; labels cycle through the classes so every class has members."""
    info = dataset_info(name)
    g = torch.Generator().manual_seed(1000 + seed)
    patterns = torch.rand(info.num_classes, info.channels, info.img_size, info.img_size, generator=g)
    g.manual_seed(2000 + seed + (0 if train else 1))
    labels = torch.arange(size) % info.num_classes
    labels = labels[torch.randperm(size, generator=g)]
    noise = torch.rand(size, info.channels, info.img_size, info.img_size, generator=g)
    images = (0.6 * patterns[labels] + 0.4 * noise) * 255
    return images.round().to(torch.uint8), labels.to(torch.int64)
