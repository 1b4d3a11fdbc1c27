"""The one mixed-precision rule of training and the model benchmark: bfloat16 autocast on CUDA only
(a CPU step stays in float32, where bfloat16 matmuls are slower, not faster)."""
from __future__ import annotations

import contextlib

import torch


def bf16_autocast(device: torch.device, enabled: bool = True, *, cache: bool = True):
    """``torch.autocast("cuda", bfloat16)`` when ``enabled`` and ``device`` is CUDA, else a no-op context.
    ``cache=False`` for a step captured in a CUDA graph: autocast's cast-weight cache must not be
    reused across replays."""
    if enabled and torch.device(device).type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=cache)
    return contextlib.nullcontext()
