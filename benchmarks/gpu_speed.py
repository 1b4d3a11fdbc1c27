"""One GPU measurement that always comes back, in a few minutes: the entry point of
``gpu_run.session`` (benchmarks/gpu_run/) (its docstring lists the phases and outputs), plus the "paper" phase,
which trains paper 004's models with attnzoo.train's own loop (benchmarks/paper_phase.py).

    python3 benchmarks/gpu_speed.py [--out DIR] [--budget-seconds 420] [--phases warm speed correctness models compile paper]
    python3 benchmarks/gpu_speed.py --phases warm models --models vit_s --budget-seconds 230   # the model benchmark alone
    python3 benchmarks/gpu_speed.py --from-results A/speed.json B/speed.json --out DIR          # merge earlier runs

On a CPU it runs as a dry run of its own code (--device cpu with tiny shapes and tiny models).
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from gpu_run.session import main  # noqa: E402
from paper_phase import PAPER  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(extra=(PAPER,)))
