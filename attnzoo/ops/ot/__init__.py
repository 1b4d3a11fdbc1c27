"""Optimal-transport attention (paper 004 sec 9, eq 22): each query moves mass from the sources j (with
preference u_j) to the templates A by a softmax over A; OT-ViT's last layer.

Backends: "reference"; "cpu", OT as matmuls of a separable softmax with exact tiles where that
underflows (cpu.py, factorised.py, tiles.py), never (Nq, Nk, |A|), recompute in backward, priority
10 (auto keeps the eager reference for small calls, below the crossover measured by
benchmarks/ot_dispatch_crossover.py: ``_cpu_auto_prefers``); "triton", the same as tensor-core
matmuls (triton.py, triton_kernels.py), priority 20, auto on CUDA only. Packed (varlen) calls on
"triton" (auto: CUDA) take the same kernels for all sequences at once (varlen.py, through
ops/varlen_triton.py).
"""
from __future__ import annotations

import math

import torch

from .. import varlen_triton
from ..dispatch import register_backend
from ..measured import register_flavour
from ..triton_utils import register_triton
from ..catalog import declare
from ..record import Variant
from .cost import FORMULA, ot_flops, ot_reference_bytes
from .cpu import ot_attention_cpu
from .factorised import supports_ot_fused
from .functional import check, ot
from .layer import OTHook
from .reference import ot_attention
from .triton import ot_attention_triton, supports_ot_triton
from .varlen import route as packed_route

# Below these sizes of the reference's (B*H, Nq, Nk, |A|) cube auto keeps the eager reference on CPU.
# Measured side by side (benchmarks/results/cpu/ot_dispatch_crossover.json: fp32, 1 thread, 96 shapes with
# Nq 1..1024, Nk 16..1024, |A| = Nk or 2 Nk, D 16 / 32 / 64, each forward and forward + backward); each is
# the power of two that lost the least time summed over the rows of its kind. Below them 'cpu' took
# 0.99-1.7x the reference's time; from them on 0.01-1.1x (10 of 144 rows slower, none by more than 11%).
# One query is its own case: the fused path's products are then matrix-vector products
# with nothing to gain over the reference, whose cube is no bigger than the Gram term both paths hold,
# so the reference keeps up for longer.
OT_CPU_MIN_CUBE = 2 ** 16
OT_CPU_MIN_CUBE_SINGLE_QUERY = 2 ** 19


def ot_cube(q, k, **kw):
    """B*H*Nq*Nk*|A|: the elements of one (B, H, Nq, Nk, |A|) tensor of the eager reference."""
    templates = kw.get("templates_k")
    n_templates = k.shape[-2] + (0 if templates is None else templates.shape[-2])
    heads = math.prod(torch.broadcast_shapes(q.shape[:-2], k.shape[:-2]))
    return heads * q.shape[-2] * k.shape[-2] * n_templates


def _cpu_auto_prefers(q, k, v, **kw):
    """(auto only, CPU tensors) None from the measured crossover on, else why the reference is kept."""
    if q.device.type != "cpu":
        return None
    cube = ot_cube(q, k, **kw)
    single = q.shape[-2] == 1
    limit = OT_CPU_MIN_CUBE_SINGLE_QUERY if single else OT_CPU_MIN_CUBE
    if cube < limit:
        return (f"small call: B*H*Nq*Nk*|A| = {cube} < {limit}{' (one query)' if single else ''}, where the "
                f"eager reference was measured faster (benchmarks/results/cpu/ot_dispatch_crossover.json); "
                f"name backend='cpu' for its lower memory")
    return None



register_backend("ot", "cpu", ot_attention_cpu, supports=supports_ot_fused, priority=10,
                 auto_prefers=_cpu_auto_prefers,
                 description="OT attention as matmuls (separable softmax) + exact tiles where that underflows; "
                             "never (Nq, Nk, |A|), recompute in backward; auto picks it on CPU from "
                             f"B*H*Nq*Nk*|A| >= {OT_CPU_MIN_CUBE} ({OT_CPU_MIN_CUBE_SINGLE_QUERY} for one "
                             "query), where it was measured faster than the reference")
register_triton("ot", ot_attention_triton, supports_ot_triton,
                description="Triton OT attention as tensor-core matmuls of stabilised exponentials (exact per-pair "
                            "fallback where the shift underflows), forward and backward, chunked over batch x heads")

# packed (varlen) calls on "triton" (auto: CUDA) run the kernels above on all sequences at once (varlen.py)
varlen_triton.register_route("ot", packed_route)

register_flavour("ot", lambda kw: ["templates"] if kw.get("templates_k") is not None else [])

RECORD = declare(Variant(
    name="ot", reference=ot_attention, functional=ot, check=check, hook=OTHook(), class_name="OTAttention",
    extras=frozenset(),
    extras_refused={"softcap": "its weights mix the templates' logits alpha q.k_t + k_j.k_t per source key, not one logit "
                               "per key that a cap would bound",
                    "sinks": "its weights are a transport plan from the keys' mass u, with no softmax normaliser "
                             "for a sink to join"},
    doc=("Optimal-transport attention layer (paper 004 sec 9, eq 22), the last layer of OT-ViT. "
         "``forward(x, attn_mask=None, is_causal=False, templates=None)``: ``templates`` (B, M, dim) are extra "
         "tokens (OT-ViT's same-class templates) projected with this layer's key and value weights (and k_norm) "
         "and added to the template set A. gamma defaults to sqrt(head_dim)."),
    complexity="O(Nq Nk |A| D) time", parameters="alpha, gamma; forward(templates=)",
    paper="paper 004 sec 9, eq (22)", flops=ot_flops, flop_formula=FORMULA, reference_bytes=ot_reference_bytes,
))
