"""Generate docs/bench.md (the README's benchmark section) from the committed result JSONs:
benchmarks/results/cpu/bench_cpu.json and the newest GPU sweep under benchmarks/results/gpu/.

    .venv/bin/python benchmarks/render_readme.py [--cpu JSON] [--gpu-dir DIR] [--out docs/bench.md]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from attnzoo.bench import load  # noqa: E402
from attnzoo.bench.docs import render  # noqa: E402
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", type=Path, default=ROOT / "benchmarks" / "results" / "cpu" / "bench_cpu.json")
    p.add_argument("--gpu-dir", type=Path, default=ROOT / "benchmarks" / "results" / "gpu")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "bench.md")
    args = p.parse_args(argv)
    cpu = (load(args.cpu), args.cpu) if args.cpu.exists() else None
    gpu = newest_gpu_sweep(args.gpu_dir) if args.gpu_dir.exists() else []
    write_text(render(cpu, gpu, args.out), args.out)
    print(f"wrote {args.out} from {'CPU ' + str(args.cpu) if cpu else 'no CPU results'} and {len(gpu)} GPU file(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
