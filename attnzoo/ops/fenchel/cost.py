"""Forward FLOPs of Fenchel attention (ops/sizes.py's convention)."""
from __future__ import annotations

from fractions import Fraction

from ..sizes import Shape, score_matmul_flops

FORMULA = ("first_order: 2 B H Nq Nk (D + Dv); second_order adds 2 B H Nq Nk (D + D^2) + 2/3 B H Nq D^3; "
           "exact adds one Newton step more; x 1/2 causal")


def fenchel_flops(s: Shape, causal: bool, solve: str = "first_order", **_) -> Fraction:
    """First order: QK^T and PV. second_order adds the per-query key moments (u K: 2 Nq Nk D,
    sum_j u_ij k_j k_j^T: 2 Nq Nk D^2) and one D x D solve per query (2/3 D^3); "exact" counts one
    Newton step on top (a lower bound: the number of steps depends on the data)."""
    total = score_matmul_flops(s, causal=False)
    d = s.head_dim
    moments = 2 * s.bh * s.seq_q * s.nk * (d + d * d) + Fraction(2, 3) * s.bh * s.seq_q * d ** 3
    if solve == "second_order":
        total += moments
    elif solve == "exact":
        newton_step = 2 * s.bh * s.seq_q * s.nk * (2 * d + d * d) + Fraction(2, 3) * s.bh * s.seq_q * d ** 3
        total += moments + newton_step
    elif solve != "first_order":
        raise ValueError(f"solve must be 'first_order', 'second_order' or 'exact', got {solve!r}")
    return total / 2 if causal else total
