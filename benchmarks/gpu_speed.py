"""One GPU measurement that always comes back, in a few minutes.

    python3 benchmarks/gpu_speed.py [--out DIR] [--budget-seconds 420] [--phases warm speed correctness train compile]

Phases, each with its own deadline, all results flushed as they come (rows.jsonl) so a killed run
still leaves everything measured so far:
1. warm: worker processes launch every case once, filling Triton's and inductor's on-disk caches
   (compiles run in parallel; the main process then loads them);
2. speed: FlashAttention's benchmark shapes (batch * N = 16384 tokens, hidden 2048; D 64 / 128,
   N 1024 / 4096 / 16384, causal and not, bf16): SDPA's default dispatch, its FlashAttention-2,
   cuDNN and memory-efficient kernels, FlexAttention, and every attnzoo backend of every variant
   that runs on CUDA; median ms of the forward and of forward + backward (triton.testing.do_bench),
   the extra peak memory of each; rows whose time extrapolated from a smaller N exceeds
   --max-call-ms are skipped as such;
3. correctness: every CUDA backend against float64 at awkward shapes (bf16, fp16, fp32);
4. train: timm ViT-S/16 training images/s with each layer;
5. compile: torch.compile(fullgraph=True) of every layer with the default backend;
6. paper: paper 004's ViT and OT-ViT training images/s (attnzoo.train.throughput), compiled and eager.
Outputs (in --out, default benchmarks/results/gpu/<device>): speed.json, speed.md (the fastest
attnzoo backend per variant against SDPA + every row), speed.png, correctness.json, train.json, compile.json,
paper.json, rows.jsonl, log.txt, and measured_table.json, which is what attnzoo/ops/measured_tables/<device>.json
(read by ``auto``) is copied from.

On a CPU it runs as a dry run of its own code (--device cpu with tiny shapes; the Triton backends
under TRITON_INTERPRET=1).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

from gpu import cases as C  # noqa: E402
from gpu import compile_check, correctness, paper_speed, report, timing, train_speed, warm  # noqa: E402

PHASES = ("warm", "speed", "correctness", "train", "compile", "paper")
# share of the budget each phase may use (what a phase leaves unused goes to the next ones)
SHARES = {"warm": 0.32, "speed": 0.33, "correctness": 0.12, "train": 0.12, "compile": 0.11, "paper": 0.15}


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--budget-seconds", type=float, default=420)
    p.add_argument("--phases", nargs="+", choices=PHASES, default=list(PHASES))
    p.add_argument("--device", default="cuda")
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--causal", nargs="+", choices=("no", "yes"), default=["no", "yes"])
    p.add_argument("--tokens", type=int, default=16384, help="batch * N")
    p.add_argument("--hidden", type=int, default=2048, help="heads * head dim")
    p.add_argument("--max-call-ms", type=float, default=1500.0)
    p.add_argument("--workers", type=int, default=max(1, min(14, (os.cpu_count() or 2) - 2)))
    p.add_argument("--train-batch", type=int, default=128)
    p.add_argument("--shapes", nargs="*", default=None, metavar="D:N:causal",
                   help="explicit shapes instead of head dims x seq lens x causal, e.g. 128:4096:no 64:16384:yes")
    p.add_argument("--only", nargs="*", default=None, help="substrings of case labels to keep")
    p.add_argument("--correctness-dtypes", nargs="+", choices=("bfloat16", "float16", "float32"),
                   default=["bfloat16", "float16", "float32"])
    p.add_argument("--train-layers", nargs="*", default=None, help="layer specs for the train phase (default: all)")
    p.add_argument("--paper-runs", nargs="*", default=None, help="run labels for the paper phase, '_' for ' ' (default: all)")
    p.add_argument("--from-results", nargs="+", type=Path, default=None, metavar="SPEED_JSON",
                   help="measure nothing: write the report, plot and ranking table of earlier runs' speed.json files "
                        "(their rows together; each row's ratios use the SDPA row of its own run and shape)")
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


class Run:
    def __init__(self, args):
        self.args = args
        self.device = torch.device(args.device)
        self.info = device_info(self.device)
        from attnzoo.ops.measured import slug
        self.out = args.out or ROOT / "benchmarks" / "results" / "gpu" / slug(self.info["name"])
        self.out.mkdir(parents=True, exist_ok=True)
        self.start = time.time()
        self.end = self.start + args.budget_seconds
        self.log_file = open(self.out / "log.txt", "w")
        self.rows_file = open(self.out / "rows.jsonl", "w")
        self.rows = []

    def log(self, msg: str) -> None:
        line = f"[+{time.time() - self.start:6.1f}s] {msg}"
        print(line, flush=True)
        self.log_file.write(line + "\n")
        self.log_file.flush()

    def deadline(self, phase: str) -> float:
        """This phase may run until its share of what is left, counting the phases still to come."""
        left = [p for p in PHASES if p in self.args.phases and PHASES.index(p) >= PHASES.index(phase)]
        share = SHARES[phase] / sum(SHARES[p] for p in left)
        return time.time() + share * max(0.0, self.end - time.time())

    def shapes(self):
        dtype = torch.bfloat16
        if self.args.shapes:
            out = []
            for spec in self.args.shapes:
                d, n, causal = spec.split(":")
                out += C.benchmark_shapes([int(d)], [int(n)], [causal == "yes"], self.args.tokens, self.args.hidden, dtype)
            return out
        return C.benchmark_shapes(self.args.head_dims, self.args.seq_lens, [c == "yes" for c in self.args.causal],
                                  self.args.tokens, self.args.hidden, dtype)

    def cases(self):
        cases = C.baseline_cases(self.device) + C.attnzoo_cases(self.device)
        if self.args.only:
            cases = [c for c in cases if any(s in c.label for s in self.args.only)]
        return cases

    def plan(self):
        """(case, shape) pairs, most informative first: N 4096 at D 64 first, then the rest by N."""
        shapes = sorted(self.shapes(), key=lambda s: (s.n != 4096, s.head_dim != 64, s.causal, s.n, s.head_dim))
        return [(c, s) for s in shapes for c in self.cases() if c.applies(s) and _flex_applies(c, s)]

    # -- phases -----------------------------------------------------------------------------------
    def warm_jobs(self) -> list:
        """Every compile the requested phases will need, slowest kinds first so they never form the tail."""
        dev, phases = str(self.device), self.args.phases
        jobs = []
        if "compile" in phases:
            jobs += [("compile", (dev, name)) for name in compile_check.NAMES]
        if "train" in phases:
            jobs += [("train", (dev, spec, self.train_batch)) for spec in self.train_layers]
        if "paper" in phases:
            jobs += [("paper", (dev, label)) for label in self.paper_runs]
        if "speed" in phases:
            jobs += [("speed", (dev, c.label, _shape_fields(s))) for c, s in self.plan()]
        if "correctness" in phases:
            jobs += [("correctness", (dev, v, spec, b, shape, str(dt).replace("torch.", "")))
                     for v, spec, b, shape, dt in correctness.cases(self.device, self.dtypes)]
        return jobs

    def phase_warm(self):
        jobs = self.warm_jobs()
        self.log(f"warm: {len(jobs)} jobs on {self.args.workers} workers")
        return warm.warm(jobs, self.args.workers, self.deadline("warm"), self.log)

    def phase_speed(self):
        from attnzoo.ops.kernels.pointwise import triton as pointwise
        default_sigmoid = pointwise.FAST_SIGMOID  # a sigmoid case selects its evaluation; later phases get the default
        try:
            return self._speed_rows()
        finally:
            pointwise.FAST_SIGMOID = default_sigmoid

    def _speed_rows(self):
        deadline = self.deadline("speed")
        measured = {}
        for case, shape in self.plan():
            row = {"case": case.label, "table_variant": case.table_variant, "flavour": case.flavour,
                   "backend": case.backend, **_shape_fields(shape)}
            predicted = C.predicted_ms(measured, case, shape)
            if time.time() > deadline:
                row["skipped"] = "speed phase deadline reached"
            elif predicted is not None and predicted > self.args.max_call_ms:
                row["skipped"] = f"predicted {predicted:.0f} ms per call from smaller N > --max-call-ms"
            else:
                try:
                    built = case.build(shape, self.device, True)
                    row.update(timing.measure(built, self.device))
                    measured[(case.label, shape)] = row.get("fwd+bwd", row.get("fwd"))
                    del built
                except ValueError as e:  # a backend refusing this call says why
                    row["skipped"] = f"refused: {e}"[:300]
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
        self.rows_file.write(json.dumps(row, default=str) + "\n")
        self.rows_file.flush()
        timings = " ".join(f"{d} {row[d]:.3f} ms" for d in report.DIRECTIONS if d in row)
        self.log(f"{row['case']:<34} D{row['head_dim']} N{row['n']}{' causal' if row['causal'] else ''}: "
                 f"{timings or row.get('skipped') or row.get('error')}")

    @property
    def dtypes(self):
        if self.device.type != "cuda":
            return [torch.float32]
        return [getattr(torch, name) for name in self.args.correctness_dtypes]

    @property
    def train_batch(self):
        return self.args.train_batch if self.device.type == "cuda" else 2

    @property
    def train_layers(self):
        return self.args.train_layers if self.args.train_layers is not None else train_speed.LAYERS

    @property
    def paper_runs(self):
        if self.args.paper_runs is None:
            return [r[0] for r in paper_speed.RUNS]
        # "otvit_compiled" names the run "otvit compiled" (labels survive a shell's word splitting)
        runs = [label.replace("_", " ") for label in self.args.paper_runs]
        known = [r[0] for r in paper_speed.RUNS]
        unknown = [r for r in runs if r not in known]
        if unknown:
            raise SystemExit(f"--paper-runs: unknown runs {unknown}; known: {known}")
        return runs

    def phase_correctness(self):
        return correctness.run(self.device, self.dtypes, self.deadline("correctness"), self.log)

    def phase_train(self):
        steps = (3, 8) if self.device.type == "cuda" else (1, 1)
        return train_speed.run(self.device, self.deadline("train"), self.log, batch=self.train_batch,
                               warmup=steps[0], steps=steps[1], layers=self.train_layers)

    def phase_compile(self):
        return compile_check.run(self.device, self.deadline("compile"), self.log)

    def phase_paper(self):
        steps = (10, 50) if self.device.type == "cuda" else (1, 2)
        return paper_speed.run(self.device, self.deadline("paper"), self.log, steps=steps[1], warmup=steps[0],
                               runs=self.paper_runs)

    # -- outputs ----------------------------------------------------------------------------------
    def write(self, results: dict):
        rows = self.rows
        meta = {"device": self.info, "args": {k: str(v) for k, v in vars(self.args).items()},
                "seconds": round(time.time() - self.start, 1)}
        report.write_json({"meta": meta, "rows": rows}, self.out / "speed.json")
        for name in ("correctness", "train", "compile", "paper", "warm"):
            if results.get(name) is not None:
                report.write_json({"meta": meta, "rows": results[name]}, self.out / f"{name}.json")
        if rows:
            md = [f"# attnzoo on {self.info['name']} (torch {self.info['torch']}, triton {self.info['triton']})\n",
                  "Ratios are SDPA default time / path time (higher is faster; 1.0 = as fast as SDPA softmax), "
                  "measured side by side in one process by `benchmarks/gpu_speed.py`.\n",
                  "## Summary: the fastest attnzoo backend per variant\n", report.summary_markdown(rows),
                  "\n## Sinkhorn, linear and OT as multiples of SDPA's time (lower is faster)\n",
                  report.cost_model_markdown(rows),
                  "\n## Every row", report.full_markdown(rows)]
            (self.out / "speed.md").write_text("\n".join(md) + "\n")
            report.write_json(report.measured_table(rows, self.info), self.out / "measured_table.json")
            try:
                report.write_plot(rows, self.out / "speed.png")
            except Exception as e:  # noqa: BLE001 - the numbers matter more than the picture
                self.log(f"plot failed: {e}")
        self.log(f"wrote {self.out}")


def _shape_fields(shape) -> dict:
    d = dataclasses.asdict(shape)
    d["dtype"] = str(shape.dtype).replace("torch.", "")
    return d


def _flex_applies(case, shape) -> bool:
    """FlexAttention compiles one kernel per shape: the flex rows run at N 4096 only (one
    compile per head dim and causality instead of one per N)."""
    return not (case.backend == "flex" or case.label.startswith("flex")) or shape.n == 4096


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
    run = Run.__new__(Run)
    run.args, run.info, run.rows, run.start = args, meta["device"], rows, time.time()
    run.out = args.out or ROOT / "benchmarks" / "results" / "gpu" / "merged"
    run.out.mkdir(parents=True, exist_ok=True)
    run.log_file = open(os.devnull, "w")
    run.write({})
    return 0


def main(argv=None):
    args = parse(argv)
    if args.from_results:
        return report_only(args)
    torch._dynamo.config.cache_size_limit = 256
    if hasattr(torch._dynamo.config, "recompile_limit"):
        torch._dynamo.config.recompile_limit = 256
    run = Run(args)
    run.log(f"device {run.info}; budget {args.budget_seconds:.0f} s; phases {args.phases}")
    results = {}
    try:
        for phase in PHASES:
            if phase in args.phases:
                run.log(f"phase {phase}")
                try:
                    results[phase] = getattr(run, f"phase_{phase}")()
                except Exception as e:  # noqa: BLE001 - later phases still run
                    run.log(f"phase {phase} failed: {type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}")
                run.write(results)
    finally:
        run.write(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
