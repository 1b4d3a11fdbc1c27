"""Properties of the papers' formulas that hold whatever the implementation: gradients, equivariance, causal
prefixes, masking = removal, Sinkhorn marginals, and the Fenchel-dual special cases."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnzoo.functional as AF
from tests import common
from tests import formulas as R

GRAD_CASES = {
    "softmax": lambda q, k, v, c: AF.softmax(q, k, v, is_causal=c),
    "l2": lambda q, k, v, c: AF.l2(q, k, v, is_causal=c),
    "sinkhorn": lambda q, k, v, c: AF.sinkhorn(q, k, v, is_causal=c, n_iters=2, eps=0.5),
    "sigmoid": lambda q, k, v, c: AF.sigmoid(q, k, v, is_causal=c),
    "relu": lambda q, k, v, c: AF.relu(q, k, v, is_causal=c),
    "linear": lambda q, k, v, c: AF.linear(q, k, v, is_causal=c),
    "linear_identity": lambda q, k, v, c: AF.linear(q, k, v, is_causal=c, feature_map="identity"),
    "fenchel": lambda q, k, v, c: AF.fenchel(q, k, v, is_causal=c, alpha=0.7),
    "fenchel_second": lambda q, k, v, c: AF.fenchel(q, k, v, is_causal=c, solve="second_order"),
    "fenchel_exact": lambda q, k, v, c: AF.fenchel(q, k, v, is_causal=c, solve="exact"),
    "ot": lambda q, k, v, c: AF.ot(q, k, v, is_causal=c),
}


def qkv(nq=4, nk=4, d=3, dv=2, b=1, h=2, dtype=torch.float64, seed=0):
    """This file's small float64 default shapes for common.qkv, seeded per call."""
    return common.qkv(b, h, nq, nk, d, dv, dtype=dtype, generator=common.seeded(seed))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("variant", list(GRAD_CASES))
def test_gradcheck(variant, causal):
    q, k, v = (t.requires_grad_() for t in qkv(nq=3, nk=4))
    assert torch.autograd.gradcheck(lambda q, k, v: GRAD_CASES[variant](q, k, v, causal), (q, k, v), atol=1e-6)


def test_gradcheck_ot_templates_and_log_u():
    q, k, v = qkv(nq=3, nk=3)
    tk, tv = torch.randn(1, 2, 2, 3, dtype=torch.float64), torch.randn(1, 2, 2, 2, dtype=torch.float64)
    lu = torch.randn(1, 2, 3, dtype=torch.float64)
    args = tuple(t.requires_grad_() for t in (q, k, v, tk, tv, lu))
    assert torch.autograd.gradcheck(
        lambda q, k, v, tk, tv, lu: AF.ot(q, k, v, templates_k=tk, templates_v=tv, log_u=lu), args)


def test_gradcheck_masks_sigmoid_bias_and_log_u():
    q, k, v = qkv(nq=3, nk=5)
    mask = torch.randn(1, 2, 3, 5, dtype=torch.float64).requires_grad_()
    bias = torch.randn(1, 2, 1, 1, dtype=torch.float64).requires_grad_()
    lu = torch.randn(1, 2, 3, 5, dtype=torch.float64).requires_grad_()
    q.requires_grad_()
    assert torch.autograd.gradcheck(lambda q, m, b: AF.sigmoid(q, k, v, attn_mask=m, bias=b), (q, mask, bias))
    assert torch.autograd.gradcheck(lambda q, lu: AF.fenchel(q, k, v, log_u=lu, solve="exact"), (q, lu))


@pytest.mark.parametrize("variant", list(GRAD_CASES))
def test_permutation_equivariance(variant):
    q, k, v = qkv(nq=6, nk=6)
    perm = torch.randperm(6)
    out = GRAD_CASES[variant](q, k, v, False)
    out_p = GRAD_CASES[variant](q[:, :, perm], k[:, :, perm], v[:, :, perm], False)
    torch.testing.assert_close(out_p, out[:, :, perm], atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("variant", list(GRAD_CASES))
def test_causal_prefix_property(variant):
    q, k, v = qkv(nq=6, nk=6)
    out = GRAD_CASES[variant](q, k, v, True)
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    q2[:, :, 4:] += 3.0
    k2[:, :, 4:] -= 2.0
    v2[:, :, 4:] *= -5.0
    out2 = GRAD_CASES[variant](q2, k2, v2, True)
    torch.testing.assert_close(out2[:, :, :4], out[:, :, :4], atol=1e-10, rtol=1e-10)
    assert not torch.allclose(out2[:, :, 4:], out[:, :, 4:])


@pytest.mark.parametrize("variant", list(GRAD_CASES))
def test_masked_padding_keys_equal_removed_keys(variant):
    q, k, v = qkv(nq=4, nk=7)
    pad = torch.ones(1, 1, 1, 7, dtype=torch.bool)
    pad[..., 5:] = False
    call = GRAD_CASES[variant]
    fn = {"softmax": AF.softmax, "l2": AF.l2, "sigmoid": AF.sigmoid, "relu": AF.relu}.get(variant)
    if fn is not None:
        masked = fn(q, k, v, attn_mask=pad)
    else:
        kw = {"sinkhorn": dict(n_iters=2, eps=0.5), "linear": {}, "linear_identity": dict(feature_map="identity"),
              "fenchel": dict(alpha=0.7), "fenchel_second": dict(solve="second_order"),
              "fenchel_exact": dict(solve="exact"), "ot": {}}[variant]
        name = variant.split("_")[0]
        masked = getattr(AF, name)(q, k, v, attn_mask=pad, **kw)
    removed = call(q, k[:, :, :5], v[:, :, :5], False)
    torch.testing.assert_close(masked, removed, atol=1e-10, rtol=1e-10)


def _sinkhorn_weights(q, k, n_iters):
    eye = torch.eye(k.shape[2], dtype=q.dtype).expand(q.shape[0], q.shape[1], -1, -1)
    return AF.sinkhorn(q, k, eye, n_iters=n_iters)  # linear in v: v = I gives the weights


@pytest.mark.parametrize("nq,nk", [(6, 6), (4, 8), (9, 3)])
def test_sinkhorn_marginals(nq, nk):
    q, k, _ = qkv(nq=nq, nk=nk, d=4)
    errors = []
    for n in (0, 1, 3, 10, 50):
        p = _sinkhorn_weights(q, k, n)
        torch.testing.assert_close(p.sum(-1), torch.ones_like(p.sum(-1)), atol=1e-12, rtol=0)
        errors.append(float((p.sum(-2) - nq / nk).abs().max()))
    assert errors[-1] < 1e-6
    assert all(b <= a + 1e-12 for a, b in zip(errors[1:], errors[2:]))
    assert errors[0] > 10 * errors[-1]


def test_sinkhorn_zero_iterations_is_softmax_of_the_same_logits():
    q, k, v = qkv(nq=5, nk=6, d=4)
    eps = 0.7
    s = -(1 / 2) * ((q[:, :, :, None] - k[:, :, None]) ** 2).sum(-1) / (2 * eps)
    expected = torch.softmax(s, -1) @ v
    torch.testing.assert_close(AF.sinkhorn(q, k, v, n_iters=0, eps=eps), expected)
    torch.testing.assert_close(AF.sinkhorn(q, k, v, n_iters=0, cost="dot"), AF.softmax(q, k, v))


def test_fenchel_first_order_uniform_is_softmax():
    q, k, v = qkv(nq=5, nk=6, d=4)
    torch.testing.assert_close(AF.fenchel(q, k, v), AF.softmax(q, k, v), atol=1e-12, rtol=0)
    torch.testing.assert_close(AF.fenchel(q, k, v, alpha=2.0), AF.softmax(q, k, v, scale=1.0), atol=1e-12, rtol=0)


@pytest.mark.parametrize("alpha", [0.5, 1.0, 3.0])
def test_fenchel_exact_gaussian_closed_form(alpha):
    # paper 004 sec 5: u = N(mu, I)  =>  estimate = mu/(1+alpha) + alpha/(1+alpha) (mu + z)
    g = torch.Generator().manual_seed(1)
    n, d = 40000, 2
    mu = torch.tensor([0.5, -1.0], dtype=torch.float64)
    t = mu + torch.randn(n, d, generator=g, dtype=torch.float64)
    z = torch.tensor([[0.3, 0.2], [-0.4, 0.1]], dtype=torch.float64)
    out = AF.fenchel(z.view(1, 1, 2, d), t.view(1, 1, n, d), t.view(1, 1, n, d), scale=1.0, alpha=alpha, solve="exact")
    mu_hat = t.mean(0)  # the empirical u's mean; sampling error of the covariance is O(1/sqrt(n))
    expected = mu_hat + alpha / (1 + alpha) * z
    torch.testing.assert_close(out.view(2, d), expected, atol=2e-2, rtol=0)


def test_fenchel_exact_satisfies_the_dual_optimality_condition():
    # at lambda*, mu + z - lambda*/alpha = E_p[t] with p = softmax(log u + t.lambda*); with v = k the
    # output is E_p[t], so lambda* = alpha (mu + z - out) and p must reproduce out
    q, k, _ = qkv(nq=4, nk=9, d=3)
    lu = torch.randn(1, 2, 4, 9, dtype=torch.float64)
    alpha = 1.7
    out = AF.fenchel(q, k, k, log_u=lu, alpha=alpha, solve="exact", scale=0.6)
    u = torch.softmax(lu, -1)
    mu = u @ k
    lam = alpha * (mu + 0.6 * q - out)
    p = torch.softmax(lu + lam @ k.transpose(-1, -2), -1)
    torch.testing.assert_close(p @ k, out, atol=1e-9, rtol=0)


def test_fenchel_second_order_is_closer_than_first_order():
    q, k, v = qkv(nq=8, nk=16, d=3, seed=3)
    exact = AF.fenchel(q, k, v, alpha=0.5, solve="exact")
    first = AF.fenchel(q, k, v, alpha=0.5, solve="first_order")
    second = AF.fenchel(q, k, v, alpha=0.5, solve="second_order")
    assert (second - exact).norm() < (first - exact).norm()


@settings(max_examples=25, deadline=None)
@given(b=st.integers(1, 2), h=st.integers(1, 3), nq=st.integers(1, 6), nk=st.integers(1, 6),
       d=st.integers(1, 5), dv=st.integers(1, 4), causal=st.booleans(),
       variant=st.sampled_from(["softmax", "l2", "sigmoid", "relu", "linear", "sinkhorn"]))
def test_hypothesis_shapes(b, h, nq, nk, d, dv, causal, variant):
    q, k, v = qkv(nq=nq, nk=nk, d=d, dv=dv, b=b, h=h)
    allow, add = R.allow_and_add(None, causal, b, h, nq, nk)
    user_allow, _ = R.allow_and_add(None, False, b, h, nq, nk)
    s = 1 / math.sqrt(d)
    ref = {"softmax": lambda: R.softmax(q, k, v, allow, add, s), "l2": lambda: R.l2(q, k, v, allow, add, s),
           "sigmoid": lambda: R.sigmoid(q, k, v, allow, add, s), "relu": lambda: R.relu(q, k, v, allow, add, s),
           "linear": lambda: R.linear(q, k, v, allow, add),
           "sinkhorn": lambda: R.sinkhorn(q, k, v, user_allow, add, s, 3, 1.0, "l2", causal)}[variant]()
    out = getattr(AF, variant)(q, k, v, is_causal=causal)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
