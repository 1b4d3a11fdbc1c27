"""Chunked linear attention (ops/linear/{cpu,triton}.py) against float64 math from the formulas.

tests/formulas.py.linear is the N x N form written from Katharopoulos et al. / paper 002 eq 2.2:
w_ij = phi(scale q_i).phi(k_j) exp(mask_ij) on the keys taking part, out_i = sum_j w_ij v_j /
(sum_j w_ij + 1e-6), or / n_i for the identity map. The fused paths never form w: agreement
checks the chunking, the state recurrence and the hand-written backward.
The Triton kernels run under TRITON_INTERPRET=1 (set by `make test`) on tiny shapes.
"""
from __future__ import annotations

import math
import os

import pytest
import torch

import attnzoo.functional as AF
from attnzoo.ops.linear import cpu as lin_cpu

from . import formulas as FM
from tests.memory_probe import LargestOutput

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# (feature_map, is_causal, nq, nk, mask kind): odd lengths that do not fill the last chunk,
# self and cross attention with Nq < Nk and Nq > Nk (bottom-right causal), key masks.
CPU_CASES = [
    (fm, causal, nq, nk, mask)
    for fm in ("elu", "relu", "identity")
    for causal in (False, True)
    for nq, nk, mask in ((21, 21, None), (13, 30, "bool"), (30, 13, "float"), (16, 16, "float"))
]
CPU_CHUNK = 8   # small chunks so these lengths span several, with a partial last one
# the interpreter is slow: one case per feature map and form, still odd lengths and cross
TRITON_CASES = [
    ("elu", True, 37, 37, None), ("relu", True, 20, 45, "bool"), ("identity", True, 45, 20, "float"),
    ("elu", False, 11, 7, "bool"), ("identity", False, 9, 9, None),
]


def _mask(kind, B, nk):
    if kind == "bool":
        m = torch.rand(B, 1, 1, nk) > 0.3
        m[..., 0] = True
        return m
    if kind == "float":
        return (0.5 * torch.randn(nk, dtype=torch.float64)).masked_fill(torch.rand(nk) < 0.3, -math.inf)
    return None


def _inputs(nq, nk, dtype, B=2, H=2, D=5, Dv=3):
    q = torch.randn(B, H, nq, D, dtype=dtype, requires_grad=True)
    k = torch.randn(B, H, nk, D, dtype=dtype, requires_grad=True)
    v = torch.randn(B, H, nk, Dv, dtype=dtype, requires_grad=True)
    return q, k, v


def _expected(q, k, v, mask, causal, fm, scale):
    B, H, nq, _ = q.shape
    allow, add = FM.allow_and_add(mask, causal, B, H, nq, k.shape[2])
    return FM.linear(q.double(), k.double(), v.double(), allow, add, feature_map=fm, scale=scale)


def _check(backend, fm, causal, nq, nk, mask_kind, dtype, tol):
    q, k, v = _inputs(nq, nk, dtype)
    mask = _mask(mask_kind, q.shape[0], nk)
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(dtype)
    scale = 0.8
    out = AF.linear(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, feature_map=fm, backend=backend)
    ref = _expected(q, k, v, mask, causal, fm, scale)
    grad = torch.randn_like(ref)
    got = torch.autograd.grad(out, (q, k, v), grad.to(dtype))
    want = torch.autograd.grad(ref, (q, k, v), grad)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    for name, g, w in zip("qkv", got, want):
        torch.testing.assert_close(g.double(), w.double(), rtol=tol, atol=tol, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("fm,causal,nq,nk,mask", CPU_CASES)
def test_cpu_matches_formula(monkeypatch, fm, causal, nq, nk, mask):
    monkeypatch.setattr(lin_cpu, "DEFAULT_CHUNK", CPU_CHUNK)
    _check("cpu", fm, causal, nq, nk, mask, torch.float64, 1e-9)


@pytest.mark.parametrize("fm,causal,nq,nk,mask", TRITON_CASES)
def test_triton_matches_formula(fm, causal, nq, nk, mask):
    if not INTERPRET:
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1 (make test sets it)")
    _check("triton", fm, causal, nq, nk, mask, torch.float32, 2e-5)


BACKENDS = ["cpu"] + (["triton"] if INTERPRET else [])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fm", ["elu", "identity"])
def test_rows_without_keys_are_zero_with_finite_grads(backend, fm):
    # causal with Nq > Nk: the first Nq - Nk queries see nothing; batch 1 has every key masked
    q, k, v = _inputs(9, 5, torch.float32)
    mask = torch.ones(2, 1, 1, 5, dtype=torch.bool)
    mask[1] = False
    out = AF.linear(q, k, v, attn_mask=mask, is_causal=True, feature_map=fm, backend=backend)
    assert torch.equal(out[:, :, :4], torch.zeros_like(out[:, :, :4]))
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype,mag", [(torch.float32, 30.0), (torch.bfloat16, 1.0), (torch.bfloat16, 30.0)])
def test_extreme_and_half_inputs_stay_finite(backend, dtype, mag):
    q, k, v = (t.detach().mul(mag).to(dtype).requires_grad_() for t in _inputs(40, 40, torch.float32))
    out = AF.linear(q, k, v, is_causal=True, backend=backend)
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert all(torch.isfinite(g).all() for g in torch.autograd.grad(out.float().sum(), (q, k, v)))
    if mag == 1.0:   # bf16 inputs, fp32 math inside: only the rounding of inputs/outputs remains
        ref = _expected(q, k, v, None, True, "elu", 1.0)
        torch.testing.assert_close(out.double(), ref, rtol=3e-2, atol=3e-2)




def test_cpu_causal_never_builds_prefix_sums_or_n_by_n():
    n, d = 512, 16
    q, k, v = (torch.randn(1, 1, n, d, requires_grad=True) for _ in range(3))
    with LargestOutput() as mode:
        out = AF.linear(q, k, v, is_causal=True, backend="cpu")
        out.sum().backward()
    # the reference's prefix sums hold n * d * (d + 1) numbers, the weights n * n; chunks hold n * 64
    assert mode.largest <= n * lin_cpu.DEFAULT_CHUNK < min(n * n, n * d * d) // 2


def test_dispatch_and_clear_refusals():
    q, k, v = _inputs(6, 6, torch.float32)
    assert AF.explain("linear", q, k, v, is_causal=True).backend.name == "cpu"
    general = torch.rand(6, 6) > 0.5
    with pytest.raises(ValueError, match="query-dependent attn_mask"):
        AF.linear(q, k, v, attn_mask=general, backend="cpu")
    with pytest.raises(ValueError, match="dropout"):
        AF.linear(q, k, v, dropout_p=0.1, backend="cpu")
    # auto falls back to the reference for a general mask, and still matches the formula
    out = AF.linear(q, k, v, attn_mask=general)
    allow, add = FM.allow_and_add(general, False, 2, 2, 6, 6)
    torch.testing.assert_close(out.double(), FM.linear(q.double(), k.double(), v.double(), allow, add),
                               rtol=1e-5, atol=1e-5)


def test_triton_refuses_what_it_cannot_hold():
    q = torch.randn(1, 1, 4, 300)
    expected = "registers" if INTERPRET else "TRITON_INTERPRET"
    with pytest.raises(ValueError, match=expected):
        AF.linear(q, q, q, backend="triton")
