"""Causal Sinkhorn under a sliding window with key padding, batched (issue 29 follow-up): backends "cpu"
and "triton" (interpreter) solve each row's window problem in batches, never the prefix loop, also with a
per-key mask, and give the float64 rule.

The rule (docs/usage.md, "Causal masks and variants that couple queries"), written out here for a mask
that holds one value per key (keep_j, bias_j) and a window of left w, off = Nk - Nq: row i is the last row
of Sinkhorn solved non-causally on
    keys    T_i = {j : i + off - w <= j <= i + off, keep_j},
    queries {r >= 0 : r + off in T_i} and query i itself (whatever keep_{i + off}),
each pair (r, j) taking part with the bias of the earlier token, bias_{min(r + off, j)} (the mask's value
for the later token seeing the earlier one). Row i with no key is a zero row.
"""
from __future__ import annotations

import math

import pytest
import torch

import attnzoo.functional as AF
from attnzoo.ops import plan
from tests.sinkhorn_math import lse
from tests.common import needs_interpreter

D = 4


def sinkhorn_last_row64(q, k, v, bias, n_iters):
    """Non-causal log-domain Sinkhorn (cost l2, eps 1, scale D^-1/2) on one small problem, its last row."""
    nq, nk = q.shape[-2], k.shape[-2]
    L = -(D ** -0.5) * ((q[:, None, :] - k[None, :, :]) ** 2).sum(-1) / 2 + bias
    g = torch.zeros(1, nk, dtype=L.dtype)
    for _ in range(n_iters):
        f = -lse(L + g, -1)
        g = math.log(nq / nk) - lse(L + f, -2)
    z = L + g
    return (torch.exp(z - lse(z, -1)) @ v)[-1]


def rule64(q, k, v, left, keep, bias, n_iters=2):
    """(B, H, Nq, Dv) by the rule above; keep, bias: (B, H, Nk)."""
    B, H, nq, nk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    off = nk - nq
    out = torch.zeros(B, H, nq, v.shape[-1], dtype=torch.float64)
    rows = []
    for b in range(B):
        for h in range(H):
            for i in range(nq):
                keys = [j for j in range(max(0, i + off - left), i + off + 1) if keep[b, h, j]]
                if not keys:
                    rows.append(out[b, h, i])
                    continue
                queries = [j - off for j in keys if 0 <= j - off != i] + [i]   # query i last (keys before 0 - off: no query)
                pair_bias = torch.stack([torch.stack([bias[b, h, min(r + off, j)] for j in keys])
                                         for r in queries])
                rows.append(sinkhorn_last_row64(q[b, h, queries], k[b, h, keys], v[b, h, keys], pair_bias, n_iters))
    return torch.stack(rows).reshape(B, H, nq, -1)


def inputs(B, H, nq, nk, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, n, D, generator=g, dtype=torch.float64) for n in (nq, nk, nk))
    keep = torch.rand(B, 1, 1, nk, generator=g) > 0.3
    keep[0, 0, 0, 1] = keep[-1, 0, 0, -2] = False   # padded tokens inside every case
    bias = torch.randn(B, 1, 1, nk, generator=g, dtype=torch.float64)
    dout = torch.randn(B, H, nq, D, generator=g, dtype=torch.float64)
    return q, k, v, keep, bias, dout


def key_mask(kind, keep, bias, nq):
    if kind == "bool":
        return keep, torch.zeros_like(bias)
    if kind == "float":   # -inf for a padded key, a bias per key elsewhere
        return bias.masked_fill(~keep, -math.inf), bias
    # the same bool mask broadcast over the query rows (stride 0): still one value per key
    return keep.expand(-1, -1, nq, -1), torch.zeros_like(bias)


def grads(fn, tensors, dout):
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    out = fn(*leaves)
    return [out, *torch.autograd.grad(out, leaves, dout.to(out.dtype))]


@pytest.fixture
def no_prefix_loop(monkeypatch):
    from attnzoo.ops.sinkhorn import cpu, triton as st
    plan.clear()
    for module in (cpu, st):
        monkeypatch.setattr(module, "causal_by_prefix", lambda *a, **k: pytest.fail("ran the prefix loop"))


# (label, B, H, Nq, Nk, left, mask kind)
CASES = [
    ("square_bool", 2, 2, 9, 9, 3, "bool"),
    ("longer_keys_float_bias", 2, 1, 7, 11, 2, "float"),
    ("more_queries_rows_broadcast", 2, 2, 11, 7, 3, "rows"),
    ("left_zero_float", 1, 2, 6, 6, 0, "float"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_cpu_causal_window_with_key_padding_is_the_rule(case, no_prefix_loop):
    label, B, H, nq, nk, left, kind = case
    q, k, v, keep, bias, dout = inputs(B, H, nq, nk, seed=len(label))
    mask, pair_bias = key_mask(kind, keep, bias, nq)
    full = lambda t: t.expand(B, H, 1, nk)[..., 0, :]
    kw = dict(is_causal=True, window_size=(left, 0), attn_mask=mask, n_iters=2)
    got = grads(lambda *t: AF.sinkhorn(*t, backend="cpu", **kw), [q, k, v], dout)
    want = grads(lambda *t: rule64(*t, left, full(keep), full(pair_bias)), [q, k, v], dout)
    for name, a, b in zip(["out", "dq", "dk", "dv"], got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=name)
    # the padding matters: the same window without the mask is far away
    plain = AF.sinkhorn(q, k, v, backend="cpu", is_causal=True, window_size=(left, 0), n_iters=2)
    assert (plain - want[0]).abs().max() > 1e-2


def test_the_rule_here_is_the_reference_backends():
    """The formula above is the package's rule: the reference backend (band folded into the mask, the
    prefix problems of masking.coupled_causal_rows) gives it too."""
    q, k, v, keep, bias, _ = inputs(2, 1, 7, 11, seed=3)
    mask = bias.masked_fill(~keep, -math.inf)
    ref = AF.sinkhorn(q, k, v, attn_mask=mask, is_causal=True, window_size=(2, 0), n_iters=2, backend="reference")
    torch.testing.assert_close(ref, rule64(q, k, v, 2, keep.expand(2, 1, 1, 11)[..., 0, :],
                                           bias.expand(2, 1, 1, 11)[..., 0, :]), rtol=1e-10, atol=1e-10)


def test_rows_with_every_window_key_padded_are_zero(no_prefix_loop):
    q, k, v, _, _, _ = inputs(1, 1, 8, 8, seed=5)
    keep = torch.tensor([True, False, False, False, True, True, True, True]).reshape(1, 1, 1, 8)
    out = AF.sinkhorn(q, k, v, attn_mask=keep, is_causal=True, window_size=(2, 0), n_iters=2, backend="cpu")
    assert out[..., 3, :].abs().max() == 0   # row 3 sees keys 1..3, all padded
    assert out[..., [0, 1, 2, 4], :].abs().min() > 0


def test_any_other_mask_keeps_the_prefix_loop(monkeypatch):
    """A per-pair mask is not sliced into windows: the exact prefix loop runs, equal to the reference."""
    from attnzoo.ops.sinkhorn import cpu
    plan.clear()
    calls = []
    real = cpu.causal_by_prefix
    monkeypatch.setattr(cpu, "causal_by_prefix", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, k, v, _, _, _ = inputs(1, 2, 8, 8, seed=6)
    mask = torch.rand(8, 8, generator=torch.Generator().manual_seed(1)) > 0.3
    kw = dict(attn_mask=mask, is_causal=True, window_size=(3, 0), n_iters=2)
    got = AF.sinkhorn(q, k, v, backend="cpu", **kw)
    assert calls
    torch.testing.assert_close(got, AF.sinkhorn(q, k, v, backend="reference", **kw), rtol=1e-10, atol=1e-10)


def test_cpu_takes_the_window_itself_and_a_non_causal_window_is_unchanged():
    """Auto on CPU runs a causal window on "cpu" with window_size (not folded by the call path); a
    non-causal window there walks the band's tiles (here one), bit for bit the folded call's numbers."""
    from attnzoo.ops import variant as catalog
    from attnzoo.ops.logit_extras import window_band
    q, k, v, keep, _, _ = inputs(1, 2, 9, 9, seed=7)
    choice = catalog.explain("sinkhorn", q, k, v, is_causal=True, window_size=(3, 0), attn_mask=keep)
    assert choice.backend.name == "cpu" and "window_size" in choice.backend.extras
    native = AF.sinkhorn(q, k, v, attn_mask=keep, window_size=(3, 1), n_iters=2, backend="cpu")
    folded = AF.sinkhorn(q, k, v, attn_mask=keep & window_band((3, 1), 9, 9), n_iters=2, backend="cpu")
    assert torch.equal(native, folded)


@needs_interpreter
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_triton_causal_window_with_key_padding_is_the_rule(kind, no_prefix_loop):
    """fp32 kernels against the float64 rule: the rule's fp32 floor (1e-5 on outputs of size ~1)."""
    q, k, v, keep, bias, dout = inputs(2, 1, 10, 12, seed=11 if kind == "bool" else 12)
    mask, pair_bias = key_mask(kind, keep, bias, 10)
    kw = dict(is_causal=True, window_size=(3, 0), attn_mask=mask if kind == "bool" else mask.float(), n_iters=2)
    got = grads(lambda *t: AF.sinkhorn(*t, backend="triton", **kw), [t.float() for t in (q, k, v)], dout)
    want = grads(lambda *t: rule64(*t, 3, keep.expand(2, 1, 1, 12)[..., 0, :], pair_bias.expand(2, 1, 1, 12)[..., 0, :]),
                 [q, k, v], dout)
    for name, a, b in zip(["out", "dq", "dk", "dv"], got, want):
        torch.testing.assert_close(a.double(), b, rtol=2e-5, atol=2e-5, msg=name)
