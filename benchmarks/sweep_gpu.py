"""The standard GPU sweep, in FlashAttention's benchmark shapes: batch * N = 16k tokens, hidden 2048
(head dim 64 -> 32 heads, 128 -> 16 heads), bf16, N from 512 to 16k, fwd and fwd+bwd, non-causal
and causal; every variant, backend and baseline (SDPA's backends, FlexAttention, flash-attn and
flash-linear-attention when installed). Results go to benchmarks/results/gpu/<device>/ and
benchmarks/render_readme.py puts the newest sweep in README.md.

NOT COMPLETED ON A GPU YET. On the H100 lent briefly on 2026-11-25 it wrote nothing within 150-230 s
per configuration (benchmarks/results/gpu/h100_tests.md): results were written only at the end of a
configuration, every row went straight into triton.testing.do_bench (~8 calls of a slow eager
reference before a first sample), and FlexAttention was recompiled per row. Changed since, and
tested on CPU only (--device cpu):
- configurations run most valuable first (head dim 64, non-causal, softmax family with the SDPA
  anchors; then the other variants; then causal; then head dim 128), and the running one is printed;
- every row: a first call (compile, kept as first_call_s), a second call; skipped when the second
  exceeds --max-call-seconds, a few CUDA-event repeats when it is slow, do_bench only for fast calls;
  any single call is interrupted after --call-timeout-seconds;
- --budget-seconds per configuration and --total-budget-seconds for the sweep: a call still running
  is interrupted, the rest recorded as skipped, and the outputs are written;
- each finished row goes at once to <name>.jsonl (flushed) and as one plain line to stdout; a killed
  run is rebuilt with `python -m attnzoo bench --from-jsonl <name>.jsonl`;
- --skip-backends (e.g. torch-flex,flex); FlexAttention compiled once per process, dynamo's
  recompile limits raised during the run.
benchmarks/gpu_session.sh runs the GPU tests and this sweep in one device call.

    python3 benchmarks/sweep_gpu.py [--head-dims 64 128] [--seq-lens ...] [--variants ...]
        [--budget-seconds 150] [--total-budget-seconds 400] [--skip-backends torch-flex,flex] [--device cpu]
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from attnzoo.bench import BenchConfig, run, write_outputs  # noqa: E402
from attnzoo.bench.environment import device_name, slug  # noqa: E402
from attnzoo.bench.report import row_line  # noqa: E402
from attnzoo.bench.rowlog import RowLog  # noqa: E402
from attnzoo.bench.runner import ALL_VARIANTS  # noqa: E402

# what most readers come for: the softmax family (fused kernels against SDPA / FlexAttention) first
SOFTMAX_FAMILY = ("softmax", "l2", "sigmoid", "relu", "fenchel")


def configurations(head_dims: list[int], causal: list[str], variants: list[str]) -> list[dict]:
    """(head dim, causal, variant group) in the order they run: most valuable first."""
    family = [v for v in variants if v.split("(")[0].strip() in SOFTMAX_FAMILY]
    others = [v for v in variants if v not in family]
    out = []
    for head_dim in head_dims:
        for c in causal:
            for group, members in (("softmax-family", family), ("others", others)):
                if members:
                    out.append({"head_dim": head_dim, "causal": c == "yes", "group": group, "variants": members})
    return out


def _names(text: str) -> list[str]:
    return [n for n in text.split(",") if n]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (to check the sweep itself on tiny shapes)")
    p.add_argument("--seq-lens", nargs="+", type=int, default=[512, 1024, 2048, 4096, 8192, 16384])
    p.add_argument("--head-dims", nargs="+", type=int, default=[64, 128])
    p.add_argument("--hidden", type=int, default=2048, help="heads = hidden / head dim")
    p.add_argument("--batch-tokens", type=int, default=16384)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--modes", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"])
    p.add_argument("--variants", nargs="+", default=list(ALL_VARIANTS))
    p.add_argument("--causal", nargs="+", choices=["no", "yes"], default=["no", "yes"])
    p.add_argument("--skip-backends", nargs="+", type=_names, default=[], metavar="NAME",
                   help="backends / baselines left out, space- or comma-separated (e.g. torch-flex,flex)")
    p.add_argument("--max-call-seconds", type=float, default=30.0,
                   help="rows whose steady call is measured or predicted slower than this are skipped")
    p.add_argument("--call-timeout-seconds", type=float, default=120.0,
                   help="any single call (first, compiling call included) is interrupted after this long")
    p.add_argument("--target-seconds", type=float, default=1.0, help="slow calls: repeats fill about this long")
    p.add_argument("--budget-seconds", type=float, default=None, help="time budget of each configuration")
    p.add_argument("--total-budget-seconds", type=float, default=None,
                   help="time budget of the whole sweep: no configuration starts after it, each gets at most what is left")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads (default: 1 on CPU, where a busy machine makes tiny ops wait at "
                        "thread barriers; untouched on CUDA)")
    p.add_argument("--out", type=Path, default=None,
                   help="default: benchmarks/results/gpu/<device> on CUDA, runs/sweep_gpu/<device> on CPU")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("sweep_gpu.py: --device cuda but torch.cuda.is_available() is False (use --device cpu to check "
              "the sweep itself)", file=sys.stderr)
        return 2
    interpret = os.environ.get("TRITON_INTERPRET")
    if device.type == "cpu":  # timing the Triton interpreter would be meaningless: its rows are left out
        os.environ.pop("TRITON_INTERPRET", None)
    threads = args.threads or (1 if device.type == "cpu" else None)
    before_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _sweep(args, device)
    finally:  # called in-process (tests): leave the caller's settings as they were
        torch.set_num_threads(before_threads)
        if interpret is not None:
            os.environ["TRITON_INTERPRET"] = interpret


def _sweep(args, device: torch.device) -> int:
    name_of_device = device_name(device)
    out = args.out or (ROOT / "benchmarks" / "results" / "gpu" if device.type == "cuda" else
                       ROOT / "runs" / "sweep_gpu") / slug(name_of_device)
    sweep_id = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    skip = [n for names in args.skip_backends for n in names]
    plan = configurations(args.head_dims, args.causal, args.variants)
    sweep_start = time.perf_counter()
    print(f"sweep {sweep_id} on {name_of_device}: {len(plan)} configuration(s), per-configuration budget "
          f"{args.budget_seconds} s, total budget {args.total_budget_seconds} s, output {out}", flush=True)
    written = []
    for i, cfg in enumerate(plan, 1):
        budget = args.budget_seconds
        if args.total_budget_seconds is not None:
            left = args.total_budget_seconds - (time.perf_counter() - sweep_start)
            if left <= 0:
                print(f"== total budget used up: configurations {i}..{len(plan)} not started", flush=True)
                break
            budget = left if budget is None else min(budget, left)
        head_dim, causal = cfg["head_dim"], cfg["causal"]
        name = f"bench_gpu_d{head_dim}{'_causal' if causal else ''}_{cfg['group']}"
        label = f"{cfg['group']}, head dim {head_dim}, {'causal' if causal else 'non-causal'}"
        print(f"== configuration {i}/{len(plan)}: {label} ({' '.join(cfg['variants'])}; "
              f"budget {'none' if budget is None else f'{budget:.0f} s'}) -> {out / name}.jsonl", flush=True)
        config = BenchConfig(
            variants=cfg["variants"], seq_lens=args.seq_lens, dtypes=[args.dtype], modes=args.modes,
            batch_tokens=args.batch_tokens, head_dim=head_dim, heads=[max(1, args.hidden // head_dim)],
            causal=causal, device=str(device), max_call_seconds=args.max_call_seconds,
            call_timeout_seconds=args.call_timeout_seconds, target_seconds=args.target_seconds,
            budget_seconds=budget, skip_backends=skip, label=label,
            notes=f"benchmarks/sweep_gpu.py sweep {sweep_id}")
        start = time.perf_counter()
        with RowLog(out / f"{name}.jsonl") as log:
            def on_row(row, log=log, start=start):
                log.row(row)
                print(row_line(row, time.perf_counter() - start), flush=True)
            result = run(config, progress=False, on_start=log.start, on_row=on_row)
        result["settings"]["wall_seconds"] = round(time.perf_counter() - start, 1)
        files = write_outputs(result, out, name)
        statuses = {}
        for row in result["results"]:
            statuses[row["status"]] = statuses.get(row["status"], 0) + 1
        print(f"== wrote {files['json'].name}, {files['markdown'].name}, {log.path.name} and {len(files['plots'])} "
              f"plots in {result['settings']['wall_seconds']} s; rows: "
              + ", ".join(f"{n} {s}" for s, n in sorted(statuses.items())), flush=True)
        written.append(files["json"])
    print(f"sweep done in {time.perf_counter() - sweep_start:.1f} s: {len(written)} of {len(plan)} configuration(s) "
          f"written to {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
