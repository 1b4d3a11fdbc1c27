"""Softmax attention: softmax_j(scale q_i.k_j + mask_ij) v_j (Vaswani et al. 2017; paper 002 eq 2.2).

Backends: "reference" (reference.py); "torch", SDPA (ops/kernels/sdpa.py), priority 25: SDPA is the
baseline every fused softmax kernel is measured against, so auto prefers it to Triton on CUDA too,
except for a call with sinks (SDPA's need an (Nq, Nk + 1) mask; Triton fuses them, and softcap and
windows, which SDPA does not take); "triton", the online-softmax kernel (ops/kernels/flash_softmax/),
priority 20; "cpu", the blockwise
path (ops/kernels/blockwise.py), priority 10, on CPU tensors (docs/kernels_cpu_torch.md has the
measurements behind the priorities).
"""
from __future__ import annotations

from ..kernels import blockwise, blockwise_varlen, sdpa
from ..kernels.flash_softmax import bound as flash_bound
from ..kernels.flash_softmax import triton as flash
from ..triton_utils import call_reason, register_triton
from .. import varlen_triton
from ..catalog import declare
from ..record import Variant
from .functional import softmax
from .backends import softmax_cpu, softmax_cpu_varlen, softmax_torch, softmax_triton_varlen
from .reference import softmax_attention


def sinks_fused_on_cuda(q, k, v, **kw):
    """(auto only) SDPA computes sinks as one more key in an (Nq, Nk + 1) float mask, which also keeps it off
    its flash kernel; on CUDA the Triton kernel fuses them (no mask), so auto leaves such a call to it."""
    if kw.get("sinks") is None or q.device.type != "cuda" or call_reason(q, k, v, **kw) is not None:
        return None
    return "sinks on CUDA: the Triton kernel fuses them, SDPA would need an (Nq, Nk + 1) mask"


sdpa.register("softmax", softmax_torch, priority=25, gqa=True, specialize=sdpa.specialize_plain, extras=("sinks",),
              auto_prefers=sinks_fused_on_cuda)
blockwise.register("softmax", softmax_cpu, extras=("softcap", "sinks", "window_size"))
blockwise_varlen.register("softmax", softmax_cpu_varlen)
varlen_triton.register("softmax", softmax_triton_varlen)
register_triton("softmax", flash.softmax_attention, gqa=True, specialize=flash_bound.specializer(l2=False),
                description="Triton FlashAttention-2-style fused softmax, fwd+bwd, in-kernel dropout, no N x N tensor",
                extras=flash.FUSED_EXTRAS)

RECORD = declare(Variant(
    name="softmax", reference=softmax_attention, functional=softmax,
    extras=frozenset({"softcap", "sinks"}),
    doc="softmax(q k^T / sqrt(d)) v: timm's Attention, through attnzoo's dispatcher.",
    complexity="O(N^2 D) time, O(N) memory fused", paper="Vaswani et al. 2017; paper 002 eq (2.2)",
))
