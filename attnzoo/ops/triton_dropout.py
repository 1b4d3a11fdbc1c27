"""Dropout on the attention weights inside the Triton kernels (softmax family and pointwise family).

The keep-mask is never stored. Weight (b, h, i, j) of a call is kept iff
    tl.rand(seed, offset) >= p,   offset = ((b * H + h) * Nq + i) * Nk + j   (int64),
so Z_ij ~ Bernoulli(1 - p) independently, and every kernel of the call (forward, dK/dV, dQ) regenerates
the same Z from the same (seed, offset): the backward needs no mask from the forward.

``seed`` is a 1-element int64 tensor drawn by ``draw_seed`` from torch's default generator of q's
device, once per forward call, and saved for the backward. A tensor (not a Python int) because
turning a generator draw into an int is ``.item()``: a host-device sync on CUDA and a graph break under
torch.compile. So ``torch.manual_seed(s)`` before a call makes its mask reproducible, and
``dropout_keep_mask`` writes out the exact Z a call used (for tests and for inspection).

Counter width: Triton's ``tl.rand`` splits an int64 offset into two 32-bit Philox counter words
(lo, hi) and uses all 64 bits of the seed as the key, so offsets past 2**32 elements do not wrap
around onto earlier ones: masks stay independent up to 2**63 elements per call.
"""
from __future__ import annotations

import torch

from .triton_utils import HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def dropout_args(SEED, dropout_p, DROPOUT: tl.constexpr):
        """(seed, dropout_p as fp32) for a kernel's prologue; the seed is read only when DROPOUT is set
        (inductor passes Python floats as fp64 scalars: keep the fp32 types)."""
        if DROPOUT:
            seed = tl.load(SEED)
        else:
            seed = 0
        return seed, tl.cast(dropout_p, tl.float32)

    @triton.jit
    def dropout_scale_at(seed, pid_bh, qi, kj, Nq, Nk, dropout_p):
        """Z_ij / (1 - p) at query indices ``qi`` and key indices ``kj`` broadcast against each other
        ([M, 1] x [1, N], or [1, M] x [N, 1] for a transposed dK/dV tile: the same Z either way), fp32:
        0 where dropped, 1 / (1 - p) where kept. ``pid_bh`` = b * H + h must be int64 so the offsets
        are computed in int64."""
        offsets = (pid_bh * Nq + qi) * Nk + kj
        keep = tl.rand(seed, offsets) >= dropout_p
        return tl.where(keep, 1.0 / (1.0 - dropout_p), 0.0)

    @triton.jit
    def dropout_scale(seed, pid_bh, offs_m, offs_n, Nq, Nk, dropout_p):
        """Z_ij / (1 - p) for one (BLOCK_M, BLOCK_N) tile of queries offs_m and keys offs_n."""
        return dropout_scale_at(seed, pid_bh, offs_m[:, None], offs_n[None, :], Nq, Nk, dropout_p)

    @triton.jit
    def dropout_mask_kernel(KEEP, SEED, dropout_p, H, Nq, Nk, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """KEEP (B, H, Nq, Nk) uint8 contiguous: 1 where the kernels keep the weight, from dropout_scale."""
        dropout_p = tl.cast(dropout_p, tl.float32)
        seed = tl.load(SEED)
        pid_bh = tl.program_id(2).to(tl.int64)
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        kept = dropout_scale(seed, pid_bh, offs_m, offs_n, Nq, Nk, dropout_p) > 0.0
        where = (pid_bh * Nq + offs_m[:, None]) * Nk + offs_n[None, :]
        tl.store(KEEP + where, kept.to(tl.uint8), mask=(offs_m[:, None] < Nq) & (offs_n[None, :] < Nk))


def draw_seed(device) -> torch.Tensor:
    """A fresh 1-element int64 Philox seed from torch's default generator of ``device`` (the first and
    only random number a kernel call draws)."""
    return torch.randint(0, torch.iinfo(torch.int64).max, (1,), dtype=torch.int64, device=device)


def call_seed(q: torch.Tensor, dropout_p: float):
    """The seed of one kernel call: drawn when ``dropout_p > 0`` (the only random number the call
    draws, so ``torch.manual_seed(s)`` before the call fixes its mask), else None."""
    return draw_seed(q.device) if dropout_p > 0 else None


def dropout_flag(dropout_p: float, seed) -> bool:
    """Whether a kernel launch applies dropout; checks that a seed comes with dropout_p > 0."""
    if not dropout_p > 0:
        return False
    if seed is None:
        raise ValueError(f"dropout_p={dropout_p} needs a seed tensor (see attnzoo.ops.triton_dropout.draw_seed)")
    return True


def dropout_keep_mask(seed, dropout_p: float, shape, device=None) -> torch.Tensor:
    """The bool keep-mask Z (B, H, Nq, Nk) that a kernel call with this ``seed`` (tensor or int) and
    ``dropout_p`` applies; the weights it keeps are scaled by 1 / (1 - dropout_p)."""
    if not HAVE_TRITON:
        raise RuntimeError("triton is not installed")
    B, H, nq, nk = (int(s) for s in shape)
    if not isinstance(seed, torch.Tensor):
        seed = torch.tensor([int(seed)], dtype=torch.int64, device=device)
    seed = seed.reshape(1).to(torch.int64)
    keep = torch.empty((B, H, nq, nk), dtype=torch.uint8, device=seed.device)
    block = 16 if seed.device.type == "cpu" else 64
    grid = (triton.cdiv(nq, block), triton.cdiv(nk, block), B * H)
    dropout_mask_kernel[grid](keep, seed, float(dropout_p), H, nq, nk, BLOCK_M=block, BLOCK_N=block)
    return keep.bool()
