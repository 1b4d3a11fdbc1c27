"""What the varlen (packed-sequence) Triton launches share (kernels/flash_softmax/varlen.py,
kernels/pointwise/varlen.py): packed (T, H, D) tensors handed to kernels written for (B, H, N, D), and
the per-sequence block layout their row statistics and gradients are stored in.

A varlen program's "batch" index is its sequence: it moves its base pointers to the sequence's first
token itself, so a packed tensor is passed with no batch stride. The kernels' per-row vectors (lse,
delta, n) and their contiguous gradient stores index ``pid_bh * Nq`` rows with the sequence's own Nq;
with the base moved to ``H * start`` that is sequence s's (H, n_s) block starting at row H * cu[s]:
``unblock`` gathers such rows back into packed order. Nothing here reads the offsets on the host.
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import triton_tuning as tuning

def packed_strides(t: Tensor) -> tuple[int, int, int, int]:
    """(batch, head, token, dim) strides of a packed (T, H, D) tensor in the kernels' (b, h, n, d) order:
    no batch stride (a program moves its base to its sequence's start)."""
    return 0, t.stride(1), t.stride(0), t.stride(2)


def packed_sizes(q: Tensor, k: Tensor, v: Tensor, max_q: int, max_k: int) -> tuple:
    """The kernels' size arguments (H, Nq, Nk, D, DV, GROUP, the tuning buckets) of packed q, k, v: the
    maxima stand for Nq and Nk (each program reads its own from the offsets), and the autotuning key
    buckets them."""
    H, D, H_kv, DV = q.shape[1], q.shape[2], k.shape[1], v.shape[2]
    return H, max_q, max_k, D, DV, H // H_kv, tuning.n_bucket(max_q), tuning.n_bucket(max_k)


def blocked_rows(cu: Tensor, total: int, heads: int) -> Tensor:
    """(total, heads) int64: where token t's row of head h lies in per-sequence blocks (sequence s's
    (heads, n_s) rows start at heads * cu[s]): heads * start + h * n + position. Device ops only."""
    token = torch.arange(total, device=cu.device)
    cu64 = cu.to(torch.int64)
    seq = torch.searchsorted(cu64[1:], token, right=True)
    start = cu64[seq]
    n = cu64[seq + 1] - start
    head = torch.arange(heads, device=cu.device)
    return (heads * start + (token - start))[:, None] + head[None, :] * n[:, None]


def unblock(blocked: Tensor, cu: Tensor, total: int, heads: int) -> Tensor:
    """(heads * total, D) rows in per-sequence blocks -> packed (total, heads, D): one gather, an extra
    pass over the tensor (the kernels' gradient stores are contiguous per head)."""
    return blocked.index_select(0, blocked_rows(cu, total, heads).reshape(-1)).view(total, heads, -1)
