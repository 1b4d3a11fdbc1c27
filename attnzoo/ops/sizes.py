"""Problem sizes, and the cost formulas most variants share (a variant with other costs declares its own
in its record, ops/<variant>/).

FLOP convention (FlashAttention's, extended): the multiply-adds of the matrix products count 2 FLOPs
each; exp, max, division and other elementwise work is not counted. A count is a property of the
problem (variant, shapes, arguments), not of the kernel that runs it.
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction


@dataclass(frozen=True)
class Shape:
    """B batch, H heads, Nq queries (``seq_q``), Nk keys (``seq_k``, default Nq), D = q/k head dim,
    Dv = v head dim (``head_dim_v``, default D)."""
    batch: int
    heads: int
    seq_q: int
    head_dim: int
    seq_k: int | None = None
    head_dim_v: int | None = None

    @property
    def nk(self) -> int:
        return self.seq_q if self.seq_k is None else self.seq_k

    @property
    def dv(self) -> int:
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    @property
    def bh(self) -> int:
        return self.batch * self.heads


def visible_keys(nq: int, nk: int) -> list[int]:
    """Keys each query sees under bottom-right causal masking (j <= i + Nk - Nq)."""
    return [min(max(i + nk - nq + 1, 0), nk) for i in range(nq)]


def score_matmul_flops(s: Shape, causal: bool, **_) -> Fraction:
    """QK^T and PV: 2 B H Nq Nk (D + Dv) (= FlashAttention's 4 B H N^2 D), halved when causal."""
    total = Fraction(2 * s.bh * s.seq_q * s.nk * (s.head_dim + s.dv))
    return total / 2 if causal else total


SCORE_MATMUL_FORMULA = "2 B H Nq Nk (D + Dv) (= 4 B H N^2 D); x 1/2 causal"
DEFAULT_BACKWARD_FACTOR = Fraction(5, 2)  # FlashAttention's: five matrix products against two


def weights_bytes(s: Shape, train: bool, causal: bool, itemsize: int, **_) -> int:
    """Rough peak of an eager reference that materialises a few (B, H, Nq, Nk) tensors."""
    return s.bh * s.seq_q * s.nk * itemsize * (6 if train else 3)
