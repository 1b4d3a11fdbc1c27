"""Fused linear-attention and OT-attention backends register here (imported by attnzoo.functional).

cpu: chunked causal linear attention / OT as matmuls with exact blockwise tiles where needed, both with
custom autograd (any device, plain torch).
triton: the same algorithms as Triton kernels; auto picks them on CUDA only, on CPU tensors they run
when asked by name under TRITON_INTERPRET=1 (the interpreter, for tests).
The cpu priorities come from benchmarks/fused_linear_ot.py: both fused paths were at least as fast
as the reference at every size measured there, and use far less memory. For small OT calls the eager
reference is faster: auto keeps it below the crossover measured by benchmarks/ot_dispatch_crossover.py
(``_ot_cpu_auto_prefers``).
"""
from __future__ import annotations

import math

import torch

from .dispatch import register_backend
from .linear.cpu import linear_attention_cpu, supports_linear_fused
from .linear.triton import device_reason, dtype_reason as _linear_dtypes, linear_attention_triton
from .ot.cpu import ot_attention_cpu
from .ot.factorised import supports_ot_fused
from .ot.triton import ot_attention_triton, supports_ot_triton
from .triton_utils import eager_under_interpreter


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


def _ot_cpu_auto_prefers(q, k, v, **kw):
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


def _supports_triton(*reasons):
    def supports(q, k, v, **kw):
        for reason in (device_reason(q),) + tuple(r(q, k, v, **kw) for r in reasons):
            if reason is not None:
                return reason
        return None
    return supports


register_backend("linear", "cpu", linear_attention_cpu, supports=supports_linear_fused, priority=10,
                 description="chunked causal linear attention (no (N, D, Dv) prefix sums), custom autograd")
register_backend("linear", "triton", eager_under_interpreter(linear_attention_triton),
                 supports=_supports_triton(supports_linear_fused, _linear_dtypes), priority=20, auto_devices=("cuda",),
                 description="Triton causal linear attention, chunked parallel form (tensor-core chunks, fp32 "
                             "state scan), forward and backward")
register_backend("ot", "cpu", ot_attention_cpu, supports=supports_ot_fused, priority=10,
                 auto_prefers=_ot_cpu_auto_prefers,
                 description="OT attention as matmuls (separable softmax) + exact tiles where that underflows; "
                             "never (Nq, Nk, |A|), recompute in backward; auto picks it on CPU from "
                             f"B*H*Nq*Nk*|A| >= {OT_CPU_MIN_CUBE} ({OT_CPU_MIN_CUBE_SINGLE_QUERY} for one "
                             "query), where it was measured faster than the reference")
register_backend("ot", "triton", ot_attention_triton, supports=supports_ot_triton,
                 priority=20, auto_devices=("cuda",),
                 description="Triton OT attention as tensor-core matmuls of stabilised exponentials (exact per-pair "
                             "fallback where the shift underflows), forward and backward, chunked over batch x heads")
