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
stopped part-way resumes from its last checkpoint; one with other settings is an error that names
the differing keys. ``table.md`` / ``table.json`` and ``test_curves.png`` are written after every
finished run, so an interrupted plan still leaves its table."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import yaml

from .config import TrainConfig, load_config

PLAN_KEYS = {"title", "out_dir", "seeds", "set", "level", "runs"}
RUN_KEYS = {"config", "set", "paper"}
# settings that may differ between the runs of one table without changing what is measured
INCIDENTAL = {("train", "out_dir"), ("train", "progress"), ("train", "plot"), ("train", "device"),
              ("data", "data_dir"), ("data", "download"), ("data", "num_workers"), ("data", "pipeline"),
              ("train", "log_every")}


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
    with open(path) as f:
        data = yaml.safe_load(f) or {}
    return isinstance(data, dict) and "runs" in data


def load_plan(path) -> Plan:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"plan file {str(path)!r} not found (see configs/compare/*.yaml)")
    with open(path) as f:
        data = yaml.safe_load(f) or {}
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


def plan_from_configs(paths: list[str], out_dir: Optional[str] = None) -> Plan:
    """A plan of training configs, each run named after its file."""
    runs = [PlanRun(Path(p).stem, Path(p)) for p in paths]
    names = [r.name for r in runs]
    if len(set(names)) != len(names):
        raise ValueError(f"two configs share a file name: {names}")
    return Plan(" vs ".join(names), Path(out_dir or "runs/compare"), [0], runs)


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
        return "partial" if (folder / "checkpoints" / "last.json").is_file() else "new"
    saved = json.loads(metrics.read_text())
    diffs = _differences(saved.get("config", {}), cfg.to_dict())
    if diffs:
        raise ValueError(f"{folder} holds a run with other settings ({'; '.join(diffs)}); "
                         f"move it away or choose another --out-dir")
    return "done" if saved.get("epochs_done", 0) >= cfg.train.epochs else "partial"


def run_plan(plan: Plan, log: Callable[..., None] = print, train_fn: Optional[Callable] = None,
             report_only: bool = False) -> dict:
    """Train every (run, seed) that is not done yet, then write the table and the curves."""
    from .loop import train
    train_fn = train_fn or train
    planned = configs(plan)
    states = [status(cfg) for _, _, cfg in planned]
    if not report_only:
        for (run, seed, cfg), state in zip(planned, states):
            if state == "done":
                log(f"{run.name} seed {seed}: done already ({cfg.train.out_dir})")
                continue
            log(f"{run.name} seed {seed}: {'resuming' if state == 'partial' else 'training'} -> {cfg.train.out_dir}")
            train_fn(cfg, resume=cfg.train.out_dir if state == "partial" else None, log=log)
            report(plan)
    return report(plan)


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
