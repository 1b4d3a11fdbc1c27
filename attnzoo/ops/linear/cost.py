"""Forward FLOPs and the eager reference's memory of linear attention."""
from __future__ import annotations

from fractions import Fraction

from ..sizes import Shape

FORMULA = "2 B H D Dv (Nq + Nk) + 2 B H Nq D (normalised feature maps); same when causal"
BACKWARD_FACTOR = Fraction(2)  # its two products need four in backward


def linear_flops(s: Shape, causal: bool, feature_map: str = "elu", **_) -> Fraction:
    """phi(K)^T V and phi(Q) (phi(K)^T V): 2 B H D Dv (Nq + Nk), plus 2 B H Nq D for the normaliser
    phi(q_i) . sum_j phi(k_j) (feature maps elu/relu; "identity" has none). Causal prefix sums do the
    same multiply-adds, so causal does not change the count."""
    total = 2 * s.bh * s.head_dim * s.dv * (s.seq_q + s.nk)
    if feature_map != "identity":
        total += 2 * s.bh * s.seq_q * s.head_dim
    return Fraction(total)


def linear_reference_bytes(s: Shape, train: bool, causal: bool, itemsize: int, **_) -> int:
    """The causal reference keeps (N, D, Dv) prefix sums and the (Nq, Nk) mask."""
    square = s.bh * s.seq_q * s.nk * itemsize
    prefix = s.bh * s.nk * s.head_dim * s.dv * itemsize if causal else 0
    return prefix * (3 if train else 1) + (square if causal else 0)
