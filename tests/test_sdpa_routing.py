"""The exact identities that route L2 and Fenchel (per-key log u) to SDPA's fastest kernels.

-scale ||q - k||^2 = scale (2 q.k - ||k||^2) - scale ||q||^2 and scale q.k + log u_j are SDPA on q, k
augmented by one coordinate (two in bf16/fp16: hi + lo). Checked against float64 formulas written
here from the definitions, outputs and every gradient (q, k, v, log u), with -inf preferences,
bottom-right causal masks with Nq != Nk, and rows left with no key.
"""
from __future__ import annotations

import math

import pytest
import torch

import attnzoo.functional as AF
from attnzoo.ops.fenchel.backends import fenchel_torch
from attnzoo.ops.kernels.sdpa import split_coordinate
from attnzoo.ops.l2.backends import l2_torch
from tests import formulas as Fm
from tests.common import qkv, seeded


def _inputs(B, H, nq, nk, D, dtype, seed=0, spread=1.0):
    qkv64 = qkv(B, H, nq, nk, D, dtype=torch.float64, generator=seeded(seed))
    return [(spread * t).to(dtype).requires_grad_() for t in qkv64]


def _grads(out, inputs, seed=1):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.dtype)
    return torch.autograd.grad((out * w).sum(), inputs, allow_unused=True)


def _softmax64(logits, allow, v):
    """Row softmax over the allowed keys, zero rows without any; NaN-free in the backward too."""
    safe = torch.where(allow, logits, torch.zeros((), dtype=logits.dtype))
    m = torch.where(allow, safe, torch.full((), -1e30, dtype=logits.dtype)).amax(-1, keepdim=True).detach()
    w = torch.where(allow, torch.exp(safe - m), torch.zeros((), dtype=logits.dtype))
    s = w.sum(-1, keepdim=True)
    return (w / torch.where(s > 0, s, torch.ones_like(s))) @ v


def _fenchel64(q, k, v, log_u, is_causal, scale):
    B, H, nq, nk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    allow, add = Fm.allow_and_add(None, is_causal, B, H, nq, nk)
    lu = log_u.double().expand(B, H, nq, nk)
    allow = allow & (lu > -math.inf)
    add = add + torch.where(lu > -math.inf, lu, torch.zeros((), dtype=torch.float64))
    return _softmax64(scale * q.double() @ k.double().transpose(-1, -2) + add, allow, v.double())


def _l264(q, k, v, is_causal, scale):
    B, H, nq, nk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    allow, add = Fm.allow_and_add(None, is_causal, B, H, nq, nk)
    d2 = ((q.double()[:, :, :, None, :] - k.double()[:, :, None, :, :]) ** 2).sum(-1)
    return _softmax64(-scale * d2 + add, allow, v.double())


def test_split_coordinate_carries_twice_the_bits():
    x = torch.randn(1000, 1, dtype=torch.float64).float() * 100
    for dtype, bits in ((torch.bfloat16, 8), (torch.float16, 11)):
        hi_lo = split_coordinate(x, dtype)
        assert hi_lo.shape == (1000, 2) and hi_lo.dtype == dtype
        rel = ((hi_lo.float().sum(-1, keepdim=True) - x).abs() / x.abs()).max()
        one = ((x.to(dtype).float() - x).abs() / x.abs()).max()
        assert rel < 2.0 ** (-2 * bits + 1), (dtype, rel)
        assert one > 2.0 ** (-bits - 2)  # one coordinate alone would not do


@pytest.mark.parametrize("nq,nk,is_causal", [(7, 7, False), (5, 9, True), (9, 5, True), (6, 6, True)])
def test_l2_sdpa_route_matches_float64(nq, nk, is_causal):
    q, k, v = _inputs(2, 3, nq, nk, 6, torch.float64, spread=1.5)
    scale = 0.4
    got = l2_torch(q, k, v, is_causal=is_causal, scale=scale)
    want = _l264(q, k, v, is_causal, scale)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    for a, b in zip(_grads(got, (q, k, v)), _grads(want, (q, k, v))):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("nq,nk,is_causal", [(7, 7, False), (5, 9, True), (9, 5, True)])
@pytest.mark.parametrize("log_u_shape", ["keys", "batch-head-keys", "1d", "scalar-key"])
def test_fenchel_key_coordinate_matches_float64(nq, nk, is_causal, log_u_shape):
    B, H = 2, 3
    q, k, v = _inputs(B, H, nq, nk, 5, torch.float64)
    g = torch.Generator().manual_seed(3)
    shape = {"keys": (1, 1, 1, nk), "batch-head-keys": (B, H, 1, nk), "1d": (nk,),
             "scalar-key": (B, 1, 1, 1)}[log_u_shape]
    log_u = torch.randn(shape, generator=g, dtype=torch.float64)
    if log_u_shape != "scalar-key":
        log_u[..., 0] = -math.inf   # key 0 never takes part: causal rows that only see it are empty
        if log_u.dim() == 4 and log_u.shape[0] == B:
            log_u[1, 2, 0, :] = -math.inf  # one whole (batch, head) without keys
    log_u.requires_grad_()
    got = fenchel_torch(q, k, v, is_causal=is_causal, scale=0.5, log_u=log_u, alpha=1.5)
    want = _fenchel64(q, k, v, log_u.reshape((1,) * (4 - log_u.dim()) + tuple(log_u.shape)), is_causal, 0.75)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    for name, a, b in zip("qkvu", _grads(got, (q, k, v, log_u)), _grads(want, (q, k, v, log_u))):
        b = torch.zeros_like(a) if b is None else b
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10, msg=lambda m, n=name: f"d{n}: {m}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("variant", ["l2", "fenchel"])
def test_half_precision_routes_keep_the_key_term_exact(dtype, variant):
    """In bf16/fp16 the hi + lo coordinates keep ||k||^2 and log u to ~16 bits: the error against
    float64 is the rounding of the output to the dtype (<= eps/2 relative), not of the logits. With
    one coordinate (hi alone) the error is 0.9-2.5 eps here."""
    q, k, v = _inputs(1, 2, 16, 16, 8, dtype, spread=2.0)  # ||k||^2 ~ 32: one bf16 coordinate errs by ~0.1
    scale = 8 ** -0.5
    if variant == "l2":
        got = l2_torch(q, k, v, scale=scale)
        want = _l264(q, k, v, False, scale)
    else:
        log_u = (10.0 * torch.randn(1, 1, 1, 16, dtype=torch.float64)).to(dtype)  # large preferences
        got = fenchel_torch(q, k, v, scale=scale, log_u=log_u)
        want = _fenchel64(q, k, v, log_u, False, scale)
    err = (got.double() - want).abs().max().item()
    assert err <= 0.6 * torch.finfo(dtype).eps * want.abs().max().item(), err


def test_functional_auto_and_torch_backends_agree_with_the_reference():
    q, k, v = _inputs(2, 2, 6, 8, 4, torch.float32)
    log_u = torch.randn(2, 1, 1, 8)
    for name, kw in (("l2", {}), ("fenchel", {"log_u": log_u, "alpha": 0.7})):
        fn = AF.VARIANT_FUNCTIONS[name]
        ref = fn(q, k, v, is_causal=True, backend="reference", **kw)
        got = fn(q, k, v, is_causal=True, backend="torch", **kw)
        torch.testing.assert_close(got, ref, rtol=2e-5, atol=2e-6)
