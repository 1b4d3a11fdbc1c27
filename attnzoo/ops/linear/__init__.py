"""Linear attention (paper 002 eq 2.2; Katharopoulos et al. 2020): phi(q_i) . sum_j phi(k_j) v_j^T
normalised by phi(q_i) . sum_j phi(k_j), phi = elu + 1 (or relu, or none); no logits, so no scale.

Backends: "reference"; "cpu", chunked causal linear attention / two matmuls (cpu.py, factorised.py),
custom autograd, priority 10 (benchmarks/fused_linear_ot.py: at least as fast as the reference at
every size measured, far less memory); "triton", the chunked parallel form for causal calls (triton.py,
triton_kernels.py) and a key-state reduction for non-causal ones (noncausal.py,
noncausal_kernels.py), priority 20, auto on CUDA only; packed calls reach the same kernels through
varlen.py (ops/varlen_triton.py); "band", a sliding window in O(N w) on any device (band.py), the
backend a windowed call takes (the others get the band folded into an N x N mask).
"""
from __future__ import annotations

from .. import varlen_triton
from ..dispatch import all_of, register_backend
from ..measured import register_flavour
from ..triton_utils import device_reason, register_triton
from ..catalog import declare
from ..record import Variant
from .band import linear_attention_band, supports_band
from .bound import specialize as bind_causal
from .cost import BACKWARD_FACTOR, FORMULA, linear_flops, linear_reference_bytes
from .cpu import linear_attention_cpu, supports_linear_fused
from .functional import check, linear
from .reference import linear_attention
from .triton import dtype_reason, linear_attention_triton
from .varlen import route as packed_route


def _triton_device(q, k, v, **kw):
    return device_reason(q)


register_backend("linear", "cpu", linear_attention_cpu, supports=supports_linear_fused, priority=10,
                 description="chunked causal linear attention (no (N, D, Dv) prefix sums), custom autograd")
register_triton("linear", linear_attention_triton,
                all_of(_triton_device, supports_linear_fused, dtype_reason), specialize=bind_causal,
                description="Triton linear attention: causal in the chunked parallel form (tensor-core chunks, "
                            "fp32 state scan), non-causal as a split key-state reduction and a query pass; "
                            "forward and backward")

register_backend("linear", "band", linear_attention_band, supports=supports_band, priority=5,
                 extras=("window_size",),
                 description="a sliding window in O(N w): each block of queries against its run of keys (unfold "
                             "views), plain autograd, any device, at most a key mask; the backend windowed calls "
                             "take (an unbounded side or no window: O(N^2), below cpu's priority)")
# packed (varlen) calls on "triton" (auto: CUDA) run the kernels above on all sequences at once
varlen_triton.register_route("linear", packed_route)

register_flavour("linear", lambda kw: [kw["feature_map"]] if kw.get("feature_map", "elu") != "elu" else [])

RECORD = declare(Variant(
    name="linear", reference=linear_attention, functional=linear, check=check,
    extras=frozenset(),
    extras_refused={"softcap": "it has no logits (its weights are feature maps phi(q_i).phi(k_j))",
                    "sinks": "it has no logits, so no sink logit can join its normaliser"},
    default_scale=1.0, doc="Linear attention; its kernel uses no 1/sqrt(d) scale (see functional.linear).",
    complexity="O(N D Dv) without a general mask; a window of w: O(N w D); a general mask needs O(N^2)",
    parameters="feature_map", paper="paper 002 eq (2.2); Katharopoulos et al. 2020",
    flops=linear_flops, flop_formula=FORMULA, backward_factor=BACKWARD_FACTOR,
    reference_bytes=linear_reference_bytes,
))
