"""The benchmark pages, generated from the committed result JSONs by benchmarks/render_readme.py: the full
page (docs/benchmarks.md, :func:`render`) and the README's short section between its bench markers
(:func:`front_page`). The GPU kernel table and the whole-model table come from the newest GPU results
(``gpu_section``, ``models_section``), the CPU tables from the CPU sweep and the overhead benchmark.
Nothing in them is typed by hand except the prose."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from attnzoo.bench.errors import OK
from attnzoo.bench.report import (_md_escape, cost_model_markdown, fmt_bytes, fmt_time, markdown_summary, models_settings_line,
                     models_summary_markdown, overhead_markdown, speed_summary_markdown, settings_line)
from attnzoo.bench.schema import load_any

HOW_TO = """\
```bash
attnzoo bench                                   # all ten variants, every backend, N 256 and 1024, fwd and fwd+bwd
attnzoo bench --variants softmax "sinkhorn(n_iters=5)" linear --seq-lens 1024 4096 --mode fwd+bwd
attnzoo bench --causal --dtype bfloat16 --heads 16 --head-dim 128 --out runs/bench/mine
attnzoo bench --compare benchmarks/results/cpu/bench_cpu.json   # this run against a saved one
attnzoo bench --compare OLD.json NEW.json                       # two saved runs, no benchmarking
attnzoo bench --budget-seconds 300 --call-timeout-seconds 60 --skip-backends torch-flex,flex   # bounded
attnzoo bench --from-jsonl runs/bench/x/bench.jsonl             # the result of a run that was killed
attnzoo bench --models                                          # whole models' training throughput (below)
attnzoo bench --models vit_s gpt2 --variants softmax l2 --model-modes eager compile --device cuda
attnzoo bench --overhead --out benchmarks/results/cpu           # per-call overhead at tiny shapes, CPU
```
Each run writes `NAME.jsonl` while it runs (a header line, then one line per finished row, flushed at
once), then `NAME.json` (every measurement and the environment), `NAME.md` (tables) and
`NAME_time_*.png` / `NAME_memory_*.png` (log-log plots; no memory plot with `--no-memory`; the plots
an earlier run of the same NAME left in `--out` are removed first) to `--out`, and prints a table. On a terminal
a progress bar shows while it runs; when the output is a pipe or a log, one plain line per finished
row instead (variant, backend, N, heads when `--heads` names several, mode, status, median time, x SDPA,
first-call time); the terminal and `--compare` tables add an `H x D` column then too. If the run is
killed, `--from-jsonl` rebuilds the JSON, Markdown and plots from the rows it finished. Variants are names or spec strings; `--backends` filters attnzoo's
backends (`reference`, `torch`, `cpu`, `triton`, ..., `auto`) and the baselines (`sdpa`,
`sdpa-flash`, `sdpa-efficient`, `sdpa-cudnn`, `sdpa-math`, `torch-flex`, `flash-attn`, `fla`,
`torch-mha`). A spec that `attnzoo.create` refuses (`"l2(foo=1)"`, `"sinkhorn(n_iters=-1)"`) and
`--device cuda` where no GPU is visible stop the command before any work, in one error line.
Standard runs: `benchmarks/sweep_cpu.py` (CPU) and `benchmarks/gpu_speed.py` (GPU, docs/gpu.md); this
page: `benchmarks/render_readme.py`. One harness serves all three benchmarks: `attnzoo.bench.timing`
times everything, `attnzoo.bench.report` writes every table, and one grid of cases (a variant spec
through one backend, or a baseline, with a flavour of inputs) serves `attnzoo bench`, the GPU run
and the measured ranking tables `auto` reads, with one rule for skipping a row predicted too slow
(its time at the largest smaller N, scaled by the FLOP count).

**Whole models** (`--models`; default all four, each variant of `--variants` or the model's own list):
timm `vit_small_patch16_224` (224 x 224, N = 197, batch 128), Hugging Face BERT-base (`BertForMaskedLM`,
128 tokens, batch 64), GPT-2-small (`GPT2LMHeadModel`, 1024 tokens, causal, batch 8) and a Llama-style
model (`LlamaForCausalLM`, hidden 768, 12 layers, 12 query heads sharing 4 key/value heads, 1024 tokens,
causal, batch 8), all built from their configs (no download, dropout off). The variant goes in with
`attn_layer=attnzoo.layer(spec)` (timm) or `attnzoo.swap(model, spec)` (Hugging Face, built with
`attn_implementation="sdpa"`, its own attention and the baseline). Each (model, attention, mode) case
trains with AdamW (bf16 autocast on CUDA) in `eager`, `compile` (`torch.compile(model)`) or
`cudagraphs` (`mode="reduce-overhead"`; on a CPU that mode only compiles, so the case is recorded as
skipped with that reason) mode: warm-up steps (compilation and graph capture land there, their time
kept), blocks of steps timed with one synchronisation per block (images/s or tokens/s: the median
block), steps started on an idle GPU timed until the host returns (host ms per step), and a
torch.profiler pass counting kernel launches and CUDA-graph launches per step (aten ops per step on a
CPU) and the GPU's busy time. The ratio ("x own") divides by the model's own attention in the same
mode, measured in the same process; cases run model by model, eager before compiled before CUDA
graphs, the own attention first, each under its own deadline (`--case-seconds`,
`--compile-case-seconds`, `--budget-seconds`), so a slow compile is a skipped row, not a lost run.
Files: `models.json`, `models.md`, `models.jsonl`. `--model-size tiny` (the default on a CPU) keeps each
architecture at a few thousand parameters.

**Per-call overhead** (`--overhead`, CPU, one thread): what a call costs beyond its math, forward +
backward at B 1, H 2, N 16, D 8: the functional each name runs against `F.scaled_dot_product_attention`
(causal for `masked`), and `attnzoo.create(name, 64, 2)` against timm's `Attention(64, 2)`. The
candidates of a group are timed in interleaved rounds (every candidate once a round, 5 calls a sample,
the order rotating), so machine noise hits them alike; figures are medians over rounds, ratios the
median of per-round ratios. Files: `overhead.json`, `overhead.md`.
"""

WHAT = """\
- **Rows**: every (variant, backend, N, dtype, mode). A variant's backends are those registered with
  the dispatcher for its kernel, plus `auto` (shown as `auto -> <backend it picked>`; when that
  backend was already measured on the same problem the measurement is shared, not repeated).
  `masked` is causal attention through `attnzoo.functional.masked` (kind softmax by default), so its
  baseline is causal SDPA. `multihead` is the `attnzoo.MultiheadAttention` module (kind softmax by
  default) *with* its input/output projections, against `torch.nn.MultiheadAttention`.
- **Baselines in the same run**: torch SDPA (default dispatch, and each backend it offers on the
  device), FlexAttention (CUDA only; softmax, L2 and first-order Fenchel are expressible, the
  others are recorded as not expressible), flash-attn and flash-linear-attention (recorded as
  not installed when absent).
- **Status**: `ok`, `oom`, `n/a` (unsupported, with the dispatcher's reason), `not installed`,
  `skipped` (measured or predicted - from the same row at the largest smaller N, scaled by FLOPs - slower
  than `--max-call-seconds`, an eager reference estimated larger than the host memory limit, a call
  interrupted past `--call-timeout-seconds`, `--budget-seconds` used up, or a backend left out with
  `--skip-backends`) or `error` - never a crash. Every reason is kept in the JSON and
  listed under the tables.
- **Timing**: one rule on every device. The first call is the warm-up (torch.compile, Triton JIT and
  autotuning land there; its time is kept as `first_call_s`); the second call measures the steady
  cost: slower than `--max-call-seconds` it is skipped with that time, slower than
  `--once-above-seconds` it is the only sample ("1 run" in the tables: with seconds per call the
  spread of a few runs tells little), slower than `--slow-call-seconds` on CUDA it is followed by a
  few CUDA-event repeats; otherwise median and spread (p20-p80) of repeated calls
  (`time.perf_counter` on CPU, `triton.testing.do_bench` on CUDA). On CPU a call predicted slower
  than `--once-above-seconds` runs once, giving both its time and its peak memory.
- **x SDPA**: time (and peak memory) divided by torch SDPA softmax with default dispatch on the same
  problem and causality, measured in the same run.
"""


def _relative(path: Path, start: Path) -> str:
    return os.path.relpath(path, start).replace(os.sep, "/")


def _methods(result: dict) -> str:
    m = result.get("methods", {})
    return "\n".join(f"- **{k}**: {v}" for k, v in m.items())


def _flop_table(result: dict) -> str:
    conv = result["flop_conventions"]
    lines = ["| variant | forward FLOPs |", "|---|---|"]
    lines += [f"| {v} | {_md_escape(f)} |" for v, f in conv["forward"].items()]
    lines += ["", f"{conv['backward']}. B batch, H heads, N/Nq/Nk sequence lengths, D and Dv head dims; only "
                  "multiply-adds of matrix products are counted (2 FLOPs each), so TFLOP/s is a rescaled "
                  "throughput, comparable between backends of one variant."]
    return "\n".join(lines)


def headline(result: dict, modes=("fwd", "fwd+bwd")) -> str:
    """Per variant at the largest N measured: the fastest attnzoo backend next to the eager reference."""
    rows = [r for r in result["results"] if r["status"] == OK and r["kind"] == "attnzoo" and r["backend"] != "auto"]
    if not rows:
        return "_no successful attnzoo rows_"
    out = ["| variant | mode | N | fastest backend | time | x SDPA | peak memory | eager reference | "
           "reference memory |", "|---|---|---|---|---|---|---|---|---|"]
    variants = list(dict.fromkeys(r["variant"] for r in result["results"]))
    for mode in modes:
        for variant in variants:
            mine = [r for r in rows if r["variant"] == variant and r["mode"] == mode]
            if not mine:
                continue
            n = max(r["seq_len"] for r in mine)
            best = min((r for r in mine if r["seq_len"] == n), key=lambda r: r["time_s"]["median"])
            ref = next((r for r in result["results"] if r["variant"] == variant and r["mode"] == mode
                        and r["seq_len"] == n and r["backend"] == "reference"), None)
            if ref is None:
                ref_time = ref_mem = ""
            elif ref["status"] == OK:
                ref_time, ref_mem = fmt_time(ref["time_s"]["median"]), fmt_bytes(ref.get("peak_memory_bytes"))
            else:
                ref_time, ref_mem = ref["status"], ""
            ratio = best.get("ratio_time_vs_sdpa")
            out.append(f"| {variant} | {mode} | {n} | {best['backend']} | {fmt_time(best['time_s']['median'])} | "
                       f"{'' if ratio is None else f'{ratio:.3g}x'} | {fmt_bytes(best.get('peak_memory_bytes'))} | "
                       f"{ref_time} | {ref_mem} |")
    return "\n".join(out)


def _plots(result_path: Path, doc_dir: Path) -> str:
    stem = result_path.stem  # time_/memory_ after the stem: "d64" must not pick up "d64_causal"'s plots
    pngs = sorted(p for metric in ("time", "memory") for p in result_path.parent.glob(f"{stem}_{metric}_*.png"))
    return "\n".join(f"![{p.stem}]({_relative(p, doc_dir)})" for p in pngs)


def _result_section(title: str, result: dict, path: Path, doc_dir: Path) -> str:
    parts = [f"### {title}", "", settings_line(result), ""]
    notes = result["settings"].get("notes")
    if notes:
        parts += [f"Notes: {notes}", ""]
    if result["settings"].get("rebuilt_from_rowlog") and not result["settings"].get("complete"):
        s = result["settings"]
        parts += [f"Partial run: rebuilt from its row log `{s['rebuilt_from_rowlog']}` with {s.get('rows_logged')} of "
                  f"{s.get('planned_rows', '?')} planned rows (the process stopped before the end).", ""]
    parts += [f"Source: [`{_relative(path, doc_dir)}`]({_relative(path, doc_dir)}) "
              f"(wall time {result['settings'].get('wall_seconds', '?')} s)", "",
              "Fastest attnzoo backend per variant at the largest N:", "", headline(result), "",
              _plots(path, doc_dir), "", "<details><summary>every variant, backend and N</summary>", "",
              markdown_summary(result["results"]), "</details>", ""]
    return "\n".join(parts)


@dataclass
class GpuSection:
    """The GPU measurement's generated tables (benchmarks/gpu_speed.py), as the renderer hands them."""
    device: str
    summary: str                 # the fastest attnzoo backend per variant vs SDPA (Markdown table)
    cost_model: str              # Sinkhorn / linear / OT as multiples of SDPA's time (Markdown table)
    source: Path                 # the speed.md with every row
    plot: Optional[Path] = None
    settings: str = ""
    models: Optional["ModelsSection"] = None   # the whole-model benchmark, shown beside the kernel table


def _newest(gpu_dir: Path, name: str) -> Optional[Path]:
    found = sorted(Path(gpu_dir).glob(f"*/{name}"), key=lambda p: p.stat().st_mtime, reverse=True)
    return found[0] if found else None


def gpu_section(gpu_dir: Path) -> Optional[GpuSection]:
    """The newest committed GPU results as the tables the pages show, or None: the kernel measurement
    (benchmarks/results/gpu/<device>/speed.json, written by benchmarks/gpu_speed.py) and the whole-model
    benchmark (models.json, ``models_section``)."""
    models = models_section(gpu_dir)
    path = _newest(gpu_dir, "speed.json")
    data = json.loads(path.read_text()) if path is not None else {"rows": []}
    rows = data["rows"]
    if not rows:
        if models is None:
            return None
        return GpuSection(device=models.result["environment"].get("device_name", "GPU"), summary="", cost_model="",
                          source=models.source, models=models)
    device = data["meta"]["device"]
    shape = next((r for r in rows if r.get("fwd")), {})
    settings = (f"torch {device['torch']}, triton {device.get('triton')}, {shape.get('dtype', '')}, "
                "FlashAttention's benchmark shapes (batch x N = 16384 tokens, hidden 2048), "
                "`triton.testing.do_bench` medians.")
    plot = path.with_name("speed.png")
    return GpuSection(device=device["name"], summary=speed_summary_markdown(rows), cost_model=cost_model_markdown(rows),
                      source=path.with_name("speed.md"), plot=plot if plot.exists() else None, settings=settings,
                      models=models)


@dataclass
class ModelsSection:
    """The whole-model benchmark's GPU result (attnzoo bench --models, or gpu_speed.py's models phase)."""
    result: dict
    source: Path                 # its models.json


def models_section(gpu_dir: Path) -> Optional[ModelsSection]:
    """The newest committed GPU model benchmark (benchmarks/results/gpu/<device>/models.json) with at
    least one finished case, or None."""
    path = _newest(gpu_dir, "models.json")
    if path is None:
        return None
    result = load_any(path)
    if not any(r["status"] == OK for r in result["results"]):
        return None
    return ModelsSection(result, path)


def _models_part(models: ModelsSection, doc_dir: Path) -> list[str]:
    src = _relative(Path(models.source).resolve(), doc_dir)
    md = _relative(Path(models.source).with_suffix(".md").resolve(), doc_dir)
    return [f"Whole models ({models.result['environment'].get('device_name')}): training throughput with each "
            "variant swapped in, and in brackets its ratio to the model's own attention (timm's Attention, Hugging "
            "Face's sdpa) in the same mode, measured side by side in one process (`attnzoo bench --models`; bf16 "
            "autocast, AdamW). " + models_settings_line(models.result) + ".", "",
            models_summary_markdown(models.result), "",
            f"Launches, host and GPU time per step of every case: [`{md}`]({md}) (data: [`{src}`]({src})).", ""]


def _overhead_part(overhead: tuple[dict, Path], doc_dir: Path) -> list[str]:
    result, path = overhead
    s, env = result["settings"], result["environment"]
    src = _relative(Path(path).resolve(), doc_dir)
    load = env.get("load_average")
    busy = f" (load average {load[0]:.3g} at the end: the machine's other jobs)" if load else ""
    return ["### Per-call overhead (CPU)", "",
            f"What a call costs beyond its math: forward + backward at B {s['batch']}, H {s['heads']}, "
            f"N {s['seq_len']}, D {s['head_dim']} (layers: width {s['dim']}, {s['layer_heads']} heads) on "
            f"{env.get('device_name')}{busy}, {s['threads']} thread, {s['rounds']} interleaved rounds of {s['inner']} calls "
            f"(medians; ratio = median of per-round ratios), torch {env.get('torch')}, {result['created'][:10]}. "
            f"`attnzoo bench --overhead`; data: [`{src}`]({src}).", "", overhead_markdown(result)]


def _gpu_part(gpu: GpuSection, doc_dir: Path, full: bool) -> list[str]:
    parts = _kernel_part(gpu, doc_dir, full) if gpu.summary else []
    if gpu.models is not None:
        parts += _models_part(gpu.models, doc_dir)
    elif full:
        parts += [NO_MODELS, ""]
    return parts


def _kernel_part(gpu: GpuSection, doc_dir: Path, full: bool) -> list[str]:
    src = _relative(Path(gpu.source).resolve(), doc_dir)
    parts = [f"GPU ({gpu.device}): SDPA's default softmax time divided by the fastest attnzoo backend's time for "
             "the same call, measured side by side in one process (higher is faster; 1.0 = as fast as cuDNN "
             "softmax). " + gpu.settings, "", gpu.summary, ""]
    if full:
        parts += ["Sinkhorn, linear and OT against their cost models, as multiples of SDPA's time, with extra "
                  "peak memory:", "", gpu.cost_model, ""]
        if gpu.plot is not None:
            plot = _relative(Path(gpu.plot).resolve(), doc_dir)
            parts += [f"![GPU speed]({plot})", ""]
    parts += [f"Every row (each backend, shape, memory, first-call time): [`{src}`]({src}). Kernels rebuilt "
              "since a measurement are listed, with what they change and what is still unmeasured, in "
              "docs/gpu.md (\"What is left on a GPU\").", ""]
    return parts


def _sources(cpu, gpu, overhead=None) -> list:
    models = gpu.models if gpu is not None else None
    return ([cpu[1]] if cpu else []) + ([gpu.source] if gpu and gpu.summary else []) + (
        [models.source] if models else []) + ([overhead[1]] if overhead else [])


def render(cpu: Optional[tuple[dict, Path]], gpu: Optional[GpuSection], doc_path: Path,
           overhead: Optional[tuple[dict, Path]] = None) -> str:
    """The Markdown of the benchmark page: ``cpu`` is (result, path of its JSON), ``gpu`` the GPU
    results' tables (kernels, whole models) or None, ``overhead`` (result, path) of the CPU overhead
    benchmark."""
    doc_dir = Path(doc_path).resolve().parent
    sources = _sources(cpu, gpu, overhead)
    parts = [f"<!-- generated by benchmarks/render_readme.py from "
             f"{', '.join(_relative(Path(p).resolve(), doc_dir) for p in sources) or 'no results'}; "
             f"do not edit by hand -->", "", "## Benchmarks", "",
             "Which attention can you afford at your sequence length? `attnzoo bench` answers with time, "
             "TFLOP/s, tokens/s and peak memory of every variant and backend, side by side with torch SDPA "
             "in the same run; on a GPU, `benchmarks/gpu_speed.py` measures every backend against SDPA's "
             "cuDNN and FlashAttention-2 kernels and FlexAttention in a few minutes.", "", HOW_TO,
             "### What is measured", "", WHAT, _methods(cpu[0]) if cpu else "", "", "### FLOP counts", "",
             _flop_table(cpu[0]) if cpu else "", ""]
    if gpu is not None:
        parts += [f"### GPU results: {gpu.device}", ""] + _gpu_part(gpu, doc_dir, full=True)
    else:
        parts += ["### GPU results", "",
                  "None committed: `benchmarks/gpu_speed.py` (FlashAttention's shapes: batch x N = 16k tokens, "
                  "hidden 2048, head dim 64 and 128, bf16, causal and not) writes them to "
                  "benchmarks/results/gpu/<device>/; `benchmarks/render_readme.py` then adds its tables here.", ""]
    if gpu is None:
        parts += ["### Whole models on a GPU", "", NO_MODELS, ""]
    if overhead is not None:
        parts += _overhead_part(overhead, doc_dir)
    if cpu:
        parts.append(_result_section(f"CPU results ({cpu[0]['created'][:10]})", cpu[0], Path(cpu[1]).resolve(),
                                     doc_dir))
    return "\n".join(parts).rstrip() + "\n"


NO_MODELS = ("Whole models: not measured on a GPU yet. `attnzoo bench --models` (or the models phase of `benchmarks/gpu_speed.py`, "
             "docs/gpu.md) writes `models.json` / `models.md` to benchmarks/results/gpu/<device>/, and "
             "`benchmarks/render_readme.py` then adds the table here and to the README.")


def front_page(cpu: Optional[tuple[dict, Path]], gpu: Optional[GpuSection], doc_path: Path,
               full_page: Optional[Path] = None) -> str:
    """The README's short benchmark section: the GPU kernel summary table when there is one (else the
    CPU headline: fwd+bwd, the fastest attnzoo backend per variant at the largest N), beside it the
    whole-model table when a GPU model benchmark is committed, and a link to the full page
    (``full_page``, written by :func:`render`)."""
    doc_dir = Path(doc_path).resolve().parent
    sources = _sources(cpu, gpu)
    parts = [f"<!-- generated by benchmarks/render_readme.py from "
             f"{', '.join(_relative(Path(p).resolve(), doc_dir) for p in sources) or 'no results'}; "
             f"do not edit by hand -->", "", "## Benchmarks", ""]
    if gpu is not None:
        parts += _gpu_part(gpu, doc_dir, full=False)
    elif cpu is not None:
        result, path = cpu
        where = result["environment"].get("device_name") or result["settings"].get("device")
        parts += [f"Training step (forward + backward) at the largest N measured on {where} ({result['created'][:10]}): "
                  "the fastest attnzoo backend per variant, its time relative to torch SDPA softmax in the same run, "
                  "and the eager reference (the formula, materialising N x N) for comparison.", "",
                  settings_line(result), "", headline(result, modes=("fwd+bwd",)), "",
                  f"Source: [`{_relative(Path(path).resolve(), doc_dir)}`]({_relative(Path(path).resolve(), doc_dir)}).",
                  ""]
    else:
        parts += ["No committed benchmark results yet: `attnzoo bench` measures them.", ""]
    if full_page is not None:
        link = _relative(Path(full_page).resolve(), doc_dir)
        parts += [f"Every variant, backend, N and mode, the method and the FLOP counts: [{link}]({link}).", ""]
    return "\n".join(parts).rstrip() + "\n"
