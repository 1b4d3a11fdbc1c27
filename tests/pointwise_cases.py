"""The pointwise Triton kernels' table of cases (sigmoid, ReLU / n) and its check against float64 math
written from paper 002 eq (2.5); also the kernels' sigmoid evaluations as a one-block kernel.

out_i = sum_j w_ij v_j over the keys taking part, with s_ij = scale q_i.k_j + mask_ij,
sigmoid: w_ij = sigmoid(s_ij + b_i) (b_i = -log n_i by default, or given, with its gradient),
relu:    w_ij = relu(s_ij) / n_i, and n_i = the number of keys taking part in row i.
Run under TRITON_INTERPRET=1 by tests/test_triton_pointwise.py and on a GPU by tests/test_triton_gpu.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

import attnzoo.functional as AF
from tests.common import HAVE_TRITON, bool_mask, extreme_mask, float_mask, leaves, padding_mask, qkv
from tests.flash_rule import assert_flash_rule, yardstick_dtype


@dataclass
class Case:
    name: str
    kind: str               # sigmoid | relu
    nq: int
    nk: int
    d: int = 16
    b: int = 1
    h: int = 2
    mask: str = "none"      # none | bool | float | padding | extreme | rows (Nq, 1) bool | keys (Nk,) float
    causal: bool = False
    bias: str = "default"   # default | scalar | head (1, H, 1, 1) | rows (B, H, Nq, 1)
    logit_size: float = 1.0


CASES = [
    Case("sigmoid-self-16", "sigmoid", 16, 16),
    Case("sigmoid-33x20-causal-bool", "sigmoid", 33, 20, mask="bool", causal=True),  # rows 0..12 see no key
    Case("sigmoid-head-bias-7x33-padding", "sigmoid", 7, 33, b=2, mask="padding", bias="head"),
    Case("sigmoid-scalar-float-mask", "sigmoid", 16, 16, mask="float", bias="scalar"),
    Case("sigmoid-row-bias-causal-33-d32", "sigmoid", 33, 33, d=32, causal=True, bias="rows"),
    Case("relu-self-16", "relu", 16, 16),
    Case("relu-causal-float-33", "relu", 33, 33, mask="float", causal=True),
    Case("relu-extreme-1e4", "relu", 7, 16, mask="extreme", logit_size=1e4),
    Case("sigmoid-extreme-1e4", "sigmoid", 7, 16, mask="extreme", logit_size=1e4),
    # masks broadcast by strides along the key axis / over queries
    Case("sigmoid-row-mask-33x20-causal", "sigmoid", 33, 20, mask="rows", causal=True),
    Case("relu-key-mask-20x33", "relu", 20, 33, mask="keys"),
]
LOW_PRECISION = [
    ("sigmoid-33x20-causal-bool", torch.bfloat16), ("sigmoid-head-bias-7x33-padding", torch.bfloat16),
    ("relu-causal-float-33", torch.float16),
]
BY_NAME = {c.name: c for c in CASES}


def make_mask(case: Case):
    B, H, nq, nk = case.b, case.h, case.nq, case.nk
    if case.mask == "bool":                              # with a row that has no key left
        return bool_mask((B, 1, nq, nk), 0.7, empty_rows=[(slice(None), slice(None), nq - 1)])
    if case.mask == "float":
        return float_mask((1, H, nq, nk), 0.2)
    if case.mask == "padding":
        return padding_mask(([nk - 3, nk // 2] + [nk] * B)[:B], nk)
    if case.mask == "extreme":
        return extreme_mask((1, 1, nq, nk))
    if case.mask == "rows":  # (Nq, 1): whole query rows masked out
        return bool_mask((nq, 1), 0.7, empty_rows=[min(2, nq - 1)])
    if case.mask == "keys":  # (Nk,): a float bias per key, -inf removes a key
        return float_mask((nk,), empty_rows=[nk // 3])
    return None


def make_inputs(case: Case, device="cpu", dtype=torch.float32):
    B, H = case.b, case.h
    q, k, v = qkv(B, H, case.nq, case.nk, case.d)
    t = {"q": q, "k": k, "v": v, "mask": make_mask(case), "bias": None}
    if case.bias == "scalar":
        t["bias"] = 0.5
    elif case.bias == "head":
        t["bias"] = torch.randn(1, H, 1, 1)
    elif case.bias == "rows":
        t["bias"] = torch.randn(B, H, case.nq, 1)
    return leaves(t, device, dtype)


def run_kernel(case: Case, inp):
    fn = AF.sigmoid if case.kind == "sigmoid" else AF.relu
    kw = {"bias": inp["bias"]} if case.kind == "sigmoid" else {}
    return fn(inp["q"], inp["k"], inp["v"], attn_mask=inp["mask"], is_causal=case.causal, scale=case.d ** -0.5,
              backend="triton", **kw)


def differentiable(inp):
    names = ["q", "k", "v"] + (["bias"] if isinstance(inp["bias"], torch.Tensor) else [])
    return names, [inp[n] for n in names]


def expected(case: Case, inp, dtype=torch.float64):
    leaves = {n: inp[n].detach().to(dtype).requires_grad_(True) for n in differentiable(inp)[0]}
    q, k, v = leaves["q"], leaves["k"], leaves["v"]
    B, H, nq, nk = case.b, case.h, case.nq, case.nk
    s = case.d ** -0.5 * torch.einsum("bhid,bhjd->bhij", q, k)
    allow = torch.ones(B, H, nq, nk, dtype=torch.bool, device=q.device)
    if case.causal:
        allow &= torch.arange(nk, device=q.device)[None, :] <= torch.arange(nq, device=q.device)[:, None] + (nk - nq)
    if inp["mask"] is not None:
        m = inp["mask"].expand(B, H, nq, nk)
        if m.dtype == torch.bool:
            allow &= m
        else:
            allow &= m > -math.inf
            s = s + torch.where(m > -math.inf, m, 0.0).to(dtype)
    n = allow.sum(-1, keepdim=True).to(dtype).clamp_min(1.0)       # keys taking part (1 for empty rows)
    if case.kind == "relu":
        w = torch.relu(s) / n
    else:
        b = {"default": -torch.log(n), "scalar": inp["bias"]}.get(case.bias, leaves.get("bias"))
        w = torch.sigmoid(s + b)
    w = torch.where(allow, w, torch.zeros((), dtype=dtype, device=q.device))
    return w @ v, leaves



def check_case(case: Case, device="cpu", dtype=torch.float32):
    inp = make_inputs(case, device, dtype)
    out = run_kernel(case, inp)
    assert out.shape == (case.b, case.h, case.nq, case.d) and out.dtype == dtype
    names, xs = differentiable(inp)
    grad_out = torch.randn(out.shape, device=device).to(dtype)
    grads = torch.autograd.grad(out, xs, grad_out)
    for name, t in [("out", out)] + list(zip(names, grads)):
        assert torch.isfinite(t).all(), f"{case.name}: {name} has NaN/Inf"
    ref, leaves = expected(case, inp)
    ref_grads = torch.autograd.grad(ref, [leaves[n] for n in names], grad_out.double())
    # FlashAttention's rule: at most ~2x the error of the same math run as the eager reference runs it for
    # `dtype` (fp32 arithmetic for bf16 / fp16, stored in `dtype`), plus a small floor
    low, low_leaves = expected(case, inp, yardstick_dtype(dtype))
    low_grads = [g.to(dtype) for g in torch.autograd.grad(low, [low_leaves[n] for n in names], grad_out.to(low.dtype))]
    low = low.to(dtype)
    assert_flash_rule(case.name, dtype, case.logit_size,
                      [("out", out, low, ref)] + list(zip(names, grads, low_grads, ref_grads)))


# --- the sigmoid evaluations of the kernels ---------------------------------------------------------

SIGMOID_POINTS = torch.tensor([-float("inf"), -1e4, -88.0, -30.0, -17.3, -9.0, -4.5, -1.0, -1e-3, 0.0, 1e-3, 0.7,
                               3.0, 11.0, 40.0, 1e4] + torch.linspace(-20, 20, 97).tolist())


if HAVE_TRITON:
    import triton
    import triton.language as tl

    from attnzoo.ops.kernels.pointwise.triton_kernels import sigmoid

    @triton.jit
    def apply_sigmoid(X, Y, n, IMPL: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(Y + offs, sigmoid(tl.load(X + offs, mask=offs < n, other=0.0), IMPL), mask=offs < n)


def run_sigmoid(x: torch.Tensor, impl: int) -> torch.Tensor:
    """The kernels' ``sigmoid(x, IMPL)`` applied elementwise by a one-block Triton kernel."""
    y = torch.empty_like(x)
    apply_sigmoid[(1,)](x, y, x.numel(), IMPL=impl, BLOCK=triton.next_power_of_2(x.numel()))
    return y
