"""Triton backends for softmax, l2, fenchel, sigmoid and relu register here (imported by attnzoo.functional).

``auto`` picks them on CUDA tensors only (priority 20); on CPU they run when asked for by name with
TRITON_INTERPRET=1 set before import (that is how CI runs the real kernels). Each ``supports`` returns
a sentence saying why a call is refused, which ``attnzoo.explain`` prints. ``dropout_p > 0`` is not a
reason: these kernels drop weights themselves (ops/triton_dropout.py).
"""
from __future__ import annotations

from . import dispatch
from .pointwise import triton as pointwise_triton
from .softmax import triton as softmax_triton
from .triton_utils import common_reason

PRIORITY = 20


def _base_reason(q, k, v, **kw):
    return common_reason(q, k, v, attn_mask=kw.get("attn_mask"), dropout_p=kw.get("dropout_p", 0.0))


def _fenchel_reason(q, k, v, **kw):
    why = _base_reason(q, k, v, **kw)
    if why is not None:
        return why
    solve = kw.get("solve", "first_order")
    if solve != "first_order":
        return f"solve={solve!r}: the Triton kernel computes the first-order solution (paper 004 eq 16) only"
    log_u = kw.get("log_u")
    if log_u is not None and softmax_triton.key_preference(log_u, q, k) is None:
        return (f"log_u of shape {tuple(log_u.shape)} varies with the query; the kernel takes a per-key "
                "preference (B|1, H|1, 1, Nk); T5 tables go through FenchelAttention or t5_bias_attention")
    return None


def _sigmoid_reason(q, k, v, **kw):
    why = _base_reason(q, k, v, **kw)
    if why is not None:
        return why
    return pointwise_triton.bias_reason(kw.get("bias"), q)


_BACKENDS = {
    "softmax": (softmax_triton.softmax_attention, _base_reason,
                "Triton FlashAttention-2-style fused softmax, fwd+bwd, in-kernel dropout, no N x N tensor"),
    "l2": (softmax_triton.l2_attention, _base_reason,
           "Triton fused L2 softmax (-scale ||q-k||^2 via row/column norms), fwd+bwd, in-kernel dropout"),
    "fenchel": (softmax_triton.fenchel_attention, _fenchel_reason,
                "Triton fused softmax(alpha s + log u) with a per-key log u and its gradient (first order), in-kernel dropout"),
    "sigmoid": (pointwise_triton.sigmoid_attention, _sigmoid_reason,
                "Triton fused sigmoid attention, no row statistics, fwd+bwd with bias gradient, in-kernel dropout"),
    "relu": (pointwise_triton.relu_attention, _base_reason,
             "Triton fused ReLU(s)/n attention, no row statistics, fwd+bwd, in-kernel dropout"),
}

for _variant, (_fn, _supports, _description) in _BACKENDS.items():
    dispatch.register_backend(_variant, "triton", _fn, supports=_supports, priority=PRIORITY,
                              description=_description, auto_devices=("cuda",))
