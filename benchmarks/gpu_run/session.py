"""One GPU measurement that always comes back, in a few minutes (``benchmarks/gpu_speed.py`` runs it).

Phases, each with its own deadline, all results flushed as they come (rows.jsonl, models.jsonl) so a
killed run still leaves everything measured so far:
1. warm: worker processes launch every case once, filling Triton's and inductor's on-disk caches
   (compiles run in parallel; the main process then loads them);
2. speed: FlashAttention's benchmark shapes (batch * N = 16384 tokens, hidden 2048; D 64 / 128,
   N 1024 / 4096 / 16384, causal and not, bf16): SDPA's default dispatch, its FlashAttention-2,
   cuDNN and memory-efficient kernels, FlexAttention, and every attnzoo backend of every variant
   that runs on CUDA, in each variant's flavours of inputs (the cases of ``attnzoo.bench.speed_grid``);
   median ms of the forward and of forward + backward (``timing.time_directions``), the extra peak
   memory of each; rows whose time extrapolated from a smaller N (``extrapolate``: scaled by the
   FLOP count) exceeds --max-call-ms are skipped as such;
3. correctness: every CUDA backend against float64 at awkward shapes (bf16, fp16, fp32);
4. models: whole models' training throughput with each variant swapped in, eager, compiled and in
   CUDA graphs, with launches and host time per step (``attnzoo.bench.model_bench``);
5. compile: torch.compile(fullgraph=True) of every layer with the default backend;
then any phase the entry point adds (benchmarks/gpu_speed.py adds "paper", which trains with
attnzoo.train's own loop).
Outputs (in --out, default benchmarks/results/gpu/<device>): speed.json, speed.md (the fastest
attnzoo backend per variant against SDPA + every row), speed.png, correctness.json, compile.json,
models.json / models.md, rows.jsonl, models.jsonl, log.txt, and measured_table.json, which is what
attnzoo/ops/measured_tables/<device>.json (read by ``auto``) is copied from. ``--mirror DIR`` writes
log.txt and models.jsonl to DIR as well, as they grow, and models.md (a device call's $OUT).

On a CPU it runs as a dry run of its own code (--device cpu with tiny shapes; the Triton backends
under TRITON_INTERPRET=1).
"""
from __future__ import annotations

import argparse
import json
import os
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from attnzoo.bench import errors, model_bench
from attnzoo.bench import speed_grid as grid
from attnzoo.bench.extrapolate import Extrapolation
from attnzoo.bench.model_zoo import MODELS, OWN
from attnzoo.bench.plots import plot_speed
from attnzoo.bench.ranking import measured_table
from attnzoo.bench.report import DIRECTIONS, model_row_line, speed_report
from attnzoo.bench.rowlog import RowLog
from attnzoo.bench.schema import write_json, write_text
from attnzoo.ops.measured import slug

from . import compile_check, correctness, warm

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Phase:
    """A phase an entry point adds: ``run(session) -> rows``, ``warm_jobs(session) -> [(kind, fn, args)]``,
    ``add_arguments(parser)`` for its options, ``share`` of the budget."""
    name: str
    run: Callable
    share: float
    warm_jobs: Callable = lambda session: []
    add_arguments: Callable = lambda parser: None


BUILTIN = ("warm", "speed", "correctness", "models", "compile")
# share of the budget each phase may use (what a phase leaves unused goes to the next ones)
SHARES = {"warm": 0.25, "speed": 0.33, "correctness": 0.12, "models": 0.4, "compile": 0.11}


def parse(argv=None, extra: tuple = ()):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    phases = BUILTIN + tuple(x.name for x in extra)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--mirror", type=Path, default=None,
                   help="also write log.txt and models.jsonl here as they grow, and models.md (a device call's $OUT)")
    p.add_argument("--budget-seconds", type=float, default=420)
    p.add_argument("--phases", nargs="+", choices=phases, default=list(phases))
    p.add_argument("--device", default="cuda")
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--causal", nargs="+", choices=("no", "yes"), default=["no", "yes"])
    p.add_argument("--tokens", type=int, default=16384, help="batch * N")
    p.add_argument("--hidden", type=int, default=2048, help="heads * head dim")
    p.add_argument("--max-call-ms", type=float, default=1500.0)
    p.add_argument("--workers", type=int, default=max(1, min(14, (os.cpu_count() or 2) - 2)))
    p.add_argument("--shapes", nargs="*", default=None, metavar="D:N:causal",
                   help="explicit shapes instead of head dims x seq lens x causal, e.g. 128:4096:no 64:16384:yes")
    p.add_argument("--only", nargs="*", default=None, help="substrings of case labels to keep")
    p.add_argument("--correctness-dtypes", nargs="+", choices=("bfloat16", "float16", "float32"),
                   default=["bfloat16", "float16", "float32"])
    m = p.add_argument_group("models phase (attnzoo.bench.model_bench)")
    m.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    m.add_argument("--model-variants", nargs="+", default=None, metavar="SPEC",
                   help="variants swapped into every model (default: each model's own list)")
    m.add_argument("--model-modes", nargs="+", choices=model_bench.MODES, default=list(model_bench.MODES))
    m.add_argument("--model-size", choices=("full", "tiny"), default=None)
    m.add_argument("--model-batch", type=int, default=None)
    m.add_argument("--model-warmup", type=int, default=None)
    m.add_argument("--model-steps", type=int, default=None)
    m.add_argument("--model-blocks", type=int, default=None)
    m.add_argument("--case-seconds", type=float, default=40.0, help="an eager model case is interrupted past this")
    m.add_argument("--compile-case-seconds", type=float, default=90.0,
                   help="a compiled model case is interrupted past this")
    m.add_argument("--model-workers", type=int, default=6,
                   help="warm phase: worker processes compiling model cases at once (each holds a model on the GPU)")
    p.add_argument("--from-results", nargs="+", type=Path, default=None, metavar="SPEED_JSON",
                   help="measure nothing: write the report, plot and ranking table of earlier runs' speed.json files "
                        "(their rows together; each row's ratios use the SDPA row of its own run and shape)")
    for phase in extra:
        phase.add_arguments(p)
    return p.parse_args(argv)


def device_info(device) -> dict:
    info = {"name": "cpu", "capability": None, "torch": torch.__version__}
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if device.type == "cuda":
        info["name"] = torch.cuda.get_device_name(device)
        info["capability"] = list(torch.cuda.get_device_capability(device))
    return info


class _Tee:
    """The text log, written to the results folder and, with --mirror, to a second folder too."""

    def __init__(self, *paths: Optional[Path]):
        self.files = [open(p, "w") for p in paths if p is not None]

    def write(self, text: str) -> None:
        for f in self.files:
            f.write(text)
            f.flush()


class Session:
    def __init__(self, args, extra: tuple = ()):
        self.args = args
        self.extra = {x.name: x for x in extra}
        self.order = BUILTIN + tuple(self.extra)
        self.shares = {**SHARES, **{x.name: x.share for x in extra}}
        self.device = torch.device(args.device)
        if self.device.type == "cpu":  # the dry run runs its own code: the Triton cases in the interpreter too
            os.environ.setdefault("ATTNZOO_BENCH_INTERPRETER", "1")
        self.info = device_info(self.device)
        self.out = args.out or ROOT / "benchmarks" / "results" / "gpu" / slug(self.info["name"])
        self.out.mkdir(parents=True, exist_ok=True)
        if args.mirror is not None:
            args.mirror.mkdir(parents=True, exist_ok=True)
        self.start = time.time()
        self.end = self.start + args.budget_seconds
        self.log_file = _Tee(self.out / "log.txt", None if args.mirror is None else args.mirror / "log.txt")
        self.rows_file = RowLog(self.out / "rows.jsonl")   # in results.tar.gz; $OUT holds few files
        self.rows_file.start()
        self.models_file = None
        if "models" in args.phases:
            self.models_file = RowLog(self.out / "models.jsonl", None if args.mirror is None else args.mirror / "models.jsonl")
        self.rows = []
        self.models_result = None
        self.models_head, self.models_rows = None, []

    def log(self, msg: str) -> None:
        line = f"[+{time.time() - self.start:6.1f}s] {msg}"
        print(line, flush=True)
        self.log_file.write(line + "\n")

    def deadline(self, phase: str) -> float:
        """This phase may run until its share of what is left, counting the phases still to come."""
        left = [p for p in self.order if p in self.args.phases and self.order.index(p) >= self.order.index(phase)]
        share = self.shares[phase] / sum(self.shares[p] for p in left)
        return time.time() + share * max(0.0, self.end - time.time())

    def problems(self):
        dtype, a = torch.bfloat16, self.args
        if a.shapes:
            out = []
            for spec in a.shapes:
                d, n, causal = spec.split(":")
                out += grid.benchmark_problems([int(d)], [int(n)], [causal == "yes"], a.tokens, a.hidden, dtype, self.device)
            return out
        return grid.benchmark_problems(a.head_dims, a.seq_lens, [c == "yes" for c in a.causal], a.tokens, a.hidden, dtype,
                                       self.device)

    def cases(self):
        cases = grid.speed_cases(self.device)
        if self.args.only:
            cases = [c for c in cases if any(s in c.label for s in self.args.only)]
        return cases

    def plan(self):
        """(case, problem) pairs, most informative first: N 4096 at D 64 first, then the rest by N."""
        problems = sorted(self.problems(), key=lambda p: (p.shape.seq_q != 4096, p.shape.head_dim != 64, p.causal,
                                                          p.shape.seq_q, p.shape.head_dim))
        cases = self.cases()
        return [(c, p) for p in problems for c in cases if c.applies(p)]

    def model_config(self, budget: Optional[float] = None) -> model_bench.ModelBenchConfig:
        a = self.args
        return model_bench.ModelBenchConfig(
            models=a.models, variants=a.model_variants, modes=a.model_modes, size=a.model_size, batch=a.model_batch,
            device=str(self.device), warmup=a.model_warmup, steps=a.model_steps, blocks=a.model_blocks,
            case_seconds=a.case_seconds, compile_case_seconds=a.compile_case_seconds, budget_seconds=budget,
            notes="the models phase of benchmarks/gpu_speed.py").validate()

    # -- phases -----------------------------------------------------------------------------------
    def warm_jobs(self) -> list:
        """Every compile the requested phases will need, slowest kinds first so they never form the tail."""
        dev, phases = str(self.device), self.args.phases
        jobs = []
        if "models" in phases:  # in the phase's own order (the highest priority first); a model's own
            # attention in eager mode compiles nothing, and CUDA graphs need CUDA
            config = self.model_config()
            jobs += [("models", warm.warm_model, (dev, case.model.name, case.attention, case.mode, config.size,
                                                  config.batch)) for case in model_bench.plan(config)
                     if not (case.mode == "eager" and case.attention == OWN)
                     and not (case.mode == "cudagraphs" and self.device.type != "cuda")]
        if "compile" in phases:
            jobs += [("compile", warm.warm_compile, (dev, name)) for name in compile_check.NAMES]
        for name in phases:
            if name in self.extra:
                jobs += self.extra[name].warm_jobs(self)
        if "speed" in phases:
            jobs += [("speed", warm.warm_speed, (dev, c.label, grid.row_fields(p))) for c, p in self.plan()]
        if "correctness" in phases:
            jobs += [("correctness", warm.warm_correctness, (dev, v, spec, b, shape, str(dt).replace("torch.", "")))
                     for v, spec, b, shape, dt in correctness.cases(self.device, self.dtypes)]
        return jobs

    def phase_warm(self):
        jobs = self.warm_jobs()
        self.log(f"warm: {len(jobs)} jobs on {self.args.workers} workers ({self.args.model_workers} for models)")
        return warm.warm(jobs, self.args.workers, self.deadline("warm"), self.log,
                         limits={"models": self.args.model_workers})

    def phase_speed(self):
        from attnzoo.ops.kernels.pointwise import triton as pointwise
        default_sigmoid = pointwise.FAST_SIGMOID  # a sigmoid case selects its evaluation; later phases get the default
        try:
            return self._speed_rows()
        finally:
            pointwise.FAST_SIGMOID = default_sigmoid

    def _speed_rows(self):
        from attnzoo.bench.timing import time_directions
        deadline = self.deadline("speed")
        measured = Extrapolation()   # ms per call, keyed by the case and everything of the shape but N
        for case, problem in self.plan():
            row = {"case": case.label, "table_variant": case.table_variant, "flavour": case.flavour.name,
                   "backend": case.backend, **grid.row_fields(problem)}
            key, n, work = (case.label, problem.shape.head_dim, problem.causal), problem.shape.seq_q, case.flops(problem)
            predicted = measured.predict(key, n, work)
            if time.time() > deadline:
                row["skipped"] = "speed phase deadline reached"
            elif predicted is not None and predicted > self.args.max_call_ms:
                row["skipped"] = f"predicted {predicted:.0f} ms per call from smaller N > --max-call-ms"
            else:
                try:
                    prepared = case.prepare(problem)
                    row.update(time_directions(prepared.forward, prepared.leaves, self.device))
                    measured.record(key, n, work, row.get("fwd+bwd", row.get("fwd")))
                    del prepared
                except (ValueError, errors.Unsupported) as e:  # a backend refusing this call says why
                    row["skipped"] = f"refused: {e}"[:300]
                except (errors.Unavailable, errors.Skipped) as e:
                    row["skipped"] = str(e)[:300]
                except Exception as e:  # noqa: BLE001 - a failure is a result
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
                    row["trace"] = traceback.format_exc()[-600:]
                finally:
                    if self.device.type == "cuda":
                        torch.cuda.empty_cache()
            self._emit(row)
        return self.rows

    def _emit(self, row):
        self.rows.append(row)
        self.rows_file.row(row)
        timings = " ".join(f"{d} {row[d]:.3f} ms" for d in DIRECTIONS if d in row)
        self.log(f"{row['case']:<34} D{row['head_dim']} N{row['n']}{' causal' if row['causal'] else ''}: "
                 f"{timings or row.get('skipped') or row.get('error')}")

    @property
    def dtypes(self):
        if self.device.type != "cuda":
            return [torch.float32]
        return [getattr(torch, name) for name in self.args.correctness_dtypes]

    def phase_correctness(self):
        return correctness.run(self.device, self.dtypes, self.deadline("correctness"), self.log)

    def phase_models(self):
        """The model benchmark with what is left of this phase's share as its budget; every case is
        logged (models.jsonl, here and in --mirror) the moment it finishes."""
        config = self.model_config(budget=max(1.0, self.deadline("models") - time.time()))

        def on_start(head):
            self.models_head = head
            self.models_file.start(head)

        def on_row(row):
            self.models_rows.append(row)
            self.models_file.row(row)
            self.log("models " + model_row_line(row))

        self.models_result = model_bench.run(config, progress=False, on_start=on_start, on_row=on_row)
        return self.models_result["results"]

    def _models_so_far(self) -> Optional[dict]:
        """The model benchmark's result, also when the run was stopped mid-phase (SIGINT from the
        device call's time limit): rebuilt from the cases that finished."""
        if self.models_result is None and self.models_head is not None and self.models_rows:
            result = model_bench.finish(self.models_head, list(self.models_rows))
            result["settings"].update(rows_logged=len(self.models_rows), complete=False)
            return result
        return self.models_result

    def phase_compile(self):
        return compile_check.run(self.device, self.deadline("compile"), self.log)

    # -- outputs ----------------------------------------------------------------------------------
    def write(self, results: dict):
        rows = self.rows
        meta = {"device": self.info, "args": {k: str(v) for k, v in vars(self.args).items()},
                "seconds": round(time.time() - self.start, 1)}
        write_json({"meta": meta, "rows": rows}, self.out / "speed.json")
        for name in ("correctness", "compile", "warm", *self.extra):
            if results.get(name) is not None:
                write_json({"meta": meta, "rows": results[name]}, self.out / f"{name}.json")
        models = self._models_so_far()
        if models is not None:
            from attnzoo.bench.output import write_models_outputs
            files = write_models_outputs(models, self.out, "models")
            if self.args.mirror is not None:
                write_text(files["markdown"].read_text(), self.args.mirror / "models.md")
        if rows:
            write_text(speed_report(rows, self.info), self.out / "speed.md")
            write_json(measured_table(rows, self.info), self.out / "measured_table.json")
            try:
                plot_speed(rows, self.out / "speed.png")
            except Exception as e:  # noqa: BLE001 - the numbers matter more than the picture
                self.log(f"plot failed: {e}")
        self.log(f"wrote {self.out}")


def report_only(args) -> int:
    """--from-results: the outputs of earlier runs' rows, merged (no run shares a shape with another)."""
    rows, meta = [], None
    for path in args.from_results:
        data = json.loads(path.read_text())
        meta = meta or data["meta"]
        done = [r for r in data["rows"] if "deadline" not in r.get("skipped", "")]  # rows a run got to
        seen = {(r["case"], r["head_dim"], r["n"], r["causal"]) for r in rows}
        clash = [r["case"] for r in done if (r["case"], r["head_dim"], r["n"], r["causal"]) in seen]
        if clash:
            raise SystemExit(f"--from-results: {path} measures again what an earlier file measured: {clash[:3]}")
        rows += done
    out = args.out or ROOT / "benchmarks" / "results" / "gpu" / "merged"
    out.mkdir(parents=True, exist_ok=True)
    write_json({"meta": meta, "rows": rows}, out / "speed.json")
    write_text(speed_report(rows, meta["device"]), out / "speed.md")
    write_json(measured_table(rows, meta["device"]), out / "measured_table.json")
    try:
        plot_speed(rows, out / "speed.png")
    except Exception as e:  # noqa: BLE001 - the numbers matter more than the picture
        print(f"plot failed: {e}")
    print(f"wrote {out}")
    return 0


def main(argv=None, extra: tuple = ()) -> int:
    args = parse(argv, extra)
    if args.from_results:
        return report_only(args)
    torch._dynamo.config.cache_size_limit = 256
    if hasattr(torch._dynamo.config, "recompile_limit"):
        torch._dynamo.config.recompile_limit = 256
    session = Session(args, extra)
    session.log(f"device {session.info}; budget {args.budget_seconds:.0f} s; phases {args.phases}")
    results = {}
    try:
        for phase in session.order:
            if phase in args.phases:
                session.log(f"phase {phase}")
                try:
                    run = session.extra[phase].run if phase in session.extra else getattr(session, f"phase_{phase}")
                    results[phase] = run(session) if phase in session.extra else run()
                except Exception as e:  # noqa: BLE001 - later phases still run
                    session.log(f"phase {phase} failed: {type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}")
                session.write(results)
    finally:
        session.write(results)
    return 0
