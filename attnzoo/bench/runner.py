"""Run the benchmark grid and collect one record per (variant, backend, N, dtype, mode).

Nothing here raises for a combination that cannot run: unsupported (with the dispatcher's reason),
unavailable (library not installed), out of memory, skipped (predicted too slow or too large) and
errors are all recorded as rows with a status and a reason.
"""
from __future__ import annotations

import datetime
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

from . import environment, errors
from .baselines import anchor, baseline_targets
from .flops import BACKWARD_RULE, FORMULAS, MODES, Shape, flops
from .memory import estimate_reference_bytes, memory_method, peak_memory_bytes, timed_peak_cpu
from .problem import Problem
from .targets import attnzoo_targets, parse_variant
from .timing import summarize, time_cpu, time_cuda

SCHEMA = "attnzoo.bench/1"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}
DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16",
                 "fp64": "float64", "double": "float64"}


def dtype_name(name: str) -> str:
    """Canonical dtype name ("bf16" -> "bfloat16"); ValueError naming the choices otherwise."""
    canonical = DTYPE_ALIASES.get(str(name).lower(), str(name).lower())
    if canonical not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)} (or {list(DTYPE_ALIASES)}), got {name!r}")
    return canonical
ALL_VARIANTS = ("softmax", "l2", "sinkhorn", "sigmoid", "relu", "linear", "masked", "multihead", "fenchel", "ot")


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class BenchConfig:
    variants: list[str] = field(default_factory=lambda: list(ALL_VARIANTS))
    backends: Optional[list[str]] = None      # None: every attnzoo backend, "auto" and every baseline
    seq_lens: list[int] = field(default_factory=lambda: [256, 1024])
    dtypes: list[str] = field(default_factory=lambda: ["float32"])
    modes: list[str] = field(default_factory=lambda: ["fwd", "fwd+bwd"])
    batch_tokens: int = 16384                 # batch = max(1, batch_tokens // N)
    head_dim: int = 64
    heads: list[int] = field(default_factory=lambda: [1])
    causal: bool = False
    device: str = "cpu"
    warmup: int = 1
    min_repeats: int = 3
    max_repeats: int = 10
    target_seconds: float = 1.0               # CPU: repeats chosen to fill about this long per row
    max_call_seconds: float = 10.0            # predicted slower than this per call: skipped
    once_above_seconds: float = 2.0           # CPU: a call slower than this is timed once (its warm-up)
    budget_seconds: Optional[float] = None    # once the run has taken this long, the remaining rows are skipped
    max_memory_gb: Optional[float] = None     # CPU reference calls estimated above this: skipped
    measure_memory: bool = True
    seed: int = 0
    notes: str = ""

    def validate(self) -> "BenchConfig":
        for spec in self.variants:
            parse_variant(spec)
        for name, values in (("seq_lens", self.seq_lens), ("heads", self.heads)):
            if not values or any(not isinstance(x, int) or isinstance(x, bool) or x < 1 for x in values):
                raise ValueError(f"{name} must be a non-empty list of ints >= 1, got {values!r}")
        if not self.dtypes:
            raise ValueError("dtypes must name at least one dtype")
        self.dtypes = [dtype_name(d) for d in self.dtypes]
        for m in self.modes:
            if m not in MODES:
                raise ValueError(f"mode must be one of {MODES}, got {m!r}")
        for name in ("max_call_seconds", "once_above_seconds", "target_seconds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        for name in ("batch_tokens", "head_dim", "warmup", "min_repeats", "max_repeats"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.max_repeats < self.min_repeats:
            raise ValueError(f"max_repeats ({self.max_repeats}) must be >= min_repeats ({self.min_repeats})")
        torch.device(self.device)
        return self


def _available_memory_bytes() -> Optional[int]:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _memory_limit(config: BenchConfig) -> float:
    if config.max_memory_gb is not None:
        return config.max_memory_gb * 2 ** 30
    available = _available_memory_bytes()
    return 0.5 * available if available else math.inf


def _problems(config: BenchConfig):
    device = torch.device(config.device)
    for heads in config.heads:
        for n in sorted(config.seq_lens):
            for dtype in config.dtypes:
                for mode in config.modes:
                    shape = Shape(batch=max(1, config.batch_tokens // n), heads=heads, seq_q=n,
                                  head_dim=config.head_dim)
                    yield Problem(shape, DTYPES[dtype], device, mode, config.causal, config.seed)


def plan(config: BenchConfig) -> list:
    """[(problem, target)] in run order. First pass: per problem the SDPA anchors and every variant's
    "auto" (what a user gets; its backend's row later reuses the measurement); second pass: every other
    backend and baseline. Within a pass N grows (a row's time at N is predicted from the previous N),
    so when a time budget runs out it is the alternatives at the largest N that are lost first."""
    specs = [parse_variant(v) for v in config.variants]
    device = torch.device(config.device)
    targets = []
    for spec in specs:
        targets += attnzoo_targets(spec, config.backends) + baseline_targets(spec, device, config.backends)
    anchors = [anchor(c) for c in sorted({s.causal(config.causal) for s in specs} | {config.causal})]
    first = anchors + [t for t in targets if t.backend == "auto"]
    second = [t for t in targets if t.backend != "auto"]
    out = []
    problems = list(_problems(config))
    seen = set()
    for group in (first, second):
        for problem in problems:
            for t in group:
                key = (problem.key(), t.variant, t.backend)
                if key not in seen:
                    seen.add(key)
                    out.append((problem, t))
    return out


class Runner:
    def __init__(self, config: BenchConfig):
        self.config = config.validate()
        self.device = torch.device(config.device)
        self.memory_limit = _memory_limit(config)
        self.cache: dict[tuple, dict] = {}       # cache_key -> measured fields (shared by "auto")
        self.history: dict[tuple, tuple] = {}    # same row at the previous N -> (flops, median s)

    def _time(self, step: Callable[[], None]):
        c = self.config
        if self.device.type == "cuda":
            return time_cuda(step)
        return time_cpu(step, warmup=c.warmup, min_repeats=c.min_repeats, max_repeats=c.max_repeats,
                        target_seconds=c.target_seconds, once_above_seconds=c.once_above_seconds)

    def measure(self, problem: Problem, target, elapsed: float = 0.0) -> dict:
        spec, s = target.spec, problem.shape
        causal = spec.causal(problem.causal)
        row = {
            "variant": target.variant, "backend": target.backend, "kind": target.kind,
            "seq_len": s.seq_q, "batch": s.batch, "heads": s.heads, "head_dim": s.head_dim,
            "dtype": str(problem.dtype).replace("torch.", ""), "mode": problem.mode, "causal": causal,
            "status": errors.OK, "reason": None, "resolved_backend": None, "shared_with": None,
            "flops": flops(spec.name, s, problem.mode, causal=causal, **spec.flop_kwargs()),
            "time_s": None, "tflops": None, "tokens_per_s": None, "peak_memory_bytes": None,
            "ratio_time_vs_sdpa": None, "ratio_memory_vs_sdpa": None,
        }
        budget = self.config.budget_seconds
        if budget is not None and elapsed > budget:
            return {**row, "status": errors.SKIPPED,
                    "reason": f"the run's time budget (budget_seconds={budget:g}) was used up before this row"}
        try:
            prepared = target.prepare(problem)
        except errors.Unsupported as e:
            return {**row, "status": errors.UNSUPPORTED, "reason": errors.short(e)}
        except errors.Unavailable as e:
            return {**row, "status": errors.UNAVAILABLE, "reason": errors.short(e)}
        except errors.Skipped as e:
            return {**row, "status": errors.SKIPPED, "reason": errors.short(e)}
        except Exception as e:  # noqa: BLE001 - recorded, never fatal
            status, reason = errors.classify(e)
            errors.free_cached_memory(self.device)
            return {**row, "status": status, "reason": reason}
        row["resolved_backend"] = prepared.resolved
        if prepared.cache_key in self.cache:
            shared = self.cache[prepared.cache_key]
            if shared.get("time_s"):  # this row's own history too: it predicts this row at the next N
                self.history[self._history_key(problem, target, causal)] = (row["flops"], shared["time_s"]["median"])
            return {**row, **{k: v for k, v in shared.items() if k != "label"}, "shared_with": shared["label"]}
        measured = self._measure_prepared(problem, target, prepared, row["flops"], causal)
        measured["label"] = f"{target.variant}/{target.backend}"
        self.cache[prepared.cache_key] = measured
        return {**row, **{k: v for k, v in measured.items() if k != "label"}}

    def _history_key(self, problem: Problem, target, causal: bool) -> tuple:
        s = problem.shape
        return (target.variant, target.backend, str(problem.dtype), problem.mode, causal, s.heads, s.head_dim)

    def _measure_prepared(self, problem, target, prepared, n_flops: int, causal: bool) -> dict:
        c, s = self.config, problem.shape
        # memory first: it is the harder limit (the OS kills the process, no exception to record)
        if self.device.type == "cpu" and prepared.materialises:
            itemsize = 8 if problem.dtype == torch.float64 else 4
            estimate = estimate_reference_bytes(target.spec.name, s, problem.mode, causal, itemsize,
                                                **target.spec.flop_kwargs())
            if estimate > self.memory_limit:
                return {"status": errors.SKIPPED,
                        "reason": f"estimated peak {estimate / 2 ** 30:.3g} GiB for the materialising path exceeds "
                                  f"the host memory limit {self.memory_limit / 2 ** 30:.3g} GiB (max_memory_gb)"}
        hkey = self._history_key(problem, target, causal)
        predicted = None
        if hkey in self.history:
            prev_flops, prev_median = self.history[hkey]
            predicted = prev_median * n_flops / max(prev_flops, 1)
            if predicted > c.max_call_seconds:
                return {"status": errors.SKIPPED,
                        "reason": f"predicted {predicted:.3g} s per call (scaled by FLOPs from the previous N) "
                                  f"exceeds max_call_seconds={c.max_call_seconds:g}"}
        once = (self.device.type == "cpu" and c.measure_memory and predicted is not None
                and predicted > c.once_above_seconds)
        try:
            if once:
                seconds, peak = timed_peak_cpu(prepared.step)
                stats = summarize([seconds])
            else:
                stats = self._time(prepared.step)
                peak = peak_memory_bytes(prepared.step, self.device) if c.measure_memory else None
        except Exception as e:  # noqa: BLE001 - recorded, never fatal
            status, reason = errors.classify(e)
            errors.free_cached_memory(self.device)
            return {"status": status, "reason": reason}
        self.history[hkey] = (n_flops, stats.median)
        out = {"status": errors.OK, "time_s": stats.to_dict(), "peak_memory_bytes": peak,
               "tflops": n_flops / stats.median / 1e12 if stats.median > 0 else None,
               "tokens_per_s": s.batch * s.seq_q / stats.median if stats.median > 0 else None}
        if once:
            out["reason"] = (f"run once (predicted {predicted:.3g} s per call > once_above_seconds="
                             f"{c.once_above_seconds:g}): time and peak memory from that one call")
        elif stats.n == 1 and self.device.type == "cpu":
            out["reason"] = (f"timed once: the warm-up call took {stats.median:.3g} s, more than "
                             f"once_above_seconds={c.once_above_seconds:g}")
        return out


def _anchor_key(row: dict) -> tuple:
    return (row["seq_len"], row["batch"], row["heads"], row["head_dim"], row["dtype"], row["mode"], row["causal"])


def add_ratios(rows: list[dict]) -> None:
    """time and memory of each row / those of SDPA softmax (default dispatch, same problem and causality)."""
    anchors = {_anchor_key(r): r for r in rows
               if r["backend"] == "sdpa" and r["variant"] in ("softmax", "masked") and r["status"] == errors.OK}
    for r in rows:
        a = anchors.get(_anchor_key(r))
        if a is None or r["status"] != errors.OK:
            continue
        r["ratio_time_vs_sdpa"] = r["time_s"]["median"] / a["time_s"]["median"]
        if r["peak_memory_bytes"] is not None and a["peak_memory_bytes"]:
            r["ratio_memory_vs_sdpa"] = r["peak_memory_bytes"] / a["peak_memory_bytes"]


def run(config: BenchConfig, progress: bool = True, on_row: Optional[Callable[[dict], None]] = None) -> dict:
    """Run the grid; returns the JSON-ready result (schema ``attnzoo.bench/1``)."""
    runner = Runner(config)
    todo = plan(config)
    load_before = environment.load_average()
    rows = []
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    columns = (TextColumn("[bold]bench[/]"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("{task.description}"))
    start = time.perf_counter()
    with Progress(*columns, transient=True, disable=not progress) as bar:
        task = bar.add_task("", total=len(todo))
        for problem, target in todo:
            bar.update(task, description=f"{target.variant} / {target.backend}  N={problem.shape.seq_q} "
                                         f"{problem.mode} {str(problem.dtype).replace('torch.', '')}")
            row = runner.measure(problem, target, time.perf_counter() - start)
            rows.append(row)
            if on_row is not None:
                on_row(row)
            bar.advance(task)
    add_ratios(rows)
    device = torch.device(config.device)
    return {
        "schema": SCHEMA,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "environment": {**environment.collect(device), "load_average_at_start": load_before},
        "settings": {**asdict(config), "memory_limit_bytes": None if math.isinf(runner.memory_limit)
                     else int(runner.memory_limit)},
        "methods": {
            "timing": ("triton.testing.do_bench (CUDA events)" if device.type == "cuda" else
                       "time.perf_counter per call after warm-up; repeats fill target_seconds"),
            "memory": memory_method(device),
            "fwd": "forward under torch.no_grad (inference)",
            "fwd+bwd": "forward + torch.autograd.grad of a fixed random cotangent w.r.t. q, k, v (and parameters)",
            "auto": "'auto' runs the backend the dispatcher picks (resolved_backend); when that backend was "
                    "already measured on the same problem the measurement is shared (shared_with)",
            "ratios": "ratio_*_vs_sdpa = this row / torch SDPA softmax with default dispatch, same problem "
                      "and causality, measured in the same run",
        },
        "flop_conventions": {"forward": dict(FORMULAS), "backward": BACKWARD_RULE},
        "results": rows,
    }
