"""``attnzoo bench --models``: training throughput of whole models with each variant swapped in, against
the model's own attention, measured side by side in one process.

A case is (model, attention, mode): the model of ``model_zoo`` with its own attention (``"own"``) or a
variant spec, trained with AdamW (fused on CUDA; bf16 autocast on CUDA, float32 on CPU) in one of
three modes: ``eager``, ``compile`` (``torch.compile(model)``) and ``cudagraphs``
(``torch.compile(model, mode="reduce-overhead")``: compiled and captured in CUDA graphs; on a CPU that
mode only compiles, so the case is recorded as skipped with that reason). Per case:

1. ``warmup`` steps (compilation, autotuning and graph capture land there; their time is kept);
2. ``blocks`` blocks of ``steps`` steps, one synchronisation per block (``timing.time_steps``): the
   median seconds per step gives images/s or tokens/s;
3. ``host_steps`` steps each started on an idle GPU (``timing.host_seconds``): the host's share;
4. ``profile_steps`` steps under torch.profiler (``timing.profile_steps``): kernel launches and
   CUDA-graph launches per step on CUDA, aten ops per step everywhere, the GPU's busy time.

Each case runs under its own deadline (``case_seconds``, ``compile_case_seconds``, cut to what is
left of ``budget_seconds``): a slow compile is interrupted and recorded as skipped, and the run goes
on. Nothing raises for a case that cannot run: every row has a status and a reason. Cases run in
priority order (``plan``): model by model, within a model every attention in eager mode first, then
compiled, then with CUDA graphs, the model's own attention first each time, so that the ratios
("x own") of what a budget lets through always have their denominator.
"""
from __future__ import annotations

import datetime
import gc
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

import torch

from ..models.amp import bf16_autocast
from . import environment, errors
from .guard import CallInterrupted, interrupt_after
from .model_zoo import MODELS, OWN, SIZES, ModelSpec, missing_library, model_spec
from .progress import progress_bar
from .schema import MODELS_SCHEMA, validate_models
from .targets import check_spec
from .timing import host_seconds, profile_steps, time_steps

MODES = ("eager", "compile", "cudagraphs")

# steps per case: on a GPU few steps of a real model suffice (a step is tens of ms); the tiny CPU models
# are timed over a few steps too
GPU_STEPS = {"warmup": 3, "steps": 4, "blocks": 3, "host_steps": 2, "profile_steps": 1}
CPU_STEPS = {"warmup": 1, "steps": 2, "blocks": 3, "host_steps": 2, "profile_steps": 1}


@dataclass
class ModelBenchConfig:
    models: list[str] = field(default_factory=lambda: list(MODELS))
    variants: Optional[list[str]] = None      # None: each model's own list (model_zoo)
    modes: list[str] = field(default_factory=lambda: list(MODES))
    size: Optional[str] = None                # None: "full" on CUDA, "tiny" on CPU
    batch: Optional[int] = None               # None: the size's batch per model
    device: str = "cpu"
    warmup: Optional[int] = None              # None: GPU_STEPS / CPU_STEPS
    steps: Optional[int] = None
    blocks: Optional[int] = None
    host_steps: Optional[int] = None
    profile_steps: Optional[int] = None
    case_seconds: float = 90.0                # an eager case is interrupted past this
    compile_case_seconds: float = 240.0       # a compiled case (compile and cudagraphs) past this
    budget_seconds: Optional[float] = None    # the whole run: cases left when it is used up are skipped
    compile_backend: str = "inductor"
    seed: int = 0
    notes: str = ""

    def validate(self) -> "ModelBenchConfig":
        if not self.models:
            raise ValueError("models must name at least one model")
        for name in self.models:
            model_spec(name)
        for spec in self.variants or []:
            check_spec(spec)
        for mode in self.modes:
            if mode not in MODES:
                raise ValueError(f"model mode must be one of {MODES}, got {mode!r}")
        if self.size is not None and self.size not in SIZES:
            raise ValueError(f"size must be one of {SIZES}, got {self.size!r}")
        torch.device(self.device)
        defaults = GPU_STEPS if self.on_cuda else CPU_STEPS
        for name, default in defaults.items():
            value = getattr(self, name)
            if value is None:
                setattr(self, name, default)
            elif isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "warmup" else 1):
                raise ValueError(f"{name} must be an int >= {0 if name == 'warmup' else 1}, got {value!r}")
        if self.batch is not None and (isinstance(self.batch, bool) or not isinstance(self.batch, int) or self.batch < 1):
            raise ValueError(f"batch must be an int >= 1, got {self.batch!r}")
        for name in ("case_seconds", "compile_case_seconds", "budget_seconds"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
                raise ValueError(f"{name} must be a number > 0, got {value!r}")
        if self.size is None:
            self.size = "full" if self.on_cuda else "tiny"
        return self

    @property
    def on_cuda(self) -> bool:
        return torch.device(self.device).type == "cuda"


@dataclass(frozen=True)
class Case:
    model: ModelSpec
    attention: str      # OWN or a variant spec
    mode: str


def plan(config: ModelBenchConfig) -> list[Case]:
    """The cases in priority order: model by model (as listed), mode by mode (eager, compile,
    cudagraphs), the model's own attention first, then every variant."""
    out = []
    for name in config.models:
        spec = model_spec(name)
        variants = list(config.variants) if config.variants is not None else list(spec.variants)
        for mode in [m for m in MODES if m in config.modes]:
            out += [Case(spec, a, mode) for a in [OWN] + variants]
    return out


class Trainer:
    """One case's model, optimizer, batch and training step."""

    def __init__(self, case: Case, config: ModelBenchConfig, device: torch.device):
        self.case, self.device = case, device
        spec = case.model
        shapes = spec.shapes(config.size)
        if config.batch is not None:
            shapes = type(shapes)(config.batch, shapes.seq)
        self.shapes = shapes
        torch.manual_seed(config.seed)
        model = spec.build(config.size, None if case.attention == OWN else case.attention).to(device)
        model.train()
        self.parameters = sum(p.numel() for p in model.parameters() if p.requires_grad)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
        g = torch.Generator(device="cpu").manual_seed(config.seed)
        self.batch = spec.batch_of(model, shapes, device, g)
        self.model = model
        self.cudagraphs = case.mode == "cudagraphs"
        if case.mode == "compile":
            self.run_model = torch.compile(model, backend=config.compile_backend)
        elif self.cudagraphs:
            self.run_model = torch.compile(model, mode="reduce-overhead")
        else:
            self.run_model = model
        self.loss: Optional[torch.Tensor] = None

    def step(self) -> None:
        if self.cudagraphs:  # a new step: the graphs' outputs of the last one may be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        with bf16_autocast(self.device):
            loss = self.case.model.loss(self.run_model, self.batch)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.loss = loss.detach()


def _row(case: Case, config: ModelBenchConfig) -> dict:
    spec = case.model
    shapes = spec.shapes(config.size)
    batch = config.batch or shapes.batch
    return {"model": spec.name, "attention": case.attention, "mode": case.mode, "status": errors.OK, "reason": None,
            "unit": spec.unit, "batch": batch, "seq_len": shapes.seq, "causal": spec.causal,
            "items_per_step": spec.items_per_step(type(shapes)(batch, shapes.seq)),
            "items_per_s": None, "step_s": None, "ratio_vs_own": None, "host_ms_per_step": None,
            "op_host_ms_per_step": None,
            "launches_per_step": None, "graph_launches_per_step": None, "aten_ops_per_step": None,
            "host_waits_per_step": None, "device_ms_per_step": None, "warmup_s": None, "parameters": None,
            "loss": None}


class ModelRunner:
    def __init__(self, config: ModelBenchConfig):
        self.config = config.validate()
        self.device = torch.device(config.device)
        self.deadline: Optional[float] = None

    def start_clock(self, start: float) -> None:
        if self.config.budget_seconds is not None:
            self.deadline = start + self.config.budget_seconds

    def case_limit(self, case: Case) -> float:
        c = self.config
        limit = c.case_seconds if case.mode == "eager" else c.compile_case_seconds
        if self.deadline is not None:
            limit = min(limit, self.deadline - time.perf_counter())
        return limit

    def measure(self, case: Case) -> dict:
        row = _row(case, self.config)
        missing = missing_library(case.model.name)
        if missing is not None:
            return {**row, "status": errors.UNAVAILABLE, "reason": missing}
        if case.mode == "cudagraphs" and self.device.type != "cuda":
            return {**row, "status": errors.SKIPPED,
                    "reason": "CUDA graphs need a CUDA device: on a CPU, mode='reduce-overhead' only compiles "
                              "(the compile row measures that)"}
        limit = self.case_limit(case)
        if limit <= 0:
            return {**row, "status": errors.SKIPPED,
                    "reason": f"the run's time budget (budget_seconds={self.config.budget_seconds:g}) was used up "
                              f"before this case"}
        trainer = None
        failed = None
        try:
            with interrupt_after(limit):
                trainer = Trainer(case, self.config, self.device)
                row.update(self._timed(trainer))
        except Exception as e:  # noqa: BLE001 - recorded, never fatal
            interrupted = _interruption(e)
            if interrupted is not None:
                ran_out = self.deadline is not None and time.perf_counter() >= self.deadline - 1e-3
                why = (f"the run's time budget (budget_seconds={self.config.budget_seconds:g}) ran out" if ran_out else
                       f"the case's limit ({'case' if case.mode == 'eager' else 'compile_case'}_seconds={limit:.3g})")
                after = limit if math.isnan(interrupted.seconds) else interrupted.seconds
                failed = {"status": errors.SKIPPED, "reason": f"interrupted after {after:.3g} s: {why}"}
            else:
                status, reason = errors.classify(e)
                failed = {"status": status, "reason": reason}
        finally:
            if trainer is not None:
                row["parameters"] = trainer.parameters
            del trainer
            self._recover(case)
        if failed is not None:
            return {**row, **failed}
        if row["loss"] is not None and not math.isfinite(row["loss"]):
            return {**row, "status": errors.ERROR, "reason": f"the training loss became {row['loss']}"}
        return row

    def _timed(self, trainer: Trainer) -> dict:
        c, device = self.config, self.device
        start = time.perf_counter()
        for _ in range(c.warmup):
            trainer.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        warmup_s = time.perf_counter() - start
        stats = time_steps(trainer.step, device, c.steps, c.blocks)
        host = host_seconds(trainer.step, device, c.host_steps)
        items = trainer.case.model.items_per_step(trainer.shapes)
        out = {"items_per_s": items / stats.median, "step_s": stats.to_dict(), "warmup_s": warmup_s,
               "host_ms_per_step": host.median * 1e3, "loss": float(trainer.loss)}
        try:  # the throughput stands even if the profiler fails
            profile = profile_steps(trainer.step, device, c.profile_steps)
        except Exception as e:  # noqa: BLE001 - said in the row, never fatal
            return {**out, "reason": f"no profile: {errors.short(f'{type(e).__name__}: {e}', 200)}"}
        return {**out, **{k: v for k, v in profile.items() if k != "profiled_steps"}}

    def _recover(self, case: Case) -> None:
        """Free the case's model and compiled graphs before the next one. A full garbage collection
        takes about a second with torch and transformers loaded, so it runs only when GPU memory that
        reference cycles may hold has grown past a quarter of the device."""
        if case.mode != "eager":
            import torch._dynamo
            torch._dynamo.reset()
        if self.device.type == "cuda":
            try:
                torch.cuda.synchronize(self.device)
            except Exception:  # noqa: BLE001 - a broken context shows in the next row
                pass
            total = torch.cuda.get_device_properties(self.device).total_memory
            if torch.cuda.memory_allocated(self.device) > total / 4:
                gc.collect()
            torch.cuda.empty_cache()


def _interruption(e: BaseException) -> Optional[CallInterrupted]:
    """The deadline's CallInterrupted, also when torch.compile wrapped it in an error of its own (the
    alarm can land inside inductor, which re-raises whatever it caught as an InductorError)."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, CallInterrupted):
            return e
        if "CallInterrupted: interrupted after" in str(e):  # re-raised as text, the original dropped
            return CallInterrupted(float("nan"), float("nan"))
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def add_ratios(rows: list[dict]) -> None:
    """ratio_vs_own = items/s of the row / items/s of the model's own attention in the same mode."""
    own = {(r["model"], r["mode"]): r["items_per_s"] for r in rows if r["attention"] == OWN and r["status"] == errors.OK}
    for r in rows:
        base = own.get((r["model"], r["mode"]))
        r["ratio_vs_own"] = r["items_per_s"] / base if base and r["status"] == errors.OK else None


def methods(device: torch.device) -> dict:
    cuda = device.type == "cuda"
    return {
        "step": "one training step: forward and loss under " + ("bf16 autocast" if cuda else "float32")
                + ", backward, AdamW step" + (" (fused)" if cuda else "") + ", zero_grad(set_to_none=True)",
        "throughput": "median over blocks of steps timed with one synchronisation per block (the host queues a step "
                      "while the GPU runs the last); images/s (ViT) or tokens/s (language models)",
        "host_ms_per_step": "a step started on an idle GPU, timed until its last call returns without waiting for "
                            "the GPU (median): close to the step time means the step is bound by the host",
        "launches": "torch.profiler: kernel launches (cudaLaunchKernel / cuLaunchKernel events) and CUDA-graph "
                    "launches per step on CUDA; aten ops per step on every device (nested calls counted)",
        "op_host_ms_per_step": "torch.profiler: the host's self time inside profiled calls per step (torch ops, "
                               "CUDA API calls, custom ops with their Python), waits for the GPU left out",
        "ratio_vs_own": "items/s with the variant / items/s with the model's own attention (timm's Attention, "
                        "Hugging Face's sdpa), same model and mode, measured in the same process",
        "modes": "eager; compile = torch.compile(model); cudagraphs = torch.compile(model, mode='reduce-overhead') "
                 "(CUDA only)",
    }


def header(config: ModelBenchConfig, planned_rows: Optional[int] = None) -> dict:
    device = torch.device(config.device)
    settings = asdict(config)
    settings["shapes"] = {name: asdict(model_spec(name).shapes(config.size)) for name in config.models}
    if planned_rows is not None:
        settings["planned_rows"] = planned_rows
    return {"schema": MODELS_SCHEMA,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "environment": {**environment.collect(device), "load_average_at_start": environment.load_average()},
            "settings": settings, "methods": methods(device),
            "models": {name: {"title": model_spec(name).title + (" - tiny configuration of the same architecture"
                                                                   if config.size == "tiny" else ""),
                              "own": model_spec(name).own, "unit": model_spec(name).unit} for name in config.models}}


def finish(head: dict, rows: list[dict], wall_seconds: Optional[float] = None) -> dict:
    add_ratios(rows)
    settings = dict(head["settings"])
    if wall_seconds is not None:
        settings["run_seconds"] = round(wall_seconds, 1)
    return validate_models({**head, "settings": settings, "results": rows})


def run(config: ModelBenchConfig, progress: bool = True, on_row: Optional[Callable[[dict], None]] = None,
        on_start: Optional[Callable[[dict], None]] = None) -> dict:
    """Run every case of ``plan(config)``; returns the JSON-ready result (schema ``attnzoo.bench.models/1``).
    ``on_start(header)`` and ``on_row(row)`` as for the kernel benchmark's ``run`` (a row log)."""
    from .dynamo import raised_recompile_limits
    runner = ModelRunner(config)
    todo = plan(config)
    head = header(config, planned_rows=len(todo))
    if on_start is not None:
        on_start(head)
    rows: list[dict] = []
    start = time.perf_counter()
    runner.start_clock(start)
    with raised_recompile_limits(), progress_bar(progress, "models") as bar:
        task = bar.add_task("", total=len(todo))
        for case in todo:
            bar.update(task, description=f"{case.model.name} / {case.attention} / {case.mode}")
            row = runner.measure(case)
            rows.append(row)
            add_ratios(rows)
            if on_row is not None:
                on_row(row)
            bar.advance(task)
    return finish(head, rows, wall_seconds=time.perf_counter() - start)
