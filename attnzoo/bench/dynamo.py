"""Recompile limits of torch.compile while a benchmark runs.

A benchmark calls each compiled function (FlexAttention above all) with many shapes, score_mods,
masks and modes. Past ``torch._dynamo.config.cache_size_limit`` recompilations of one frame (8 by
default; ``recompile_limit`` in newer torch) dynamo stops compiling it and runs it eagerly, without
an error: FlexAttention's eager path materialises the N x N scores and is far slower, so the table
would silently time the wrong thing. The limits are raised for the run and put back afterwards.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

LIMIT_NAMES = ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit", "accumulated_recompile_limit")


@contextmanager
def raised_recompile_limits(at_least: int = 512) -> Iterator[dict]:
    """Every limit of ``LIMIT_NAMES`` this torch has, raised to ``at_least``; yields {name: value in force}."""
    try:
        import torch._dynamo.config as config
    except ImportError:  # torch without dynamo: nothing is compiled, nothing to raise
        yield {}
        return
    before = {name: getattr(config, name) for name in LIMIT_NAMES if hasattr(config, name)}
    for name, value in before.items():
        if isinstance(value, int) and value < at_least:
            setattr(config, name, at_least)
    try:
        yield {name: getattr(config, name) for name in before}
    finally:
        for name, value in before.items():
            setattr(config, name, value)
