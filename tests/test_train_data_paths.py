"""Data folders the user names (issue 23, item 9): a --data-dir that does not exist stops the
command with its name, before any download or training; one a config cannot use is an error
that says so; the demo never swaps a named folder for the digits."""
from __future__ import annotations

import pytest

from attnzoo.cli import main
from attnzoo.train import DataNotFoundError, load_config
from attnzoo.train.datasets import load_split

from .train_helpers import no_system_datasets  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("one_thread", "no_system_datasets")
MISSING = "/nonexistent/attnzoo-data"


@pytest.fixture
def no_downloads(monkeypatch):
    """Any download attempt fails the test (the check must come first)."""
    import torchvision.datasets

    def refuse(*args, **kwargs):
        raise AssertionError("a download was attempted")
    for name in ("FashionMNIST", "CIFAR10", "CIFAR100"):
        monkeypatch.setattr(torchvision.datasets, name, refuse)


def _one_error_line(capsys, *needles):
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err, captured.err
    for needle in needles:
        assert needle in captured.err, (needle, captured.err)
    return captured


@pytest.mark.parametrize("config", ["configs/vit_fashion_mnist.yaml", "configs/otvit_cifar10.yaml"])
def test_train_with_a_missing_data_dir_names_it(tmp_path, capsys, no_downloads, config):
    rc = main(["train", config, "--data-dir", MISSING, "--out-dir", str(tmp_path / "run")])
    assert rc == 2
    _one_error_line(capsys, MISSING, "does not exist")
    assert not (tmp_path / "run").exists()


def test_compare_with_a_missing_data_dir_names_it(tmp_path, capsys, no_downloads):
    rc = main(["compare", "configs/compare/paper004_fashion_mnist.yaml", "--data-dir", MISSING,
               "--out-dir", str(tmp_path)])
    assert rc == 2
    _one_error_line(capsys, MISSING)


@pytest.mark.parametrize("config,extra,why", [
    ("configs/demo.yaml", [], "digits"),
    ("configs/vit_fashion_mnist.yaml", ["--set", "data.synthetic=true"], "synthetic"),
])
def test_a_data_dir_the_config_cannot_use_is_an_error(tmp_path, capsys, config, extra, why):
    rc = main(["train", config, "--data-dir", str(tmp_path), "--out-dir", str(tmp_path / "run"), *extra])
    assert rc == 2
    _one_error_line(capsys, str(tmp_path), why)
    assert not (tmp_path / "run").exists()


def test_an_existing_folder_without_the_files_is_named(tmp_path, no_downloads):
    cfg = load_config("configs/vit_fashion_mnist.yaml", [f"data.data_dir={tmp_path}", "data.download=false"])
    with pytest.raises(DataNotFoundError, match=str(tmp_path)):
        load_split("fashion_mnist", True, cfg.data.data_dir, download=False)


def test_a_failed_download_names_where_it_looked(tmp_path):
    """With downloads allowed and no network, the error names the folders searched and the target."""
    with pytest.raises(DataNotFoundError, match=f"not found in .*{tmp_path}.*download into"):
        load_split("fashion_mnist", True, str(tmp_path), download=True)


@pytest.mark.parametrize("argv,needles", [
    (["--data-dir", MISSING], [MISSING, "does not exist"]),
    (["--data-dir", "{tmp}"], ["{tmp}", "holds no Fashion-MNIST files"]),
    (["--data-dir", "{tmp}", "--dataset", "digits"], ["{tmp}", "digits"]),
])
def test_the_demo_never_swaps_a_named_folder_for_the_digits(tmp_path, capsys, argv, needles):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    rc = main(["demo", "--out", str(tmp_path / "demo"), *argv])
    assert rc == 2
    _one_error_line(capsys, *[n.replace("{tmp}", str(tmp_path)) for n in needles])
    assert not (tmp_path / "demo").exists()
