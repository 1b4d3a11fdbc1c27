"""ReLU attention (paper 002 eq 2.5): sum_j relu(s_ij) v_j / n_i, no row statistics.

Backends: "reference"; "triton", the pointwise kernels (ops/kernels/pointwise/), priority 20; "cpu",
the blockwise path (10), also registered as "torch" (9, the non-Triton path under the name the
softmax family's SDPA backends carry; SDPA itself does not apply).
"""
from __future__ import annotations

from ..kernels import blockwise, blockwise_varlen
from ..kernels.pointwise import bound as pointwise_bound
from ..kernels.pointwise import triton as pointwise
from ..triton_utils import register_triton
from .. import varlen_triton
from ..catalog import declare
from ..record import Variant
from .functional import relu
from .backends import relu_cpu, relu_cpu_varlen, relu_triton_varlen
from .reference import relu_attention

register_triton("relu", pointwise.relu_attention,
                gqa=True, specialize=pointwise_bound.specializer(sigmoid=False),
                extras=("softcap", "window_size"),
                description="Triton fused ReLU(s)/n attention, no row statistics, fwd+bwd, in-kernel dropout")
blockwise.register("relu", relu_cpu, extras=("softcap", "window_size"))
blockwise_varlen.register("relu", relu_cpu_varlen)
varlen_triton.register("relu", relu_triton_varlen)
blockwise.register("relu", relu_cpu, name="torch", priority=9, extras=("softcap", "window_size"),
                   description=blockwise.DESCRIPTION + " (the same path as 'cpu')")

RECORD = declare(Variant(
    name="relu", reference=relu_attention, functional=relu, class_name="ReLUAttention",
    extras=frozenset({"softcap"}),
    extras_refused={"sinks": "its weights relu(s_ij) / n_i have no sum of exponentials over the keys for a "
                             "sink to join"},
    complexity="O(N^2 D), no row statistics", parameters="none", paper="paper 002 eq (2.5)",
))
