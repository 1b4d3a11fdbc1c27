"""FLOP counts per attention variant, the numerator of every TFLOP/s figure ``attnzoo bench`` reports.

Convention (FlashAttention's, extended): count the multiply-adds of the matrix products (2 FLOPs
each); exp, max, division and other elementwise work is not counted. A count is a fixed property of
the problem (variant, shapes, arguments), not of the kernel that runs it, so TFLOP/s figures of
different backends of one variant are directly comparable (they are a rescaled throughput).

Shapes: B batch, H heads, Nq queries, Nk keys, D = q/k head dim, Dv = v head dim.

Forward:
- softmax, l2, sigmoid, relu, fenchel (first_order): 2 B H Nq Nk (D + Dv)      (QK^T and PV)
  = FlashAttention's 4 B H N^2 D; halved when causal (FlashAttention's convention).
- fenchel second_order: adds the per-query key moments (u K: 2 Nq Nk D, sum_j u_ij k_j k_j^T:
  2 Nq Nk D^2) and one D x D solve per query (2/3 D^3); solve="exact" counts one Newton step on top
  (a lower bound: the number of steps depends on the data).
- sinkhorn: the streaming O(N)-memory algorithm recomputes the logits in each of its 2 n_iters
  normalisation passes (row, column) and once more in the final softmax-with-bias pass:
  2 B H Nq Nk D (2 n_iters) + 2 B H Nq Nk (D + Dv). Causal = Sinkhorn on every prefix
  (docs/design.md): each prefix problem is counted over its own kept (query, key) pairs, exactly.
- linear: phi(K)^T V and phi(Q) (phi(K)^T V): 2 B H D Dv (Nq + Nk), plus 2 B H Nq D for the
  normaliser phi(q_i) . sum_j phi(k_j) (feature maps elu/relu; "identity" has none). Causal prefix
  sums do the same multiply-adds, so causal does not change the count.
- ot (M(a, b) = -a.b, |A| = Nk + extra templates): query term Q A^T (2 Nq |A| D), Gram K A^T
  (2 Nk |A| D), the u-weighted sum over sources j of the per-(i, j) softmax over A (2 Nq Nk |A|)
  and W A_v (2 Nq |A| Dv). Causal: the (i, j, t) sum counts only kept triples.
- masked: its kind with is_causal=True. multihead: its kind plus the four projections of
  attnzoo.MultiheadAttention (in_proj 2 B N E 3E, out_proj 2 B N E E with E = H D).

Backward: 2.5 x forward (FlashAttention's convention: five matrix products against two, the
logits recomputed), except linear attention whose two products need four in backward (2.0 x), and
the projections of multihead (dX and dW: 2.0 x). "fwd+bwd" = forward + backward.
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

MODES = ("fwd", "fwd+bwd")
BACKWARD_FACTOR = {"linear": Fraction(2)}
DEFAULT_BACKWARD_FACTOR = Fraction(5, 2)
PROJECTION_BACKWARD_FACTOR = Fraction(2)

FORMULAS = {
    "softmax": "2 B H Nq Nk (D + Dv) (= 4 B H N^2 D); x 1/2 causal",
    "l2": "2 B H Nq Nk (D + Dv); x 1/2 causal",
    "sigmoid": "2 B H Nq Nk (D + Dv); x 1/2 causal",
    "relu": "2 B H Nq Nk (D + Dv); x 1/2 causal",
    "fenchel": "first_order: 2 B H Nq Nk (D + Dv); second_order adds 2 B H Nq Nk (D + D^2) + 2/3 B H Nq D^3; "
               "exact adds one Newton step more; x 1/2 causal",
    "sinkhorn": "2 B H Nq Nk D (2 n_iters) + 2 B H Nq Nk (D + Dv); causal: summed exactly over every prefix problem",
    "linear": "2 B H D Dv (Nq + Nk) + 2 B H Nq D (normalised feature maps); same when causal",
    "ot": "2 B H |A| (D (Nq + Nk) + Nq Nk + Nq Dv), |A| = Nk + templates; causal: kept (i, j, t) triples only",
    "masked": "its kind with is_causal=True",
    "multihead": "its kind + in/out projections 8 B N E^2 (E = H D)",
}
BACKWARD_RULE = "backward = 2.5 x forward (linear: 2 x; multihead projections: 2 x); fwd+bwd = forward + backward"


@dataclass(frozen=True)
class Shape:
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


def _visible_keys(nq: int, nk: int) -> list[int]:
    """Keys each query sees under bottom-right causal masking (j <= i + Nk - Nq)."""
    return [min(max(i + nk - nq + 1, 0), nk) for i in range(nq)]


def _softmax_like(s: Shape, causal: bool) -> Fraction:
    total = Fraction(2 * s.bh * s.seq_q * s.nk * (s.head_dim + s.dv))
    return total / 2 if causal else total


def _fenchel(s: Shape, causal: bool, solve: str = "first_order", **_) -> Fraction:
    total = _softmax_like(s, causal=False)
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


def _sinkhorn(s: Shape, causal: bool, n_iters: int = 3, **_) -> Fraction:
    d, dv = s.head_dim, s.dv
    if not causal:
        pairs = s.seq_q * s.nk
        return Fraction(s.bh * (2 * pairs * d * 2 * n_iters + 2 * pairs * (d + dv)))
    # prefix problem of query i: queries 0..i, each with its own visible keys; its normalisation
    # passes touch those pairs, its final pass only query i's row.
    visible = _visible_keys(s.seq_q, s.nk)
    pass_pairs = 0
    prefix = 0
    for c in visible:
        prefix += c
        pass_pairs += prefix
    return Fraction(s.bh * (2 * d * 2 * n_iters * pass_pairs + 2 * (d + dv) * sum(visible)))


def _linear(s: Shape, causal: bool, feature_map: str = "elu", **_) -> Fraction:
    total = 2 * s.bh * s.head_dim * s.dv * (s.seq_q + s.nk)
    if feature_map != "identity":
        total += 2 * s.bh * s.seq_q * s.head_dim
    return Fraction(total)


def _ot(s: Shape, causal: bool, n_templates: int = 0, **_) -> Fraction:
    a = s.nk + n_templates
    products = 2 * s.bh * a * (s.head_dim * (s.seq_q + s.nk) + s.seq_q * s.dv)
    if causal:
        # query i: sources j and in-sequence templates t both among its visible keys, plus every extra template
        triples = sum(c * (c + n_templates) for c in _visible_keys(s.seq_q, s.nk))
    else:
        triples = s.seq_q * s.nk * a
    return Fraction(products + 2 * s.bh * triples)


_FORWARD = {
    "softmax": lambda s, causal, **kw: _softmax_like(s, causal),
    "l2": lambda s, causal, **kw: _softmax_like(s, causal),
    "sigmoid": lambda s, causal, **kw: _softmax_like(s, causal),
    "relu": lambda s, causal, **kw: _softmax_like(s, causal),
    "fenchel": _fenchel,
    "sinkhorn": _sinkhorn,
    "linear": _linear,
    "ot": _ot,
}
VARIANTS = tuple(_FORWARD) + ("masked", "multihead")


def _projections(s: Shape) -> Fraction:
    e = s.heads * s.head_dim
    return Fraction(2 * s.batch * s.seq_q * e * 3 * e + 2 * s.batch * s.seq_q * e * e)


def _kernel(variant: str, kind: str | None) -> str:
    return kind or "softmax" if variant in ("masked", "multihead") else variant


def forward_flops(variant: str, shape: Shape, causal: bool = False, **kwargs) -> Fraction:
    """Forward FLOPs of one call; ``kwargs`` are the variant's arguments (n_iters, feature_map,
    solve, kind, n_templates), unknown ones ignored."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    kind = _kernel(variant, kwargs.pop("kind", None))
    if kind not in _FORWARD:
        raise ValueError(f"kind must be one of {tuple(_FORWARD)}, got {kind!r}")
    total = _FORWARD[kind](shape, causal or variant == "masked", **kwargs)
    if variant == "multihead":
        total += _projections(shape)
    return total


def backward_flops(variant: str, shape: Shape, causal: bool = False, **kwargs) -> Fraction:
    kind = _kernel(variant, kwargs.get("kind"))
    kernel_kwargs = {k: v for k, v in kwargs.items() if k != "kind"}
    kernel = forward_flops(kind if variant == "multihead" else variant, shape, causal,
                           **({"kind": kind} if variant == "masked" else {}), **kernel_kwargs)
    total = kernel * BACKWARD_FACTOR.get(kind, DEFAULT_BACKWARD_FACTOR)
    if variant == "multihead":
        total += _projections(shape) * PROJECTION_BACKWARD_FACTOR
    return total


def flops(variant: str, shape: Shape, mode: str = "fwd", causal: bool = False, **kwargs) -> int:
    """FLOPs of one ``mode`` call ("fwd" or "fwd+bwd"), rounded to an integer."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    total = forward_flops(variant, shape, causal, **dict(kwargs))
    if mode == "fwd+bwd":
        total += backward_flops(variant, shape, causal, **dict(kwargs))
    return round(total)
