"""Run the benchmark grid and collect one record per (variant, backend, N, dtype, mode).

Nothing here raises for a combination that cannot run: unsupported (with the dispatcher's reason),
unavailable (library not installed), out of memory, skipped (predicted too slow or too large) and
errors are all recorded as rows with a status and a reason.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

from .. import registry
from . import errors
from .baselines import anchor, baseline_targets
from .dynamo import raised_recompile_limits
from .extrapolate import Extrapolation
from .flops import MODES, Shape
from .guard import CallInterrupted, interrupt_after
from .memory import estimate_reference_bytes, peak_memory_bytes, timed_peak_cpu
from .problem import Problem, make_step
from .progress import progress_bar
from .result import anchor_key, finish, header, is_anchor, set_ratio
from .targets import attnzoo_targets, parse_variant
from .timing import CallTooSlow, Timing, TimingRule, summarize, time_call

__all__ = ["ALL_VARIANTS", "BenchConfig", "Runner", "all_variants", "plan", "run"]

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}
DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16",
                 "fp64": "float64", "double": "float64"}


def dtype_name(name: str) -> str:
    """Canonical dtype name ("bf16" -> "bfloat16"); ValueError naming the choices otherwise."""
    canonical = DTYPE_ALIASES.get(str(name).lower(), str(name).lower())
    if canonical not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)} (or {list(DTYPE_ALIASES)}), got {name!r}")
    return canonical
def all_variants() -> list[str]:
    """Every registered name that runs a variant's kernel (variants, then wrappers)."""
    out = []
    for name in registry.available():
        try:
            registry.resolve(name)
        except ValueError:
            continue  # a class registered with register() whose layer runs no declared variant
        out.append(name)
    return out


ALL_VARIANTS = tuple(all_variants())  # the names registered when attnzoo was imported


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class BenchConfig:
    variants: list[str] = field(default_factory=all_variants)
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
    target_seconds: float = 1.0               # repeats (timed one by one) chosen to fill about this long per row
    max_call_seconds: float = 10.0            # predicted or measured (second call) slower than this: skipped
    once_above_seconds: float = 2.0           # a second call slower than this is the row's only sample
    slow_call_seconds: float = 0.2            # CUDA: slower than this, CUDA-event repeats instead of do_bench
    call_timeout_seconds: Optional[float] = None  # any single call (compile included) interrupted past this
    budget_seconds: Optional[float] = None    # the run stops measuring after this long: the rest is skipped
    skip_backends: list[str] = field(default_factory=list)  # these backends / baselines are left out
    label: str = ""                           # a name for this run (sweep configuration), shown in the docs
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
        for name in ("max_call_seconds", "once_above_seconds", "target_seconds", "slow_call_seconds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        if self.max_call_seconds == 0:  # would skip every row before timing it
            raise ValueError("max_call_seconds must be > 0 (a row slower than this per call is skipped), got 0")
        for name in ("call_timeout_seconds", "budget_seconds"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
                raise ValueError(f"{name} must be None or a number >= 0, got {value!r}")
        if isinstance(self.skip_backends, str) or any(not isinstance(b, str) for b in self.skip_backends):
            raise ValueError(f"skip_backends must be a list of backend names, got {self.skip_backends!r}")
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
    backend and baseline; third pass: the compiling ones (FlexAttention). Within a pass N grows (a row's time at N is predicted from the previous N),
    so when a time budget runs out it is the alternatives at the largest N that are lost first."""
    specs = [parse_variant(v) for v in config.variants]
    device = torch.device(config.device)
    targets = []
    for spec in specs:
        targets += attnzoo_targets(spec, config.backends) + baseline_targets(spec, device, config.backends)
    anchors = [anchor(c) for c in sorted({s.causal(config.causal) for s in specs} | {config.causal})]
    skip = set(config.skip_backends)
    anchors = [t for t in anchors if t.backend not in skip]
    targets = [t for t in targets if t.backend not in skip]
    first = anchors + [t for t in targets if t.backend == "auto"]
    second = [t for t in targets if t.backend != "auto" and not getattr(t, "compiles", False)]
    # compiling targets (FlexAttention: one torch.compile per shape, score_mod and mode) in a third pass,
    # so that under a time budget they are what gets cut, not the other alternatives
    third = [t for t in targets if t.backend != "auto" and getattr(t, "compiles", False)]
    out = []
    problems = list(_problems(config))
    seen = set()
    for group in (first, second, third):
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
        self.history = Extrapolation()          # the same row at smaller N predicts this one
        self.timed_out: dict[tuple, str] = {}    # same row at a smaller N hit call_timeout_seconds -> its reason
        self.deadline: Optional[float] = None    # time.perf_counter() at which the budget runs out
        c = self.config
        self.rule = TimingRule(warmup=c.warmup, min_repeats=c.min_repeats, max_repeats=c.max_repeats,
                               target_seconds=c.target_seconds, max_call_seconds=c.max_call_seconds,
                               once_above_seconds=c.once_above_seconds, slow_call_seconds=c.slow_call_seconds)

    def start_clock(self, start: float) -> None:
        if self.config.budget_seconds is not None:
            self.deadline = start + self.config.budget_seconds

    def call_limit(self) -> Optional[float]:
        """Seconds the next call may take: call_timeout_seconds, cut to what is left of the budget."""
        limits = [x for x in (self.config.call_timeout_seconds,
                              None if self.deadline is None else self.deadline - time.perf_counter()) if x is not None]
        return min(limits) if limits else None

    def _budget_ran_out(self) -> bool:
        return self.deadline is not None and time.perf_counter() >= self.deadline - 1e-3

    def _interrupted_reason(self, e: CallInterrupted) -> str:
        c = self.config
        if self._budget_ran_out():
            why = f"the run's time budget (budget_seconds={c.budget_seconds:g}) ran out during this row"
        else:
            why = f"a single call ran past call_timeout_seconds={c.call_timeout_seconds:g}"
        return f"interrupted after {e.seconds:.3g} s: {why}"

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def measure(self, problem: Problem, target, elapsed: float = 0.0) -> dict:
        spec, s = target.spec, problem.shape
        causal = spec.causal(problem.causal)
        row = {
            "variant": target.variant, "backend": target.backend, "kind": target.kind,
            "seq_len": s.seq_q, "batch": s.batch, "heads": s.heads, "head_dim": s.head_dim,
            "dtype": str(problem.dtype).replace("torch.", ""), "mode": problem.mode, "causal": causal,
            "status": errors.OK, "reason": None, "resolved_backend": None, "shared_with": None,
            "flops": target.flops(problem),
            "time_s": None, "tflops": None, "tokens_per_s": None, "peak_memory_bytes": None,
            "ratio_time_vs_sdpa": None, "ratio_memory_vs_sdpa": None, "first_call_s": None,
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
        if target.backend == "auto" and prepared.resolved in self.config.skip_backends:
            return {**row, "status": errors.SKIPPED,
                    "reason": f"auto picks '{prepared.resolved}', which skip_backends leaves out"}
        if prepared.cache_key in self.cache:
            shared = self.cache[prepared.cache_key]
            if shared.get("time_s"):  # this row's own history too: it predicts this row at the next N
                self.history.record(self._history_key(problem, target, causal), problem.shape.seq_q, row["flops"],
                                    shared["time_s"]["median"])
            return {**row, **{k: v for k, v in shared.items() if k != "label"}, "shared_with": shared["label"]}
        measured = self._measure_prepared(problem, target, prepared, row["flops"], causal)
        measured["label"] = target.label
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
        if hkey in self.timed_out:  # a larger N (or the same compile) would only hit the limit again
            return {"status": errors.SKIPPED,
                    "reason": f"the same row at a smaller N was {self.timed_out[hkey]}"}
        predicted = self.history.predict(hkey, s.seq_q, n_flops)
        if predicted is not None:
            if predicted > c.max_call_seconds:
                return {"status": errors.SKIPPED,
                        "reason": f"predicted {predicted:.3g} s per call (scaled by FLOPs from the previous N) "
                                  f"exceeds max_call_seconds={c.max_call_seconds:g}"}
        # CPU, predicted slow: one call gives both time and peak memory (the tracker's overhead is noise)
        once = (self.device.type == "cpu" and c.measure_memory and predicted is not None
                and predicted > c.once_above_seconds)
        step = make_step(prepared.forward, prepared.leaves, problem)
        try:
            if once:
                with interrupt_after(self.call_limit()):
                    seconds, peak = timed_peak_cpu(step)
                timing = Timing(summarize([seconds]), seconds, seconds, "once-predicted")
            else:
                # the eager reference compiles nothing: its first call already is its steady cost
                timing = time_call(step, self.device, self.rule, limit=self.call_limit,
                                   probe=self._memory_probe(step) if c.measure_memory else None,
                                   eager=prepared.resolved == "reference")
                peak = timing.probed
                if c.measure_memory and peak is None:
                    with interrupt_after(self.call_limit()):
                        peak = peak_memory_bytes(step, self.device)
        except CallTooSlow as e:
            self.history.record(hkey, s.seq_q, n_flops, e.seconds)
            which = ("first call of the eager reference, which compiles nothing" if e.from_first else
                     f"second call, after a first call of {e.first_call_s:.3g} s")
            return {"status": errors.SKIPPED, "first_call_s": e.first_call_s,
                    "reason": f"measured {e.seconds:.3g} s per call ({which}) exceeds "
                              f"max_call_seconds={c.max_call_seconds:g}"}
        except CallInterrupted as e:
            failed = {"status": errors.SKIPPED, "reason": self._interrupted_reason(e)}
            if not self._budget_ran_out():
                self.timed_out[hkey] = failed["reason"]
        except Exception as e:  # noqa: BLE001 - recorded, never fatal
            status, reason = errors.classify(e)
            failed = {"status": status, "reason": reason}
        else:
            failed = None
        if failed is not None:
            # outside the except block: the traceback (and the tensors its frames hold) is gone by now
            self._recover()
            return failed
        stats = timing.stats
        self.history.record(hkey, s.seq_q, n_flops, stats.median)
        out = {"status": errors.OK, "time_s": stats.to_dict(), "peak_memory_bytes": peak,
               "first_call_s": timing.first_call_s,
               "tflops": n_flops / stats.median / 1e12 if stats.median > 0 else None,
               "tokens_per_s": s.batch * s.seq_q / stats.median if stats.median > 0 else None}
        if once:
            out["reason"] = (f"run once (predicted {predicted:.3g} s per call > once_above_seconds="
                             f"{c.once_above_seconds:g}): time and peak memory from that one call")
        elif timing.method == "once":
            out["reason"] = (f"timed once: the second call (after a first of {timing.first_call_s:.3g} s) took "
                             f"{stats.median:.3g} s, more than once_above_seconds={c.once_above_seconds:g}")
        return out

    def _memory_probe(self, step: Callable[[], None]):
        """What runs as the second call: on CUDA it also reads the allocator's peak (free); on CPU the
        tracker's per-op overhead would distort the time, so only when the first call was already slow
        enough that the second will be the only sample (saves one more slow call)."""
        def probe(first_call_s: float):
            if self.device.type == "cuda" or first_call_s > self.config.once_above_seconds:
                return lambda: peak_memory_bytes(step, self.device)
            return None
        return probe

    def _recover(self) -> None:
        """After an interrupted or failed call: let queued GPU work finish and give its memory back."""
        try:
            self._synchronize()
        except Exception:  # noqa: BLE001 - a broken context shows up in the next row's status
            pass
        errors.free_cached_memory(self.device)


def run(config: BenchConfig, progress: bool = True, on_row: Optional[Callable[[dict], None]] = None,
        on_start: Optional[Callable[[dict], None]] = None) -> dict:
    """Run the grid; returns the JSON-ready result (schema ``attnzoo.bench/1``).

    ``on_start(header)`` gets the result without its rows before the first row runs, ``on_row(row)``
    each row as it completes (its ratios to SDPA filled when the anchor already ran, which the plan
    arranges): together they let a caller keep a row log that survives the process (``rowlog``)."""
    runner = Runner(config)
    todo = plan(config)
    head = header(config, runner.memory_limit, planned_rows=len(todo))
    if on_start is not None:
        on_start(head)
    rows: list[dict] = []
    anchors: dict[tuple, dict] = {}
    start = time.perf_counter()
    runner.start_clock(start)
    with raised_recompile_limits(), progress_bar(progress) as bar:
        task = bar.add_task("", total=len(todo))
        for problem, target in todo:
            bar.update(task, description=f"{target.variant} / {target.backend}  N={problem.shape.seq_q} "
                                         f"{problem.mode} {str(problem.dtype).replace('torch.', '')}")
            row = runner.measure(problem, target, time.perf_counter() - start)
            if is_anchor(row):
                anchors.setdefault(anchor_key(row), row)
            set_ratio(row, anchors.get(anchor_key(row)))
            rows.append(row)
            if on_row is not None:
                on_row(row)
            bar.advance(task)
    return finish(head, rows, wall_seconds=time.perf_counter() - start)
