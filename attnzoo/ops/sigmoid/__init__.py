"""Sigmoid attention (paper 002 eq 2.5; Ramapuram et al. 2024): sum_j sigmoid(s_ij + b) v_j, b = -log n_i
by default, no row statistics.

Backends: "reference"; "triton", the pointwise kernels (ops/kernels/pointwise/), priority 20; "cpu",
the blockwise path (10), also registered as "torch" (9, the non-Triton path under the name the
softmax family's SDPA backends carry; SDPA itself does not apply).
"""
from __future__ import annotations

from ..dispatch import all_of
from ..kernels import blockwise, blockwise_varlen
from ..kernels.pointwise import bound as pointwise_bound
from ..kernels.pointwise import triton as pointwise
from ..triton_utils import call_reason, register_triton
from .. import varlen_triton
from ..catalog import declare
from ..record import Variant
from .functional import check, sigmoid
from .backends import sigmoid_cpu, sigmoid_cpu_varlen, sigmoid_triton_varlen
from .layer import SigmoidHook
from .reference import sigmoid_attention


def _bias_reason(q, k, v, **kw):
    return pointwise.bias_reason(kw.get("bias"), q)


register_triton("sigmoid", pointwise.sigmoid_attention, all_of(call_reason, _bias_reason),
                gqa=True, specialize=pointwise_bound.specializer(sigmoid=True),
                extras=("softcap", "window_size"),
                description="Triton fused sigmoid attention, no row statistics, fwd+bwd with bias gradient, "
                            "in-kernel dropout")
blockwise.register("sigmoid", sigmoid_cpu, extras=("softcap", "window_size"))
blockwise_varlen.register("sigmoid", sigmoid_cpu_varlen)
varlen_triton.register("sigmoid", sigmoid_triton_varlen)
blockwise.register("sigmoid", sigmoid_cpu, name="torch", priority=9, extras=("softcap", "window_size"),
                   description=blockwise.DESCRIPTION + " (the same path as 'cpu')")

RECORD = declare(Variant(
    name="sigmoid", reference=sigmoid_attention, functional=sigmoid, check=check, hook=SigmoidHook(),
    extras=frozenset({"softcap"}),
    extras_refused={"sinks": "each weight is sigmoid(s_ij + b) on its own, with no normaliser over the keys "
                             "for a sink to join"},
    doc=("sum_j sigmoid(s_ij + b) v_j. ``bias`` fixes b (default -log n); ``learnable_bias=True`` adds a "
         "learned per-head shift (initialised to 0) on top of it."),
    complexity="O(N^2 D), no row statistics", parameters="optional learnable per-head bias shift",
    paper="paper 002 eq (2.5); Ramapuram et al. 2024",
))
