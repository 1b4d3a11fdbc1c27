"""Checkpoints: atomic writes, what a corrupt or missing checkpoint says, through the API and the CLI."""
from __future__ import annotations

import json

import pytest
import torch

from attnzoo.cli import main
from attnzoo.train import CheckpointError, CheckpointNotFoundError, load_checkpoint, train
from attnzoo.train import checkpoint as C

from .train_helpers import copy_run, tiny_config, no_system_datasets  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("one_thread", "no_system_datasets")


class Stop(Exception):
    """Ends a run after a chosen epoch (its checkpoint written), as an interruption would."""


def stop_after(epoch):
    def on_epoch(row):
        if row["epoch"] == epoch:
            raise Stop
    return on_epoch


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A 3-epoch run interrupted after epoch 2: resuming it with the same config trains epoch 3."""
    out = tmp_path_factory.mktemp("ckpt")
    torch.set_num_threads(1)
    with pytest.raises(Stop):
        train(tiny_config(out, overrides=["train.epochs=3"]), log=lambda *a: None, on_epoch=stop_after(2))
    return out


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


def _flip_middle_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # inside the tensor data / the pickled state: the file still parses
    path.write_bytes(bytes(data))


CORRUPTIONS = [  # (which file, damage, exception, message)
    ("weights", _garbage, CheckpointError, "corrupt"),
    ("weights", _truncate, CheckpointError, "corrupt"),
    ("weights", _flip_middle_byte, CheckpointError, "SHA-256"),
    ("state", _garbage, CheckpointError, "corrupt"),
    ("state", _truncate, CheckpointError, "corrupt"),
    ("state", _flip_middle_byte, CheckpointError, "SHA-256"),
    ("state", lambda p: torch.save({"epoch": 1}, p), CheckpointError, "corrupt"),
    ("state", lambda p: p.unlink(), CheckpointNotFoundError, "missing"),
    ("weights", lambda p: p.unlink(), CheckpointNotFoundError, "missing"),
    ("pointer", _garbage, CheckpointError, "pointer"),
    # both pointers gone (with last.json alone gone, the run resumes from best.json: test_audit_cli_train.py)
    ("pointer", lambda p: [f.unlink() for f in p.parent.glob("*.json")], CheckpointNotFoundError, "no checkpoint"),
]


@pytest.mark.parametrize("which,damage,exc,match", CORRUPTIONS)
def test_damaged_checkpoints_give_a_clear_error(run_dir, tmp_path, which, damage, exc, match):
    run = copy_run(run_dir, tmp_path)
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
    run = copy_run(run_dir, tmp_path)
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


def test_flipped_weight_bytes_are_found_through_a_direct_safetensors_path(run_dir, tmp_path):
    """Without a pointer naming the file, the checksum the state file records catches the damage."""
    run = copy_run(run_dir, tmp_path)
    ck = run / "checkpoints"
    ref = json.loads((ck / "last.json").read_text())
    for pointer in ("last.json", "best.json"):
        (ck / pointer).unlink()
    weights = ck / ref["weights"]
    assert load_checkpoint(weights)[1]["epoch"] == 2
    _flip_middle_byte(weights)
    with pytest.raises(CheckpointError, match="SHA-256"):
        load_checkpoint(weights)


def _rewrite_state(path, change):
    """Save an edited state under the same name and refresh the pointers' checksums, so only the edit
    (not a checksum) is what the loader meets."""
    state = torch.load(path, weights_only=True)
    change(state)
    torch.save(state, path)
    for pointer in path.parent.glob("*.json"):
        ref = json.loads(pointer.read_text())
        if ref["state"] == path.name:
            ref["state_sha256"] = C.sha256(path)
            pointer.write_text(json.dumps(ref))


STATE_EDITS = [  # (edit, message)
    (lambda s: s.pop("optimizer"), "lacks \\['optimizer'\\]"),
    (lambda s: s.update(format="something else"), "not an attnzoo training state"),
    (lambda s: s.update(rng={}), "RNG state"),
    (lambda s: s["optimizer"].update(param_groups=[]), "optimizer"),
]


@pytest.mark.parametrize("edit,match", STATE_EDITS)
def test_an_incomplete_state_is_a_one_line_cli_error(run_dir, tmp_path, capsys, edit, match):
    run = copy_run(run_dir, tmp_path)
    ref = json.loads((run / "checkpoints" / "last.json").read_text())
    _rewrite_state(run / "checkpoints" / ref["state"], edit)
    with pytest.raises(CheckpointError, match=match):
        train(tiny_config(run, overrides=["train.epochs=3"]), resume=str(run), log=lambda *a: None)
    assert _cli_resume(run, []) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("attnzoo train: error:") and "Traceback" not in err


def _cli_resume(run, extra):
    """attnzoo train on the tiny config's shape (a YAML written beside the run), resuming ``run``."""
    import yaml
    cfg = tiny_config(run).to_dict()
    cfg["train"]["epochs"] = 3
    path = run.parent / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return main(["train", str(path), "--resume", str(run), *extra])


def test_another_model_config_is_refused_on_resume(run_dir, tmp_path, capsys):
    run = copy_run(run_dir, tmp_path)
    with pytest.raises(CheckpointError, match="model.attention: checkpoint 'softmax', config 'sigmoid'"):
        train(tiny_config(run, overrides=["train.epochs=3", "model.attention=sigmoid"]), resume=str(run),
              log=lambda *a: None)
    assert _cli_resume(run, ["--set", "model.embed_dim=32"]) == 2
    err = capsys.readouterr().err
    assert "different model" in err and "model.embed_dim" in err and err.count("\n") == 1
    assert load_checkpoint(run)[1]["epoch"] == 2  # nothing was written


def test_another_architectures_weights_are_a_checkpoint_error(run_dir, tmp_path, capsys):
    run = copy_run(run_dir, tmp_path)
    weights, state = load_checkpoint(run)
    other = {k + "_renamed" if k.startswith("head") else k: v for k, v in weights.items()}
    C.save_checkpoint(run / "checkpoints", 2, other, {k: v for k, v in state.items() if k != "format"})
    with pytest.raises(CheckpointError, match="another architecture"):
        train(tiny_config(run, overrides=["train.epochs=3"]), resume=str(run), log=lambda *a: None)
    assert _cli_resume(run, []) == 2
    assert "another architecture" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["../../outside.safetensors", "/etc/passwd", "sub/epoch0002.safetensors", ".."])
def test_a_pointer_may_only_name_files_beside_it(run_dir, tmp_path, name):
    run = copy_run(run_dir, tmp_path)
    pointer = run / "checkpoints" / "last.json"
    ref = json.loads(pointer.read_text())
    (tmp_path / "outside.safetensors").write_bytes((run / "checkpoints" / ref["weights"]).read_bytes())
    pointer.write_text(json.dumps({**ref, "weights": name}))
    with pytest.raises(CheckpointError, match="may only name files beside it"):
        load_checkpoint(run)


SAVE_WRITES = ["weights", "state", "best.json", "last.json"]


@pytest.mark.parametrize("crash_at", range(len(SAVE_WRITES)))
def test_a_crash_at_any_write_leaves_both_pointers_loadable(run_dir, tmp_path, monkeypatch, crash_at):
    """Epoch 3 is the best; the save dies at each of its four atomic writes in turn, leaving a
    half-written temporary as a killed process would. last.json and best.json stay loadable and
    verified, best.json never names an epoch older than last.json's best, and the next save
    removes the temporary."""
    run = copy_run(run_dir, tmp_path)
    ck = run / "checkpoints"
    weights, state = load_checkpoint(run)
    best_before = load_checkpoint(run, "best")[1]["epoch"]
    state = {k: v for k, v in state.items() if k not in ("format", "weights_sha256")}
    real, calls = C._atomic_write, {"n": 0}

    def dying(path, write):
        if calls["n"] == crash_at:
            (path.parent / f".{path.name}.x1y2z3{C.TMP_SUFFIX}").write_bytes(b"half")
            raise KeyboardInterrupt  # killed mid-write: nothing cleans up
        calls["n"] += 1
        real(path, write)

    monkeypatch.setattr(C, "_atomic_write", dying)
    with pytest.raises(KeyboardInterrupt):
        C.save_checkpoint(ck, 3, weights, {**state, "epoch": 3}, is_best=True)
    monkeypatch.undo()
    last, best = load_checkpoint(run, "last")[1], load_checkpoint(run, "best")[1]
    assert last["epoch"] == 2 and best["epoch"] == (3 if crash_at == 3 else best_before)
    assert [p for p in ck.iterdir() if p.name.endswith(C.TMP_SUFFIX)]
    C.save_checkpoint(ck, 3, weights, {**state, "epoch": 3}, is_best=True)
    assert not [p for p in ck.iterdir() if p.name.endswith(C.TMP_SUFFIX)]
    assert load_checkpoint(run, "last")[1]["epoch"] == load_checkpoint(run, "best")[1]["epoch"] == 3


def test_training_start_removes_stale_temporaries(run_dir, tmp_path):
    run = copy_run(run_dir, tmp_path)
    stale = [run / f".metrics.csv.abc{C.TMP_SUFFIX}", run / "checkpoints" / f".last.json.def{C.TMP_SUFFIX}"]
    for f in stale:
        f.write_bytes(b"left by a killed process")
    train(tiny_config(run, overrides=["train.epochs=3"]), resume=str(run), log=lambda *a: None)
    assert not any(f.exists() for f in stale)
