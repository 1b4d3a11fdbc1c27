"""Paper 004's table in one device call: ViT and OT-ViT, three seeds each, on one GPU, within a time
budget, everything returned through $OUT.

    python3 benchmarks/paper_table.py --out "$OUT"          # Fashion-MNIST, 8 minutes in all

Phases (each bounded; a later one still runs when an earlier one fails):
1. env.txt: the GPU, torch, triton, the commit;
2. the data: Fashion-MNIST's four files in --data-dir checked against their sizes and checksums
   (python -m attnzoo.train.fashion_mnist_files copy puts them there before the call);
3. throughput.jsonl: train images/s of each model of the plan at the plan's settings
   (attnzoo.train.throughput on generated images, --throughput-steps steps, CUDA graphs as
   configured), so the speed targets are measured apart from the shared protocol;
4. the protocol: ``attnzoo compare PLAN --parallel N --time-budget S`` (every model's seed 0 first,
   N runs at once sharing the GPU, each stopping after its last epoch that fits); every phase's
   output in log.txt;
5. table.md / table.json / test_curves.png as compare wrote them, summary.json (per run: epochs
   done, final accuracy, images/s, CUDA-graph status; in all: images trained per second of the
   protocol's wall time) and runs.tar.gz (each run's metrics.json, metrics.csv and train.log, no
   checkpoints: untar it at the repository root and carry runs/paper_table to the next call, which
   keeps the finished runs and trains the rest).

On a CPU it runs the same code on tiny settings (the tests do: --set data.synthetic=true ...).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEFAULT_PLAN = "configs/compare/paper004_fashion_mnist.yaml"
RESERVE_S = 60.0   # kept back from the protocol for the end: stragglers' grace, the table, the archive


def _log(*parts) -> None:
    print(*parts, flush=True)


def _run(cmd: list[str], timeout: float, out_file: Path) -> int:
    """Run a command (output appended to ``out_file``, its end echoed), stopped after ``timeout`` s:
    SIGTERM first (``attnzoo compare`` then stops the run processes it started), SIGKILL 30 s later."""
    _log(f"$ {' '.join(cmd)}  (at most {timeout:.0f} s)")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    start = out_file.stat().st_size if out_file.exists() else 0
    with open(out_file, "a") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        try:
            code = proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            out.write(f"\n[stopped after {timeout:.0f} s]\n")
            code = 124
    with open(out_file) as f:
        f.seek(start)
        _log("\n".join(f.read().splitlines()[-15:]))
    return code


def write_env(out: Path, python: str) -> None:
    lines = [time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())]
    for cmd in (["git", "rev-parse", "HEAD"], ["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                                                 "--format=csv,noheader"],
                [python, "-c", "import torch, platform; print('python', platform.python_version(), 'torch', "
                               "torch.__version__, 'cuda', torch.cuda.is_available() and torch.cuda.get_device_name())"],
                [python, "-c", "import triton; print('triton', triton.__version__)"]):
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT)
            lines.append((res.stdout or res.stderr).strip())
        except (OSError, subprocess.TimeoutExpired) as e:
            lines.append(f"{cmd[0]}: {e}")
    (out / "env.txt").write_text("\n".join(lines) + "\n")


def check_data(plan, data_dir: str, out: Path) -> bool:
    """The plan's Fashion-MNIST files verified (other datasets: nothing to check here)."""
    from attnzoo.train import protocol
    datasets = {cfg.data.dataset for _, _, cfg in protocol.configs(plan)}
    synthetic = all(cfg.data.synthetic for _, _, cfg in protocol.configs(plan))
    if synthetic or data_dir is None or datasets != {"fashion_mnist"}:
        return True
    from attnzoo.train.fashion_mnist_files import verify_folder
    try:
        found = verify_folder(Path(data_dir))
    except Exception as e:  # noqa: BLE001 - reported, then the protocol is not started
        _log(f"data: {e}")
        with open(out / "log.txt", "a") as f:
            f.write(f"data check failed: {e}\n")
        return False
    _log(f"data: {data_dir} holds the four Fashion-MNIST files, verified ({sorted(set(found.values()))})")
    return True


def throughput(plan, python: str, device: str, steps: int, timeout: float, out: Path) -> None:
    """Each model of the plan at the plan's settings, alone on the device (one process per distinct
    list of overrides; the paper plans need one)."""
    groups: dict[tuple, list[str]] = {}
    for run in plan.runs:
        groups.setdefault(tuple(plan.overrides + run.overrides), []).append(str(run.config))
    log = out / "throughput.log"
    for overrides, configs in groups.items():
        cmd = [python, "-m", "attnzoo.train.throughput", *configs, "--device", device, "--steps", str(steps),
               "--warmup", str(max(5, steps // 4))]
        for s in overrides:
            cmd += ["--set", s]
        _run(cmd, timeout / len(groups), log)
    rows = [line for line in log.read_text().splitlines() if line.startswith("{") and '"train_images_per_s"' in line]
    (out / "throughput.jsonl").write_text("\n".join(rows) + ("\n" if rows else ""))
    with open(out / "log.txt", "a") as f:   # the measurement's whole output joins the protocol's log
        f.write(log.read_text())
    log.unlink()


def summarise(runs_dir: Path, wall_s: float, started: float) -> dict:
    """Per run: epochs, accuracy, images/s, graph status; in all: images trained in this call per
    second of the protocol's wall time."""
    runs, images = {}, 0.0
    for metrics in sorted(runs_dir.glob("*/metrics.json")):
        data = json.loads(metrics.read_text())
        epochs = data.get("epochs", [])
        speeds = [e["images_per_s"] for e in epochs]
        runs[metrics.parent.name] = {
            "epochs_done": data.get("epochs_done"), "epochs": data["config"]["train"]["epochs"],
            "final_test_acc": data.get("final_test_acc"), "best_test_acc": data.get("best_test_acc"),
            "train_images_per_s_mean": statistics.fmean(speeds) if speeds else None,
            "train_seconds": sum(e["train_time_s"] for e in epochs), "graph": data.get("graph"),
            "partner_overflow_rows": data.get("partner_overflow_rows")}
        if metrics.stat().st_mtime >= started:   # the epochs of this call (earlier calls' runs are kept as they are)
            images += sum(e["images_per_s"] * e["train_time_s"] for e in epochs)
    return {"runs": runs, "protocol_wall_seconds": wall_s,
            "images_per_second_of_wall_time": images / wall_s if wall_s > 0 else None}


def archive(runs_dir: Path, out: Path) -> None:
    """Each run's metrics and log (no checkpoints: too large to come back) as runs.tar.gz."""
    with tarfile.open(out / "runs.tar.gz", "w:gz") as tar:
        for path in sorted(runs_dir.glob("*/*")):
            if path.name in ("metrics.json", "metrics.csv", "train.log"):
                tar.add(path, arcname=str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path))
        for name in ("table.md", "table.json"):
            if (runs_dir / name).is_file():
                tar.add(runs_dir / name, arcname=str((runs_dir / name).relative_to(ROOT)
                                                     if (runs_dir / name).is_relative_to(ROOT) else runs_dir / name))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--plan", default=DEFAULT_PLAN)
    p.add_argument("--data-dir", default="data/fashion-mnist", help="'none': the configs' own data settings")
    p.add_argument("--budget-seconds", type=float, default=480.0, help="the whole script's wall time")
    p.add_argument("--parallel", type=int, default=2, help="runs at once, each a process sharing the GPU")
    p.add_argument("--runs", default="runs/paper_table", help="the runs' folder (carry it to resume in a later call)")
    p.add_argument("--out", default=os.environ.get("OUT") or None, help="results folder (default $OUT, else a temp dir)")
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="default: the plan's")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field of every run (and of the throughput measurement)")
    p.add_argument("--throughput-steps", type=int, default=30, help="0 skips the throughput phase")
    p.add_argument("--device", default="cuda", help="the throughput phase's device (the runs use the configs')")
    p.add_argument("--python", default=sys.executable)
    args = p.parse_args(argv)
    t_start = time.time()
    deadline = t_start + args.budget_seconds
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="paper_table."))
    out.mkdir(parents=True, exist_ok=True)
    runs_dir = Path(args.runs) if Path(args.runs).is_absolute() else ROOT / args.runs
    data_dir = None if args.data_dir == "none" else args.data_dir

    from attnzoo.train import protocol
    plan = protocol.load_plan(ROOT / args.plan if not Path(args.plan).is_absolute() else args.plan)
    if args.seeds:
        plan.seeds = list(dict.fromkeys(args.seeds))
    extra = list(args.overrides) + (["data.data_dir=" + json.dumps(data_dir)] if data_dir else [])
    for r in plan.runs:
        r.overrides = r.overrides + extra
    _log(f"paper table: {plan.title}; {len(plan.runs)} models x seeds {plan.seeds}; budget {args.budget_seconds:.0f} s; "
         f"results in {out}")

    write_env(out, args.python)
    if not check_data(plan, data_dir, out):
        return 2
    if args.throughput_steps > 0:
        throughput(plan, args.python, args.device, args.throughput_steps,
                   min(150.0, max(10.0, (deadline - time.time()) / 4)), out)

    budget = deadline - time.time() - RESERVE_S
    t_protocol = time.time()
    if budget > 10:
        cmd = [args.python, "-m", "attnzoo", "compare", str(args.plan), "--out-dir", str(runs_dir),
               "--parallel", str(args.parallel), "--time-budget", f"{budget:.0f}",
               "--set", "train.progress=false", "--set", "train.plot=false"]
        if args.seeds:
            cmd += ["--seeds", *map(str, plan.seeds)]
        if data_dir:
            cmd += ["--data-dir", data_dir]
        for s in args.overrides:
            cmd += ["--set", s]
        _run(cmd, budget + RESERVE_S - 10, out / "log.txt")
    else:
        _log(f"no time left for the protocol ({budget:.0f} s)")
    wall = time.time() - t_protocol

    for name in ("table.md", "table.json", "test_curves.png"):
        if (runs_dir / name).is_file():
            shutil.copyfile(runs_dir / name, out / name)
    summary = summarise(runs_dir, wall, t_protocol) if runs_dir.is_dir() else {"runs": {}}
    summary["script_wall_seconds"] = time.time() - t_start
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    if runs_dir.is_dir():
        archive(runs_dir, out)
    if (out / "table.md").is_file():
        _log((out / "table.md").read_text())
    _log(json.dumps({k: v for k, v in summary.items() if k != "runs"}))
    _log(f"files in {out}: {' '.join(sorted(p.name for p in out.iterdir()))}")
    return 0 if (out / "table.md").is_file() else 1


if __name__ == "__main__":
    raise SystemExit(main())
