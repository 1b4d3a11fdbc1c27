"""Several models x several seeds, then one table and one PNG: ``attnzoo compare``.

A plan is a YAML file (``configs/compare/*.yaml``) or a list of training configs:

    title: ViT vs OT-ViT on Fashion-MNIST (paper 004, Table 2)
    out_dir: runs/paper004_fashion_mnist
    seeds: [0, 1, 2]
    set: []                      # --set overrides for every run
    level: 0.95                  # confidence level of the intervals
    runs:
      vit:   {config: configs/vit_fashion_mnist.yaml, paper: {mean: 0.928, ci: 0.01}}
      otvit: {config: configs/otvit_fashion_mnist.yaml, set: [], paper: {mean: 0.937, ci: 0.01}}

Each (run, seed) trains into ``out_dir/NAME_seedS``. A run that already finished with the same
settings is kept (seeds can be added later, on another machine, and the table grows); one that
stopped part-way resumes from its last checkpoint (or starts again when its folder holds metrics
but no checkpoint: a folder carried back from another machine without its checkpoints); one with
other settings is an error that names the differing keys. ``table.md`` / ``table.json`` and
``test_curves.png`` are written after every finished run, so an interrupted plan still leaves its
table.

``parallel`` > 1 trains that many runs at once, each in its own process sharing the device (its
output in ``NAME_seedS/train.log``), in the plan's order by seed (every model's seed 0 first), so
that a plan cut short keeps whole seeds. ``deadline`` (a ``time.time()`` value, from
``--time-budget``) stops each run after the last epoch expected to end before it and starts no
run that an earlier run of the same model says cannot finish in time."""
from __future__ import annotations

import itertools
import json
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from .checkpoint import newest_pointer
from .config import TrainConfig, load_config, read_yaml

PLAN_KEYS = {"title", "out_dir", "seeds", "set", "level", "runs"}
RUN_KEYS = {"config", "set", "paper"}
# settings that may differ between the runs of one table without changing what is measured
INCIDENTAL = {("train", "out_dir"), ("train", "progress"), ("train", "plot"), ("train", "device"),
              ("data", "data_dir"), ("data", "download"), ("data", "num_workers"), ("data", "pipeline"),
              ("train", "log_every"), ("data", "verify")}
START_METHOD = "spawn"   # child processes of a parallel plan (spawn: safe with CUDA; the tests use fork)
POLL_SECONDS = 2.0


@dataclass
class PlanRun:
    name: str
    config: Path
    overrides: list[str] = field(default_factory=list)
    paper: Optional[dict] = None


@dataclass
class Plan:
    title: str
    out_dir: Path
    seeds: list[int]
    runs: list[PlanRun]
    overrides: list[str] = field(default_factory=list)
    level: float = 0.95


def _strings(value, key: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{key} must be a list of key=value strings, got {value!r}")
    return list(value)


def _find(path: str, base: Path) -> Path:
    """A config path as written in a plan: relative to the working directory, else to the plan's
    folder or the folder above it (plans live in configs/compare/)."""
    for candidate in (Path(path), base / path, base.parent / path):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"config file {path!r} (named in the plan) not found")


def is_plan(path) -> bool:
    """True for a plan YAML (a mapping with ``runs``), False for a training config."""
    data = read_yaml(path)
    return isinstance(data, dict) and "runs" in data


def load_plan(path) -> Plan:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"plan file {str(path)!r} not found (see configs/compare/*.yaml)")
    data = read_yaml(path)
    unknown = sorted(set(data) - PLAN_KEYS)
    if unknown:
        raise ValueError(f"{path}: unknown plan key(s) {unknown}; known: {sorted(PLAN_KEYS)}")
    runs_data = data.get("runs")
    if not isinstance(runs_data, dict) or not runs_data:
        raise ValueError(f"{path}: runs must map run names to {{config: ..., set: [...], paper: ...}}")
    runs = []
    for name, spec in runs_data.items():
        if not isinstance(spec, dict) or "config" not in spec:
            raise ValueError(f"{path}: runs.{name} needs a config")
        bad = sorted(set(spec) - RUN_KEYS)
        if bad:
            raise ValueError(f"{path}: unknown key(s) {bad} in runs.{name}; known: {sorted(RUN_KEYS)}")
        paper = spec.get("paper")
        if paper is not None and not (isinstance(paper, dict) and isinstance(paper.get("mean"), (int, float))):
            raise ValueError(f"{path}: runs.{name}.paper must be {{mean: number, ci: number}}, got {paper!r}")
        runs.append(PlanRun(str(name), _find(spec["config"], path.parent), _strings(spec.get("set"), f"runs.{name}.set"),
                            paper))
    seeds = data.get("seeds", [0])
    if not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds):
        raise ValueError(f"{path}: seeds must be a non-empty list of integers, got {seeds!r}")
    level = data.get("level", 0.95)
    if not isinstance(level, (int, float)) or not 0 < level < 1:
        raise ValueError(f"{path}: level must be in (0, 1), got {level!r}")
    return Plan(str(data.get("title", path.stem)), Path(data.get("out_dir", f"runs/{path.stem}")), list(seeds),
                runs, _strings(data.get("set"), "set"), float(level))


VARY_HINT = ("to compare variants of one config, pass it once with one --vary per variant, e.g. --vary "
             "model.attention=softmax --vary model.attention=sigmoid, or write a plan (configs/compare/*.yaml) "
             "naming each run and its set: overrides")


def plan_from_configs(paths: list[str], out_dir: Optional[str] = None, vary: Optional[list[str]] = None) -> Plan:
    """A plan of training configs, each run named after its file. ``vary``: ``KEY=VALUE`` overrides;
    each value of a key gives every config one run per value (several keys: every combination),
    named ``FILE-VALUE`` (``vit_fashion_mnist-sigmoid``)."""
    options = _vary_options(vary or [])
    runs = []
    for path in paths:
        for choice in itertools.product(*options.values()):
            overrides = [f"{key}={value}" for key, value in zip(options, choice)]
            runs.append(PlanRun("-".join([Path(path).stem, *map(_name_part, choice)]), Path(path), overrides))
    names = [r.name for r in runs]
    if len(set(names)) != len(names):
        repeated = sorted({n for n in names if names.count(n) > 1})
        if vary:
            raise ValueError(f"--vary gives two runs one name ({repeated}): their values differ only in characters "
                             "a folder name drops; write a plan (configs/compare/*.yaml) naming each run")
        raise ValueError(f"two configs share a file name ({repeated}), and a run is named after its config's file; "
                         f"{VARY_HINT}")
    return Plan(" vs ".join(names), Path(out_dir or "runs/compare"), [0], runs)


def _vary_options(vary: list[str]) -> dict[str, list[str]]:
    """``["model.attention=softmax", "model.attention=relu"]`` -> {"model.attention": ["softmax", "relu"]}."""
    options: dict[str, list[str]] = {}
    for item in vary:
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise ValueError(f"--vary expects KEY=VALUE (e.g. model.attention=sigmoid), got {item!r}")
        values = options.setdefault(key.strip(), [])
        if value in values:
            raise ValueError(f"--vary {item} is given twice")
        values.append(value)
    return options


def _name_part(value: str) -> str:
    """A --vary value as part of a run's folder name: letters, digits, '.' and '_' kept, any other run
    of characters one '-' ("sinkhorn(n_iters=5, eps=0.5)" -> "sinkhorn-n_iters-5-eps-0.5")."""
    return re.sub(r"[^A-Za-z0-9._]+", "-", value).strip("-") or "empty"


def run_dir(plan: Plan, name: str, seed: int) -> Path:
    return plan.out_dir / f"{name}_seed{seed}"


def configs(plan: Plan) -> list[tuple[PlanRun, int, TrainConfig]]:
    """Every (run, seed, config), loaded and checked before anything trains."""
    out = []
    for run in plan.runs:
        for seed in plan.seeds:
            extra = plan.overrides + run.overrides + [f"train.seed={seed}",
                                                      f"train.out_dir={json.dumps(str(run_dir(plan, run.name, seed)))}"]
            try:
                out.append((run, seed, load_config(run.config, extra)))
            except ValueError as e:
                raise ValueError(f"{run.name} (seed {seed}): {e}") from None
    return out


def _differences(a: dict, b: dict) -> list[str]:
    return [f"{section}.{key}: {a.get(section, {}).get(key)!r} -> {b.get(section, {}).get(key)!r}"
            for section in sorted(set(a) | set(b)) for key in sorted(set(a.get(section, {})) | set(b.get(section, {})))
            if (section, key) not in INCIDENTAL and a.get(section, {}).get(key) != b.get(section, {}).get(key)]


def status(cfg: TrainConfig) -> str:
    """``done``, ``partial`` (resume it) or ``new`` for a planned run's folder."""
    folder = Path(cfg.train.out_dir)
    metrics = folder / "metrics.json"
    if not metrics.is_file():
        return "partial" if newest_pointer(folder) is not None else "new"
    saved = json.loads(metrics.read_text())
    diffs = _differences(saved.get("config", {}), cfg.to_dict())
    if diffs:
        raise ValueError(f"{folder} holds a run with other settings ({'; '.join(diffs)}); "
                         f"move it away or choose another --out-dir")
    return "done" if saved.get("epochs_done", 0) >= cfg.train.epochs else "partial"


def _resume_from(cfg: TrainConfig, state: str, log) -> Optional[str]:
    """The checkpoint a ``partial`` run resumes from; None (train from the start) when its folder
    holds metrics but no checkpoint (carried from another machine without them)."""
    if state != "partial":
        return None
    if newest_pointer(cfg.train.out_dir) is not None:
        return cfg.train.out_dir
    log(f"{cfg.train.out_dir}: metrics but no checkpoint to resume from: training from the first epoch")
    return None


def _progress(total: int):
    from tqdm.auto import tqdm
    return tqdm(total=total, desc="protocol", unit="epoch", dynamic_ncols=True, file=sys.stderr,
                mininterval=1.0 if sys.stderr.isatty() else 30.0)


def _epochs_done(cfg: TrainConfig) -> int:
    metrics = Path(cfg.train.out_dir) / "metrics.json"
    try:
        return int(json.loads(metrics.read_text()).get("epochs_done", 0))
    except (OSError, ValueError):
        return 0


def run_plan(plan: Plan, log: Callable[..., None] = print, train_fn: Optional[Callable] = None,
             report_only: bool = False, parallel: int = 1, deadline: Optional[float] = None) -> dict:
    """Train every (run, seed) that is not done yet (``parallel`` at a time, until ``deadline``),
    then write the table and the curves."""
    from .loop import train
    train_fn = train_fn or train
    if parallel < 1:
        raise ValueError(f"parallel must be >= 1, got {parallel}")
    planned = configs(plan)
    states = [status(cfg) for _, _, cfg in planned]
    todo = []
    for (run, seed, cfg), state in zip(planned, states):
        if state == "done":
            log(f"{run.name} seed {seed}: done already ({cfg.train.out_dir})")
        elif not report_only:
            resume = _resume_from(cfg, state, log)
            todo.append((run, seed, cfg, resume, _epochs_done(cfg) if resume else 0))
    todo.sort(key=lambda item: (plan.seeds.index(item[1]), [r.name for r in plan.runs].index(item[0].name)))
    if todo:
        bar = _progress(sum(cfg.train.epochs for _, _, cfg, _, _ in todo))
        bar.update(sum(start for *_, start in todo))
        try:
            if parallel == 1:
                _run_in_process(plan, todo, log, train_fn, deadline, bar)
            else:
                _run_in_processes(plan, todo, log, parallel, deadline, bar)
        finally:
            bar.close()
    return report(plan)


def _time_left(deadline: Optional[float], estimate: Optional[float]) -> bool:
    """Whether a run expected to take ``estimate`` seconds (None: unknown) can start before ``deadline``."""
    if deadline is None:
        return True
    now = time.time()
    return now < deadline and (estimate is None or now + estimate < deadline)


def _run_in_process(plan, todo, log, train_fn, deadline, bar) -> None:
    took: dict[str, float] = {}
    for run, seed, cfg, resume, start in todo:
        if not _time_left(deadline, took.get(run.name)):
            log(f"{run.name} seed {seed}: not started, the time budget is spent")
            continue
        log(f"{run.name} seed {seed}: {'resuming' if resume else 'training'} -> {cfg.train.out_dir}")
        t0 = time.time()
        kwargs = {} if deadline is None else {"deadline": deadline}
        summary = train_fn(cfg, resume=resume, log=log, on_epoch=lambda row: bar.update(1), **kwargs)
        if summary and not summary.get("stopped_early"):
            took[run.name] = _full_run_seconds(time.time() - t0, start, cfg.train.epochs)
        _report_so_far(plan)


def _full_run_seconds(elapsed: float, start: int, epochs: int) -> float:
    """A whole run's expected duration from one that trained epochs start+1..epochs in ``elapsed``."""
    return elapsed * epochs / max(1, epochs - start)


def _report_so_far(plan: Plan) -> None:
    try:
        report(plan)
    except ValueError:  # no run has metrics yet
        pass


def _child(cfg_dict: dict, resume: Optional[str], deadline: Optional[float], log_path: str) -> None:
    """One run in its own process, its output in ``log_path``."""
    import os
    Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a", buffering=1) as out:
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
        sys.stdout = sys.stderr = out
        from .config import from_dict
        from .loop import train
        train(from_dict(cfg_dict), resume=resume, deadline=deadline)


def _run_in_processes(plan, todo, log, parallel, deadline, bar, grace: float = 60.0) -> None:
    """Up to ``parallel`` runs at once, each a child process sharing the device. A child still running
    ``grace`` seconds past the deadline is stopped (its last finished epoch is in its checkpoint)."""
    import multiprocessing as mp
    import signal
    import threading
    ctx = mp.get_context(START_METHOD)
    waiting, running, took, seen = list(todo), {}, {}, {}

    def stop(signum, frame):  # SIGTERM (a timeout around this command): stop the runs started here first
        raise SystemExit(128 + signum)
    previous = signal.signal(signal.SIGTERM, stop) if threading.current_thread() is threading.main_thread() else None
    try:
        while waiting or running:
            while waiting and len(running) < parallel:
                run, seed, cfg, resume, start = waiting.pop(0)
                if not _time_left(deadline, took.get(run.name)):
                    log(f"{run.name} seed {seed}: not started, the time budget is spent")
                    continue
                log_path = Path(cfg.train.out_dir) / "train.log"
                log(f"{run.name} seed {seed}: {'resuming' if resume else 'training'} -> {cfg.train.out_dir} "
                    f"(process; output in {log_path})")
                proc = ctx.Process(target=_child, args=(cfg.to_dict(), resume, deadline, str(log_path)),
                                   name=f"{run.name}_seed{seed}")
                proc.start()
                running[proc] = (run, seed, cfg, start, time.time())
                seen[proc] = _epochs_done(cfg)
            time.sleep(POLL_SECONDS)
            for proc, (run, seed, cfg, start, t0) in list(running.items()):
                now_done = _epochs_done(cfg)
                bar.update(max(0, now_done - seen[proc]))
                seen[proc] = max(seen[proc], now_done)
                if proc.is_alive():
                    if deadline is not None and time.time() > deadline + grace:
                        log(f"{run.name} seed {seed}: still running {grace:.0f} s past the time budget: stopped")
                        proc.terminate()
                        proc.join(30)
                    continue
                proc.join()
                del running[proc]
                done = _epochs_done(cfg) >= cfg.train.epochs
                if proc.exitcode != 0:
                    log(f"{run.name} seed {seed}: process ended with exit code {proc.exitcode} (see "
                        f"{Path(cfg.train.out_dir) / 'train.log'})")
                elif done:
                    took[run.name] = _full_run_seconds(time.time() - t0, start, cfg.train.epochs)
                log(f"{run.name} seed {seed}: {'finished' if done else 'stopped'} after epoch {_epochs_done(cfg)}")
                _report_so_far(plan)
    finally:
        for proc in running:
            if proc.is_alive():
                proc.terminate()
                proc.join(30)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def report(plan: Plan) -> dict:
    """table.md, table.json and test_curves.png from the runs that have metrics so far."""
    from .checkpoint import _atomic_write
    from .compare import seed_table
    from .metrics import plot_seed_curves
    groups, histories, missing = {}, {}, []
    for run in plan.runs:
        for seed in plan.seeds:
            metrics = run_dir(plan, run.name, seed) / "metrics.json"
            if metrics.is_file():
                data = json.loads(metrics.read_text())
                groups.setdefault(run.name, []).append(data)
                histories.setdefault(run.name, []).append(data["epochs"])
            else:
                missing.append(f"{run.name}_seed{seed}")
    if not groups:
        raise ValueError(f"no finished run under {plan.out_dir}: nothing to tabulate")
    table = seed_table(groups, {r.name: r.paper for r in plan.runs if r.paper}, plan.level)
    split = "/".join(sorted({e for r in table["rows"] for e in r["evaluated_on"]}))
    partial = sorted(f"{n}_seed{g['config']['train']['seed']}" for n, runs in groups.items() for g in runs
                     if g["epochs_done"] < g["config"]["train"]["epochs"])
    notes = []
    if missing:
        notes.append(f"not run yet: {', '.join(missing)}")
    if partial:
        notes.append(f"still training (last epoch so far): {', '.join(partial)}")
    text = (f"# {plan.title}\n\nFinal {split} accuracy after the last epoch, mean over seeds with the "
            f"{plan.level:.0%} confidence interval of the mean (Student's t); differences with Welch's interval.\n\n"
            + table["markdown"] + "".join(f"\n{n}\n" for n in notes))
    plan.out_dir.mkdir(parents=True, exist_ok=True)
    _atomic_write(plan.out_dir / "table.md", lambda p: Path(p).write_text(text))
    _atomic_write(plan.out_dir / "table.json",
                  lambda p: Path(p).write_text(json.dumps({"title": plan.title, **table, "missing": missing,
                                                           "partial": partial}, indent=2)))
    plot_seed_curves(histories, plan.out_dir / "test_curves.png", title=plan.title, split=split)
    return {**table, "text": text, "missing": missing, "partial": partial}
