"""Generate the benchmark pages from the committed results: the full page (--out, docs/benchmarks.md)
and the short section between the `<!-- bench:begin -->` / `<!-- bench:end -->` markers of README.md.
Sources: benchmarks/results/cpu/bench_cpu.json (the CPU sweep), benchmarks/results/cpu/overhead.json
(the per-call overhead), and the newest GPU results under benchmarks/results/gpu/<device>/: speed.json
(the kernel table) and models.json (whole models, shown beside the kernel table). The pages are
built by benchmarks/readme_pages.py.

    .venv/bin/python benchmarks/render_readme.py [--cpu JSON] [--overhead JSON] [--gpu-dir DIR] [--readme README.md] [--out PAGE.md]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from readme_pages import front_page, gpu_section, render  # noqa: E402

from attnzoo.bench.schema import load_any, write_text  # noqa: E402

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
    p.add_argument("--overhead", type=Path, default=ROOT / "benchmarks" / "results" / "cpu" / "overhead.json")
    p.add_argument("--gpu-dir", type=Path, default=ROOT / "benchmarks" / "results" / "gpu")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks.md",
                   help="the full benchmark page (README.md gets a short section linking to it)")
    p.add_argument("--readme", type=Path, default=ROOT / "README.md",
                   help="file whose bench markers get the section too (paths made relative to it)")
    args = p.parse_args(argv)
    cpu = (load_any(args.cpu), args.cpu) if args.cpu.exists() else None
    overhead = (load_any(args.overhead), args.overhead) if args.overhead.exists() else None
    gpu = gpu_section(args.gpu_dir) if args.gpu_dir.exists() else None
    if args.out is not None:
        write_text(render(cpu, gpu, args.out, overhead=overhead), args.out)
    replace_between_markers(args.readme, front_page(cpu, gpu, args.readme, args.out))
    models = gpu.models if gpu is not None else None
    used = [f"CPU {args.cpu}" if cpu else "no CPU results", f"overhead {args.overhead}" if overhead else "no overhead",
            f"GPU {gpu.source}" if gpu and gpu.summary else "no GPU kernel results",
            f"models {models.source}" if models else "no GPU model results"]
    print(f"wrote {args.readme}{' and ' + str(args.out) if args.out else ''} from {', '.join(used)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
