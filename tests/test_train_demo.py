"""attnzoo demo: runs offline on the digits scikit-learn ships, uses Fashion-MNIST only from files
already on disk, never runs a program (no apt-get), writes one table and one PNG."""
from __future__ import annotations

import json
import subprocess

import pytest

from attnzoo.cli import main
from attnzoo.commands import UsageError, demo
from attnzoo.train import datasets as DS
from attnzoo.train import load_config

from .train_helpers import no_system_datasets  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("one_thread", "no_system_datasets")

TINY = ["--epochs", "1", "--set", "data.train_subset=48", "--set", "data.test_subset=24",
        "--set", "model.embed_dim=16", "--set", "model.depth=1", "--set", "model.num_heads=2"]


@pytest.fixture
def no_programs(monkeypatch):
    """Any attempt to start a program (apt-get, sudo, a download tool) fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"the demo started a program: {args[:1]}")
    for name in ("run", "Popen", "call", "check_call", "check_output"):
        monkeypatch.setattr(subprocess, name, refuse)


def _fake_fashion_mnist(folder):
    folder.mkdir(parents=True, exist_ok=True)
    for train in (True, False):
        for name in DS.FASHION_FILES[train]:
            (folder / name).write_bytes(b"")


def test_the_demo_trains_three_models_on_the_digits_offline(tmp_path, capsys, no_programs):
    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out), *TINY]) == 0
    text = capsys.readouterr().out
    assert "digits" in text and "apt-get install dataset-fashion-mnist" in text  # printed, never run
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dataset"] == "digits"
    assert [r["label"] for r in summary["runs"]] == ["ViT softmax", "ViT sinkhorn", "OT-ViT"]
    assert [r["model"] for r in summary["runs"]] == ["vit", "vit", "otvit"]
    for r in summary["runs"]:
        assert 0 <= r["final_test_acc"] <= 1 and r["train_images_per_s"] > 0 and r["epochs"] == 1
    table = (out / "summary.md").read_text()
    assert table.count("| ViT ") == 2 and "| OT-ViT |" in table and "img/s" in table
    assert "OT-ViT" in text and "test acc" in text  # the table on stdout
    assert [p.name for p in out.rglob("*.png")] == ["test_curves.png"]  # one PNG
    assert (out / "test_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_fashion_mnist_is_used_when_its_files_are_on_disk(tmp_path, monkeypatch):
    _fake_fashion_mnist(tmp_path / "fm")
    assert demo.pick_dataset("auto", str(tmp_path / "fm"))[0] == "fashion_mnist"
    monkeypatch.setattr(DS, "DEBIAN_FASHION_MNIST", tmp_path / "fm")
    assert demo.pick_dataset("auto", None)[0] == "fashion_mnist"
    assert demo.pick_dataset("digits", None)[0] == "digits"


def test_without_fashion_mnist_the_demo_says_how_to_install_it(tmp_path):
    dataset, note = demo.pick_dataset("auto", None)
    assert dataset == "digits" and "sudo apt-get install dataset-fashion-mnist" in note
    with pytest.raises(UsageError, match="apt-get install dataset-fashion-mnist"):
        demo.pick_dataset("fashion_mnist", str(tmp_path))


@pytest.mark.parametrize("argv,match", [
    (["--variants", "softmaxx"], "softmaxx"),
    (["--variants", "softmax", "softmax"], "twice"),
    (["--set", "model.depth=0"], "depth"),
    (["--epochs", "0"], "train.epochs"),
    (["--dataset", "fashion_mnist"], "apt-get install"),
])
def test_bad_arguments_are_one_line_before_any_work(tmp_path, capsys, no_programs, argv, match):
    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out), *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("attnzoo demo: error:") and match in err
    assert not out.exists()


@pytest.mark.parametrize("name", list(demo.CONFIGS.values()))
def test_demo_configs_are_small_and_offline(name):
    cfg = load_config(f"configs/{name}")
    assert cfg.model.embed_dim <= 64 and cfg.model.depth <= 4 and cfg.train.device == "cpu" and cfg.train.threads == 1
    assert cfg.data.dataset in demo.CONFIGS
    assert cfg.data.dataset == "digits" or not cfg.data.download  # the demo never downloads
    tokens = (8 if cfg.data.dataset == "digits" else 28) // cfg.model.patch_size
    assert tokens ** 2 <= 16
