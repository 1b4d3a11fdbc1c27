"""Checkpoints: atomic writes, what a corrupt or missing checkpoint says, through the API and the CLI."""
from __future__ import annotations

import json

import pytest
import torch

from attnzoo.cli import main
from attnzoo.train import CheckpointError, CheckpointNotFoundError, load_checkpoint, train
from attnzoo.train import checkpoint as C

from .train_helpers import tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt")
    torch.set_num_threads(1)
    train(tiny_config(out, overrides=["train.epochs=2"]), log=lambda *a: None)
    return out


def _copy(run_dir, tmp_path):
    import shutil
    shutil.copytree(run_dir, tmp_path / "run")
    return tmp_path / "run"


def test_a_trained_run_holds_last_and_best_and_nothing_else(run_dir):
    ck = run_dir / "checkpoints"
    last, best = (json.loads((ck / f"{n}.json").read_text()) for n in ("last", "best"))
    assert last["epoch"] == 2
    referenced = {last["weights"], last["state"], best["weights"], best["state"], "last.json", "best.json"}
    assert {p.name for p in ck.iterdir()} == referenced  # no temporaries, no stale epochs
    weights, state = load_checkpoint(run_dir)
    assert state["epoch"] == 2 and len(state["history"]) == 2 and "optimizer" in state
    assert all(isinstance(v, torch.Tensor) for v in weights.values())
    assert load_checkpoint(ck / last["weights"])[1]["epoch"] == 2  # a .safetensors path works too


def _garbage(path):
    path.write_bytes(b"\x00not a checkpoint\xff" * 7)


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


CORRUPTIONS = [  # (which file, damage, exception, message)
    ("weights", _garbage, CheckpointError, "corrupt or truncated"),
    ("weights", _truncate, CheckpointError, "corrupt or truncated"),
    ("state", _garbage, CheckpointError, "corrupt or truncated"),
    ("state", _truncate, CheckpointError, "corrupt or truncated"),
    ("state", lambda p: torch.save({"epoch": 1}, p), CheckpointError, "not an attnzoo training state"),
    ("state", lambda p: p.unlink(), CheckpointNotFoundError, "missing"),
    ("weights", lambda p: p.unlink(), CheckpointNotFoundError, "missing"),
    ("pointer", _garbage, CheckpointError, "pointer"),
    ("pointer", lambda p: p.unlink(), CheckpointNotFoundError, "no checkpoint"),
]


@pytest.mark.parametrize("which,damage,exc,match", CORRUPTIONS)
def test_damaged_checkpoints_give_a_clear_error(run_dir, tmp_path, which, damage, exc, match):
    run = _copy(run_dir, tmp_path)
    ck = run / "checkpoints"
    ref = json.loads((ck / "last.json").read_text())
    target = {"weights": ck / ref["weights"], "state": ck / ref["state"], "pointer": ck / "last.json"}[which]
    damage(target)
    with pytest.raises(exc, match=match):
        load_checkpoint(run)
    with pytest.raises(exc, match=match):
        train(tiny_config(run, overrides=["train.epochs=3"]), resume=str(run), log=lambda *a: None)


def test_missing_checkpoint_via_the_cli(tmp_path, capsys):
    rc = main(["train", "configs/demo.yaml", "--set", "data.synthetic=true", "--resume", str(tmp_path / "nothing")])
    assert rc == 2
    err = capsys.readouterr().err
    assert "no checkpoint" in err and "nothing" in err


def test_a_crash_while_saving_keeps_the_previous_checkpoint(run_dir, tmp_path, monkeypatch):
    run = _copy(run_dir, tmp_path)
    weights, state = load_checkpoint(run)

    def crash(tensors, path, metadata=None):
        with open(path, "wb") as f:
            f.write(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(C, "save_file", crash)
    with pytest.raises(OSError, match="disk full"):
        C.save_checkpoint(run / "checkpoints", 3, weights, state)
    _, state_after = load_checkpoint(run)
    assert state_after["epoch"] == 2
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.endswith(".tmp")]
