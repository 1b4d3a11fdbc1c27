"""The packed (varlen) rows of the speed grid (issue 30): attnzoo's packed call on a batch of mixed
lengths against ``torch.nn.attention.varlen.varlen_attn`` on the same offsets.

A grid problem (B, H, N, D) becomes B sequences of the mixed lengths of bench/packed_batch.py (fractions
of N: with B a multiple of 8, half of the padded (B, N) tokens would be padding) packed back to back,
q, k, v (T, H, D) and one int32 offsets tensor on the device. attnzoo's rows run
``attnzoo.functional.varlen`` through "triton" (the varlen Triton kernels, ops/varlen_triton.py) and
"auto"; the baseline row is ``varlen_attn`` (FlashAttention's varlen kernel, CUDA, fp16 / bf16) with
causality as its window (-1, 0). The issue's target: the softmax row >= 0.9x varlen_attn. FLOPs count
each sequence's own n^2 (``flops``), so TFLOP/s compare the rows fairly. Not ranked (no auto table).
"""
from __future__ import annotations

import torch

from ..ops import varlen_triton
from ..ops.sizes import Shape
from .baselines import Baseline
from .errors import Skipped, Unsupported
from .flops import flops as variant_flops
from .packed_batch import mixed_lengths
from .problem import Problem, randn
from .targets import AUTO, Case, Prepared, _allow_interpreter, _interpreted, parse_variant

PACKED_VARIANTS = ("softmax", "l2", "sigmoid", "relu", "sinkhorn", "ot")
# causal packed Sinkhorn is the prefix Sinkhorn of each sequence (O(n^3), per length), not a kernel speed
# question: its rows are the non-causal problems, as in the dense grid
NON_CAUSAL_ONLY = frozenset({"sinkhorn"})
PACKED_BACKENDS = ("triton", AUTO)


def applies(problem: Problem) -> bool:
    """Several sequences (a batch of one has nothing to pack) of 1024 tokens and more."""
    return problem.shape.batch >= 2 and problem.shape.seq_q >= 1024


def applies_non_causal(problem: Problem) -> bool:
    return applies(problem) and not problem.causal


def packed_lengths(problem: Problem) -> list[int]:
    return mixed_lengths(problem.shape.batch, problem.shape.seq_q)


def packed_inputs(problem: Problem):
    """(q, k, v (T, H, D), cu (B + 1,) int32, max length) on the problem's device, seeded like qkv."""
    s, lengths = problem.shape, packed_lengths(problem)
    total = sum(lengths)
    q, k, v = (randn(problem, (total, s.heads, d), salt) for d, salt in ((s.head_dim, 1), (s.head_dim, 2),
                                                                          (s.dv, 3)))
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=problem.device)
    return q, k, v, cu, max(lengths)


def packed_flops(variant: str, problem: Problem) -> int:
    """The sum over the packed sequences of each one's FLOPs (its own n x n scores)."""
    s = problem.shape
    return sum(variant_flops(variant, Shape(1, s.heads, n, s.head_dim, head_dim_v=s.dv), problem.mode,
                             causal=problem.causal) for n in packed_lengths(problem))


class PackedTarget(Case):
    """``attnzoo.functional.varlen(variant, ...)`` through one backend on the packed batch."""

    def flops(self, problem: Problem) -> int:
        return packed_flops(self.spec.name, problem)

    def prepare(self, problem: Problem) -> Prepared:
        from ..functional import varlen
        q, k, v, cu, longest = packed_inputs(problem)
        backend = None if self.backend == AUTO else self.backend
        triton = varlen_triton.chosen(self.spec.name, q, backend)
        if triton and q.device.type == "cpu" and _interpreted() and not _allow_interpreter():
            raise Skipped("the packed Triton route would run in the Triton interpreter (TRITON_INTERPRET=1 on CPU "
                          "tensors); set ATTNZOO_BENCH_INTERPRETER=1 to time it anyway")
        resolved = "triton-varlen" if triton else "packed-cpu-routes"

        def forward():
            return varlen(self.spec.name, q, k, v, cu, cu, longest, longest, is_causal=problem.causal,
                          backend=backend)
        return Prepared(forward, [q, k, v], resolved, ("packed", self.spec.name, resolved, problem.key()))


class VarlenAttnTarget(Baseline):
    """torch.nn.attention.varlen.varlen_attn on the same packed batch (CUDA, fp16 / bf16)."""

    def flops(self, problem: Problem) -> int:
        return packed_flops("softmax", problem)

    def prepare(self, problem: Problem) -> Prepared:
        if problem.device.type != "cuda" or problem.dtype not in (torch.float16, torch.bfloat16):
            raise Unsupported("varlen_attn runs FlashAttention's kernel: CUDA tensors in float16 / bfloat16")
        try:
            from torch.nn.attention.varlen import varlen_attn
        except ImportError:
            raise Unsupported("this torch has no torch.nn.attention.varlen.varlen_attn") from None
        q, k, v, cu, longest = packed_inputs(problem)
        window = (-1, 0) if problem.causal else (-1, -1)

        def forward():
            return varlen_attn(q, k, v, cu, cu, longest, longest, window_size=window)
        return Prepared(forward, [q, k, v], self.backend, ("varlen_attn", problem.key()))


def packed_cases(device: torch.device) -> list[Case]:
    """The packed rows: varlen_attn, then each packed variant through "triton" and "auto"."""
    cases: list[Case] = [VarlenAttnTarget(parse_variant("softmax"), "varlen_attn", label="varlen_attn",
                                          applies=applies)]
    for name in PACKED_VARIANTS:
        spec = parse_variant(name)
        fits = applies_non_causal if name in NON_CAUSAL_ONLY else applies
        cases += [PackedTarget(spec, backend, label=f"{name}-packed / {backend}", applies=fits)
                  for backend in PACKED_BACKENDS]
    return cases


__all__ = ["PACKED_BACKENDS", "PACKED_VARIANTS", "PackedTarget", "VarlenAttnTarget", "packed_cases",
           "packed_flops", "packed_inputs"]
