"""A kept plan's bound Sinkhorn passes (ops/sinkhorn/bound.py) against the general route (triton.py's
custom ops, the same kernels launched pass by pass): the same launches with the same arguments, so
outputs and gradients are equal bit for bit. The numbers of both against float64 math are
tests/test_fused_sinkhorn.py's."""
from __future__ import annotations

import pytest
import torch

import attnzoo.functional as AF
from attnzoo.ops import plan
from tests.common import HAVE_TRITON, needs_interpreter

if HAVE_TRITON:
    from attnzoo.ops.sinkhorn import bound
    from attnzoo.ops.sinkhorn import triton as sk_triton

CASES = {  # id: (dtype, cost, n_iters, mask maker (B, H, Nq, Nk) -> mask or None)
    "f32-l2": (torch.float32, "l2", 3, lambda B, H, nq, nk: None),
    "f32-dot-1": (torch.float32, "dot", 1, lambda B, H, nq, nk: None),
    "bf16-keypad": (torch.bfloat16, "l2", 2, lambda B, H, nq, nk: torch.arange(nk).expand(B, 1, 1, nk) < nk - 5),
    "f16-float-tile": (torch.float16, "l2", 3, lambda B, H, nq, nk: torch.randn(B, H, nq, nk)),
}


def _run(q, k, v, mask, dtype, cost, n_iters):
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    out = AF.sinkhorn(*leaves, attn_mask=mask, backend="triton", cost=cost, n_iters=n_iters, eps=0.5)
    grads = torch.autograd.grad(out, leaves, torch.linspace(-1, 1, out.numel()).view_as(out).to(dtype))
    return out, grads


@needs_interpreter
@pytest.mark.parametrize("case", list(CASES))
def test_bound_passes_equal_the_general_route(case, monkeypatch):
    dtype, cost, n_iters, make_mask = CASES[case]
    torch.manual_seed(0)
    B, H, nq, nk, D = 1, 2, 20, 24, 16
    q, k, v = torch.randn(B, H, nq, D), torch.randn(B, H, nk, D), torch.randn(B, H, nk, D)
    mask = make_mask(B, H, nq, nk)
    launches = []
    real = bound.BoundSinkhorn.forward
    monkeypatch.setattr(bound.BoundSinkhorn, "forward", lambda self, *a: launches.append(1) or real(self, *a))
    plan.clear()
    bound_out, bound_grads = _run(q, k, v, mask, dtype, cost, n_iters)
    assert launches, "the call did not take the bound passes"
    with sk_triton.pinned_tile(0):  # a pinned tile takes the general route (the same first candidate)
        out, grads = _run(q, k, v, mask, dtype, cost, n_iters)
    assert len(launches) == 1
    plan.clear()
    assert torch.equal(bound_out, out)
    for name, a, b in zip("qkv", bound_grads, grads):
        assert a.dtype == b.dtype and torch.equal(a, b), name


@needs_interpreter
def test_a_mask_laid_out_otherwise_takes_the_general_route():
    """The plan binds the mask's strides: the same shape with other strides (a transposed copy's view)
    must not be read with the bound ones."""
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 1, 16, 8) for _ in range(3))
    mask = torch.randn(1, 1, 16, 16)
    plan.clear()
    first = AF.sinkhorn(q, k, v, attn_mask=mask, backend="triton")
    strided = mask.transpose(-1, -2).contiguous().transpose(-1, -2)  # the same values, column-major
    again = AF.sinkhorn(q, k, v, attn_mask=strided, backend="triton")
    plan.clear()
    assert torch.equal(first, again)
