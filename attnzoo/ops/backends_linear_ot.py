"""Fused linear-attention and OT-attention backends register here (imported by attnzoo.functional).

cpu: chunked causal linear attention / blockwise OT with custom autograd (any device, plain torch).
triton: the same algorithms as Triton kernels; auto picks them on CUDA only, on CPU tensors they run
when asked by name under TRITON_INTERPRET=1 (the interpreter, for tests).
The cpu priorities come from benchmarks/fused_linear_ot.py: both fused paths were at least as fast
as the reference at every size measured there, and use far less memory.
"""
from __future__ import annotations

from .dispatch import register_backend
from .linear.cpu import linear_attention_cpu, supports_linear_fused
from .linear.triton import device_reason, linear_attention_triton
from .ot.cpu import ot_attention_cpu
from .ot.factorised import supports_ot_fused
from .ot.triton import ot_attention_triton


def _supports_triton(fused_reason):
    def supports(q, k, v, **kw):
        return device_reason(q) or fused_reason(q, k, v, **kw)
    return supports


register_backend("linear", "cpu", linear_attention_cpu, supports=supports_linear_fused, priority=10,
                 description="chunked causal linear attention (no (N, D, Dv) prefix sums), custom autograd")
register_backend("linear", "triton", linear_attention_triton, supports=_supports_triton(supports_linear_fused),
                 priority=20, auto_devices=("cuda",),
                 description="Triton chunked causal linear attention, fp32 state, forward and backward")
register_backend("ot", "cpu", ot_attention_cpu, supports=supports_ot_fused, priority=10,
                 description="blockwise OT attention, never (Nq, Nk, |A|), recompute in backward")
register_backend("ot", "triton", ot_attention_triton, supports=_supports_triton(supports_ot_fused),
                 priority=20, auto_devices=("cuda",),
                 description="Triton OT attention: streaming logsumexp over A, forward and backward")
