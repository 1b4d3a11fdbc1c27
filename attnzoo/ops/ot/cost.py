"""Forward FLOPs and the eager reference's memory of OT attention."""
from __future__ import annotations

from fractions import Fraction

from ..sizes import Shape, visible_keys

FORMULA = "2 B H |A| (D (Nq + Nk) + Nq Nk + Nq Dv), |A| = Nk + templates; causal: kept (i, j, t) triples only"


def ot_flops(s: Shape, causal: bool, n_templates: int = 0, **_) -> Fraction:
    """M(a, b) = -a.b, |A| = Nk + extra templates: query term Q A^T (2 Nq |A| D), Gram K A^T
    (2 Nk |A| D), the u-weighted sum over sources j of the per-(i, j) softmax over A (2 Nq Nk |A|) and
    W A_v (2 Nq |A| Dv). Causal: the (i, j, t) sum counts only kept triples."""
    a = s.nk + n_templates
    products = 2 * s.bh * a * (s.head_dim * (s.seq_q + s.nk) + s.seq_q * s.dv)
    if causal:
        # query i: sources j and in-sequence templates t both among its visible keys, plus every extra template
        triples = sum(c * (c + n_templates) for c in visible_keys(s.seq_q, s.nk))
    else:
        triples = s.seq_q * s.nk * a
    return Fraction(products + 2 * s.bh * triples)


def ot_reference_bytes(s: Shape, train: bool, causal: bool, itemsize: int, n_templates: int = 0, **_) -> int:
    """The reference builds (B, H, Nq, Nk, |A|) tensors."""
    return s.bh * s.seq_q * s.nk * itemsize * (s.nk + n_templates) * (6 if train else 3)
