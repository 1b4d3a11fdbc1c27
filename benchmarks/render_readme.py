"""Generate the benchmark pages from the committed results (benchmarks/results/cpu/bench_cpu.json and the
newest GPU measurement, benchmarks/results/gpu/<device>/speed.json): the full page (--out,
docs/benchmarks.md) and the short section between the `<!-- bench:begin -->` / `<!-- bench:end -->`
markers of README.md.

    .venv/bin/python benchmarks/render_readme.py [--cpu JSON] [--gpu-dir DIR] [--readme README.md] [--out PAGE.md]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from attnzoo.bench import load  # noqa: E402
from attnzoo.bench.docs import GpuSection, front_page, render  # noqa: E402
from attnzoo.bench.schema import write_text  # noqa: E402


def gpu_section(gpu_dir: Path):
    """The newest committed GPU measurement (benchmarks/results/gpu/<device>/speed.json, written by
    benchmarks/gpu_speed.py) as the tables the pages show, or None."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpu import report
    found = sorted(gpu_dir.glob("*/speed.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    if not found:
        return None
    path = found[0]
    data = json.loads(path.read_text())
    rows, device = data["rows"], data["meta"]["device"]
    shape = next((r for r in rows if r.get("fwd")), {})
    settings = (f"torch {device['torch']}, triton {device.get('triton')}, {shape.get('dtype', '')}, "
                "FlashAttention's benchmark shapes (batch x N = 16384 tokens, hidden 2048), "
                "`triton.testing.do_bench` medians.")
    plot = path.with_name("speed.png")
    return GpuSection(device=device["name"], summary=report.summary_markdown(rows),
                      cost_model=report.cost_model_markdown(rows), source=path.with_name("speed.md"),
                      plot=plot if plot.exists() else None, settings=settings)


BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"


def replace_between_markers(path: Path, section: str) -> None:
    text = path.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{path} has no {BEGIN} ... {END} markers to fill")
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    write_text(f"{head}{BEGIN}\n{section}{END}{tail}", path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", type=Path, default=ROOT / "benchmarks" / "results" / "cpu" / "bench_cpu.json")
    p.add_argument("--gpu-dir", type=Path, default=ROOT / "benchmarks" / "results" / "gpu")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks.md",
                   help="the full benchmark page (README.md gets a short section linking to it)")
    p.add_argument("--readme", type=Path, default=ROOT / "README.md",
                   help="file whose bench markers get the section too (paths made relative to it)")
    args = p.parse_args(argv)
    cpu = (load(args.cpu), args.cpu) if args.cpu.exists() else None
    gpu = gpu_section(args.gpu_dir) if args.gpu_dir.exists() else None
    if args.out is not None:
        write_text(render(cpu, gpu, args.out), args.out)
    replace_between_markers(args.readme, front_page(cpu, gpu, args.readme, args.out))
    print(f"wrote {args.readme}{' and ' + str(args.out) if args.out else ''} from {'CPU ' + str(args.cpu) if cpu else 'no CPU results'} and {'GPU ' + str(gpu.source) if gpu else 'no GPU results'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
