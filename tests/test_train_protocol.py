"""The protocol on one device (issue 22): several runs at once as processes sharing the device,
a time budget that keeps finished seeds and resumes the rest exactly, the paired difference, and
the one device command (benchmarks/paper_table.py) on tiny CPU settings."""
from __future__ import annotations

import json
import sys
import tarfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from attnzoo.cli import main
from attnzoo.train import protocol
from attnzoo.train.compare import paired_difference

from .train_helpers import no_system_datasets  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("one_thread", "no_system_datasets")
ROOT = Path(__file__).resolve().parents[1]
TINY = ["model.embed_dim=16", "model.depth=1", "model.num_heads=2", "data.synthetic=true",
        "data.synthetic_train_size=20", "data.synthetic_test_size=12", "train.epochs=2", "train.batch_size=8",
        "train.eval_batch_size=8", "train.progress=false", "train.device=cpu", "train.plot=false",
        "data.augment=true", "train.threads=1"]
QUIET = lambda *a, **k: None  # noqa: E731


def _plan(out_dir, seeds=(0, 1), path="configs/compare/paper004_fashion_mnist.yaml"):
    plan = protocol.load_plan(path)
    plan.out_dir, plan.seeds = Path(out_dir), list(seeds)
    for r in plan.runs:
        r.overrides += TINY
    return plan


def _finals(out_dir):
    return {p.parent.name: json.loads(p.read_text())["epochs"] for p in sorted(Path(out_dir).glob("*/metrics.json"))}


def _same_numbers(a, b):
    strip = lambda rows: [{k: v for k, v in r.items() if k not in ("train_time_s", "images_per_s")} for r in rows]  # noqa: E731
    assert a.keys() == b.keys()
    for name in a:
        assert strip(a[name]) == strip(b[name]), name


def test_paired_difference_is_students_t_on_the_seed_differences():
    from scipy.stats import ttest_rel
    vit = {0: 0.91, 1: 0.93, 2: 0.92, 3: 0.90}
    ot = {0: 0.92, 1: 0.95, 2: 0.925, 4: 0.99}                 # seed 4 has no partner: left out
    mean, half, seeds = paired_difference(vit, ot)
    lo, hi = ttest_rel([ot[s] for s in (0, 1, 2)], [vit[s] for s in (0, 1, 2)]).confidence_interval(0.95)
    assert seeds == [0, 1, 2] and mean == pytest.approx((lo + hi) / 2) and half == pytest.approx((hi - lo) / 2)
    assert paired_difference({0: 0.5}, {1: 0.6}) == (None, None, [])
    assert paired_difference({0: 0.5}, {0: 0.6})[1] is None


def test_runs_as_parallel_processes_give_the_in_process_numbers(tmp_path, monkeypatch):
    """Two runs at a time, each in its own process (fork here, to skip re-importing torch; the
    command uses spawn): the same metrics as one after the other in this process, each run's
    output in its train.log, the table with the paired difference."""
    protocol.run_plan(_plan(tmp_path / "seq"), log=QUIET)
    monkeypatch.setattr(protocol, "START_METHOD", "fork")
    monkeypatch.setattr(protocol, "POLL_SECONDS", 0.2)
    lines = []
    result = protocol.run_plan(_plan(tmp_path / "par"), log=lambda *a: lines.append(" ".join(map(str, a))),
                               parallel=2)
    _same_numbers(_finals(tmp_path / "seq"), _finals(tmp_path / "par"))
    assert all((tmp_path / "par" / f"{m}_seed{s}" / "train.log").read_text() for m in ("vit", "otvit") for s in (0, 1))
    started = [line.split(":")[0] for line in lines if "(process; output in" in line]
    assert started == ["vit seed 0", "otvit seed 0", "vit seed 1", "otvit seed 1"]   # whole seeds first
    row = {r["name"]: r for r in result["rows"]}["otvit"]
    assert row["paired_seeds"] == [0, 1] and "paired by seed" in (tmp_path / "par" / "table.md").read_text()


def test_a_cut_off_plan_keeps_finished_runs_and_resumes_exactly(tmp_path, monkeypatch):
    """The budget runs out during otvit seed 0's second epoch: vit seed 0 is finished, otvit seed 0
    stops with its checkpoint after epoch 1, seed 1 is not started; the table shows what is done.
    Running the plan again resumes otvit seed 0 from its checkpoint and trains seed 1: the numbers
    are those of an uninterrupted plan."""
    from attnzoo.train import loop
    protocol.run_plan(_plan(tmp_path / "straight"), log=QUIET)
    epochs = {"n": 0}

    def three_epochs_fit(deadline, durations):
        epochs["n"] += 1
        return epochs["n"] <= 3
    monkeypatch.setattr(loop, "epoch_fits", three_epochs_fit)
    lines = []
    cut = protocol.run_plan(_plan(tmp_path / "cut"), log=lambda *a: lines.append(" ".join(map(str, a))),
                            deadline=4e9)
    monkeypatch.undo()
    assert json.loads((tmp_path / "cut" / "vit_seed0" / "metrics.json").read_text())["epochs_done"] == 2
    assert json.loads((tmp_path / "cut" / "otvit_seed0" / "metrics.json").read_text())["epochs_done"] == 1
    assert not (tmp_path / "cut" / "vit_seed1" / "metrics.json").exists()
    assert cut["partial"] == ["otvit_seed0"] and "still training" in cut["text"]
    assert any(line.startswith("vit seed 1: training") for line in lines)   # it started, and stopped at once
    lines.clear()
    protocol.run_plan(_plan(tmp_path / "cut"), log=lambda *a: lines.append(" ".join(map(str, a))))
    assert any(line.startswith("otvit seed 0: resuming") for line in lines)
    assert any(line.startswith("vit seed 0: done already") for line in lines)
    _same_numbers(_finals(tmp_path / "straight"), _finals(tmp_path / "cut"))
    for name in ("otvit_seed0", "vit_seed1"):
        a, b = (load_file(str(tmp_path / d / name / "checkpoints" / "epoch0002.safetensors")) for d in ("straight", "cut"))
        assert all(torch.equal(a[k], b[k]) for k in a), name


def test_a_run_carried_without_its_checkpoints_starts_again(tmp_path, monkeypatch):
    from attnzoo.train import loop
    plan = _plan(tmp_path, seeds=[0])
    plan.runs = plan.runs[:1]
    monkeypatch.setattr(loop, "epoch_fits", lambda deadline, durations: not durations)
    protocol.run_plan(plan, log=QUIET, deadline=4e9)
    monkeypatch.undo()
    import shutil
    shutil.rmtree(tmp_path / "vit_seed0" / "checkpoints")          # what a device call brings back
    assert protocol.status(protocol.configs(plan)[0][2]) == "partial"
    lines = []
    protocol.run_plan(plan, log=lambda *a: lines.append(" ".join(map(str, a))))
    assert any("no checkpoint to resume from: training from the first epoch" in line for line in lines)
    assert json.loads((tmp_path / "vit_seed0" / "metrics.json").read_text())["epochs_done"] == 2


def test_no_run_starts_that_cannot_finish(tmp_path):
    import time
    assert protocol._time_left(None, 1e9) and protocol._time_left(time.time() + 100, None)
    assert not protocol._time_left(time.time() + 100, 200.0) and not protocol._time_left(time.time() - 1, None)
    lines = []
    protocol._run_in_process(_plan(tmp_path), [(r, 0, cfg, None, 0) for r, _, cfg in protocol.configs(_plan(tmp_path))],
                             lambda *a: lines.append(" ".join(map(str, a))), None, time.time() - 1, _NoBar())
    assert len(lines) == 4 and all("not started, the time budget is spent" in line for line in lines)
    assert not list(tmp_path.glob("*/metrics.json"))


class _NoBar:
    def update(self, n):
        pass


@pytest.mark.parametrize("argv,match", [(["--parallel", "0"], "--parallel"), (["--time-budget", "-5"], "--time-budget")])
def test_bad_protocol_options_are_one_line(tmp_path, capsys, argv, match):
    assert main(["compare", "configs/compare/paper004_cifar10.yaml", "--out-dir", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err
    assert match in err and err.count("\n") == 1


def test_the_device_command_runs_on_cpu_with_tiny_settings(tmp_path):
    """benchmarks/paper_table.py end to end on the CIFAR-100 plan with generated CIFAR-shaped data:
    the throughput phase and the protocol as subprocesses (one run at a time here: each spawned
    run process re-imports torch, seconds on a CI machine; the processes themselves are tested
    above), and the eight files it returns through $OUT."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import paper_table
    out, runs = tmp_path / "out", tmp_path / "runs"
    args = ["--plan", "configs/compare/paper004_cifar100.yaml", "--data-dir", "none", "--budget-seconds", "400",
            "--parallel", "1", "--runs", str(runs), "--out", str(out), "--seeds", "0", "--device", "cpu",
            "--throughput-steps", "1"]
    for s in TINY + ["train.epochs=1"]:
        args += ["--set", s]
    assert paper_table.main(args) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["env.txt", "log.txt", "runs.tar.gz", "summary.json", "table.json", "table.md", "test_curves.png",
         "throughput.jsonl"])
    speeds = [json.loads(line) for line in (out / "throughput.jsonl").read_text().splitlines()]
    assert [r["model"] for r in speeds] == ["vit", "otvit"] and all(r["batch_size"] == 8 for r in speeds)
    assert all(r["dataset"] == "cifar100" and r["train_images_per_s"] > 0 for r in speeds)
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["runs"]) == {"vit_seed0", "otvit_seed0"}
    assert all(r["epochs_done"] == 1 and r["graph"] == "off" for r in summary["runs"].values())
    assert summary["images_per_second_of_wall_time"] > 0
    table = json.loads((out / "table.json").read_text())
    assert [r["name"] for r in table["rows"]] == ["vit", "otvit"] and table["rows"][1]["paired_seeds"] == [0]
    with tarfile.open(out / "runs.tar.gz") as tar:
        names = tar.getnames()
    assert any(n.endswith("vit_seed0/metrics.json") for n in names) and not any("checkpoints" in n for n in names)
    assert "otvit seed 0: training" in (out / "log.txt").read_text()


def _sleeping_child(cfg_dict, resume, deadline, log_path):
    import time
    Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    Path(log_path).write_text("started\n")
    time.sleep(600)   # ended by the parent long before


def test_sigterm_stops_the_run_processes_it_started(tmp_path, monkeypatch):
    """A timeout around ``attnzoo compare --parallel`` sends SIGTERM: the runs it started are ended
    too (none is left on the GPU machine), and the signal handler is put back."""
    import os
    import signal
    import threading
    import time
    monkeypatch.setattr(protocol, "START_METHOD", "fork")
    monkeypatch.setattr(protocol, "POLL_SECONDS", 0.1)
    monkeypatch.setattr(protocol, "_child", _sleeping_child)
    plan = _plan(tmp_path)
    todo = [(r, s, cfg, None, 0) for r, s, cfg in protocol.configs(plan)]
    started, procs = [], []

    def send_term_when_running():
        for _ in range(4000):       # up to 200 s on a loaded machine; a second or two usually
            logs = list(tmp_path.glob("*/train.log"))
            if len(logs) == 2:      # both run processes are up
                started.extend(logs)
                os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(0.05)
    before = signal.getsignal(signal.SIGTERM)
    threading.Thread(target=send_term_when_running, daemon=True).start()
    import multiprocessing as mp
    real_ctx = mp.get_context

    def recording_ctx(method):
        ctx = real_ctx(method)

        class Ctx:
            def Process(self, *a, **k):
                proc = ctx.Process(*a, **k)
                procs.append(proc)
                return proc
        return Ctx()
    monkeypatch.setattr(mp, "get_context", recording_ctx)
    t0 = time.time()
    with pytest.raises(SystemExit):
        protocol._run_in_processes(plan, todo, QUIET, 2, None, _NoBar())
    assert len(started) == 2 and len(procs) == 2 and time.time() - t0 < 300
    assert not any(p.is_alive() for p in procs)
    assert signal.getsignal(signal.SIGTERM) == before
