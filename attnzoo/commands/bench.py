"""attnzoo bench: time, throughput and peak memory of every variant and backend against torch SDPA."""
from __future__ import annotations

import datetime
from pathlib import Path

from . import UsageError

HELP = "benchmark every attention variant and backend (time, TFLOP/s, tokens/s, peak memory) against SDPA"

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


def _names(text: str) -> list[str]:
    return [n for n in text.split(",") if n]


def add_arguments(parser) -> None:
    from ..bench.flops import MODES
    from ..bench.runner import DTYPES, all_variants
    g = parser.add_argument_group("what to run")
    g.add_argument("--variants", nargs="+", default=all_variants(), metavar="SPEC",
                   help="variant names or spec strings such as 'sinkhorn(n_iters=5)' (default: every registered variant and wrapper)")
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
    o = parser.add_argument_group("output")
    o.add_argument("--out", type=Path, default=None,
                   help="folder for NAME.json, NAME.md and NAME_{time,memory}_*.png (default: runs/bench/<device>-<time>)")
    o.add_argument("--name", default="bench", help="file stem of the outputs (default: bench)")
    o.add_argument("--from-jsonl", type=Path, default=None, metavar="JSONL",
                   help="rebuild the result of a run from its row log (NAME.jsonl, written as rows finish, kept even "
                        "if the run was killed) and write NAME.json, .md and plots to --out (default: its folder)")
    o.add_argument("--compare", nargs="+", type=Path, default=None, metavar="JSON",
                   help="OLD.json: print speed-ups/regressions of this run against it; OLD.json NEW.json: compare "
                        "two saved runs without benchmarking")
    o.add_argument("--threshold", type=float, default=0.1, help="--compare: flag changes beyond this (default 0.1)")
    o.add_argument("--quiet", action="store_true",
                   help="no progress bar (on a terminal) and no line per row (when output is not a terminal)")


def _config(args):
    import torch

    from ..bench.runner import BenchConfig, default_device
    device = args.device or default_device()
    defaults = GPU_DEFAULTS if torch.device(device).type == "cuda" else CPU_DEFAULTS
    heads = args.heads or ([max(1, 2048 // args.head_dim)] if torch.device(device).type == "cuda" else [1])
    return BenchConfig(
        variants=args.variants, backends=args.backends, seq_lens=args.seq_lens or defaults["seq_lens"],
        dtypes=args.dtypes or defaults["dtypes"], modes=args.modes,
        batch_tokens=args.batch_tokens or defaults["batch_tokens"],
        head_dim=args.head_dim, heads=heads, causal=args.causal, device=device, warmup=args.warmup,
        min_repeats=args.min_repeats, max_repeats=args.max_repeats, target_seconds=args.target_seconds,
        max_call_seconds=args.max_call_seconds or defaults["max_call_seconds"], max_memory_gb=args.max_memory_gb,
        once_above_seconds=args.once_above_seconds, budget_seconds=args.budget_seconds,
        slow_call_seconds=args.slow_call_seconds, skip_backends=[n for names in args.skip_backends for n in names],
        call_timeout_seconds=(args.call_timeout_seconds if args.call_timeout_seconds is not None
                              else defaults["call_timeout_seconds"]),
        measure_memory=not args.no_memory, seed=args.seed).validate()


def _compare_only(args, console, old, new) -> int:
    from ..bench import markdown_compare, rich_compare
    console.print(rich_compare(old, new, args.threshold))
    if args.out is not None:
        from ..bench.schema import write_text
        path = write_text(markdown_compare(old, new, args.threshold), args.out / f"{args.name}_compare.md")
        console.print(f"wrote {path}")
    return 0


def _print_table(console, result) -> None:
    try:
        from ..bench import rich_table
        console.print(rich_table(result))
    except ImportError:  # rich missing (a bare GPU box): the Markdown table says the same
        from ..bench.report import markdown_summary
        print(markdown_summary(result["results"]))


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
    from ..bench import write_outputs
    from ..bench.rowlog import load_rowlog
    result = load_rowlog(args.from_jsonl)
    name = args.name if args.name != "bench" else args.from_jsonl.stem
    out = args.out or args.from_jsonl.parent
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


def check_arguments(args):
    """Every argument checked before any work (UsageError); returns the loaded --compare results."""
    from ..bench import load
    from ..bench.targets import parse_variant
    if args.compare is not None and len(args.compare) > 2:
        raise UsageError("--compare takes OLD.json, or OLD.json NEW.json")
    if args.compare is not None and args.from_jsonl is not None:
        raise UsageError("--compare and --from-jsonl do not combine: rebuild the run first, then compare its JSON")
    for path in [*(args.compare or []), *([args.from_jsonl] if args.from_jsonl is not None else [])]:
        if not path.is_file():
            raise UsageError(f"{str(path)!r} does not exist")
    try:
        compared = [load(p) for p in args.compare or []]
    except ValueError as e:
        raise UsageError(f"--compare: {e}") from None
    if (args.compare is not None and len(args.compare) == 2) or args.from_jsonl is not None:
        return compared
    for spec in args.variants:
        try:
            parse_variant(spec)
        except (ValueError, TypeError) as e:  # attnzoo.create's own message, after the spec it is about
            raise UsageError(f"--variants {spec!r}: {e}") from None
    known = known_backends()
    for option, names in (("--backends", args.backends or []),
                          ("--skip-backends", [n for group in args.skip_backends for n in group])):
        unknown = [n for n in names if n not in known]
        if unknown:
            raise UsageError(f"{option}: unknown backend(s) {unknown}; known: {', '.join(sorted(known))}")
    if args.threads is not None and args.threads < 1:
        raise UsageError(f"--threads must be >= 1, got {args.threads}")
    try:
        config = _config(args)
    except (ValueError, TypeError, RuntimeError) as e:  # RuntimeError: torch.device on a bad --device
        raise UsageError(" ".join(str(e).split())) from None
    check_device(config.device)
    return compared


def check_device(device) -> None:
    """UsageError in one line when the device cannot run here (``--device cuda`` without a GPU)."""
    from ..bench.environment import unusable_device
    problem = unusable_device(device)
    if problem is not None:
        raise UsageError(problem)


def run(args) -> int:
    import sys
    import time
    compared = check_arguments(args)
    console = _console()
    if args.compare is not None and len(args.compare) == 2:
        return _compare_only(args, console, *compared)
    if args.from_jsonl is not None:
        return _from_rowlog(args, console)
    import torch

    from ..bench import markdown_compare, rich_compare, run as run_bench, write_outputs
    from ..bench.environment import device_name, slug
    from ..bench.report import row_line
    from ..bench.rowlog import RowLog
    old = compared[0] if compared else None   # loaded before a long run, not after it
    if args.threads:
        torch.set_num_threads(args.threads)
    config = _config(args)
    out = args.out
    if out is None:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        out = Path("runs") / "bench" / f"{slug(device_name(config.device))}-{stamp}"
    tty = sys.stdout.isatty()
    start = time.perf_counter()

    def on_row(row):
        log.row(row)
        if not tty and not args.quiet:
            print(row_line(row, time.perf_counter() - start), flush=True)

    with RowLog(Path(out) / f"{args.name}.jsonl") as log:
        result = run_bench(config, progress=tty and not args.quiet, on_start=log.start, on_row=on_row)
    _print_table(console, result)
    files = write_outputs(result, out, args.name)
    console.print(f"wrote {files['json']}, {files['markdown']}, {log.path.name} and {len(files['plots'])} plots in {out}")
    if old is not None:
        console.print(rich_compare(old, result, args.threshold))
        from ..bench.schema import write_text
        write_text(markdown_compare(old, result, args.threshold), Path(out) / f"{args.name}_compare.md")
    return 0
