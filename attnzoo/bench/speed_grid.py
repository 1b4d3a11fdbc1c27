"""The GPU measurement's part of the grid (benchmarks/gpu_speed.py's speed phase, and the measured
ranking tables ``auto`` reads): FlashAttention's benchmark shapes and, per variant, the flavours of
inputs each backend is timed on, as ``Case``s of the one grid (``targets``, ``baselines``).

Every attnzoo backend registered for a variant on CUDA is a case (the names come from the
dispatcher), so new kernels are measured without editing this file. A case's row is named by its
``label`` ("l2 / torch", "fenchel+log_u / triton", "sdpa-flash") and ranked under its
``table_variant`` and flavour.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..ops import dispatch
from ..ops.sizes import Shape
from .baselines import FlexExtrasTarget, FlexTarget, SdpaExtrasTarget, SdpaTarget
from .problem import Problem, qkv, randn
from .targets import AUTO, PLAIN, AttnzooTarget, Case, Flavour, Prepared, parse_variant

MODE = "fwd+bwd"   # the speed phase times both directions of one prepared call (timing.time_directions)
FLEX_N = 4096      # FlexAttention compiles one kernel per shape: its rows run at this N only


def benchmark_problems(head_dims, seq_lens, causal_options, tokens: int, hidden: int, dtype, device) -> list[Problem]:
    """batch * N = tokens and heads * D = hidden (FlashAttention's benchmark layout)."""
    return [Problem(Shape(batch=max(1, tokens // n), heads=max(1, hidden // d), seq_q=n, head_dim=d),
                    dtype, torch.device(device), MODE, causal)
            for d in head_dims for causal in causal_options for n in seq_lens]


def row_fields(problem: Problem) -> dict:
    """The shape fields of a speed row (speed.json's layout)."""
    s = problem.shape
    return {"batch": s.batch, "heads": s.heads, "n": s.seq_q, "head_dim": s.head_dim, "causal": problem.causal,
            "dtype": str(problem.dtype).replace("torch.", "")}


def problem_from_fields(fields: dict, device) -> Problem:
    return Problem(Shape(batch=fields["batch"], heads=fields["heads"], seq_q=fields["n"], head_dim=fields["head_dim"]),
                   getattr(torch, fields["dtype"]), torch.device(device), MODE, fields["causal"])


# -- the flavours of inputs ------------------------------------------------------------------------

def _key_log_u(problem: Problem):
    s = problem.shape
    log_u = randn(problem, (s.batch, s.heads, 1, s.nk), 7).float().detach().requires_grad_(problem.needs_grad)
    return {"log_u": log_u}, [log_u]


def _key_bias(problem: Problem):
    s = problem.shape
    return {"attn_mask": randn(problem, (s.batch, 1, 1, s.nk), 8).detach()}, []


def _key_padding(problem: Problem):
    """Every other sequence keeps only its first quarter of keys (a padded batch): the rows the OT
    kernels skip whole tiles of (issue 21)."""
    s = problem.shape
    keep = torch.ones(s.batch, 1, 1, s.nk, dtype=torch.bool)
    keep[1::2, ..., s.nk // 4:] = False
    return {"attn_mask": keep.to(problem.device)}, []


def _templates(problem: Problem):
    s = problem.shape
    tk, tv = (randn(problem, (s.batch, s.heads, s.nk, s.head_dim), salt) for salt in (9, 10))
    return {"templates_k": tk, "templates_v": tv}, [tk, tv]


def _t5_table(problem: Problem):
    from ..ops.fenchel import t5
    table = randn(problem, (32, problem.shape.heads), 11).float().detach().requires_grad_(problem.needs_grad)
    return {"relative_bias": t5.T5Bias(table, 32, 128, not problem.causal)}, [table]


def _sigmoid_evaluation(name: str) -> Callable:
    """Select how the pointwise kernels evaluate a half-precision sigmoid (FAST_SIGMOID, read at each
    forward and backward launch) for the case prepared next; no extra inputs. The speed phase puts
    the default back when it ends."""
    def inputs(problem: Problem):
        from ..ops.kernels.pointwise import triton as pointwise
        pointwise.FAST_SIGMOID = name
        return {}, []
    return inputs


KEY_BIAS, LOG_U, KEY_PADDING = Flavour("mask", _key_bias), Flavour("log_u", _key_log_u), Flavour("mask", _key_padding)
TEMPLATES, T5 = Flavour("templates", _templates), Flavour("t5", _t5_table)


def _ot_shapes(p: Problem) -> bool:
    return p.shape.seq_q <= 1024 and not p.causal and p.shape.head_dim == 64


# (table variant, spec, flavour, which problems)
VARIANT_FLAVOURS = [
    ("softmax", "softmax", PLAIN, lambda p: True),
    ("softmax", "softmax", KEY_BIAS, lambda p: p.shape.seq_q == 4096),
    ("l2", "l2", PLAIN, lambda p: True),
    ("fenchel", "fenchel", LOG_U, lambda p: True),
    ("sigmoid", "sigmoid", Flavour("plain", _sigmoid_evaluation("exp2")), lambda p: True),
    # the hardware-tanh evaluation (FlashSigmoid's), opt-in: timed beside exp2 to decide the default
    ("sigmoid", "sigmoid", Flavour("tanh", _sigmoid_evaluation("tanh")), lambda p: p.shape.seq_q == 4096),
    ("relu", "relu", PLAIN, lambda p: True),
    # causal Sinkhorn is the prefix Sinkhorn: one solve per query prefix, O(N^3), not a kernel speed question
    ("sinkhorn", "sinkhorn(n_iters=3)", PLAIN, lambda p: not p.causal),
    ("linear", "linear", PLAIN, lambda p: True),
    ("linear", "linear(feature_map='identity')", Flavour("identity"), lambda p: p.shape.seq_q >= 4096),
    ("ot", "ot", PLAIN, _ot_shapes),
    ("ot", "ot", KEY_PADDING, _ot_shapes),
    ("ot", "ot", TEMPLATES, _ot_shapes),
]


class T5Case(AttnzooTarget):
    """Fenchel with a learned T5 relative bias: the fused paths take the table (``relative_bias``),
    backend "torch" the dense (1, H, N, N) log u the layer builds for non-fused backends."""

    def prepare(self, problem: Problem) -> Prepared:
        from ..ops.fenchel.t5_reference import t5_log_preference
        q, k, v = qkv(problem)
        (kw, leaves), s = _t5_table(problem), problem.shape
        bias, scale = kw["relative_bias"], s.head_dim ** -0.5
        fn = self.spec.resolved.record.functional
        if self.backend == "torch":
            def forward():
                log_u = t5_log_preference(bias.table, 32, 128, not problem.causal, s.seq_q, s.nk).to(q.dtype)
                return fn(q, k, v, is_causal=problem.causal, scale=scale, log_u=log_u, backend="torch")
        else:
            def forward():
                return fn(q, k, v, is_causal=problem.causal, scale=scale, backend=self.backend, relative_bias=bias)
        return Prepared(forward, [q, k, v, *leaves], self.backend,
                        ("t5", self.backend, problem.key(), problem.causal))


def cuda_backends(variant: str) -> list[str]:
    """The backends auto may pick on CUDA for this variant (CPU-only paths and the reference left out)."""
    table = dispatch.backend_table(variant)
    return [name for name in dispatch.backends(variant)
            if name != "reference" and "cuda" in table[name].auto_devices]


def _flex_n(case: Case) -> Case:
    """A FlexAttention case (baseline or attnzoo backend) runs at N = FLEX_N only: one compile per
    head dim and causality instead of one per N."""
    if case.backend == "flex" or case.label.startswith("flex"):
        applies = case.applies
        case.applies = lambda p: applies(p) and p.shape.seq_q == FLEX_N
    return case


def baseline_cases(device: torch.device) -> list[Case]:
    softmax = parse_variant("softmax")
    cases: list[Case] = [SdpaTarget(softmax, "sdpa", label="sdpa")]
    if torch.device(device).type == "cuda":
        cases += [SdpaTarget(softmax, name, label=name) for name in ("sdpa-flash", "sdpa-cudnn", "sdpa-efficient")]
        cases += [FlexTarget(softmax, "flex", flavour, label=label)
                  for label, flavour in (("flex", PLAIN), ("flex-t5", T5), ("flex-keybias", KEY_BIAS))]
    return cases


def attnzoo_cases(device: torch.device) -> list[Case]:
    cases: list[Case] = []
    for table_variant, spec_text, flavour, applies in VARIANT_FLAVOURS:
        spec = parse_variant(spec_text)
        names = cuda_backends(spec.kernel) if torch.device(device).type == "cuda" else [
            n for n in dispatch.backends(spec.kernel) if n != "reference"]
        for backend in names:
            label = f"{table_variant}{'' if flavour.name == 'plain' else '+' + flavour.name} / {backend}"
            cases.append(AttnzooTarget(spec, backend, flavour, label, table_variant, applies))
    fenchel = parse_variant("fenchel")
    for backend in ("triton", "flex", "torch"):
        applies = (lambda p: p.shape.seq_q <= 4096) if backend == "torch" else (lambda p: True)
        cases.append(T5Case(fenchel, backend, PLAIN, f"fenchel_t5 / {backend}", "fenchel_t5", applies))
    return cases


# softcap, sinks and sliding windows (issue 29), at N >= 4096: (row name, spec). Each against SDPA with
# the same dense mask and FlexAttention with the same mods (bench/logit_extras.py); not ranked (auto's
# tables are per variant, and a window changes which backend wins only through its mask)
EXTRAS_SPECS = [("softmax+softcap", "softmax(softcap=30)"), ("softmax+sinks", "softmax(sinks=True)"),
                ("softmax+window256", "softmax(window_size=(255, 0))"),
                ("softmax+window1024", "softmax(window_size=(1023, 0))")]
# Sinkhorn's window (its Triton passes skip the tiles outside the band; causal: batched window problems):
# attnzoo's backends only, SDPA and Flex compute softmax, not this attention
SINKHORN_WINDOW_SPECS = [("sinkhorn+window256", "sinkhorn(window_size=(255, 0))")]
# linear attention's window: its band backend (O(N w)) against the band folded into the reference's mask
# (what every other backend would run: the factorised forms cannot take a band)
LINEAR_WINDOW_SPECS = [("linear+window256", "linear(window_size=(255, 0))")]
LINEAR_WINDOW_BACKENDS = ("band", "reference")


def _long(p: Problem) -> bool:
    return p.shape.seq_q >= 4096


def extras_cases(device: torch.device) -> list[Case]:
    cases: list[Case] = []
    for name, spec_text in EXTRAS_SPECS:
        spec = parse_variant(spec_text)
        names = cuda_backends(spec.kernel) if torch.device(device).type == "cuda" else [
            n for n in dispatch.backends(spec.kernel) if n != "reference"]
        cases += [AttnzooTarget(spec, backend, PLAIN, f"{name} / {backend}", None, _long) for backend in names]
        cases.append(SdpaExtrasTarget(spec, "sdpa", label=f"sdpa+{name.split('+')[1]}", applies=_long))
        if torch.device(device).type == "cuda":
            cases.append(FlexExtrasTarget(spec, "flex", label=f"flex+{name.split('+')[1]}", applies=_long))
    for name, spec_text in SINKHORN_WINDOW_SPECS:
        spec = parse_variant(spec_text)
        names = cuda_backends(spec.kernel) if torch.device(device).type == "cuda" else [
            n for n in dispatch.backends(spec.kernel) if n != "reference"]
        cases += [AttnzooTarget(spec, backend, PLAIN, f"{name} / {backend}", None, _long) for backend in names]
    for name, spec_text in LINEAR_WINDOW_SPECS:
        spec = parse_variant(spec_text)
        cases += [AttnzooTarget(spec, backend, PLAIN, f"{name} / {backend}", None, _long)
                  for backend in LINEAR_WINDOW_BACKENDS]
    return cases


def speed_cases(device: torch.device) -> list[Case]:
    """Every case the speed phase may time on ``device``: the baselines, then attnzoo's, the extras' and
    the packed rows (bench/packed_grid.py: varlen_attn against the packed varlen route)."""
    from .packed_grid import packed_cases
    return [_flex_n(c) for c in baseline_cases(device) + attnzoo_cases(device) + extras_cases(device)
            + packed_cases(device)]


__all__ = ["AUTO", "EXTRAS_SPECS", "FLEX_N", "LINEAR_WINDOW_BACKENDS", "LINEAR_WINDOW_SPECS", "MODE",
           "SINKHORN_WINDOW_SPECS", "T5Case", "VARIANT_FLAVOURS",
           "attnzoo_cases", "baseline_cases", "extras_cases", "benchmark_problems", "cuda_backends",
           "problem_from_fields", "row_fields", "speed_cases"]
