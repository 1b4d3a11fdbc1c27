"""The standard CPU sweep committed under benchmarks/results/cpu/ (bench_cpu.json, .md, .png).

Every variant (the ten registry names) x every registered backend + "auto" + the baselines,
N in {256, 1024, 4096}, fwd and fwd+bwd, float32, one head of dim 64 and batch * N = 4096 tokens
(batch 16 at N = 256, 4 at N = 1024, a single sequence at N = 4096), 1 thread. One thread, not two: on the
shared, oversubscribed 2-core machine two threads made a small call ~100x slower (every op waits at
a barrier for a descheduled thread) and a large one only ~1.2x faster. Sized to finish in about 20
minutes there:
- rows predicted (from the same row at the previous N, scaled by FLOPs) slower than
  --max-call-seconds are recorded as skipped with the prediction; rows predicted slower than
  --once-above-seconds run once, time and peak memory from that one call;
- eager-reference rows that would not fit in memory are skipped with the estimate;
- "auto" rows (what a user gets) run first for every N, then the other backends; rows still left
  when --budget-seconds is used up are recorded as skipped.

    .venv/bin/python benchmarks/sweep_cpu.py              # then: benchmarks/render_readme.py
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

# CPU timings of Triton kernels would time the interpreter: keep it off for this sweep
os.environ.pop("TRITON_INTERPRET", None)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from attnzoo.bench import BenchConfig, rich_table, run, write_outputs  # noqa: E402
from attnzoo.bench.runner import ALL_VARIANTS  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-lens", nargs="+", type=int, default=[256, 1024, 4096])
    p.add_argument("--variants", nargs="+", default=list(ALL_VARIANTS))
    p.add_argument("--batch-tokens", type=int, default=4096)
    p.add_argument("--heads", type=int, default=1)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--max-call-seconds", type=float, default=75.0)
    p.add_argument("--once-above-seconds", type=float, default=3.0)
    p.add_argument("--budget-seconds", type=float, default=1200.0)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "cpu")
    p.add_argument("--name", default="bench_cpu")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    config = BenchConfig(
        variants=args.variants, seq_lens=args.seq_lens, dtypes=["float32"], modes=["fwd", "fwd+bwd"],
        batch_tokens=args.batch_tokens, head_dim=args.head_dim, heads=[args.heads], device="cpu",
        warmup=1, min_repeats=3, max_repeats=15, target_seconds=0.5, max_call_seconds=args.max_call_seconds,
        once_above_seconds=args.once_above_seconds, budget_seconds=args.budget_seconds,
        notes=(f"benchmarks/sweep_cpu.py on a machine shared with other jobs (see the load averages), "
               f"{args.threads} thread(s); TRITON_INTERPRET unset (Triton backends are recorded as unsupported on CPU)"))
    start = time.perf_counter()

    def progress_line(row):
        t = row["time_s"]["median"] if row.get("time_s") else None
        print(f"[{time.perf_counter() - start:7.1f}s] {row['variant']:>10} {row['backend']:<16} N={row['seq_len']:<5} "
              f"{row['mode']:<8} {row['status']:<11} {'' if t is None else f'{t * 1e3:.3g} ms'}", flush=True)

    result = run(config, progress=False, on_row=progress_line)
    result["settings"]["wall_seconds"] = round(time.perf_counter() - start, 1)
    files = write_outputs(result, args.out, args.name)
    from rich.console import Console
    Console(width=160).print(rich_table(result))
    print(f"wrote {files['json']}, {files['markdown']}, {len(files['plots'])} plots "
          f"in {result['settings']['wall_seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
