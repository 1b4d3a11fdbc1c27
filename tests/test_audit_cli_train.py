"""Issue 31's command-line and training items, each a defect a new user met: the analysis of a
checkpoint under another model's config, checkpoint weights written 0600, a run killed in its first
save that could not continue, a failed Fashion-MNIST download that left folders and a multi-line
message behind, ``attnzoo compare`` unable to compare two variants of one config, and analyze options
without help text. Each test failed before its fix."""
from __future__ import annotations

import argparse
import json
import stat
from pathlib import Path

import pytest
import torch
import yaml

from attnzoo.cli import build_parser, main
from attnzoo.train import CheckpointError, load_checkpoint, train
from attnzoo.train import checkpoint as C
from attnzoo.train import protocol

from .train_helpers import copy_run, no_system_datasets, tiny_config  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("one_thread", "no_system_datasets")
ROOT = Path(__file__).resolve().parents[1]


class Stop(Exception):
    """Ends a run after its first epoch (checkpoint and metrics written), as a kill would."""


def _stop(row):
    raise Stop


@pytest.fixture(scope="module")
def one_epoch_run(tmp_path_factory):
    """A 2-epoch softmax run on generated Fashion-MNIST look-alikes, stopped after epoch 1."""
    out = tmp_path_factory.mktemp("cli31") / "run"
    torch.set_num_threads(1)
    with pytest.raises(Stop):
        train(tiny_config(out, overrides=["train.epochs=2"]), log=lambda *a: None, on_epoch=_stop)
    return out


def _yaml(path: Path, run: Path, overrides=()) -> Path:
    """The tiny config (2 epochs, train.out_dir = run) with ``overrides``, as a YAML file."""
    path.write_text(yaml.safe_dump(tiny_config(run, overrides=["train.epochs=2", *overrides]).to_dict()))
    return path


def _one_error_line(capsys, command: str) -> str:
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out
    assert captured.err.startswith(f"attnzoo {command}: error: ") and captured.err.count("\n") == 1, captured.err
    return captured.err


# -- analyze fenchel --checkpoint RUN --config CFG: CFG is checked against the checkpoint's config ----

@pytest.mark.parametrize("override,key", [("model.attention=l2", "model.attention: checkpoint 'softmax', config 'l2'"),
                                          ("model.num_heads=4", "model.num_heads: checkpoint 2, config 4")],
                         ids=["attention", "heads"])
def test_analyze_refuses_a_config_the_checkpoint_was_not_trained_with(one_epoch_run, tmp_path, capsys, override,
                                                                       key):
    # the same parameter shapes: the weights loaded without a word into a model that was never trained
    config = _yaml(tmp_path / "other.yaml", one_epoch_run, [override])
    out = tmp_path / "out"
    argv = ["analyze", "fenchel", "--checkpoint", str(one_epoch_run), "--config", str(config), "--out", str(out)]
    assert main(argv) == 2
    err = _one_error_line(capsys, "analyze")
    assert "--checkpoint" in err and "different model" in err and key in err, err
    assert not out.exists()


@pytest.mark.parametrize("config", ["metrics.json", "same.yaml"])
def test_analyze_loads_the_checkpoint_under_its_own_config(one_epoch_run, tmp_path, config):
    from attnzoo.commands.analyze import _checked_checkpoint
    path = one_epoch_run / config if config.endswith(".json") else _yaml(tmp_path / config, one_epoch_run)
    model, info = _checked_checkpoint(str(one_epoch_run), str(path))
    weights, state = load_checkpoint(one_epoch_run)
    assert info["epoch"] == state["epoch"] == 1
    loaded = model.state_dict()
    assert set(loaded) == set(weights) and all(torch.equal(loaded[k], weights[k]) for k in weights)


# -- item 7: checkpoint files get the permissions of every other output ------------------------------

def test_checkpoint_files_get_the_usual_permissions(tmp_path):
    # the weights were 0600: the mode was set on mkstemp's file, which safetensors' save_file replaces
    C.save_checkpoint(tmp_path, 1, {"w": torch.zeros(3)}, {"epoch": 1}, is_best=True)
    files = sorted(tmp_path.iterdir())
    assert {f.name for f in files} == {"epoch0001.safetensors", "epoch0001.state.pt", "best.json", "last.json"}
    for f in files:
        assert stat.S_IMODE(f.stat().st_mode) == 0o666 & ~C._UMASK, (f.name, oct(f.stat().st_mode))


# -- item 9: a run killed between best.json and last.json continues from the newest checkpoint --------

def _killed_in_first_save(one_epoch_run, tmp_path) -> Path:
    """The run as a kill after best.json and before last.json in its first save leaves it: the
    epoch's files and best.json, no last.json, no metrics (written after the checkpoint)."""
    run = copy_run(one_epoch_run, tmp_path)
    for name in ("checkpoints/last.json", "metrics.json", "metrics.csv"):
        (run / name).unlink()
    return run


def test_a_run_killed_in_its_first_save_resumes(one_epoch_run, tmp_path, capsys):
    # --resume said "no checkpoint, train first"; a fresh run "already holds a run, pass --resume"
    run = _killed_in_first_save(one_epoch_run, tmp_path)
    config = _yaml(tmp_path / "tiny.yaml", run)
    assert main(["train", str(config)]) == 2
    err = _one_error_line(capsys, "train")
    assert "already holds a run" in err and "best.json" in err and "--resume" in err, err
    assert main(["train", str(config), "--resume"]) == 0
    assert "resumed from" in capsys.readouterr().out
    weights, state = load_checkpoint(run)
    assert state["epoch"] == 2 and [row["epoch"] for row in state["history"]] == [1, 2]
    assert json.loads((run / "metrics.json").read_text())["epochs_done"] == 2


def test_compare_resumes_a_run_killed_in_its_first_save(one_epoch_run, tmp_path):
    # protocol.status called it "new" (no last.json), and training it was then refused
    run = _killed_in_first_save(one_epoch_run, tmp_path)
    cfg = tiny_config(run, overrides=["train.epochs=2"])
    assert protocol.status(cfg) == "partial"
    assert protocol._resume_from(cfg, "partial", log=lambda *a: None) == str(run)


def test_resume_takes_best_json_when_it_ran_ahead_of_last_json(tmp_path, monkeypatch):
    """A later save killed between its best.json and its last.json: best.json names epoch 2, last.json
    still epoch 1. The run folder resumes from epoch 2 (it trained epoch 2 again before)."""
    C.save_checkpoint(tmp_path, 1, {"w": torch.zeros(2)}, {"epoch": 1}, is_best=True)
    write = C._atomic_write

    def killed_at_last_json(path, fn):
        if path.name == "last.json":
            raise Stop
        write(path, fn)
    monkeypatch.setattr(C, "_atomic_write", killed_at_last_json)
    with pytest.raises(Stop):
        C.save_checkpoint(tmp_path, 2, {"w": torch.ones(2)}, {"epoch": 2}, is_best=True)
    monkeypatch.undo()
    assert json.loads((tmp_path / "last.json").read_text())["epoch"] == 1
    assert C.newest_pointer(tmp_path) == tmp_path / "best.json"
    weights_file, _, _ = C.resolve(tmp_path)
    assert weights_file.name == "epoch0002.safetensors"
    assert torch.equal(C.load_weights(weights_file)["w"], torch.ones(2))
    assert C.resolve(tmp_path, "best")[0].name == "epoch0002.safetensors"
    assert C.resolve(tmp_path, "last")[0].name == "epoch0001.safetensors"  # named, a pointer is that pointer
    (tmp_path / "best.json").write_text(json.dumps({**json.loads((tmp_path / "best.json").read_text()),
                                                    "epoch": "2"}))
    with pytest.raises(CheckpointError, match="best.json is corrupt"):
        C.resolve(tmp_path)


# -- item 11: a failed Fashion-MNIST download cleans up and says what to do on one line ---------------

def _torchvision_offline(monkeypatch):
    """torchvision's FashionMNIST as it behaves offline: it makes root/FashionMNIST/raw/, then fails
    with a message over several lines."""
    import torchvision.datasets

    def offline(root, train=True, download=False, **kwargs):
        raw = Path(root) / "FashionMNIST" / "raw"
        raw.mkdir(parents=True, exist_ok=True)
        (raw / "train-images-idx3-ubyte.gz.part").write_bytes(b"\x1f\x8b")
        raise RuntimeError("Error downloading train-images-idx3-ubyte.gz:\nTried http://fashion-mnist.example/, "
                           "got:\n<urlopen error [Errno -2] Name or service not known>\n")
    monkeypatch.setattr(torchvision.datasets, "FashionMNIST", offline)


@pytest.mark.parametrize("data_dir", [None, "given"])
def test_a_failed_fashion_mnist_download_leaves_nothing_behind(tmp_path, monkeypatch, data_dir):
    from attnzoo.train import DataNotFoundError
    from attnzoo.train.datasets import load_split
    _torchvision_offline(monkeypatch)
    monkeypatch.chdir(tmp_path)
    if data_dir is not None:
        (tmp_path / data_dir).mkdir()
        (tmp_path / data_dir / "mine.txt").write_text("kept")
    with pytest.raises(DataNotFoundError) as e:
        load_split("fashion_mnist", True, data_dir, download=True)
    message = str(e.value)
    assert "\n" not in message, message
    assert "Name or service not known" in message and "Tried http" not in message, message
    assert "dataset-fashion-mnist" in message and "--data-dir" in message, message
    if data_dir is None:
        assert not (tmp_path / "data").exists()  # it held an empty FashionMNIST/raw/
    else:
        assert sorted(p.name for p in (tmp_path / data_dir).rglob("*")) == ["mine.txt"]


# -- item 12: compare two variants of one config -----------------------------------------------------

def test_compare_two_variants_of_one_config(tmp_path, capsys):
    # "two configs share a file name" was the only answer, with no hint
    config = _yaml(tmp_path / "tiny.yaml", tmp_path / "unused", ["train.epochs=1"])
    out = tmp_path / "cmp"
    assert main(["compare", str(config), "--vary", "model.attention=softmax", "--vary",
                 "model.attention=sinkhorn(n_iters=3, eps=0.5)", "--out-dir", str(out)]) == 0
    rows = json.loads((out / "table.json").read_text())["rows"]
    assert [r["name"] for r in rows] == ["tiny-softmax", "tiny-sinkhorn-n_iters-3-eps-0.5"]
    for name, spec in (("tiny-softmax", "softmax"), ("tiny-sinkhorn-n_iters-3-eps-0.5", "sinkhorn(n_iters=3, eps=0.5)")):
        metrics = json.loads((out / f"{name}_seed0" / "metrics.json").read_text())
        assert metrics["config"]["model"]["attention"] == spec and metrics["epochs_done"] == 1


def test_compare_names_the_way_when_two_configs_share_a_name(tmp_path, capsys):
    config = _yaml(tmp_path / "tiny.yaml", tmp_path / "unused")
    assert main(["compare", str(config), str(config), "--out-dir", str(tmp_path / "cmp")]) == 2
    err = _one_error_line(capsys, "compare")
    assert "share a file name" in err and "--vary model.attention=" in err, err
    assert main(["compare", str(config), "--vary", "model.attention", "--out-dir", str(tmp_path / "cmp")]) == 2
    assert "--vary expects KEY=VALUE" in _one_error_line(capsys, "compare")
    assert main(["compare", str(config), "--vary", "model.attention=relu", "--set", "model.attention=l2",
                 "--out-dir", str(tmp_path / "cmp")]) == 2
    assert "given by --set and by --vary" in _one_error_line(capsys, "compare")
    plan = str(ROOT / "configs/compare/paper004_fashion_mnist.yaml")
    assert main(["compare", plan, "--vary", "model.attention=relu", "--out-dir", str(tmp_path / "cmp")]) == 2
    assert "--vary applies to configs" in _one_error_line(capsys, "compare")
    assert not (tmp_path / "cmp").exists()


def test_vary_with_two_keys_gives_every_combination():
    plan = protocol.plan_from_configs(["a/vit.yaml"], vary=["model.attention=relu", "model.attention=l2",
                                                           "train.epochs=1", "train.epochs=2"])
    assert [(r.name, r.overrides) for r in plan.runs] == [
        ("vit-relu-1", ["model.attention=relu", "train.epochs=1"]),
        ("vit-relu-2", ["model.attention=relu", "train.epochs=2"]),
        ("vit-l2-1", ["model.attention=l2", "train.epochs=1"]),
        ("vit-l2-2", ["model.attention=l2", "train.epochs=2"])]


# -- item 13: every analyze option says what it takes -------------------------------------------------

def _subparsers(parser):
    return next((a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)), {})


def test_every_analyze_option_has_help_text():
    analyze = _subparsers(build_parser())["analyze"]
    tools = _subparsers(analyze)
    assert {"lipschitz", "wasserstein", "dynamics", "fenchel", "topolip"} <= set(tools)
    for tool, parser in tools.items():
        for action in parser._actions:
            if not isinstance(action, argparse._HelpAction):
                assert action.help and action.help.strip(), (tool, action.option_strings)
                if isinstance(action.default, list):  # a comma list says so, and shows its default as typed
                    assert "comma-separated" in action.help and "[" not in action.help, (tool, action.help)


def test_analyze_lipschitz_refuses_to_draw_an_empty_figure(tmp_path, capsys):
    # relu alone drew two empty panels (the figure plots estimate / bound, and paper 002 bounds no relu)
    out = tmp_path / "out"
    fast = ["--tokens", "2", "--radii", "1", "--samples", "1", "--ascent-steps", "1", "--out", str(out)]
    assert main(["analyze", "lipschitz", "--variants", "relu,linear", *fast]) == 2
    err = _one_error_line(capsys, "analyze")
    assert "no Lipschitz bound for relu, linear" in err and "softmax" in err, err
    assert not out.exists()


# -- item 15: the README's CPU guidance and what a "(cpu)" cell of the GPU table means ----------------

def test_readme_says_how_to_install_without_a_gpu_and_what_a_cpu_cell_means():
    text = (ROOT / "README.md").read_text()
    begin, end = "<!-- bench:begin -->", "<!-- bench:end -->"
    before, table, after = text.split(begin)[0], text.split(begin)[1].split(end)[0], text.split(end)[1]
    # the install guidance comes before the tables: a CPU-only torch first, and why (the CUDA wheels' size)
    assert "--index-url https://download.pytorch.org/whl/cpu" in before and "6 GB" in before
    assert "TRITON_INTERPRET=1" in before and 'backend="auto"' in before
    # a "(cpu)" cell in the GPU table is explained where the table ends (the renderer owns the table)
    if "(cpu)" in table:
        assert "`(cpu)`" in after and "CUDA tensors" in after.split("\n\n")[1], after[:600]
