"""attnzoo bench: time, throughput and peak memory of every variant and backend against torch SDPA;
with --models, training throughput of whole models with each variant swapped in; with --overhead,
the per-call cost of each functional and layer at tiny shapes on the CPU."""
from __future__ import annotations

import datetime
from pathlib import Path

from . import UsageError

HELP = ("benchmark every attention variant and backend (time, TFLOP/s, tokens/s, peak memory) against SDPA; "
        "--models: whole models' training throughput; --overhead: per-call cost")

# CPU defaults are sized so the default run takes about a minute on a small machine; the GPU ones
# follow FlashAttention's benchmarks (batch * N = 16k tokens, hidden 2048, bf16).
CPU_DEFAULTS = {"seq_lens": [256, 1024], "dtypes": ["float32"], "batch_tokens": 1024, "max_call_seconds": 5.0,
                "call_timeout_seconds": None}
GPU_DEFAULTS = {"seq_lens": [512, 1024, 2048, 4096, 8192, 16384], "dtypes": ["bfloat16"], "batch_tokens": 16384,
                "max_call_seconds": 30.0, "call_timeout_seconds": 120.0}


def _dtype(text: str) -> str:
    import argparse

    from ..bench.runner import dtype_name
    try:
        return dtype_name(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


MODEL_MODES = ("eager", "compile", "cudagraphs")


def _names(text: str) -> list[str]:
    return [n for n in text.split(",") if n]


def add_arguments(parser) -> None:
    from ..bench.flops import MODES
    from ..bench.runner import DTYPES
    g = parser.add_argument_group("what to run")
    g.add_argument("--variants", nargs="+", default=None, metavar="SPEC",
                   help="variant names or spec strings such as 'sinkhorn(n_iters=5)' (default: every registered variant "
                        "and wrapper; with --models, each model's own list)")
    g.add_argument("--backends", nargs="+", default=None, metavar="NAME",
                   help="only these backends: attnzoo ones (reference, cpu, torch, triton, auto, ...) and baselines "
                        "(sdpa, sdpa-flash, sdpa-efficient, sdpa-cudnn, sdpa-math, torch-flex, flash-attn, fla, torch-mha). "
                        "SDPA with default dispatch is always measured: it is the anchor of the ratios")
    g.add_argument("--skip-backends", nargs="+", default=[], type=_names, metavar="NAME",
                   help="leave these backends / baselines out (space- or comma-separated, e.g. torch-flex,flex); "
                        "an 'auto' row whose pick is left out is recorded as skipped")
    g.add_argument("--seq-lens", nargs="+", type=int, default=None, metavar="N",
                   help="sequence lengths (default: 256 1024 on CPU; 512 ... 16384 on GPU)")
    g.add_argument("--dtype", nargs="+", default=None, type=_dtype, dest="dtypes", metavar="DTYPE",
                   help=f"{', '.join(DTYPES)} or bf16/fp16/fp32 (default: float32 on CPU, bfloat16 on GPU)")
    g.add_argument("--mode", nargs="+", default=["fwd", "fwd+bwd"], choices=list(MODES), dest="modes",
                   help="fwd (inference, no_grad) and/or fwd+bwd (default: both)")
    g.add_argument("--batch-tokens", type=int, default=None,
                   help="batch * N, fixed across N (batch = max(1, batch_tokens // N)); default 16384 on GPU, "
                        "1024 on CPU")
    g.add_argument("--head-dim", type=int, default=64)
    g.add_argument("--heads", nargs="+", type=int, default=None,
                   help="head counts (default: 1 on CPU; 2048 / head_dim on GPU, i.e. hidden 2048)")
    g.add_argument("--causal", action="store_true", help="causal attention for every variant ('masked' always is)")
    g.add_argument("--device", default=None, help="cpu or cuda[:i] (default: cuda when available)")
    g.add_argument("--threads", type=int, default=None, help="torch.set_num_threads on CPU")
    t = parser.add_argument_group("measurement")
    t.add_argument("--warmup", type=int, default=1,
                   help="warm-up calls, the first (compiling) call included; never timed (default 1)")
    t.add_argument("--min-repeats", type=int, default=3)
    t.add_argument("--repeats", type=int, default=10, dest="max_repeats",
                   help="at most this many timed calls (CPU, and slow calls on CUDA)")
    t.add_argument("--target-seconds", type=float, default=1.0,
                   help="calls timed one by one repeat until about this long per row")
    t.add_argument("--max-call-seconds", type=float, default=None,
                   help="skip a row whose time per call, measured (second call) or predicted from the previous N, "
                        "exceeds this (default 5 on CPU, 30 on GPU)")
    t.add_argument("--once-above-seconds", type=float, default=2.0,
                   help="a second call slower than this is the row's only sample (default 2)")
    t.add_argument("--slow-call-seconds", type=float, default=0.2,
                   help="CUDA: a call slower than this is timed with a few CUDA-event repeats instead of "
                        "triton.testing.do_bench (default 0.2)")
    t.add_argument("--call-timeout-seconds", type=float, default=None,
                   help="interrupt any single call (its first, compiling one included) after this long and record "
                        "the row as skipped (default: no limit on CPU, 120 on GPU)")
    t.add_argument("--budget-seconds", type=float, default=None,
                   help="stop measuring after this long: a call still running is interrupted and the remaining "
                        "rows are recorded as skipped; the outputs are written as usual")
    t.add_argument("--max-memory-gb", type=float, default=None,
                   help="CPU: skip eager-reference rows estimated above this (default: half the available memory)")
    t.add_argument("--no-memory", action="store_true", help="skip the peak-memory pass")
    t.add_argument("--seed", type=int, default=0)
    m = parser.add_argument_group("whole models (--models) and per-call overhead (--overhead)")
    m.add_argument("--models", nargs="*", default=None, metavar="MODEL",
                   help="train whole models instead of timing kernels: vit_s, gpt2, llama, llama_padded, llama_packed, "
                        "bert (no name: all six; llama_padded / llama_packed: one batch of mixed lengths padded or "
                        "packed into one row); "
                        "each variant of --variants swapped in against the model's own attention")
    m.add_argument("--model-modes", nargs="+", default=None, choices=MODEL_MODES, metavar="MODE",
                   help="eager, compile (torch.compile), cudagraphs (mode='reduce-overhead', CUDA only) (default: all)")
    m.add_argument("--model-size", choices=("full", "tiny"), default=None,
                   help="full (ViT-S batch 128, BERT-base 128 tokens, GPT-2 / Llama 1024 tokens) or tiny (the same "
                        "architectures at a few thousand parameters) (default: full on CUDA, tiny on CPU)")
    m.add_argument("--model-batch", type=int, default=None, help="batch size for every model (default: the size's)")
    m.add_argument("--model-warmup", type=int, default=None, help="warm-up steps per case (default 3 on CUDA, 1 on CPU)")
    m.add_argument("--model-steps", type=int, default=None, help="steps per timed block (default 4 on CUDA, 2 on CPU)")
    m.add_argument("--model-blocks", type=int, default=None, help="timed blocks per case (default 3)")
    m.add_argument("--profile-steps", type=int, default=None,
                   help="steps profiled for launches and aten ops per case (default 1)")
    m.add_argument("--case-seconds", type=float, default=90.0, help="an eager model case is interrupted past this")
    m.add_argument("--compile-case-seconds", type=float, default=240.0,
                   help="a compiled model case (compile, cudagraphs) is interrupted past this")
    m.add_argument("--compile-backend", default="inductor",
                   help="torch.compile backend of the compile mode (default inductor; aot_eager checks the path quickly)")
    m.add_argument("--overhead", action="store_true",
                   help="per-call overhead on the CPU at B 1, H 2, N 16, D 8, one thread, fwd+bwd: each functional "
                        "against F.scaled_dot_product_attention and each attnzoo.create(name, 64, 2) against timm's "
                        "Attention, interleaved rounds, medians")
    m.add_argument("--rounds", type=int, default=200, help="--overhead: interleaved rounds (default 200)")
    m.add_argument("--inner", type=int, default=5, help="--overhead: calls per sample (default 5)")
    o = parser.add_argument_group("output")
    o.add_argument("--out", type=Path, default=None,
                   help="folder for NAME.json, NAME.md and NAME_{time,memory}_*.png (default: runs/bench/<device>-<time>)")
    o.add_argument("--name", default=None,
                   help="file stem of the outputs (default: bench; models with --models, overhead with --overhead)")
    o.add_argument("--from-jsonl", type=Path, default=None, metavar="JSONL",
                   help="rebuild the result of a run from its row log (NAME.jsonl, written as rows finish, kept even "
                        "if the run was killed) and write NAME.json, .md and plots to --out (default: its folder)")
    o.add_argument("--compare", nargs="+", type=Path, default=None, metavar="JSON",
                   help="OLD.json: print speed-ups/regressions of this run against it; OLD.json NEW.json: compare "
                        "two saved runs without benchmarking")
    o.add_argument("--threshold", type=float, default=0.1, help="--compare: flag changes beyond this (default 0.1)")
    o.add_argument("--quiet", action="store_true",
                   help="no progress bar (on a terminal) and no line per row (when output is not a terminal)")


def _device(args) -> str:
    from ..bench.runner import default_device
    return args.device or ("cpu" if args.overhead else default_device())


def _config(args):
    import torch

    from ..bench.runner import BenchConfig, all_variants
    device = _device(args)
    defaults = GPU_DEFAULTS if torch.device(device).type == "cuda" else CPU_DEFAULTS
    heads = args.heads or ([max(1, 2048 // args.head_dim)] if torch.device(device).type == "cuda" else [1])
    return BenchConfig(
        variants=args.variants or all_variants(), backends=args.backends,
        seq_lens=args.seq_lens or defaults["seq_lens"], dtypes=args.dtypes or defaults["dtypes"], modes=args.modes,
        batch_tokens=args.batch_tokens if args.batch_tokens is not None else defaults["batch_tokens"],
        head_dim=args.head_dim, heads=heads, causal=args.causal, device=device, warmup=args.warmup,
        min_repeats=args.min_repeats, max_repeats=args.max_repeats, target_seconds=args.target_seconds,
        max_call_seconds=(args.max_call_seconds if args.max_call_seconds is not None
                          else defaults["max_call_seconds"]), max_memory_gb=args.max_memory_gb,
        once_above_seconds=args.once_above_seconds, budget_seconds=args.budget_seconds,
        slow_call_seconds=args.slow_call_seconds, skip_backends=[n for names in args.skip_backends for n in names],
        call_timeout_seconds=(args.call_timeout_seconds if args.call_timeout_seconds is not None
                              else defaults["call_timeout_seconds"]),
        measure_memory=not args.no_memory, seed=args.seed).validate()


def _model_config(args):
    from ..bench.model_bench import MODES, ModelBenchConfig
    from ..bench.model_zoo import MODELS
    return ModelBenchConfig(
        models=args.models or list(MODELS), variants=args.variants, modes=args.model_modes or list(MODES),
        size=args.model_size, batch=args.model_batch, device=_device(args), warmup=args.model_warmup,
        steps=args.model_steps, blocks=args.model_blocks, profile_steps=args.profile_steps,
        case_seconds=args.case_seconds, compile_case_seconds=args.compile_case_seconds,
        budget_seconds=args.budget_seconds, compile_backend=args.compile_backend, seed=args.seed).validate()


def _overhead_config(args):
    from ..bench.overhead import OverheadConfig
    return OverheadConfig(rounds=args.rounds, inner=args.inner, threads=args.threads or 1, seed=args.seed,
                          variants=args.variants).validate()


def _name(args, default: str) -> str:
    return args.name or default


def _compare_only(args, console, old, new) -> int:
    from ..bench import markdown_compare, rich_compare
    console.print(rich_compare(old, new, args.threshold))
    if args.out is not None:
        from ..bench.schema import write_text
        path = write_text(markdown_compare(old, new, args.threshold), args.out / f"{_name(args, 'bench')}_compare.md")
        console.print(f"wrote {path}")
    return 0


def _print(console, table, markdown: str) -> None:
    """A rich table, or its Markdown where rich is missing (a bare GPU box)."""
    try:
        console.print(table())
    except ImportError:
        print(markdown)


def _print_table(console, result) -> None:
    from ..bench.report import markdown_summary, rich_table
    _print(console, lambda: rich_table(result), markdown_summary(result["results"]))


def _console():
    try:
        from rich.console import Console
    except ImportError:
        class Console:  # the few calls made here, as plain prints
            is_terminal = False

            def __init__(self, **_):
                pass

            def print(self, *objects):
                print(*objects, flush=True)
        return Console()
    console = Console()
    return console if console.is_terminal else Console(width=160)  # logs and pipes: wide, no folding


def _from_rowlog(args, console) -> int:
    from ..bench import write_models_outputs, write_outputs
    from ..bench.report import models_summary_markdown, rich_models_table
    from ..bench.rowlog import load_rowlog
    from ..bench.schema import MODELS_SCHEMA
    result = load_rowlog(args.from_jsonl)
    name = _name(args, args.from_jsonl.stem)
    out = args.out or args.from_jsonl.parent
    if result["schema"] == MODELS_SCHEMA:
        files = {**write_models_outputs(result, out, name), "plots": []}
        _print(console, lambda: rich_models_table(result), models_summary_markdown(result))
    else:
        files = write_outputs(result, out, name)
        _print_table(console, result)
    s = result["settings"]
    console.print(f"rebuilt {s['rows_logged']} rows ({'complete' if s['complete'] else 'partial'} run) from "
                  f"{args.from_jsonl}; wrote {files['json']}, {files['markdown']} and {len(files['plots'])} plots")
    return 0


def known_backends() -> set[str]:
    """Every name --backends / --skip-backends can mean: attnzoo's backends of every variant, auto, baselines."""
    from ..bench.baselines import BASELINE_NAMES
    from ..bench.runner import all_variants
    from ..bench.targets import AUTO, parse_variant
    from ..ops import dispatch
    names = {AUTO, *BASELINE_NAMES}
    for v in all_variants():
        names.update(dispatch.backends(parse_variant(v).kernel))
    return names


def _check_variants(specs) -> None:
    from ..bench.targets import parse_variant
    for spec in specs or []:
        try:
            parse_variant(spec)
        except (ValueError, TypeError) as e:  # attnzoo.create's own message, after the spec it is about
            raise UsageError(f"--variants {spec!r}: {e}") from None


def _check_mode(args) -> None:
    """--models, --overhead, --compare OLD NEW and --from-jsonl each run something else: one at a time."""
    chosen = [flag for flag, on in (("--models", args.models is not None), ("--overhead", args.overhead),
                                    ("--from-jsonl", args.from_jsonl is not None)) if on]
    if args.compare is not None and (args.models is not None or args.overhead):
        chosen.append("--compare")
    if len(chosen) > 1:
        raise UsageError(f"{' and '.join(chosen)} do not combine: run one at a time")
    if args.overhead and args.device not in (None, "cpu"):
        raise UsageError(f"--overhead measures on the CPU (one thread, tiny shapes), not on --device {args.device}")


def check_arguments(args):
    """Every argument checked before any work (UsageError); returns the loaded --compare results."""
    import torch

    from ..bench import load
    if args.compare is not None and len(args.compare) > 2:
        raise UsageError("--compare takes OLD.json, or OLD.json NEW.json")
    if args.compare is not None and args.from_jsonl is not None:
        raise UsageError("--compare and --from-jsonl do not combine: rebuild the run first, then compare its JSON")
    _check_mode(args)
    for path in [*(args.compare or []), *([args.from_jsonl] if args.from_jsonl is not None else [])]:
        if not path.is_file():
            raise UsageError(f"{str(path)!r} does not exist")
    try:
        compared = [load(p) for p in args.compare or []]
    except ValueError as e:
        raise UsageError(f"--compare: {e}") from None
    if (args.compare is not None and len(args.compare) == 2) or args.from_jsonl is not None:
        return compared
    _check_variants(args.variants)
    known = known_backends()
    for option, names in (("--backends", args.backends or []),
                          ("--skip-backends", [n for group in args.skip_backends for n in group])):
        unknown = [n for n in names if n not in known]
        if unknown:
            raise UsageError(f"{option}: unknown backend(s) {unknown}; known: {', '.join(sorted(known))}")
    if args.threads is not None and args.threads < 1:
        raise UsageError(f"--threads must be >= 1, got {args.threads}")
    if args.device is not None:
        try:
            torch.device(args.device)
        except RuntimeError as e:  # torch's message names neither the option nor the value's origin
            raise UsageError(f"--device {args.device!r} is not a device: {' '.join(str(e).split())}") from None
    make = _model_config if args.models is not None else _overhead_config if args.overhead else _config
    try:
        config = make(args)
    except (ValueError, TypeError, RuntimeError) as e:  # RuntimeError: torch.device on a bad --device
        raise UsageError(" ".join(str(e).split())) from None
    check_device(getattr(config, "device", "cpu"))
    return compared


def check_device(device) -> None:
    """UsageError in one line when the device cannot run here (``--device cuda`` without a GPU)."""
    from ..bench.environment import unusable_device
    problem = unusable_device(device)
    if problem is not None:
        raise UsageError(problem)


def _out_dir(args, device: str, what: str = "") -> Path:
    if args.out is not None:
        return Path(args.out)
    from ..bench.environment import device_name
    from ..ops.measured import slug
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / "bench" / f"{what}{slug(device_name(device))}-{stamp}"


def _logged_run(args, run_fn, config, out, name, row_line):
    """``run_fn(config, ...)`` with every row appended to ``<name>.jsonl`` as it finishes (a cut-off run
    keeps them) and printed as one line when stdout is not a terminal (a progress bar is shown there).
    Returns (result, the row log's file name)."""
    import sys
    import time

    from ..bench.rowlog import RowLog
    tty = sys.stdout.isatty()
    start = time.perf_counter()

    def on_row(row):
        log.row(row)
        if not tty and not args.quiet:
            print(row_line(row, time.perf_counter() - start), flush=True)

    with RowLog(out / f"{name}.jsonl") as log:
        result = run_fn(config, progress=tty and not args.quiet, on_start=log.start, on_row=on_row)
    return result, log.path.name


def _run_models(args, console) -> int:
    from ..bench import model_bench, write_models_outputs
    from ..bench.report import model_row_line, models_summary_markdown, rich_models_table
    config = _model_config(args)
    out, name = _out_dir(args, config.device, "models-"), _name(args, "models")
    result, log_name = _logged_run(args, model_bench.run, config, out, name, model_row_line)
    _print(console, lambda: rich_models_table(result), models_summary_markdown(result))
    files = write_models_outputs(result, out, name)
    console.print(f"wrote {files['json']}, {files['markdown']} and {log_name} in {out}")
    return 0


def _run_overhead(args, console) -> int:
    import sys

    from ..bench import overhead, write_overhead_outputs
    from ..bench.report import overhead_markdown, rich_overhead_table
    config = _overhead_config(args)
    result = overhead.run(config, progress=sys.stdout.isatty() and not args.quiet)
    _print(console, lambda: rich_overhead_table(result), overhead_markdown(result))
    out = _out_dir(args, "cpu", "overhead-")
    files = write_overhead_outputs(result, out, _name(args, "overhead"))
    console.print(f"wrote {files['json']} and {files['markdown']}")
    return 0


def run(args) -> int:
    compared = check_arguments(args)
    console = _console()
    if args.compare is not None and len(args.compare) == 2:
        return _compare_only(args, console, *compared)
    if args.from_jsonl is not None:
        return _from_rowlog(args, console)
    import torch
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.models is not None:
        return _run_models(args, console)
    if args.overhead:
        return _run_overhead(args, console)

    from ..bench import markdown_compare, rich_compare, run as run_bench, write_outputs
    from ..bench.report import row_line
    old = compared[0] if compared else None   # loaded before a long run, not after it
    config = _config(args)
    out, name = _out_dir(args, config.device), _name(args, "bench")
    many_heads = len(set(config.heads)) > 1   # else the lines of different head counts read alike
    result, log_name = _logged_run(args, run_bench, config, out, name,
                                   lambda row, elapsed: row_line(row, elapsed, heads=many_heads))
    _print_table(console, result)
    files = write_outputs(result, out, name)
    console.print(f"wrote {files['json']}, {files['markdown']}, {log_name} and {len(files['plots'])} plots in {out}")
    if old is not None:
        console.print(rich_compare(old, result, args.threshold))
        from ..bench.schema import write_text
        write_text(markdown_compare(old, result, args.threshold), out / f"{name}_compare.md")
    return 0
