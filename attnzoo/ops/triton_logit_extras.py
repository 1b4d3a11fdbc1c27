"""Logit softcapping and sliding-window bands inside Triton kernels (ops/logit_extras.py gives their
meaning): the pieces the pointwise and Sinkhorn kernels share.

``softcap_tile`` caps a tile of logits, s -> softcap tanh(s / softcap), and returns the slope
1 - tanh^2 for the backward. tanh is written from one exponential, tanh|x| = (1 - e) / (1 + e) with
e = exp(-2|x|) in (0, 1]: it never overflows, and Triton's language has no tanh that the interpreter
runs (libdevice's is GPU-only). Its absolute error is a few float32 ulps of 1, so the capped logit is
off by about softcap * 1e-7 at most.

``band_bounds`` (host) turns a window (left, right; -1 unbounded) and ``is_causal`` into the two finite
offsets the kernels compare with: key j takes part for query i iff
    i + (Nk - Nq) - left <= j <= i + (Nk - Nq) + right,
causality being right = 0 (a window with is_causal is the band cut at the diagonal).
"""
from __future__ import annotations

from typing import Optional

from .triton_utils import HAVE_TRITON


def band_bounds(window: Optional[tuple], is_causal: bool, nq: int, nk: int) -> tuple[int, int]:
    """(left, right) as finite offsets from the bottom-right diagonal (an unbounded side becomes
    nq + nk, past every key), with ``is_causal`` folded in as right <= 0."""
    reach = nq + nk    # past any offset j - i - (Nk - Nq); also keeps a huge bound an int32 argument
    left, right = window
    left = reach if left < 0 else min(left, reach)
    right = reach if right < 0 else min(right, reach)
    if is_causal:
        right = min(right, 0)
    return left, right


if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def softcap_tile(s, softcap):
        """(softcap tanh(s / softcap), 1 - tanh(s / softcap)^2): the capped logits and their slope."""
        x = s / softcap
        e = tl.exp(-2.0 * tl.abs(x))
        t = (1.0 - e) / (1.0 + e)
        t = tl.where(x < 0.0, -t, t)
        return softcap * t, 1.0 - t * t

    @triton.jit
    def in_band(qi, kj, Nq, Nk, left, right):
        """Whether key kj takes part for query qi under the band (broadcastable index tensors)."""
        d = kj - qi - (Nk - Nq)
        return (d >= -left) & (d <= right)

    @triton.jit
    def band_keys(start_m, Nq, Nk, left, right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """(lo, a, b, hi) for the query block [start_m, start_m + BLOCK_M) under the band: keys before lo
        and from hi on are outside every row's band (skipped); key blocks in [a, b) are whole, in bounds
        and inside every row's band (no masking); [lo, a) and [b, hi) are the band's edges (masked).
        All but hi are multiples of BLOCK_N; every index is clamped at 0 before a division."""
        off = Nk - Nq
        lo = tl.minimum((tl.maximum(start_m + off - left, 0) // BLOCK_N) * BLOCK_N, Nk)
        hi = tl.maximum(tl.minimum(tl.maximum(start_m + BLOCK_M + off + right, 0), Nk), lo)
        a = tl.cdiv(tl.maximum(start_m + BLOCK_M - 1 + off - left, 0), BLOCK_N) * BLOCK_N
        a = tl.minimum(tl.maximum(a, lo), hi)
        b = (tl.minimum(tl.maximum(start_m + off + right + 1, 0), Nk) // BLOCK_N) * BLOCK_N
        return lo, a, tl.minimum(tl.maximum(b, a), hi), hi

    @triton.jit
    def band_queries(start_n, Nq, Nk, left, right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """(first, a, b, end) for the key block [start_n, start_n + BLOCK_N) of a dK/dV kernel: query
        blocks before first and from end on see none of its keys; those in [a, b) are whole, in bounds
        and see every key of the block; [first, a) and [b, end) are the edges (masked, bounds-checked)."""
        off = Nk - Nq
        first = tl.minimum((tl.maximum(start_n - off - right, 0) // BLOCK_M) * BLOCK_M, Nq)
        end = tl.maximum(tl.minimum(tl.maximum(start_n + BLOCK_N - off + left, 0), Nq), first)
        a = tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - off - right, 0), BLOCK_M) * BLOCK_M
        a = tl.minimum(tl.maximum(a, first), end)
        b = (tl.minimum(tl.maximum(start_n - off + left + 1, 0), Nq) // BLOCK_M) * BLOCK_M
        return first, a, tl.minimum(tl.maximum(b, a), end), end
