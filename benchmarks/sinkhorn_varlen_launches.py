"""Kernel launches of one packed Sinkhorn call, forward + backward: the varlen route (ops/sinkhorn/varlen.py)
against the per-length route (one call per distinct length) on the same packed batch.

A count, not a timing: it runs under TRITON_INTERPRET=1 on CPU tensors (no GPU needed), where each launch
is counted as it runs. On a GPU every launch costs host time and an under-filled grid
for short sequences, so the count is what packing saves there; the speed itself is the sinkhorn-packed
rows of the GPU grid (attnzoo/bench/packed_grid.py).

    TRITON_INTERPRET=1 python benchmarks/sinkhorn_varlen_launches.py
"""
from __future__ import annotations

import torch
from triton.runtime.interpreter import InterpretedFunction

import attnzoo.functional as AF
from attnzoo.ops import varlen_triton

_count = [0]
_index = InterpretedFunction.__getitem__


def _counting(self, grid):
    """The launch, counted when it is called (a kept plan indexes its kernels once and calls them per call)."""
    launch = _index(self, grid)
    if not self.fn.__module__.endswith("sinkhorn.triton_kernels"):
        return launch

    def counted(*args, **kwargs):
        _count[0] += 1
        return launch(*args, **kwargs)
    return counted


def launches(lengths: list[int], causal: bool, n_iters: int = 3) -> int:
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(sum(lengths), 2, 8, generator=g, requires_grad=True) for _ in range(3))
    _count[0] = 0
    out = AF.varlen("sinkhorn", q, k, v, cu, cu, max(lengths), max(lengths), backend="triton", is_causal=causal,
                    n_iters=n_iters)
    out.sum().backward()
    return _count[0]


def main() -> None:
    InterpretedFunction.__getitem__ = _counting
    lengths = [3, 5, 7, 9, 11, 13]
    for causal in (False, True):
        packed = launches(lengths, causal)
        route = varlen_triton.ROUTES.pop("sinkhorn")     # the per-length route
        try:
            per_length = launches(lengths, causal)
        finally:
            varlen_triton.ROUTES["sinkhorn"] = route
        print(f"causal={causal}: sequences of lengths {lengths}, n_iters=3, forward + backward: "
              f"{packed} launches packed, {per_length} per length")


if __name__ == "__main__":
    main()
