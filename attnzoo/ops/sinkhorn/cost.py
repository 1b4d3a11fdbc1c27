"""Forward FLOPs and the eager reference's memory of Sinkhorn attention."""
from __future__ import annotations

from fractions import Fraction

from ..sizes import Shape, visible_keys

FORMULA = "2 B H Nq Nk D (2 n_iters) + 2 B H Nq Nk (D + Dv); causal: summed exactly over every prefix problem"


def sinkhorn_flops(s: Shape, causal: bool, n_iters: int = 3, **_) -> Fraction:
    """The streaming O(N)-memory algorithm recomputes the logits in each of its 2 n_iters
    normalisation passes (row, column) and once more in the final softmax-with-bias pass. Causal =
    Sinkhorn on every prefix (docs/design.md): each prefix problem is counted over its own kept
    (query, key) pairs, exactly."""
    d, dv = s.head_dim, s.dv
    if not causal:
        pairs = s.seq_q * s.nk
        return Fraction(s.bh * (2 * pairs * d * 2 * n_iters + 2 * pairs * (d + dv)))
    # prefix problem of query i: queries 0..i, each with its own visible keys; its normalisation
    # passes touch those pairs, its final pass only query i's row.
    visible = visible_keys(s.seq_q, s.nk)
    pass_pairs = 0
    prefix = 0
    for c in visible:
        prefix += c
        pass_pairs += prefix
    return Fraction(s.bh * (2 * d * 2 * n_iters * pass_pairs + 2 * (d + dv) * sum(visible)))


def sinkhorn_reference_bytes(s: Shape, train: bool, causal: bool, itemsize: int, n_iters: int = 3, **_) -> int:
    per_problem = s.bh * s.seq_q * s.nk * itemsize * (2 * n_iters + 4)
    if causal and train:
        return per_problem * s.seq_q  # autograd keeps every prefix problem's iterations
    return per_problem * (2 if train else 1)
