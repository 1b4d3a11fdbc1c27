"""The benchmark code that lives outside the package (benchmarks/: the GPU-run driver, the README
renderer), imported the way the scripts there import each other: with benchmarks/ on sys.path."""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load(name: str):
    """The module benchmarks/<name>.py (or the package benchmarks/<name>/)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module(name)
