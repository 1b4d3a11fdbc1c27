"""What a resume checks (issue 23, items 3 and 10): every file it reads is verified, also when the
checkpoint is named by its .safetensors path with no last.json / best.json beside it; a config
that would not continue the same run is refused unless --allow-config-change, which records the
changes; resuming a run that already holds train.epochs epochs says there is nothing left to do."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from attnzoo.cli import main
from attnzoo.train import CheckpointError, load_checkpoint, train
from attnzoo.train import checkpoint as C

from .train_helpers import copy_run, tiny_config, no_system_datasets  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("one_thread", "no_system_datasets")
QUIET = dict(log=lambda *a, **k: None)


class Stop(Exception):
    pass


@pytest.fixture(scope="module")
def half_run(tmp_path_factory):
    """A 2-epoch run stopped after epoch 1 (its checkpoint written)."""
    out = tmp_path_factory.mktemp("half") / "run"
    torch.set_num_threads(1)

    def stop(row):
        raise Stop

    with pytest.raises(Stop):
        train(tiny_config(out, overrides=["train.epochs=2"]), on_epoch=stop, **QUIET)
    return out


def _lone_weights(run):
    """The epoch's .safetensors path, with the pointers that name it deleted."""
    ck = run / "checkpoints"
    ref = json.loads((ck / "last.json").read_text())
    for pointer in ("last.json", "best.json"):
        (ck / pointer).unlink(missing_ok=True)
    return ck / ref["weights"], ck / ref["state"]


def _flip_byte(path, where):
    data = bytearray(path.read_bytes())
    data[where] ^= 0x01
    path.write_bytes(bytes(data))


def _optimizer_state_offset(state_file):
    """A byte inside the stored optimizer moments (exp_avg of the first parameter): flipping it leaves
    the file loadable, only one number changes."""
    state = torch.load(state_file, weights_only=True)
    moment = state["optimizer"]["state"][0]["exp_avg"].contiguous()
    needle = moment.reshape(-1).view(torch.uint8).numpy().tobytes()[:32]
    at = state_file.read_bytes().find(needle)
    assert at > 0
    return at + 3


def test_a_flipped_bit_in_the_optimizer_state_is_found_without_a_pointer(half_run, tmp_path):
    run = copy_run(half_run, tmp_path)
    weights, state_file = _lone_weights(run)
    assert load_checkpoint(weights)[1]["epoch"] == 1      # intact: loads by its .safetensors path
    _flip_byte(state_file, _optimizer_state_offset(state_file))
    torch.load(state_file, weights_only=True)             # the damage still unpickles: only a checksum sees it
    with pytest.raises(CheckpointError, match="state .* is corrupt: its SHA-256"):
        load_checkpoint(weights)
    with pytest.raises(CheckpointError, match="SHA-256"):
        train(tiny_config(run, overrides=["train.epochs=2"]), resume=str(weights), **QUIET)


def test_flipped_weights_and_a_swapped_state_are_found_without_a_pointer(half_run, tmp_path):
    run = copy_run(half_run, tmp_path)
    weights, state_file = _lone_weights(run)
    other = tmp_path / "other"
    with pytest.raises(Stop):
        train(tiny_config(other, overrides=["train.epochs=2", "train.seed=5"]), on_epoch=_raise, **QUIET)
    other_state = other / "checkpoints" / json.loads((other / "checkpoints" / "last.json").read_text())["state"]
    shutil.copyfile(other_state, state_file)               # another run's (intact) state beside these weights
    with pytest.raises(CheckpointError, match="SHA-256"):
        load_checkpoint(weights)
    run2 = copy_run(half_run, tmp_path / "b")
    weights2, _ = _lone_weights(run2)
    data = weights2.read_bytes()
    _flip_byte(weights2, len(data) - 5)                   # inside the last tensor's bytes
    with pytest.raises(CheckpointError, match="corrupt"):
        load_checkpoint(weights2)


def _raise(row):
    raise Stop


def test_a_checkpoint_without_any_checksum_for_its_state_is_refused(half_run, tmp_path):
    """A weights file without the pair's checksums (as an older attnzoo wrote them) and no pointer:
    the state cannot be verified, so it is not read."""
    run = copy_run(half_run, tmp_path)
    weights, _ = _lone_weights(run)
    from safetensors.torch import load_file, save_file
    save_file(load_file(str(weights)), str(weights), metadata={"format": C.STATE_FORMAT})
    with pytest.raises(CheckpointError, match="cannot be verified"):
        load_checkpoint(weights)


CHANGES = [  # (override, key named in the refusal)
    ("optim.lr=0.002", "optim.lr"),
    ("train.seed=7", "train.seed"),
    ("train.batch_size=4", "train.batch_size"),
    ("data.augment=true", "data.augment"),
    ("train.epochs=3", "train.epochs"),
]


@pytest.mark.parametrize("override,key", CHANGES)
def test_a_changed_config_is_refused_unless_allowed(half_run, tmp_path, override, key):
    run = copy_run(half_run, tmp_path)
    before = (run / "checkpoints" / "last.json").read_text()
    with pytest.raises(CheckpointError, match=f"{key}: checkpoint .*--allow-config-change"):
        train(tiny_config(run, overrides=["train.epochs=2", override]), resume=str(run), **QUIET)
    assert (run / "checkpoints" / "last.json").read_text() == before     # nothing trained, nothing written
    summary = train(tiny_config(run, overrides=["train.epochs=2", override]), resume=str(run),
                    allow_config_change=True, **QUIET)
    metrics = json.loads((run / "metrics.json").read_text())
    recorded = metrics["config_changes"]
    assert summary["config_changes"] == recorded and len(recorded) == 1
    assert recorded[0]["after_epoch"] == 1 and any(c.startswith(f"{key}:") for c in recorded[0]["changes"])
    assert load_checkpoint(run)[1]["config_changes"] == recorded          # carried on by later resumes


def test_settings_that_change_no_number_may_differ(half_run, tmp_path):
    run = copy_run(half_run, tmp_path)
    summary = train(tiny_config(run, overrides=["train.epochs=2", "train.log_every=1", "data.pipeline=loader",
                                                "train.plot=true"]), resume=str(run), **QUIET)
    assert summary["epochs_done"] == 2 and "config_changes" not in summary


def test_the_cli_flag_allows_and_records_a_change(half_run, tmp_path, capsys):
    import yaml
    run = copy_run(half_run, tmp_path)
    cfg = tiny_config(run, overrides=["train.epochs=2"]).to_dict()
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["train", str(path), "--resume", str(run), "--set", "optim.lr=0.002"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "optim.lr" in err and "--allow-config-change" in err
    assert main(["train", str(path), "--resume", str(run), "--set", "optim.lr=0.002", "--allow-config-change"]) == 0
    out = capsys.readouterr().out
    assert "changed settings" in out and "optim.lr" in out
    assert json.loads((run / "metrics.json").read_text())["config_changes"][0]["changes"][0].startswith("optim.lr")
    assert main(["train", str(path), "--allow-config-change"]) == 2   # only with --resume
    assert "--resume" in capsys.readouterr().err


def test_resuming_a_finished_run_says_there_is_nothing_left_to_train(half_run, tmp_path, capsys):
    run = copy_run(half_run, tmp_path)
    train(tiny_config(run, overrides=["train.epochs=2"]), resume=str(run), **QUIET)   # finishes epoch 2
    before = {p.name: p.read_bytes() for p in (run / "checkpoints").iterdir()}
    lines = []
    summary = train(tiny_config(run, overrides=["train.epochs=2"]), resume=str(run), log=lines.append)
    assert summary["nothing_to_train"] and summary["epochs_done"] == 2
    assert len(lines) == 1 and lines[0].startswith("nothing left to train") and "train.epochs is 2" in lines[0]
    assert {p.name: p.read_bytes() for p in (run / "checkpoints").iterdir()} == before
    import yaml
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_config(run, overrides=["train.epochs=2"]).to_dict()))
    assert main(["train", str(path), "--resume"]) == 0      # the config's own out_dir; documented: exit 0
    out = capsys.readouterr().out
    assert "nothing left to train" in out and "resumed" not in out


def test_a_time_budget_stops_between_epochs_and_resume_finishes(tmp_path, monkeypatch):
    from attnzoo.train import loop
    assert loop.epoch_fits(None, [50.0])
    assert loop.epoch_fits(100.0, [], now=99.0) and not loop.epoch_fits(100.0, [], now=100.0)
    assert loop.epoch_fits(100.0, [5.0, 9.0, 5.0], now=90.0)                # the slowest of the last three...
    assert not loop.epoch_fits(100.0, [5.0, 9.5, 5.0], now=90.0)            # ... plus 10% must fit
    assert loop.epoch_fits(100.0, [50.0, 5.0, 5.0, 5.0], now=90.0)          # older epochs do not count

    cfg = tiny_config(tmp_path / "run", overrides=["train.epochs=3"])
    seen = []
    monkeypatch.setattr(loop, "epoch_fits", lambda deadline, durations: seen.append(len(durations)) or len(durations) < 1)
    summary = train(cfg, deadline=1.0, **QUIET)
    assert summary["stopped_early"] and summary["epochs_done"] == 1 and seen == [0, 1]
    assert load_checkpoint(tmp_path / "run")[1]["epoch"] == 1
    monkeypatch.undo()
    summary = train(cfg, resume=str(tmp_path / "run"), **QUIET)
    assert summary["epochs_done"] == 3 and not summary.get("stopped_early")


def test_a_checkpoint_from_before_a_new_setting_resumes_with_its_default(half_run, tmp_path):
    """Settings a checkpoint predates count as their defaults (what it ran with), not as changes."""
    run = copy_run(half_run, tmp_path)
    weights, state = load_checkpoint(run)
    state = {k: v for k, v in state.items() if k not in ("format", "weights_tensors_sha256")}
    del state["config"]["optim"]["lr_scaling"], state["config"]["train"]["graph"]
    C.save_checkpoint(run / "checkpoints", 1, weights, state)
    summary = train(tiny_config(run, overrides=["train.epochs=2"]), resume=str(run), **QUIET)
    assert summary["epochs_done"] == 2 and "config_changes" not in summary
    with pytest.raises(CheckpointError, match="optim.lr_scaling: checkpoint 'none', config 'sqrt'"):
        train(tiny_config(copy_run(run, tmp_path / "b"), overrides=["train.epochs=3", "optim.lr_scaling=sqrt"]),
              resume=str(tmp_path / "b" / "run"), **QUIET)
