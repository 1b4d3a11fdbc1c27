"""Softmax attention: softmax_j(scale q_i.k_j + mask_ij) v_j (Vaswani et al. 2017; paper 002 eq 2.2).

Backends: "reference" (reference.py); "torch", SDPA (ops/kernels/sdpa.py), priority 25: SDPA is the
baseline every fused softmax kernel is measured against, so auto prefers it to Triton on CUDA too;
"triton", the online-softmax kernel (ops/kernels/flash_softmax/), priority 20; "cpu", the blockwise
path (ops/kernels/blockwise.py), priority 10, on CPU tensors (docs/kernels_cpu_torch.md has the
measurements behind the priorities).
"""
from __future__ import annotations

from ..kernels import blockwise, blockwise_varlen, sdpa
from ..kernels.flash_softmax import bound as flash_bound
from ..kernels.flash_softmax import triton as flash
from ..triton_utils import register_triton
from ..catalog import declare
from ..record import Variant
from .functional import softmax
from .backends import softmax_cpu, softmax_cpu_varlen, softmax_torch
from .reference import softmax_attention

sdpa.register("softmax", softmax_torch, priority=25, gqa=True, specialize=sdpa.specialize_plain, extras=("sinks",))
blockwise.register("softmax", softmax_cpu, extras=("softcap", "sinks", "window_size"))
blockwise_varlen.register("softmax", softmax_cpu_varlen)
register_triton("softmax", flash.softmax_attention, gqa=True, specialize=flash_bound.specializer(l2=False),
                description="Triton FlashAttention-2-style fused softmax, fwd+bwd, in-kernel dropout, no N x N tensor",
                extras=flash.FUSED_EXTRAS)

RECORD = declare(Variant(
    name="softmax", reference=softmax_attention, functional=softmax,
    extras=frozenset({"softcap", "sinks"}),
    doc="softmax(q k^T / sqrt(d)) v: timm's Attention, through attnzoo's dispatcher.",
    complexity="O(N^2 D) time, O(N) memory fused", paper="Vaswani et al. 2017; paper 002 eq (2.2)",
))
