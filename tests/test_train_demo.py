"""attnzoo demo: installs the Debian package only when the files are missing, apt exists and we are root."""
from __future__ import annotations

import subprocess
from types import SimpleNamespace

import pytest

from attnzoo.commands import demo
from attnzoo.train import datasets as DS

SITUATIONS = [  # (files present, apt-get found, uid, expected apt calls)
    (True, True, 0, []),
    (False, True, 0, [["apt-get", "install", "-y", "dataset-fashion-mnist"]]),
    (False, True, 1000, []),
    (False, False, 0, []),
]


@pytest.mark.parametrize("present,apt,uid,expected", SITUATIONS)
def test_ensure_fashion_mnist(tmp_path, monkeypatch, present, apt, uid, expected):
    monkeypatch.setattr(DS, "DEBIAN_FASHION_MNIST", tmp_path)
    if present:
        for train in (True, False):
            for name in DS.FASHION_FILES[train]:
                (tmp_path / name).write_bytes(b"")
    calls = []
    monkeypatch.setattr(demo.shutil, "which", lambda name: "/usr/bin/apt-get" if apt else None)
    monkeypatch.setattr(demo.os, "geteuid", lambda: uid)
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: calls.append(cmd) or SimpleNamespace(returncode=0))
    demo.ensure_fashion_mnist(None, log=lambda *a: None)
    assert calls == expected


def test_demo_config_is_small():
    from attnzoo.train import load_config
    cfg = load_config(demo.default_config())
    assert cfg.data.dataset == "fashion_mnist" and cfg.model.embed_dim <= 64 and cfg.train.epochs <= 5
