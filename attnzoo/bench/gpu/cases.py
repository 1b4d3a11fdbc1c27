"""What gpu_speed.py times: shapes in FlashAttention's benchmark layout and one case per
(variant flavour, backend) or baseline kernel.

A case builds, for one shape, a forward function and the leaf tensors that get gradients; the
timing code calls ``forward()`` (and ``.backward``) and nothing else, so a row measures exactly
the attention call. Every attnzoo backend registered for a variant on CUDA is a case (the names
come from the dispatcher), so new kernels are measured without editing this file.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from ... import functional as AF
from ...ops import dispatch


@dataclass(frozen=True)
class Shape:
    batch: int
    heads: int
    n: int
    head_dim: int
    causal: bool
    dtype: torch.dtype = torch.bfloat16

    @property
    def label(self) -> str:
        return f"D{self.head_dim} N{self.n} {'causal' if self.causal else 'full'}"


def benchmark_shapes(head_dims, seq_lens, causal_options, tokens: int, hidden: int, dtype) -> list[Shape]:
    """batch * N = tokens and heads * D = hidden (FlashAttention's benchmark layout)."""
    out = []
    for d in head_dims:
        for causal in causal_options:
            for n in seq_lens:
                out.append(Shape(max(1, tokens // n), max(1, hidden // d), n, d, causal, dtype))
    return out


@dataclass
class Built:
    forward: Callable[[], torch.Tensor]
    leaves: list


@dataclass
class Case:
    label: str                      # row name, e.g. "l2 / torch"
    table_variant: Optional[str]    # key in the measured table (None for baselines)
    flavour: str
    backend: str
    build: Callable[[Shape, torch.device, bool], Built]
    cost_power: int = 2             # time grows like N ** cost_power (for skipping hopeless rows)
    applies: Callable[[Shape], bool] = field(default=lambda s: True)


def qkv(shape: Shape, device, grad: bool, seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    dims = (shape.batch, shape.heads, shape.n, shape.head_dim)
    out = [torch.randn(dims, generator=g).to(device=device, dtype=shape.dtype) for _ in range(3)]
    return [t.requires_grad_(grad) for t in out]


# -- baselines -------------------------------------------------------------------------------------

def _sdpa_case(label: str, backend_name: Optional[str]) -> Case:
    def build(shape, device, grad):
        q, k, v = qkv(shape, device, grad)

        def forward():
            if backend_name is None:
                return F.scaled_dot_product_attention(q, k, v, is_causal=shape.causal)
            from torch.nn.attention import SDPBackend, sdpa_kernel
            with sdpa_kernel(getattr(SDPBackend, backend_name)):
                return F.scaled_dot_product_attention(q, k, v, is_causal=shape.causal)
        return Built(forward, [q, k, v])
    return Case(label, None, "plain", label, build)


def _flex_case(label: str, flavour: str) -> Case:
    """FlexAttention with the same math as an attnzoo flavour: plain softmax, T5 bias, per-key bias."""
    def build(shape, device, grad):
        from ...ops.fenchel.t5_buckets import t5_offset_lut
        from ...ops.kernels.flex import _causal_block_mask, compiled_flex_attention
        q, k, v = qkv(shape, device, grad)
        leaves = [q, k, v]
        block_mask = _causal_block_mask(shape.n, shape.n, torch.device(device)) if shape.causal else None
        score_mod = None
        if flavour == "t5":
            table = torch.randn(32, shape.heads, device=device, requires_grad=grad)
            lut = t5_offset_lut(shape.n, shape.n, 32, 128, not shape.causal, device)
            leaves.append(table)

            def score_mod(score, b, h, i, j):
                return score + table[lut[j - i + (shape.n - 1)], h]
        elif flavour == "mask":
            bias = torch.randn(shape.batch, 1, 1, shape.n, device=device, dtype=shape.dtype)

            def score_mod(score, b, h, i, j):
                return score + bias[b, 0, 0, j]
        flex = compiled_flex_attention()
        return Built(lambda: flex(q, k, v, score_mod=score_mod, block_mask=block_mask), leaves)
    return Case(label, None, flavour, label, build)


def baseline_cases(device: torch.device) -> list[Case]:
    cases = [_sdpa_case("sdpa", None)]
    if device.type == "cuda":
        cases += [_sdpa_case("sdpa-flash", "FLASH_ATTENTION"), _sdpa_case("sdpa-cudnn", "CUDNN_ATTENTION"),
                  _sdpa_case("sdpa-efficient", "EFFICIENT_ATTENTION"),
                  _flex_case("flex", "plain"), _flex_case("flex-t5", "t5"), _flex_case("flex-keybias", "mask")]
    return cases


# -- attnzoo variants ------------------------------------------------------------------------------

def _functional_build(variant: str, backend: str, extra: Callable):
    fn = AF.VARIANT_FUNCTIONS[variant]

    def build(shape, device, grad):
        q, k, v = qkv(shape, device, grad)
        kw, leaves = extra(shape, device, grad)
        return Built(lambda: fn(q, k, v, is_causal=shape.causal, backend=backend, **kw), [q, k, v] + leaves)
    return build


def _none(shape, device, grad):
    return {}, []


def _key_log_u(shape, device, grad):
    g = torch.Generator(device="cpu").manual_seed(7)
    log_u = torch.randn(shape.batch, shape.heads, 1, shape.n, generator=g).to(device).requires_grad_(grad)
    return {"log_u": log_u}, [log_u]


def _key_bias_mask(shape, device, grad):
    g = torch.Generator(device="cpu").manual_seed(8)
    return {"attn_mask": torch.randn(shape.batch, 1, 1, shape.n, generator=g).to(device, shape.dtype)}, []


def _sigmoid_evaluation(name: str) -> Callable:
    """Select how the pointwise kernels evaluate a half-precision sigmoid (FAST_SIGMOID, read at each
    forward and backward launch) for the case built next; no extra arguments."""
    def extra(shape, device, grad):
        from ...ops.kernels.pointwise import triton as pointwise
        pointwise.FAST_SIGMOID = name
        return {}, []
    return extra


def _key_padding(shape, device, grad):
    """Every other sequence keeps only its first quarter of keys (a padded batch): the rows the OT
    kernels skip whole tiles of (issue 21)."""
    keep = torch.ones(shape.batch, 1, 1, shape.n, dtype=torch.bool)
    keep[1::2, ..., shape.n // 4:] = False
    return {"attn_mask": keep.to(device)}, []


def _templates(shape, device, grad):
    g = torch.Generator(device="cpu").manual_seed(9)
    dims = (shape.batch, shape.heads, shape.n, shape.head_dim)
    tk, tv = (torch.randn(dims, generator=g).to(device, shape.dtype).requires_grad_(grad) for _ in range(2))
    return {"templates_k": tk, "templates_v": tv}, [tk, tv]


def _t5_build(backend: str):
    def build(shape, device, grad):
        from ...ops.fenchel import t5
        from ...ops.fenchel.t5_reference import t5_log_preference
        q, k, v = qkv(shape, device, grad)
        table = torch.randn(32, shape.heads, device=device, requires_grad=grad)
        scale = shape.head_dim ** -0.5
        if backend == "torch":  # the dense (1, H, N, N) log u the layer builds for non-fused backends
            def forward():
                log_u = t5_log_preference(table, 32, 128, not shape.causal, shape.n, shape.n).to(q.dtype)
                return AF.fenchel(q, k, v, is_causal=shape.causal, scale=scale, log_u=log_u, backend="torch")
        else:
            def forward():
                return AF.fenchel(q, k, v, is_causal=shape.causal, scale=scale, backend=backend,
                                  relative_bias=t5.T5Bias(table, 32, 128, not shape.causal))
        return Built(forward, [q, k, v, table])
    return build


# (table variant, flavour, functional name, kwargs builder, cost power, which shapes)
VARIANT_FLAVOURS = [
    ("softmax", "plain", "softmax", _none, 2, lambda s: True),
    ("softmax", "mask", "softmax", _key_bias_mask, 2, lambda s: s.n == 4096),
    ("l2", "plain", "l2", _none, 2, lambda s: True),
    ("fenchel", "log_u", "fenchel", _key_log_u, 2, lambda s: True),
    ("sigmoid", "plain", "sigmoid", _sigmoid_evaluation("exp2"), 2, lambda s: True),
    # the hardware-tanh evaluation (FlashSigmoid's), opt-in: timed beside exp2 to decide the default
    ("sigmoid", "tanh", "sigmoid", _sigmoid_evaluation("tanh"), 2, lambda s: s.n == 4096),
    ("relu", "plain", "relu", _none, 2, lambda s: True),
    # causal Sinkhorn is the prefix Sinkhorn: one solve per query prefix, O(N^3), not a kernel speed question
    ("sinkhorn", "plain", "sinkhorn", _none, 2, lambda s: not s.causal),
    ("linear", "plain", "linear", _none, 1, lambda s: True),
    ("linear", "identity", "linear", lambda s, d, g: ({"feature_map": "identity"}, []), 1, lambda s: s.n >= 4096),
    ("ot", "plain", "ot", _none, 3, lambda s: s.n <= 1024 and not s.causal and s.head_dim == 64),
    ("ot", "mask", "ot", _key_padding, 3, lambda s: s.n <= 1024 and not s.causal and s.head_dim == 64),
    ("ot", "templates", "ot", _templates, 3, lambda s: s.n <= 1024 and not s.causal and s.head_dim == 64),
]


def cuda_backends(variant: str) -> list[str]:
    """The backends auto may pick on CUDA for this variant (CPU-only paths and the reference left out)."""
    table = dispatch.backend_table(variant)
    return [name for name in dispatch.backends(variant)
            if name != "reference" and "cuda" in table[name].auto_devices]


def attnzoo_cases(device: torch.device) -> list[Case]:
    cases = []
    for table_variant, flavour, fn_name, extra, power, applies in VARIANT_FLAVOURS:
        names = cuda_backends(fn_name) if device.type == "cuda" else [
            n for n in dispatch.backends(fn_name) if n != "reference"]
        if table_variant == "sinkhorn":
            extra_kw = lambda s, d, g: ({"n_iters": 3}, [])  # noqa: E731
        else:
            extra_kw = extra
        for backend in names:
            label = f"{table_variant}{'' if flavour == 'plain' else '+' + flavour} / {backend}"
            cases.append(Case(label, table_variant, flavour, backend, _functional_build(fn_name, backend, extra_kw),
                              power, applies))
    for backend in ("triton", "flex", "torch"):
        applies = (lambda s: s.n <= 4096) if backend == "torch" else (lambda s: True)
        cases.append(Case(f"fenchel_t5 / {backend}", "fenchel_t5", "plain", backend, _t5_build(backend), 2, applies))
    return cases


def predicted_ms(previous: dict, case: Case, shape: Shape) -> Optional[float]:
    """Time extrapolated from the same case at the largest smaller N measured (N ** cost_power)."""
    best = None
    for (label, other), ms in previous.items():
        if label != case.label or other.head_dim != shape.head_dim or other.causal != shape.causal:
            continue
        if other.n < shape.n and (best is None or other.n > best[0].n):
            best = (other, ms)
    if best is None:
        return None
    other, ms = best
    work = (shape.batch * shape.heads * shape.n ** case.cost_power) / (other.batch * other.heads * other.n ** case.cost_power)
    return ms * work


__all__ = ["Shape", "Case", "Built", "benchmark_shapes", "baseline_cases", "attnzoo_cases", "predicted_ms", "qkv"]
