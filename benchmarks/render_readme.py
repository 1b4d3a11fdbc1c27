"""Generate the benchmark section from the committed result JSONs (benchmarks/results/cpu/bench_cpu.json
and the newest GPU sweep under benchmarks/results/gpu/), written between the `<!-- bench:begin -->` /
`<!-- bench:end -->` markers of README.md (and to --out as a page of its own if asked).

    .venv/bin/python benchmarks/render_readme.py [--cpu JSON] [--gpu-dir DIR] [--readme README.md] [--out PAGE.md]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from attnzoo.bench import load  # noqa: E402
from attnzoo.bench.docs import front_page, render  # noqa: E402
from attnzoo.bench.schema import write_text  # noqa: E402


def newest_gpu_sweep(gpu_dir: Path) -> list[tuple[dict, Path]]:
    """Every JSON of the most recent GPU sweep (same settings.notes sweep id as the newest file)."""
    found = []
    for path in sorted(gpu_dir.glob("**/*.json")):
        try:
            found.append((load(path), path))
        except ValueError as e:
            print(f"ignoring {path}: {e}", file=sys.stderr)
    if not found:
        return []
    found.sort(key=lambda rp: rp[0]["created"], reverse=True)
    sweep = found[0][0]["settings"].get("notes")
    return sorted([rp for rp in found if rp[0]["settings"].get("notes") == sweep], key=lambda rp: str(rp[1]))


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
    gpu = newest_gpu_sweep(args.gpu_dir) if args.gpu_dir.exists() else []
    if args.out is not None:
        write_text(render(cpu, gpu, args.out), args.out)
    replace_between_markers(args.readme, front_page(cpu, gpu, args.readme, args.out))
    print(f"wrote {args.readme}{' and ' + str(args.out) if args.out else ''} from {'CPU ' + str(args.cpu) if cpu else 'no CPU results'} and {len(gpu)} GPU file(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
