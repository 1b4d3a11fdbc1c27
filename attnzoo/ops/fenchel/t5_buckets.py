"""T5's relative-position buckets (Raffel et al. 2020; paper 004 eqs 17-18), shared by the layer,
the eager reference and the fused kernels."""
from __future__ import annotations

import math

import torch

from .. import validate as V


def check_bucketing(num_buckets, max_distance, bidirectional) -> None:
    """num_buckets and max_distance ints, bidirectional a bool, and at least one exact bucket per sign
    below max_distance: otherwise the log-spaced buckets divide by zero or index out of the table."""
    for name, val in (("num_buckets", num_buckets), ("max_distance", max_distance)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 2:
            raise ValueError(f"{name} must be an int >= 2, got {val!r}")
    V.check_flag("bidirectional", bidirectional)
    max_exact = (num_buckets // 2 if bidirectional else num_buckets) // 2
    if max_exact < 1:
        raise ValueError(f"num_buckets must be >= {4 if bidirectional else 2} with bidirectional={bidirectional}, "
                         f"got {num_buckets}")
    if max_distance <= max_exact:
        raise ValueError(f"max_distance must exceed the {max_exact} exact buckets (num_buckets={num_buckets}, "
                         f"bidirectional={bidirectional}), got {max_distance}")


def t5_relative_buckets(rel: torch.Tensor, num_buckets: int = 32, max_distance: int = 128,
                        bidirectional: bool = True) -> torch.Tensor:
    """Bucket index for relative offsets rel = j - i: exact for small offsets, log-spaced up to
    max_distance; bidirectional gives each sign half the buckets, causal distinguishes j <= i only."""
    buckets = torch.zeros_like(rel)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (rel > 0).long() * num_buckets
        dist = rel.abs()
    else:
        dist = (-rel).clamp_min(0)
    max_exact = num_buckets // 2
    is_small = dist < max_exact
    log_ratio = torch.log(dist.float().clamp_min(1) / max_exact) / math.log(max_distance / max_exact)
    large = max_exact + (log_ratio * (num_buckets - max_exact)).long()
    large = large.clamp_max(num_buckets - 1)
    return buckets + torch.where(is_small, dist, large)


def t5_offset_lut(nq: int, nk: int, num_buckets: int, max_distance: int, bidirectional: bool, device):
    """int32 (Nq + Nk - 1,): entry j - i + Nq - 1 is the bucket of the bottom-right aligned offset
    j - (i + Nk - Nq), so a kernel reads a tile's biases without an (Nq, Nk) tensor."""
    rel = torch.arange(-(nk - 1), nq, device=device)
    return t5_relative_buckets(rel, num_buckets, max_distance, bidirectional).to(torch.int32)
