"""Fused linear-attention and OT-attention backends register here (imported by attnzoo.functional).

cpu: chunked causal linear attention / OT as matmuls with exact blockwise tiles where needed, both with
custom autograd (any device, plain torch).
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


MAX_LINEAR_HEAD_DIM = 256   # the (D, Dv + 1) state of the linear kernels lives in registers


def _linear_head_dims(q, k, v, **kw):
    if max(q.shape[-1], v.shape[-1] + 1) > MAX_LINEAR_HEAD_DIM:
        return (f"the Triton linear kernels keep a (D, Dv + 1) state in registers: D and Dv + 1 must be "
                f"<= {MAX_LINEAR_HEAD_DIM}, got D={q.shape[-1]}, Dv={v.shape[-1]} (use backend='cpu')")
    return None


def _supports_triton(*reasons):
    def supports(q, k, v, **kw):
        for reason in (device_reason(q),) + tuple(r(q, k, v, **kw) for r in reasons):
            if reason is not None:
                return reason
        return None
    return supports


register_backend("linear", "cpu", linear_attention_cpu, supports=supports_linear_fused, priority=10,
                 description="chunked causal linear attention (no (N, D, Dv) prefix sums), custom autograd")
register_backend("linear", "triton", linear_attention_triton, supports=_supports_triton(supports_linear_fused, _linear_head_dims),
                 priority=20, auto_devices=("cuda",),
                 description="Triton chunked causal linear attention, fp32 state, forward and backward")
register_backend("ot", "cpu", ot_attention_cpu, supports=supports_ot_fused, priority=10,
                 description="OT attention as matmuls (separable softmax) + exact tiles where that underflows; "
                             "never (Nq, Nk, |A|), recompute in backward")
register_backend("ot", "triton", ot_attention_triton, supports=_supports_triton(supports_ot_fused),
                 priority=20, auto_devices=("cuda",),
                 description="Triton OT attention: streaming logsumexp over A, forward and backward")
