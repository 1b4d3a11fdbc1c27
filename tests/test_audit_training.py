"""The training side used from the outside (attnzoo train / demo, the throughput tool, the config
files): each case here was a defect found that way. A bad value was a traceback, a message naming
no key, or a run that trained to NaN; a backend name was checked only after the data was read; a
key given twice in a YAML file was dropped silently; a fresh run into a folder holding a run
deleted that run's checkpoints at its first save; Ctrl-C was a traceback."""
from __future__ import annotations

import json
import re

import pytest
import torch

from attnzoo.cli import main
from attnzoo.train import CheckpointError, load_checkpoint, load_config, loop, train
from attnzoo.train import throughput

from .train_helpers import copy_run, no_system_datasets, tiny_config  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("one_thread", "no_system_datasets")
QUIET = dict(log=lambda *a, **k: None)


def _one_error_line(capsys, command: str = "train") -> str:
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out
    assert captured.err.startswith(f"attnzoo {command}: error: ") and captured.err.count("\n") == 1, captured.err
    return captured.err


# -- config values: each bad one is a ValueError naming its key, before any data is read -----------

BAD_VALUES = [
    ("optim.betas=[0.9, a]", "optim.betas[1]"),          # was: "could not convert string to float: 'a'"
    ("optim.betas=[0.9, null]", "optim.betas[1]"),       # was: a TypeError from float()
    ("optim.lr=.inf", "optim.lr"),                        # was accepted: the run trained to NaN
    ("optim.warmup_epochs=.inf", "optim.warmup_epochs"),  # was an OverflowError traceback
    ("optim.weight_decay=.inf", "optim.weight_decay"),
    ("train.seed=100000000000000000000000", "train.seed"),  # was torch's "Overflow when unpacking long long"
    ("train.seed=-1", "train.seed"),
    ("model.mlp_ratio=-1", "mlp_ratio"),                  # was a RuntimeError traceback (negative size)
    ("model.mlp_ratio=0", "mlp_ratio"),                   # was accepted: an MLP of width 0
    ("model.attention=\"sinkhorn(backend='torch')\"", "model.attention"),  # was found at the first forward
    ("model.attention=\"multihead(backend='nope')\"", "model.attention"),
    ("train.compile_backend=nope", "train.compile_backend"),  # was torch's InvalidBackend traceback
    ("train.compile_mode=nope", "train.compile_mode"),
]


@pytest.mark.parametrize("override,key", BAD_VALUES, ids=[b[0] for b in BAD_VALUES])
def test_a_bad_value_is_an_error_naming_its_key(override, key):
    with pytest.raises(ValueError, match=re.escape(key)):
        load_config("configs/demo.yaml", [override])


@pytest.mark.parametrize("override,key", [
    ("model.ot_backend=nope", "model.ot_backend"),  # was found at the first forward, after the data
    ("model.ot_alpha=.nan", "ot_alpha"),            # was a message about a spec string's literal
    ("model.ot_gamma=.inf", "ot_gamma"),
])
def test_a_bad_ot_vit_value_is_named(override, key):
    with pytest.raises(ValueError, match=key):
        load_config("configs/otvit_fashion_mnist.yaml", [override])


@pytest.mark.parametrize("override", ["optim.warmup_epochs=.inf", "model.mlp_ratio=-1",
                                      "model.attention=\"softmax(backend='nope')\""])
def test_the_cli_reports_them_in_one_line_before_any_work(tmp_path, capsys, override):
    # Fashion-MNIST is hidden by the fixture: a value checked only later would be a missing-data error
    out = tmp_path / "run"
    assert main(["train", "configs/vit_fashion_mnist.yaml", "--set", override, "--out-dir", str(out)]) == 2
    assert override.split("=")[0].split(".")[-1] in _one_error_line(capsys)  # model errors say "model: KEY ..."
    assert not out.exists()


def test_a_section_that_is_not_a_mapping_is_named_as_the_section():
    with pytest.raises(ValueError, match=r"^model: expected a mapping"):  # was "model.: ..."
        load_config("configs/demo.yaml", ["model=3"])


# -- YAML: a key given twice is an error, not the last one silently ---------------------------------

@pytest.mark.parametrize("text,key,line", [
    ("train:\n  epochs: 3\nmodel:\n  depth: 2\ntrain:\n  batch_size: 16\n", "train", 5),
    ("train:\n  epochs: 3\n  epochs: 4\n", "train.epochs", 3),
])
def test_a_key_given_twice_in_a_config_is_named(tmp_path, capsys, text, key, line):
    path = tmp_path / "twice.yaml"
    path.write_text("data:\n  dataset: digits\n" + text)
    with pytest.raises(ValueError, match=rf"twice.yaml: key '{key}' is given twice \(line {line + 2}\)"):
        load_config(path)
    assert main(["train", str(path), "--out-dir", str(tmp_path / "run")]) == 2
    assert f"'{key}'" in _one_error_line(capsys)


def test_yaml_merge_keys_and_anchors_still_load(tmp_path):
    path = tmp_path / "merge.yaml"
    path.write_text("base: &b {epochs: 2, batch_size: 16}\n"
                    "data: {dataset: digits, synthetic: true}\ntrain:\n  <<: *b\n  seed: 3\n")
    from attnzoo.train.config import read_yaml
    assert read_yaml(path)["train"] == {"epochs": 2, "batch_size": 16, "seed": 3}


# -- a run folder is never replaced by a run that does not continue it ------------------------------

@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("finished") / "run"
    torch.set_num_threads(1)
    train(tiny_config(out, overrides=["train.epochs=2"]), **QUIET)
    return out


def _files(run):
    return {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()}


def test_a_fresh_run_into_a_folder_holding_a_run_is_refused(finished_run, tmp_path, capsys):
    run = copy_run(finished_run, tmp_path)
    before = _files(run)
    with pytest.raises(CheckpointError, match="already holds a run"):
        train(tiny_config(run, overrides=["train.epochs=2", "train.seed=1"]), **QUIET)
    assert _files(run) == before  # it deleted epoch 2's checkpoint and rewrote the metrics
    rc = main(["train", "configs/demo.yaml", "--set", "data.synthetic=true", "--set", "train.epochs=1",
               "--out-dir", str(run)])
    assert rc == 2 and "--resume" in _one_error_line(capsys)
    assert _files(run) == before


def test_a_resume_from_another_run_into_a_folder_holding_a_run_is_refused(finished_run, tmp_path):
    a, b = copy_run(finished_run, tmp_path / "a"), copy_run(finished_run, tmp_path / "b")
    before = _files(b)
    with pytest.raises(CheckpointError, match="another checkpoint"):
        train(tiny_config(b, overrides=["train.epochs=3"]), resume=str(a), allow_config_change=True, **QUIET)
    assert _files(b) == before


def test_continuing_the_folders_own_run_and_filling_a_new_folder_still_work(finished_run, tmp_path):
    run = copy_run(finished_run, tmp_path)
    train(tiny_config(run, overrides=["train.epochs=3"]), resume=str(run), allow_config_change=True, **QUIET)
    assert load_checkpoint(run)[1]["epoch"] == 3
    other = tmp_path / "elsewhere"  # a resume may continue into a new folder
    train(tiny_config(other, overrides=["train.epochs=3"]), resume=str(finished_run), allow_config_change=True,
          **QUIET)
    assert load_checkpoint(other)[1]["epoch"] == 3


def test_the_demo_still_reruns_into_its_own_folder(tmp_path, capsys):
    argv = ["demo", "--variants", "softmax", "--epochs", "1", "--set", "data.train_subset=32",
            "--set", "data.test_subset=16", "--set", "model.embed_dim=16", "--set", "model.depth=1",
            "--out", str(tmp_path / "demo")]
    assert main(argv) == 0
    assert main(argv) == 0
    capsys.readouterr()
    assert json.loads((tmp_path / "demo" / "vit-softmax" / "metrics.json").read_text())["epochs_done"] == 1


# -- Ctrl-C and the throughput tool ---------------------------------------------------------------

def test_ctrl_c_is_one_line_saying_what_was_kept(tmp_path, capsys, monkeypatch):
    real, calls = loop.train_one_epoch, {"n": 0}

    def interrupted(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(loop, "train_one_epoch", interrupted)
    out = tmp_path / "run"
    try:
        rc = main(["train", "configs/demo.yaml", "--set", "data.synthetic=true", "--set", "train.epochs=3",
                   "--set", "model.embed_dim=16", "--set", "model.depth=1", "--set", "train.plot=false",
                   "--out-dir", str(out)])
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C left attnzoo train as a KeyboardInterrupt traceback")
    captured = capsys.readouterr()
    assert rc == 130 and "Traceback" not in captured.err
    assert "interrupted" in captured.err and str(out / "checkpoints") in captured.err
    assert load_checkpoint(out)[1]["epoch"] == 1


def test_the_throughput_tool_reports_bad_input_in_one_line(capsys):
    with pytest.raises(SystemExit) as stop:  # was a ValueError traceback
        throughput.main(["configs/demo.yaml", "--device", "cpu", "--set", "optim.lr=-1"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "optim.lr" in err and err.count("\n") == 1 and "Traceback" not in err
