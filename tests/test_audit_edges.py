"""Edge inputs found by the functional-API audit, each checked against float64 math from the formulas
(tests/formulas.py) or against the clear error the docs promise.

Double backward (``create_graph=True``: gradient penalties, Hessian-vector products): every backend
either gives the float64 formula's second derivative or raises a RuntimeError. The hand-written
backwards (Triton kernels, the streaming Sinkhorn passes) used to return gradients that autograd saw
as constants, or with only a few differentiable steps around the kernels (the linear and OT Triton
backwards), so the second derivative came out silently wrong; the streaming Sinkhorn one failed with
torch's misleading "modified by an inplace operation". They now refuse create_graph with the way out,
and so do the blockwise custom op and OT's transport-weights custom op ('cpu'), whose refusal used to be
torch's own words. SDPA's fused kernels ('torch' backends) keep torch's error ("... is not implemented").
"""
from __future__ import annotations

import math

import pytest
import torch

import attnzoo.functional as AF
from attnzoo.ops import dispatch
from tests import formulas as R
from tests.common import KERNEL_DEVICE, needs_interpreter, seeded

B, H, NQ, NK, D = 1, 2, 3, 5, 4
# variant -> (options, float64 formula(q, k, v, is_causal))
VARIANTS = {
    "softmax": ({}, lambda q, k, v, c: R.softmax(q, k, v, *_allow_add(c), 1 / math.sqrt(D))),
    "l2": ({}, lambda q, k, v, c: R.l2(q, k, v, *_allow_add(c), 1 / math.sqrt(D))),
    "sinkhorn": ({"n_iters": 2}, lambda q, k, v, c: R.sinkhorn(q, k, v, _allow_add(False)[0], _allow_add(False)[1],
                                                               1 / math.sqrt(D), 2, 1.0, "l2", c)),
    "sigmoid": ({}, lambda q, k, v, c: R.sigmoid(q, k, v, *_allow_add(c), 1 / math.sqrt(D))),
    "relu": ({}, lambda q, k, v, c: R.relu(q, k, v, *_allow_add(c), 1 / math.sqrt(D))),
    "linear": ({}, lambda q, k, v, c: R.linear(q, k, v, *_allow_add(c), "elu")),
    "fenchel": ({"alpha": 0.8}, lambda q, k, v, c: R.fenchel_first(q, k, v, *_allow_add(c), 1 / math.sqrt(D),
                                                                   None, 0.8)),
    "ot": ({}, lambda q, k, v, c: R.ot(q, k, v, *_allow_add(c), 1 / math.sqrt(D))),
}


def _allow_add(causal):
    return R.allow_and_add(None, causal, B, H, NQ, NK)


def _inputs():
    g = seeded(21)
    return [torch.randn(B, H, n, D, generator=g, dtype=torch.float64) for n in (NQ, NK, NK)]


def _second_derivative(fn, leaves, penalty_on_output):
    """d/d(q, k, v) of ||grad||^2, grad the first derivative of a loss taken with create_graph=True.
    ``penalty_on_output``: the loss is ||out||^2 (the incoming gradient 2 out depends on q, k, v);
    otherwise sum(out) (a constant incoming gradient: only the backward's own graph links it to q)."""
    out = fn(*leaves)
    loss = out.square().sum() if penalty_on_output else out.sum()
    grads = torch.autograd.grad(loss, leaves, create_graph=True)
    penalty = sum(g.square().sum() for g in grads)
    return torch.autograd.grad(penalty, leaves)


def _want(variant, causal, penalty_on_output):
    _, formula = VARIANTS[variant]
    leaves = [t.clone().requires_grad_() for t in _inputs()]
    return _second_derivative(lambda q, k, v: formula(q, k, v, causal), leaves, penalty_on_output)


def _got(variant, backend, causal, penalty_on_output, dtype=torch.float64, device="cpu"):
    opts, _ = VARIANTS[variant]
    leaves = [t.to(dtype).to(device).requires_grad_() for t in _inputs()]
    fn = lambda q, k, v: getattr(AF, variant)(q, k, v, is_causal=causal, backend=backend, **opts)
    return _second_derivative(fn, leaves, penalty_on_output)


def _cpu_cases():
    return [(v, b) for v in VARIANTS for b in dispatch.backends(v)
            if not b.startswith("triton") and b != "flex"]


CPU_CASES = _cpu_cases()


def _sdpa_fused(variant, backend):
    """The calls that SDPA's fused CPU kernel serves: its backward has no derivative."""
    return backend == "torch" and variant in ("softmax", "l2", "fenchel")


@pytest.mark.parametrize("penalty_on_output", [True, False], ids=["penalty-on-output", "penalty-on-sum"])
@pytest.mark.parametrize("variant,backend", CPU_CASES, ids=[f"{v}-{b}" for v, b in CPU_CASES])
def test_double_backward_is_right_or_refused_on_cpu_backends(variant, backend, penalty_on_output):
    causal = variant in ("linear", "sinkhorn")  # the causal paths of the backends with their own autograd
    want = _want(variant, causal, penalty_on_output)
    try:
        got = _got(variant, backend, causal, penalty_on_output)
    except ValueError as e:  # a backend that declines the call says why
        assert "cannot run this" in str(e)
        return
    except RuntimeError as e:  # refused: never a silently wrong second derivative
        if _sdpa_fused(variant, backend):  # torch's own words: a hook per forward to reword them is host work on
            assert "not implemented" in str(e), str(e)  # the hottest path (SDPA serves softmax by default)
        else:  # attnzoo's own message, with the way out
            assert "double backward" in str(e) and "backend='reference'" in str(e), str(e)
        return
    for name, a, b in zip("qkv", got, want):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9, msg=lambda m, n=name: f"d2/d{n}: {m}")


@needs_interpreter
@pytest.mark.parametrize("penalty_on_output", [True, False], ids=["penalty-on-output", "penalty-on-sum"])
@pytest.mark.parametrize("variant,causal", [("linear", True), ("linear", False), ("ot", False), ("softmax", False),
                                            ("sinkhorn", False), ("sigmoid", True)])
def test_double_backward_through_triton_is_refused_under_the_interpreter(variant, causal, penalty_on_output):
    with pytest.raises(RuntimeError, match=r"double backward \(create_graph=True\) is not supported.*"
                                           r"backend='reference'"):
        _got(variant, "triton", causal, penalty_on_output, torch.float32, KERNEL_DEVICE)


@pytest.mark.parametrize("variant", ["sinkhorn", "ot", "linear"])
def test_the_reference_way_out_gives_the_formulas_second_derivative(variant):
    for a, b in zip(_got(variant, "reference", True, True), _want(variant, True, True)):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("variant", ["softmax", "l2"])
def test_sdpa_math_kernel_still_differentiates_twice(variant):
    """A float mask that requires grad sends SDPA on CPU to its math kernel (plain aten ops), which
    autograd differentiates twice: this call gives the formula's second derivative in q, k, v and the mask."""
    mask = torch.randn(B, H, NQ, NK, generator=seeded(22), dtype=torch.float64)
    allow = torch.ones(B, H, NQ, NK, dtype=torch.bool)
    leaves = lambda: [t.clone().requires_grad_() for t in _inputs() + [mask]]
    got = _second_derivative(lambda q, k, v, m: getattr(AF, variant)(q, k, v, attn_mask=m, backend="torch"),
                             leaves(), True)
    want = _second_derivative(lambda q, k, v, m: getattr(R, variant)(q, k, v, allow, m, 1 / math.sqrt(D)),
                              leaves(), True)
    for name, a, b in zip(["q", "k", "v", "mask"], got, want):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9, msg=lambda m, n=name: f"d2/d{n}: {m}")


def test_first_order_gradients_still_flow_under_create_graph_false():
    """The refusal only concerns create_graph: a plain backward through the streaming Sinkhorn path
    (the one the wrapper now guards on CPU) still matches the formula."""
    leaves = [t.clone().requires_grad_() for t in _inputs()]
    got = torch.autograd.grad(AF.sinkhorn(*leaves, n_iters=2, is_causal=True, backend="cpu").square().sum(), leaves)
    ref = [t.clone().requires_grad_() for t in _inputs()]
    want = torch.autograd.grad(VARIANTS["sinkhorn"][1](*ref, True).square().sum(), ref)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9)




# --- float16 L2 with keys of norm > 256: ||k||^2 past float16's 65504 -----------------------------------

def _l2_large_norm_inputs(h_kv):
    """Queries and keys sharing a large offset (|k| ~ 280, ||k||^2 ~ 7.8e4; the kind of shared component
    "massive activations" give every token), so the L2 logits -scale ||q - k||^2 stay moderate, rounded to
    float16 first (the comparison measures the kernel, not the input rounding)."""
    g = seeded(31)
    d = 16
    q = 70.0 + torch.randn(1, 4, 5, d, generator=g, dtype=torch.float64)
    k = 70.0 + torch.randn(1, h_kv, 7, d, generator=g, dtype=torch.float64)
    v = torch.randn(1, h_kv, 7, d, generator=g, dtype=torch.float64)
    cot = torch.randn(1, 4, 5, d, generator=g, dtype=torch.float64)
    return [t.half().double() for t in (q, k, v)], cot


@pytest.mark.parametrize("backend", ["torch", "auto"])
@pytest.mark.parametrize("h_kv,causal", [(4, False), (2, True)], ids=["mha", "gqa-causal"])
def test_float16_l2_with_large_key_norms_is_finite_and_accurate(backend, h_kv, causal):
    """The SDPA path carries -||k||^2 as an extra coordinate of k: in float16 it overflowed to -inf past
    65504 and every output and gradient was NaN (the reference, computing in fp32, is fine); auto picks
    this path for float16 on CPU. The output meets FlashAttention's rule against the float64 formula.
    The gradients are checked to 5% of their scale only: SDPA's float16 backward rounds dS before
    multiplying it by keys of size ~100, and that cancellation costs dq, dk ~10x the fp32 reference's
    error below the overflow too (unchanged by the fix; noted in the audit report)."""
    from tests.flash_rule import assert_flash_rule, max_error, reference_or_rounded, scale_of

    (q, k, v), cot = _l2_large_norm_inputs(h_kv)
    assert float((k * k).sum(-1).max()) > 65504
    gqa = h_kv != q.shape[1]

    def run(dtype, backend):
        leaves = [t.to(dtype).clone().requires_grad_() for t in (q, k, v)]
        if dtype == torch.float64:  # the formula, k and v repeated to the query heads
            r = q.shape[1] // h_kv
            kk, vv = (t.repeat_interleave(r, 1) for t in leaves[1:])
            allow, add = R.allow_and_add(None, causal, 1, q.shape[1], q.shape[2], k.shape[2])
            out = R.l2(leaves[0], kk, vv, allow, add, 1 / math.sqrt(q.shape[-1]))
        else:
            out = AF.l2(*leaves, is_causal=causal, backend=backend, enable_gqa=gqa)
        return [out] + list(torch.autograd.grad((out.double() * cot).sum(), leaves))

    got, low, want = run(torch.float16, backend), run(torch.float16, "reference"), run(torch.float64, None)
    assert all(torch.isfinite(t).all() for t in got)
    logit_size = float((k * k).sum(-1).max()) / math.sqrt(q.shape[-1])  # the cancelling terms' size
    assert_flash_rule(f"l2-{backend}", torch.float16, logit_size,
                      [("out", got[0], reference_or_rounded(got[:1], low[:1], want[:1], torch.float16)[0], want[0])])
    for name, a, b in zip(("dq", "dk", "dv"), got[1:], want[1:]):
        assert max_error(a, b) <= 0.05 * scale_of(b), (name, max_error(a, b), scale_of(b))
