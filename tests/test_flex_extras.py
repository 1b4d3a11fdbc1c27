"""softcap, sinks and window_size on the FlexAttention backends (ops/kernels/flex.py): the sinks'
renormalisation from the row's log-sum-exp and its gradients against float64 math (always), and the
l2 / fenchel flex backends' forward on CPU against float64 formulas written here (opt-in,
ATTNZOO_FLEX_CPU=1: it compiles FlexAttention for CPU, ~1-3 min; FlexAttention has no CPU backward,
and its CPU compile returns no log-sum-exp, so the cases with sinks run FlexAttention's eager
implementation; the compiled sinks path and every gradient are CUDA only)."""
from __future__ import annotations

import math
import os

import pytest
import torch

from attnzoo.ops import dispatch
from attnzoo.ops.kernels.flex import flex_available, with_sinks
from tests.common import band_allowed


def attend(logits, allow, v, sinks):
    """sum_j exp(l_ij) v_j / (sum_{j allowed} exp(l_ij) + exp(sink_h)); a row with no key gives 0."""
    e = torch.where(allow, torch.exp(logits), torch.zeros_like(logits))
    total = e.sum(-1, keepdim=True)
    if sinks is not None:
        total = total + torch.exp(sinks).view(1, -1, 1, 1)
    return (e / torch.where(total > 0, total, torch.ones_like(total))) @ v


def test_sinks_renormalisation_and_its_gradients_match_float64():
    """with_sinks(out, lse, sinks) on a plain softmax's output and log-sum-exp (the two FlexAttention
    returns, with autograd through both, as FlexAttention's backward takes d lse) is the attention with
    the sink in the normaliser: values and d q, d k, d v, d sinks."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, n, 5, generator=g, dtype=torch.float64).requires_grad_() for n in (6, 7, 7))
    sinks = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64, requires_grad=True)
    logits = 0.4 * q @ k.transpose(-1, -2)
    plain = torch.softmax(logits, -1) @ v
    got = with_sinks(plain, torch.logsumexp(logits, -1), sinks)
    want = attend(logits, torch.ones(6, 7, dtype=torch.bool), v, sinks)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    grad = torch.randn(got.shape, generator=g, dtype=torch.float64)
    got_grads = torch.autograd.grad(got, (q, k, v, sinks), grad, retain_graph=True)  # logits are shared
    for a, b, name in zip(got_grads, torch.autograd.grad(want, (q, k, v, sinks), grad), ("dq", "dk", "dv", "dsinks")):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)
    assert got_grads[3].abs().min() > 1e-3  # every head's sink takes a gradient


@pytest.mark.parametrize("variant", ["l2", "fenchel"])
def test_flex_backends_declare_the_extras(variant):
    """The dispatcher hands softcap, sinks and window_size to the flex backends instead of declining them
    (window: the band is not folded into a dense mask)."""
    assert {"softcap", "sinks", "window_size"} <= dispatch.backend_table(variant)["flex"].extras


# variant, nq, nk, causal, window, softcap, sinks, mask ("bool_empty_row", "float", "log_u" or None)
CASES = [
    ("l2", 40, 48, True, (9, -1), 2.0, True, None),
    ("fenchel", 48, 48, False, (5, 3), 1.5, False, "bool_empty_row"),
    ("fenchel", 56, 40, True, (6, -1), None, True, "float"),
    ("fenchel", 160, 160, True, (20, 0), 3.0, True, "log_u"),
]


@pytest.mark.skipif(os.environ.get("ATTNZOO_FLEX_CPU") != "1" or not flex_available(),
                    reason="opt-in (ATTNZOO_FLEX_CPU=1): compiles FlexAttention for CPU, ~1-3 min")
@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[1]}x{c[2]}-{c[4]}-{c[7]}" for c in CASES])
def test_flex_forward_with_extras_matches_float64_on_cpu(case, monkeypatch):
    """The compiled CPU kernel; with sinks FlexAttention's eager implementation (torch 2.14's CPU
    compile cannot return the log-sum-exp the sinks need: "return_lse is not supported yet")."""
    from torch.nn.attention.flex_attention import flex_attention as eager_flex

    from attnzoo.ops.fenchel.backends import fenchel_flex
    from attnzoo.ops.kernels import flex
    from attnzoo.ops.l2.backends import l2_flex
    variant, nq, nk, causal, window, softcap, with_sinks_, mask_kind = case
    if with_sinks_:
        monkeypatch.setattr(flex, "compiled_flex_attention", lambda: eager_flex)
    B, H, D, scale = 2, 2, 8, 0.35
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(B, H, n, D, generator=g, dtype=torch.float64) for n in (nq, nk, nk))
    sinks = torch.tensor([0.3, -0.4], dtype=torch.float64) if with_sinks_ else None
    allow = band_allowed(nq, nk, window, causal).expand(B, H, nq, nk)
    add = torch.zeros(B, H, nq, nk, dtype=torch.float64)
    kw = {}
    mask = None
    if mask_kind == "bool_empty_row":
        mask = torch.rand(B, 1, nq, nk, generator=g) > 0.3
        mask[:, :, 3] = False
        allow = allow & mask
    elif mask_kind == "float":
        mask = torch.randn(1, H, nq, nk, generator=g, dtype=torch.float64)
        mask[..., ::4] = -math.inf
        allow = allow & (mask > -math.inf)
        add = add + torch.where(mask > -math.inf, mask, torch.zeros_like(mask))
    elif mask_kind == "log_u":
        log_u = torch.randn(1, H, 1, nk, generator=g, dtype=torch.float64)
        add = add + log_u
        kw["log_u"] = log_u.float()
    if variant == "l2":
        logits = -scale * ((q[:, :, :, None] - k[:, :, None]) ** 2).sum(-1)
    else:
        logits = scale * q @ k.transpose(-1, -2)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    want = attend(logits + add, allow, v, sinks)
    fn = l2_flex if variant == "l2" else fenchel_flex
    mask32 = mask if mask is None or mask.dtype == torch.bool else mask.float()
    with torch.no_grad():
        got = fn(q.float(), k.float(), v.float(), attn_mask=mask32, is_causal=causal, scale=scale, softcap=softcap,
                 sinks=None if sinks is None else sinks.float(), window_size=window, **kw)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)
