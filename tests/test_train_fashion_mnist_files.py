"""Fashion-MNIST's files are checked by size and checksum before they are read, and a command
copies them into the checkout (data/, ignored by git) for a machine without them (issue 22)."""
from __future__ import annotations

import gzip
import hashlib
import os
import struct
from pathlib import Path

import numpy as np
import pytest

from attnzoo.train import DataNotFoundError
from attnzoo.train import fashion_mnist_files as F
from attnzoo.train.datasets import load_split

from .train_helpers import no_system_datasets  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("one_thread", "no_system_datasets")


def _write_idx(path, array):
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


@pytest.fixture
def generated(tmp_path, monkeypatch):
    """Four small idx files under the real names, recorded as the known ones (KNOWN patched with
    their digests computed here by hashlib, independently of the module)."""
    folder = tmp_path / "fm"
    folder.mkdir()
    rng = np.random.default_rng(0)
    sizes = {True: 20, False: 10}
    known = {}
    for train, (img, lab) in F.FASHION_FILES.items():
        _write_idx(folder / img, rng.integers(0, 256, (sizes[train], 28, 28)))
        _write_idx(folder / lab, rng.integers(0, 10, sizes[train]))
    for name in F.NAMES:
        data = (folder / name).read_bytes()
        known[name] = (len(data), hashlib.sha256(data).hexdigest(), "0" * 32)
    monkeypatch.setattr(F, "KNOWN", known)
    return folder


def test_generated_files_are_refused_unless_verification_is_off(tmp_path):
    folder = tmp_path / "fm"
    folder.mkdir()
    for name in F.NAMES:
        _write_idx(folder / name, np.zeros((3, 28, 28) if "images" in name else (3,)))
    with pytest.raises(F.DataChecksumError, match="train-images-idx3-ubyte.gz is not the Fashion-MNIST file.*"
                                                  "data.verify=false"):
        load_split("fashion_mnist", True, str(folder), download=False)
    x, y = load_split("fashion_mnist", True, str(folder), download=False, verify=False)
    assert x.shape == (3, 1, 28, 28) and y.shape == (3,)


def test_known_files_pass_and_any_damage_is_named(generated):
    assert F.verify_folder(generated) == {n: "debian" for n in F.NAMES}
    x, _ = load_split("fashion_mnist", True, str(generated), download=False)
    assert x.shape == (20, 1, 28, 28)
    target = generated / "t10k-labels-idx1-ubyte.gz"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x10
    target.write_bytes(bytes(data))
    with pytest.raises(F.DataChecksumError, match="t10k-labels-idx1-ubyte.gz"):
        F.verify_folder(generated)
    target.write_bytes(bytes(data[:-3]))            # a truncated copy: the size differs too
    with pytest.raises(F.DataChecksumError, match=f"{len(data) - 3} bytes"):
        F.verify_file(target)


def test_zalandos_files_pass_by_torchvisions_md5(generated, monkeypatch):
    name = "train-labels-idx1-ubyte.gz"
    data = (generated / name).read_bytes()
    size, sha, _ = F.KNOWN[name]
    monkeypatch.setitem(F.KNOWN, name, (size + 1, "f" * 64, hashlib.md5(data).hexdigest()))
    assert F.verify_file(generated / name) == "zalando"


def test_the_recorded_md5s_are_torchvisions():
    from torchvision.datasets.mnist import FashionMNIST  # the class itself (the fixture replaced the export)
    assert {name: md5 for name, md5 in FashionMNIST.resources} == {n: k[2] for n, k in F.KNOWN.items()}


def test_the_copy_command_copies_and_verifies(generated, tmp_path, capsys):
    dest = tmp_path / "checkout" / "data" / "fashion-mnist"
    assert F.main(["copy", "--from", str(generated), "--to", str(dest)]) == 0
    assert sorted(p.name for p in dest.iterdir()) == sorted(F.NAMES)
    assert "verified" in capsys.readouterr().out
    assert F.main(["check", str(dest)]) == 0
    (dest / F.NAMES[0]).write_bytes(b"not it")
    assert F.main(["check", str(dest)]) == 2
    assert F.NAMES[0] in capsys.readouterr().err
    assert F.main(["copy", "--from", str(tmp_path / "absent"), "--to", str(dest)]) == 2
    assert "absent" in capsys.readouterr().err
    (generated / F.NAMES[1]).unlink()
    with pytest.raises(DataNotFoundError, match=F.NAMES[1]):
        F.copy_files(generated, dest)


REAL = [Path(p) for p in (os.environ.get("ATTNZOO_FASHION_MNIST_FILES", "data/fashion-mnist"),
                          "/usr/share/datasets/fashion-mnist")]


def test_the_real_files_match_the_recorded_checksums():
    """Where the real files are on disk (data/fashion-mnist after the copy command, or the Debian
    package), they pass; elsewhere there is nothing to check."""
    found = [d for d in REAL if all((d / n).is_file() for n in F.NAMES)]
    if not found:
        pytest.skip("no copy of Fashion-MNIST on this machine (data/fashion-mnist or the Debian package)")
    for d in found:
        assert set(F.verify_folder(d).values()) <= {"debian", "zalando"}
