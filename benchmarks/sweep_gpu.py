"""The standard GPU sweep, in FlashAttention's benchmark shapes: batch * N = 16k tokens, hidden 2048
(head dim 64 -> 32 heads, 128 -> 16 heads), bf16, N from 512 to 16k, fwd and fwd+bwd, non-causal
and causal; every variant, backend and baseline (SDPA's backends, FlexAttention, flash-attn and
flash-linear-attention when installed). Results go to benchmarks/results/gpu/<device>/ and
benchmarks/render_readme.py puts the newest sweep in README.md.

NOT COMPLETED YET: on the H100 lent briefly on 2026-11-25 it wrote nothing within 150-230 s per
configuration (benchmarks/results/gpu/h100_tests.md); the CUDA code paths of the harness (do_bench
timing, allocator peaks, FlexAttention/flash-attn/fla baselines) have not finished a run.

    .venv/bin/python benchmarks/sweep_gpu.py [--head-dims 64 128] [--seq-lens ...] [--variants ...]
"""
from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from attnzoo.bench import BenchConfig, rich_table, run, write_outputs  # noqa: E402
from attnzoo.bench.environment import slug  # noqa: E402
from attnzoo.bench.runner import ALL_VARIANTS  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-lens", nargs="+", type=int, default=[512, 1024, 2048, 4096, 8192, 16384])
    p.add_argument("--head-dims", nargs="+", type=int, default=[64, 128])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--batch-tokens", type=int, default=16384)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--variants", nargs="+", default=list(ALL_VARIANTS))
    p.add_argument("--causal", nargs="+", choices=["no", "yes"], default=["no", "yes"])
    p.add_argument("--max-call-seconds", type=float, default=30.0)
    p.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/gpu/<device>")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("sweep_gpu.py needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    device_name = torch.cuda.get_device_name(0)
    out = args.out or ROOT / "benchmarks" / "results" / "gpu" / slug(device_name)
    sweep_id = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    console = None
    for head_dim in args.head_dims:
        for causal in args.causal:
            config = BenchConfig(
                variants=args.variants, seq_lens=args.seq_lens, dtypes=[args.dtype], modes=["fwd", "fwd+bwd"],
                batch_tokens=args.batch_tokens, head_dim=head_dim, heads=[args.hidden // head_dim],
                causal=causal == "yes", device="cuda", max_call_seconds=args.max_call_seconds,
                notes=f"benchmarks/sweep_gpu.py sweep {sweep_id}")
            start = time.perf_counter()
            result = run(config)
            result["settings"]["wall_seconds"] = round(time.perf_counter() - start, 1)
            name = f"bench_gpu_d{head_dim}{'_causal' if causal == 'yes' else ''}"
            files = write_outputs(result, out, name)
            from rich.console import Console
            console = console or Console(width=160)
            console.print(rich_table(result))
            console.print(f"wrote {files['json']} and {len(files['plots'])} plots")
    return 0


if __name__ == "__main__":
    sys.exit(main())
