"""Fused OT attention (ops/ot/{cpu,triton}.py) against float64 math from paper 004 eq (22).

tests/formulas.py.ot loops over queries i and input templates j and applies eq (22) with
M = -a.b + C literally: out_i = sum_j u_ij softmax_t((alpha q_i.a_t + k_j.a_t) / gamma + mask_it) a_v_t
over the template set A = kept keys + extra templates, u uniform or softmax(log_u) over kept keys.
The fused paths never form the (Nq, Nk, |A|) tensor; every gradient (q, k, v, templates, log_u) is checked.
The Triton kernels run under TRITON_INTERPRET=1 (set by `make test`) on tiny shapes.
"""
from __future__ import annotations

import math
import os

import pytest
import torch

import attnzoo.functional as AF
from attnzoo.ops.ot import cpu as ot_cpu
from attnzoo.ops.ot import tiles as ot_tiles
from attnzoo.ops.ot.factorised import ot_terms

from . import formulas as FM
from tests.memory_probe import LargestOutput

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
B, H, D, DV = 2, 2, 6, 3

# (is_causal, nq, nk, n_templates, mask kind, log_u)
CPU_CASES = [
    (False, 7, 7, 0, None, False), (False, 7, 7, 3, None, True), (True, 7, 7, 0, None, False),
    (True, 5, 9, 4, None, True), (True, 9, 5, 2, "key_bool", False), (False, 6, 8, 0, "key_float", True),
    (False, 8, 6, 3, "query_bool", True), (True, 7, 7, 3, "query_float", False), (False, 5, 7, 2, "padding", True),
]
TRITON_CASES = [
    (False, 7, 9, 3, None, True), (True, 9, 5, 2, "key_bool", False), (False, 6, 6, 2, "query_float", True),
    (True, 9, 7, 0, "padding", True),
]


def test_triton_tiles_crossing_every_block_boundary(monkeypatch):
    if not INTERPRET:
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1 (make test sets it)")
    from attnzoo.ops.ot import triton as ot_triton
    for name in ("BI", "BJ", "BT"):   # 9 queries, 9 sources, 9 templates over 8-wide tiles
        monkeypatch.setattr(ot_triton, name, 8)
    _check("triton", True, 9, 9, 0, "padding", True, torch.float32, 2e-5)


def _mask(kind, nq, nk):
    if kind == "key_bool":
        m = torch.rand(B, 1, 1, nk) > 0.3
        m[..., 0] = True
        return m
    if kind == "key_float":
        return (0.5 * torch.randn(nk, dtype=torch.float64)).masked_fill(torch.rand(nk) < 0.3, -math.inf)
    if kind == "query_bool":
        return torch.rand(B, H, nq, nk) > 0.4
    if kind == "query_float":
        return (0.5 * torch.randn(nq, nk, dtype=torch.float64)).masked_fill(torch.rand(nq, nk) < 0.3, -math.inf)
    if kind == "padding":   # batch 1's last two keys are padding
        m = torch.ones(B, 1, 1, nk, dtype=torch.bool)
        m[1, ..., -2:] = False
        return m
    return None


def _inputs(nq, nk, n_templates, with_log_u, dtype, mag=1.0):
    def t(*shape, mag=1.0):
        return (mag * torch.randn(*shape, dtype=dtype)).requires_grad_()
    q, k, v = t(B, H, nq, D, mag=mag), t(B, H, nk, D, mag=mag), t(B, H, nk, DV)
    tk, tv = (t(B, H, n_templates, D, mag=mag), t(B, H, n_templates, DV)) if n_templates else (None, None)
    log_u = t(B, H, nk) if with_log_u else None
    return q, k, v, tk, tv, log_u


def _expected(q, k, v, tk, tv, log_u, mask, causal, scale, alpha):
    allow, add = FM.allow_and_add(mask, causal, B, H, q.shape[2], k.shape[2])
    d = (lambda x: None if x is None else x.double())
    return FM.ot(q.double(), k.double(), v.double(), allow, add, scale, alpha=alpha, log_u=d(log_u),
                 tk=d(tk), tv=d(tv))


def _check(backend, causal, nq, nk, n_templates, mask_kind, with_log_u, dtype, tol, mag=1.0):
    q, k, v, tk, tv, log_u = _inputs(nq, nk, n_templates, with_log_u, dtype, mag)
    mask = _mask(mask_kind, nq, nk)
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(dtype)
    scale, alpha = 0.7, 1.3
    out = AF.ot(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, alpha=alpha, log_u=log_u,
                templates_k=tk, templates_v=tv, backend=backend)
    ref = _expected(q, k, v, tk, tv, log_u, mask, causal, scale, alpha)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    names = [n for n, x in zip(("q", "k", "v", "templates_k", "templates_v", "log_u"), (q, k, v, tk, tv, log_u))
             if x is not None]
    inputs = [x for x in (q, k, v, tk, tv, log_u) if x is not None]
    grad = torch.randn_like(ref)
    got = torch.autograd.grad(out, inputs, grad.to(dtype))
    want = torch.autograd.grad(ref, inputs, grad)
    for name, g, w in zip(names, got, want):
        torch.testing.assert_close(g.double(), w.double(), rtol=tol, atol=tol, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("causal,nq,nk,n_templates,mask,log_u", CPU_CASES)
def test_cpu_matches_eq22(causal, nq, nk, n_templates, mask, log_u):
    _check("cpu", causal, nq, nk, n_templates, mask, log_u, torch.float64, 1e-9)


def _all_pairs_to_tiles(monkeypatch, tile_elements):
    """Send every (i, j) pair of the CPU path to its exact blockwise fallback (tiles.py)."""
    monkeypatch.setattr(ot_cpu, "SAFE_NORMALISER", {torch.float32: math.inf, torch.float64: math.inf})
    monkeypatch.setattr(ot_tiles, "TILE_ELEMENTS", tile_elements)


def test_cpu_large_logits_mix_matmul_and_exact_pairs():
    # logits of a few hundred: the matmul path cannot resolve some (i, j) pairs in floating point
    # and hands them to the exact tiles; together they must still be eq (22) to float64 accuracy
    torch.manual_seed(0)
    q, k, _, tk, _, _ = _inputs(7, 7, 3, False, torch.float64, mag=15.0)
    c, g, _ = ot_terms(q, k, attn_mask=None, is_causal=False, alpha=1.3, gamma=1 / 0.7, log_u=None, templates_k=tk)
    share = ot_cpu._parts(c, g)[3].double().mean().item()
    assert 0.05 < share < 0.95, share
    torch.manual_seed(0)
    _check("cpu", False, 7, 7, 3, None, False, torch.float64, 1e-9, mag=15.0)


@pytest.mark.parametrize("tile_elements", [1, 40, 10**6])
@pytest.mark.parametrize("causal,nq,nk,n_templates,mask,log_u", [CPU_CASES[4], CPU_CASES[6]])
def test_cpu_blockwise_fallback_matches_eq22(monkeypatch, tile_elements, causal, nq, nk, n_templates, mask, log_u):
    # tile_elements=1: one (i, j) pair per tile, every block boundary of the loops is crossed
    _all_pairs_to_tiles(monkeypatch, tile_elements)
    _check("cpu", causal, nq, nk, n_templates, mask, log_u, torch.float64, 1e-9)


@pytest.mark.parametrize("causal,nq,nk,n_templates,mask,log_u", TRITON_CASES)
def test_triton_matches_eq22(causal, nq, nk, n_templates, mask, log_u):
    if not INTERPRET:
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1 (make test sets it)")
    _check("triton", causal, nq, nk, n_templates, mask, log_u, torch.float32, 2e-5)


BACKENDS = ["cpu"] + (["triton"] if INTERPRET else [])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n_templates", [0, 2])
def test_rows_without_keys_are_zero_with_finite_grads(backend, n_templates):
    q, k, v, tk, tv, log_u = _inputs(5, 4, n_templates, True, torch.float32)
    mask = torch.ones(B, H, 5, 4, dtype=torch.bool)
    mask[:, :, 2] = False      # query 2 has no input template left: u is empty, out is 0
    out = AF.ot(q, k, v, attn_mask=mask, log_u=log_u, templates_k=tk, templates_v=tv, backend=backend)
    assert torch.equal(out[:, :, 2], torch.zeros_like(out[:, :, 2]))
    inputs = [x for x in (q, k, v, tk, tv, log_u) if x is not None]
    assert all(torch.isfinite(g).all() for g in torch.autograd.grad(out.sum(), inputs))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype,mag", [(torch.float32, 1e3), (torch.bfloat16, 1.0), (torch.bfloat16, 1e2)])
def test_extreme_and_half_inputs_stay_finite(backend, dtype, mag):
    q, k, v, tk, tv, _ = _inputs(6, 5, 2, False, torch.float32)
    q, k, v, tk, tv = (x.detach().mul(mag).to(dtype).requires_grad_() for x in (q, k, v, tk, tv))
    out = AF.ot(q, k, v, is_causal=True, templates_k=tk, templates_v=tv, backend=backend)
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert all(torch.isfinite(g).all() for g in torch.autograd.grad(out.float().sum(), (q, k, v, tk, tv)))
    if mag == 1.0:   # bf16 inputs, fp32 math inside: only the rounding of inputs/outputs remains
        ref = _expected(q, k, v, tk, tv, None, None, True, 1 / math.sqrt(D), 1.0)
        torch.testing.assert_close(out.double(), ref, rtol=3e-2, atol=3e-2)




@pytest.mark.parametrize("causal,tiles", [(False, False), (True, False), (True, True)])
def test_cpu_never_allocates_the_cube(monkeypatch, causal, tiles):
    if tiles:
        _all_pairs_to_tiles(monkeypatch, 1024)
    nq, nk, m = 16, 12, 20
    q, k, v, tk, tv, log_u = _inputs(nq, nk, m, True, torch.float32)
    mask = torch.ones(B, 1, 1, nk, dtype=torch.bool)
    with LargestOutput() as mode:
        out = AF.ot(q, k, v, attn_mask=mask, is_causal=causal, log_u=log_u, templates_k=tk, templates_v=tv,
                    backend="cpu")
        out.sum().backward()
    na = nk + m
    # the query term C (Nq x |A|) and the Gram term G (Nk x |A|) are the largest (u and the pair
    # normalisers are Nq x Nk <= Nq x |A|); the reference's (B, H, Nq, Nk, |A|) cube is 16x bigger here
    assert mode.largest <= B * H * max(nq, nk) * na < B * H * nq * nk * na // 8


def test_dispatch_picks_cpu_and_refuses_dropout():
    q, k, v, *_ = _inputs(4, 4, 0, False, torch.float32)
    assert AF.explain("ot", q, k, v).backend.name == "cpu"
    with pytest.raises(ValueError, match="dropout"):
        AF.ot(q, k, v, dropout_p=0.1, backend="cpu")
