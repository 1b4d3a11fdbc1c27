"""Fenchel-dual preference-weighted attention (paper 004 eqs 7, 13, 16-18): weights proportional to
u_ij exp(alpha s_ij), first order in closed form (a softmax with log u added), second order and the
exact dual per query.

Backends: "reference" (all three solvers); "triton", the online-softmax kernel with a per-key log u
(20); "torch", SDPA with log u as a coordinate or an additive mask (15); "cpu", the blockwise path
(10); "flex", FlexAttention (5, CUDA). The fused ones compute the first order only. A learned T5
relative-position preference runs on the fused kernels from its table (t5.py).
"""
from __future__ import annotations

from ..dispatch import all_of, register_backend
from ..measured import register_flavour
from ..kernels import blockwise, blockwise_varlen, sdpa
from ..kernels.flash_softmax import bound as flash_bound
from ..kernels.flash_softmax import triton as flash
from ..kernels.flex import flex_reason
from ..triton_utils import call_reason, register_triton
from .. import varlen_triton
from ..catalog import declare
from ..record import Variant
from .cost import FORMULA, fenchel_flops
from .functional import check, fenchel
from . import layer
from .backends import fenchel_cpu, fenchel_cpu_varlen, fenchel_flex, fenchel_torch, fenchel_triton_varlen
from .layer import FenchelHook
from .reference import fenchel_attention


def first_order_only(q, k, v, **kw):
    solve = kw.get("solve", "first_order")
    if solve != "first_order":
        return (f"solve={solve!r} needs per-query covariances of the keys (paper 004 eqs 13 / 7); only "
                f"solve='first_order' is a softmax with an additive bias")
    return None


def triton_first_order(q, k, v, **kw):
    solve = kw.get("solve", "first_order")
    if solve != "first_order":
        return f"solve={solve!r}: the Triton kernel computes the first-order solution (paper 004 eq 16) only"
    return None


def per_key_log_u(q, k, v, **kw):
    log_u = kw.get("log_u")
    if log_u is not None and flash.key_preference(log_u, q, k) is None:
        return (f"log_u of shape {tuple(log_u.shape)} varies with the query; the kernel takes a per-key "
                "preference (B|1, H|1, 1, Nk); T5 tables go through relative_bias (ops/fenchel/t5.py)")
    return None


register_triton("fenchel", flash.fenchel_attention, all_of(call_reason, triton_first_order, per_key_log_u),
                gqa=True, specialize=flash_bound.specializer(),
                description="Triton fused softmax(alpha s + log u) with a per-key log u and its gradient (first "
                            "order), in-kernel dropout", extras=flash.FUSED_EXTRAS)
sdpa.register("fenchel", fenchel_torch, first_order_only, priority=15,
              description=sdpa.DESCRIPTION + ", log u as an additive mask")
blockwise.register("fenchel", fenchel_cpu, first_order_only, extras=("softcap", "sinks", "window_size"))
blockwise_varlen.register("fenchel", fenchel_cpu_varlen)
varlen_triton.register("fenchel", fenchel_triton_varlen)
register_backend("fenchel", "flex", fenchel_flex, supports=all_of(flex_reason, first_order_only), priority=5,
                 description="FlexAttention with log u as a score_mod (CUDA)", auto_devices=("cuda",),
                 extras=("softcap", "sinks", "window_size"))

register_flavour("fenchel", lambda kw: ["log_u"] if kw.get("log_u") is not None else [])

RECORD = declare(Variant(
    name="fenchel", reference=fenchel_attention, functional=fenchel, check=check, hook=FenchelHook(),
    extras=frozenset({"softcap", "sinks"}),
    doc=layer.__doc__,
    complexity="first_order O(N^2 D); second_order/exact add O(N D^3) per query",
    parameters="preference=uniform|t5|context, alpha, solve", paper="paper 004 eqs (7), (13), (16)-(18)",
    flops=fenchel_flops, flop_formula=FORMULA,
))
