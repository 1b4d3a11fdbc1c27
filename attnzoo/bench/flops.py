"""FLOP counts per attention variant, the numerator of every TFLOP/s figure ``attnzoo bench`` reports.

Convention (FlashAttention's, extended; ops/sizes.py): count the multiply-adds of the matrix products
(2 FLOPs each); exp, max, division and other elementwise work is not counted. A count is a fixed
property of the problem (variant, shapes, arguments), not of the kernel that runs it, so TFLOP/s
figures of different backends of one variant are directly comparable (they are a rescaled throughput).

Shapes: B batch, H heads, Nq queries, Nk keys, D = q/k head dim, Dv = v head dim.

Each variant declares its forward formula and backward factor in its record (ops/<variant>/; the
default is QK^T and PV, 2 B H Nq Nk (D + Dv), halved when causal, and backward = 2.5 x forward,
FlashAttention's convention: five matrix products against two, the logits recomputed). A wrapper
adds its own work around its kind's kernel: "masked" runs the kind with is_causal=True, "multihead"
adds the four projections of attnzoo.MultiheadAttention (layers/wrapper.py, layers/multihead.py).
"fwd+bwd" = forward + backward.
"""
from __future__ import annotations

from fractions import Fraction

from .. import registry
from ..ops import variant as catalog
from ..ops.sizes import DEFAULT_BACKWARD_FACTOR, Shape

__all__ = ["MODES", "Shape", "formulas", "backward_rule", "forward_flops", "backward_flops", "flops"]

MODES = ("fwd", "fwd+bwd")


def formulas() -> dict[str, str]:
    """Forward FLOP formula in words, per registered variant and wrapper."""
    out = {record.name: record.flop_formula for record in catalog.records()}
    for name, wrapper in registry.wrappers().items():
        out[name] = "its kind" + (" with is_causal=True" if wrapper.causal else "") + (
            f" + {wrapper.module_formula}" if wrapper.module_formula else "")
    return out


def backward_rule() -> str:
    factors = {r.name: r.backward_factor for r in catalog.records()}
    default = DEFAULT_BACKWARD_FACTOR
    others = ", ".join(f"{n}: {float(f):g} x" for n, f in factors.items() if f != default)
    modules = ", ".join(f"{n} {w.module_work}: {float(w.module_backward_factor):g} x"
                        for n, w in registry.wrappers().items() if w.module_flops is not None)
    extra = "; ".join(x for x in (others, modules) if x)
    return f"backward = {float(default):g} x forward" + (f" ({extra})" if extra else "") + "; fwd+bwd = forward + backward"


def _resolve(variant: str, kwargs: dict) -> tuple[registry.Resolved, dict]:
    """(the resolution, the formula's extra arguments such as n_templates); ValueErrors name the argument."""
    if not isinstance(variant, str) or variant not in registry.available():
        raise ValueError(f"variant must be one of {registry.available()}, got {variant!r}")
    kwargs = dict(kwargs)
    kind = kwargs.pop("kind", None)
    resolved = registry.resolve(variant, **({} if kind is None else {"kind": kind}), **kwargs)
    options = resolved.record.options
    extra = {k: v for k, v in kwargs.items() if k not in options}  # e.g. n_templates; unknown ones ignored
    return resolved, extra


def forward_flops(variant: str, shape: Shape, causal: bool = False, **kwargs) -> Fraction:
    """Forward FLOPs of one call; ``kwargs`` are the variant's arguments (n_iters, feature_map,
    solve, kind, n_templates), unknown ones ignored."""
    resolved, extra = _resolve(variant, kwargs)
    return resolved.forward_flops(shape, causal, **extra)


def backward_flops(variant: str, shape: Shape, causal: bool = False, **kwargs) -> Fraction:
    resolved, extra = _resolve(variant, kwargs)
    return resolved.backward_flops(shape, causal, **extra)


def flops(variant: str, shape: Shape, mode: str = "fwd", causal: bool = False, **kwargs) -> int:
    """FLOPs of one ``mode`` call ("fwd" or "fwd+bwd"), rounded to an integer."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    total = forward_flops(variant, shape, causal, **dict(kwargs))
    if mode == "fwd+bwd":
        total += backward_flops(variant, shape, causal, **dict(kwargs))
    return round(total)
