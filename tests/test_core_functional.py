"""Every variant x {self, cross} x {no mask, bool, float, padding, causal} x
{float32, float64}, against the float64 formulas in tests/formulas.py."""
from __future__ import annotations

import math

import pytest
import torch

import attnzoo
import attnzoo.functional as AF
from tests import formulas as R
from tests.common import bool_mask, float_mask, padding_mask, qkv
from tests.flash_rule import assert_flash_rule, flash_rule_failures, reference_or_rounded, scale_grad

B, H, D, DV = 2, 2, 4, 3
SHAPES = {"self": (5, 5), "cross_more_keys": (4, 7), "cross_fewer_keys": (6, 3)}
MASKS = ["none", "bool", "float", "padding", "causal"]


def make_mask(kind, nq, nk, g):
    if kind == "bool":  # one fully masked row: must give zeros, not NaN
        return bool_mask((B, 1, nq, nk), 0.7, generator=g, empty_rows=[(0, 0, 0)])
    if kind == "float":
        return float_mask((B, H, nq, nk), 0.3, generator=g, dtype=torch.float64)
    if kind == "padding":
        return padding_mask([nk, nk - 2], nk)
    return None


# name -> (call(q, k, v, mask, causal), reference(q, k, v, allow, add, scale, user_allow, causal))
def _fenchel_log_u(nq, nk):
    # values bf16 holds exactly: test_bf16_inputs hands the same log u to the kernel and the float64 formula
    g = torch.Generator().manual_seed(3)
    return torch.randn(1, H, nq, nk, generator=g, dtype=torch.float64).bfloat16().double()


def _ot_log_u(nk):
    g = torch.Generator().manual_seed(4)
    return torch.randn(B, H, nk, generator=g, dtype=torch.float64)


def _templates(dtype):
    g = torch.Generator().manual_seed(5)
    return (torch.randn(B, H, 2, D, generator=g, dtype=torch.float64).to(dtype),
            torch.randn(B, H, 2, DV, generator=g, dtype=torch.float64).to(dtype))


VARIANTS = {
    "softmax": (lambda q, k, v, m, c: AF.softmax(q, k, v, attn_mask=m, is_causal=c),
                lambda q, k, v, a, add, s, ua, c: R.softmax(q, k, v, a, add, s)),
    "l2": (lambda q, k, v, m, c: AF.l2(q, k, v, attn_mask=m, is_causal=c),
           lambda q, k, v, a, add, s, ua, c: R.l2(q, k, v, a, add, s)),
    "sinkhorn": (lambda q, k, v, m, c: AF.sinkhorn(q, k, v, attn_mask=m, is_causal=c, n_iters=3, eps=0.7),
                 lambda q, k, v, a, add, s, ua, c: R.sinkhorn(q, k, v, ua, add, s, 3, 0.7, "l2", c)),
    "sinkhorn_dot": (lambda q, k, v, m, c: AF.sinkhorn(q, k, v, attn_mask=m, is_causal=c, n_iters=2, cost="dot"),
                     lambda q, k, v, a, add, s, ua, c: R.sinkhorn(q, k, v, ua, add, s, 2, 1.0, "dot", c)),
    "sigmoid": (lambda q, k, v, m, c: AF.sigmoid(q, k, v, attn_mask=m, is_causal=c),
                lambda q, k, v, a, add, s, ua, c: R.sigmoid(q, k, v, a, add, s)),
    "sigmoid_bias": (lambda q, k, v, m, c: AF.sigmoid(q, k, v, attn_mask=m, is_causal=c, bias=-0.5),
                     lambda q, k, v, a, add, s, ua, c: R.sigmoid(q, k, v, a, add, s, bias=-0.5)),
    "relu": (lambda q, k, v, m, c: AF.relu(q, k, v, attn_mask=m, is_causal=c),
             lambda q, k, v, a, add, s, ua, c: R.relu(q, k, v, a, add, s)),
    "linear_elu": (lambda q, k, v, m, c: AF.linear(q, k, v, attn_mask=m, is_causal=c),
                   lambda q, k, v, a, add, s, ua, c: R.linear(q, k, v, a, add, "elu")),
    "linear_identity": (lambda q, k, v, m, c: AF.linear(q, k, v, attn_mask=m, is_causal=c, feature_map="identity"),
                        lambda q, k, v, a, add, s, ua, c: R.linear(q, k, v, a, add, "identity")),
    "fenchel": (lambda q, k, v, m, c: AF.fenchel(q, k, v, attn_mask=m, is_causal=c, alpha=0.8,
                                                 log_u=_fenchel_log_u(q.shape[2], k.shape[2]).to(q.dtype)),
                lambda q, k, v, a, add, s, ua, c: R.fenchel_first(q, k, v, a, add, s, _fenchel_log_u(q.shape[2], k.shape[2]), 0.8)),
    "fenchel_second": (lambda q, k, v, m, c: AF.fenchel(q, k, v, attn_mask=m, is_causal=c, alpha=0.8, solve="second_order"),
                       lambda q, k, v, a, add, s, ua, c: R.fenchel_second(q, k, v, a, add, s, None, 0.8)),
    "ot": (lambda q, k, v, m, c: AF.ot(q, k, v, attn_mask=m, is_causal=c, alpha=1.0),
           lambda q, k, v, a, add, s, ua, c: R.ot(q, k, v, a, add, s)),
    "ot_templates": (lambda q, k, v, m, c: AF.ot(q, k, v, attn_mask=m, is_causal=c, alpha=0.5, gamma=1.5,
                                                 log_u=_ot_log_u(k.shape[2]).to(q.dtype),
                                                 templates_k=_templates(q.dtype)[0], templates_v=_templates(q.dtype)[1]),
                     lambda q, k, v, a, add, s, ua, c: R.ot(q, k, v, a, add, s, 0.5, 1.5, _ot_log_u(k.shape[2]),
                                                            *_templates(torch.float64))),
    "masked": (lambda q, k, v, m, c: AF.masked(q, k, v, attn_mask=m, kind="sigmoid"),
               lambda q, k, v, a, add, s, ua, c: R.sigmoid(q, k, v, R.allow_and_add(None, True, B, H, q.shape[2], k.shape[2])[0] & a, add, s)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_matches_formula(variant, shape, mask_kind, dtype):
    nq, nk = SHAPES[shape]
    g = torch.Generator().manual_seed(hash((variant, shape, mask_kind)) % 2**31)
    q, k, v = qkv(B, H, nq, nk, D, DV, dtype=torch.float64, generator=g)
    mask = make_mask(mask_kind, nq, nk, g)
    causal = mask_kind == "causal"
    call, ref = VARIANTS[variant]
    m = mask if mask is None or mask.dtype == torch.bool else mask.to(dtype)
    out = call(q.to(dtype), k.to(dtype), v.to(dtype), m, causal)
    allow, add = R.allow_and_add(mask, causal, B, H, nq, nk)
    user_allow, _ = R.allow_and_add(mask, False, B, H, nq, nk)
    expected = ref(q, k, v, allow, add, 1 / math.sqrt(D), user_allow, causal)
    assert out.dtype == dtype and out.shape == (B, H, nq, DV)
    assert torch.isfinite(out).all()
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


def test_fully_masked_rows_are_zero_for_every_variant():
    """A row with no key: output 0, and no gradient reaches its query; the other rows' gradients are
    finite (a NaN there would come from exp(-inf - -inf) in the masked row)."""
    q, k, v = torch.randn(B, H, 3, D), torch.randn(B, H, 5, D), torch.randn(B, H, 5, DV)
    mask = torch.ones(1, 1, 3, 5, dtype=torch.bool)
    mask[..., 1, :] = False
    for name, (call, _) in VARIANTS.items():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = call(*leaves, mask, False)
        assert torch.equal(out[..., 1, :], torch.zeros_like(out[..., 1, :])), name
        out.square().sum().backward()
        dq = leaves[0].grad
        assert torch.equal(dq[..., 1, :], torch.zeros_like(dq[..., 1, :])), name
        assert dq[..., [0, 2], :].abs().sum() > 0, name  # the other rows do get a gradient
        for t in leaves:
            assert torch.isfinite(t.grad).all(), name


@pytest.mark.parametrize("variant", [v for v in VARIANTS if not v.startswith("ot")])
def test_extreme_logits_give_no_nan(variant):
    q = torch.full((B, H, 4, D), 1e2)
    q[:, :, 1] = -1e2
    k = torch.randn(B, H, 6, D) * 1e2
    v = torch.randn(B, H, 6, DV)
    call, _ = VARIANTS[variant]
    qq = q.clone().requires_grad_()
    out = call(qq, k, v, None, False)
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(qq.grad).all()


def test_ot_large_inputs():
    # OT's logits hold the Gram term k_j.k_t: |k| ~ 30 already gives logits ~ 1e3
    q, k, v = torch.randn(B, H, 4, D) * 30, torch.randn(B, H, 6, D) * 30, torch.randn(B, H, 6, DV)
    q.requires_grad_()
    out = AF.ot(q, k, v)
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(q.grad).all()


def bf16_triples(variant, perturb=None):
    """(name, the auto backend on bf16 inputs, the reference backend on the same inputs (or the float64
    result rounded to bf16 where auto chose the reference), the float64 formula on those inputs) for the
    output and dq, dk, dv. ``perturb``: (q, k, v) -> (q, k, v), to make the tested path wrong on purpose."""
    call, ref = VARIANTS[variant]
    g = torch.Generator().manual_seed(11)
    q, k = (torch.randn(B, H, 9, D, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(B, H, 9, DV, generator=g, dtype=torch.float64)
    cot = torch.randn(B, H, 9, DV, generator=g, dtype=torch.float64)
    # round the inputs to bf16 first, so the comparison measures the kernel, not the input rounding
    q, k, v = (t.bfloat16().double() for t in (q, k, v))
    allow, add = R.allow_and_add(None, False, B, H, 9, 9)

    def run(fn, dtype, tested=False):
        leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        out = fn(*(perturb(*leaves) if tested and perturb else leaves))
        return [out] + list(torch.autograd.grad((out.double() * cot).sum(), leaves))

    want = run(lambda q, k, v: ref(q, k, v, allow, add, 1 / math.sqrt(D), allow, False), torch.float64)
    got = run(lambda q, k, v: call(q, k, v, None, False), torch.bfloat16, tested=True)
    with attnzoo.use_backend("reference"):
        low = run(lambda q, k, v: call(q, k, v, None, False), torch.bfloat16)
    return list(zip(("out", "dq", "dk", "dv"), got, reference_or_rounded(got, low, want, torch.bfloat16), want))


@pytest.mark.parametrize("variant", ["softmax", "l2", "sigmoid", "relu", "linear_elu", "fenchel", "sinkhorn", "ot"])
def test_bf16_inputs(variant):
    """bf16 in, bf16 out, finite; the output and every gradient within FlashAttention's rule of float64."""
    triples = bf16_triples(variant)
    assert triples[0][1].dtype == torch.bfloat16
    assert all(torch.isfinite(got).all() for _, got, _, _ in triples)
    assert_flash_rule(variant, torch.bfloat16, 1.0, triples)


@pytest.mark.parametrize("variant,what,factor", [("softmax", "dq", 0.85), ("sinkhorn", "dq", 0.95),
                                                 ("fenchel", "dk", 0.95), ("linear_elu", "dv", 1.05)])
def test_bf16_check_sees_a_scaled_gradient(variant, what, factor):
    i = "qkv".index(what[1])
    triples = bf16_triples(variant, lambda *qkv: [scale_grad(t, factor) if j == i else t for j, t in enumerate(qkv)])
    assert any(f"{what} error" in f for f in flash_rule_failures(variant, torch.bfloat16, 1.0, triples))
