"""Sinkhorn's sliding window in the Triton kernels (issue 29), under TRITON_INTERPRET=1 (16 x 16 tiles: the
shapes below cross several tiles, and the windows are narrower and wider than one).

The float64 formulas here are written from docs/usage.md and docs/kernels_sinkhorn.md, not from the code:

    L_ij = cap(-scale |q_i - k_j|^2 / (2 eps)) (cost l2) or cap(scale q_i.k_j / eps) (dot), + a float mask;
    key j takes part for query i iff the mask keeps it and i + off - left <= j <= i + off + right
    (off = Nk - Nq, -1 unbounded): non-causal, the band is a mask of the transport problem;
    f = -lse_j(L + g), g = log(Nq / Nk) - lse_i(L + f), n_iters times from g = 0, out = softmax_j(L + g) v
    (an empty row or column: lse = 0, a zero output row).

Causal with a window of left w: row i is the last row of Sinkhorn solved, non-causally and unmasked, on the
tokens it sees: keys max(0, i + off - w)..i + off and the queries of those positions (the rule of
docs/usage.md; the formula checks it against the reference backend's prefix problems too).
"""
from __future__ import annotations

import math

import pytest
import torch

import attnzoo.functional as AF
from tests.sinkhorn_math import (assert_planted_nan_skipped, causal64, in_window, logits,
                                  tiles_outside_every_band, windowed64, with_planted_nan)
from tests.common import needs_interpreter
from tests.flash_rule import assert_flash_rule

pytestmark = needs_interpreter

D = 8


# --- helpers (the float64 formulas: tests/sinkhorn_math.py) ---------------------------------------------

def inputs(H, nq, nk, seed, spread=1.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, H, nq, D, generator=g, dtype=torch.float64) * spread
    k = torch.randn(1, H, nk, D, generator=g, dtype=torch.float64) * spread
    v = torch.randn(1, H, nk, D, generator=g, dtype=torch.float64)
    dout = torch.randn(1, H, nq, D, generator=g, dtype=torch.float64)
    return q, k, v, dout


def run(fn, tensors, dtype, dout):
    """(out, dq, dk, dv) of fn on copies of the inputs (rounded to dtype, then in ``dtype``)."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in tensors]
    out = fn(*leaves)
    return [out, *torch.autograd.grad(out, leaves, dout.to(out.dtype))]


def rounded(tensors, dtype):
    return [t.to(dtype).double() for t in tensors]   # the rule does not count the inputs' rounding


def key_padding(nk, seed):
    keep = torch.rand(1, 1, 1, nk, generator=torch.Generator().manual_seed(seed)) > 0.25
    keep[..., -1] = True
    return keep


def check(label, dtype, q, k, v, dout, want_fn, kw, logit_size=5.0):
    q, k, v = rounded((q, k, v), dtype)
    want = run(want_fn, [q, k, v], torch.float64, dout)
    got = run(lambda *t: AF.sinkhorn(*t, backend="triton", **kw), [q, k, v], dtype, dout)
    low = run(lambda *t: AF.sinkhorn(*t, backend="reference", **kw), [q, k, v], dtype, dout)
    assert_flash_rule(label, dtype, logit_size, zip(["out", "dq", "dk", "dv"], got, low, want))
    return got, want


# --- non-causal windows: forward and gradients against float64 ---------------------------------------------

# (label, H, Nq, Nk, window, mask, softcap, cost, eps)
CASES = [
    ("left_only_l2", 1, 40, 40, (5, 0), None, None, "l2", 1.0),
    ("right_only_dot_longer_keys", 1, 21, 50, (0, 7), None, None, "dot", 1.0),
    ("unbounded_left_key_padding", 2, 50, 33, (-1, 4), "keys", None, "l2", 1.0),
    ("unbounded_right_softcap_dot", 1, 36, 36, (6, -1), None, 1.5, "dot", 0.5),
    ("two_sided_float_mask_softcap_l2", 1, 33, 45, (10, 3), "float", 2.0, "l2", 1.0),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_window_fp32_forward_and_gradients(case):
    label, H, nq, nk, window, mask_kind, softcap, cost, eps = case
    q, k, v, dout = inputs(H, nq, nk, seed=len(label))
    mask = None
    if mask_kind == "keys":
        mask = key_padding(nk, 3)
    elif mask_kind == "float":
        g = torch.Generator().manual_seed(4)
        mask = torch.randn(nq, nk, generator=g).masked_fill(torch.rand(nq, nk, generator=g) < 0.2, -math.inf)
    kw = dict(window_size=window, attn_mask=mask, softcap=softcap, cost=cost, eps=eps, n_iters=2)
    got, want = check(label, torch.float32, q, k, v, dout,
                      lambda *t: windowed64(*t, window, mask, cost, eps, softcap), kw)
    # the window changes the answer (a test of the band, not of the plain call)
    plain = windowed64(*rounded((q, k, v), torch.float32), (-1, -1), mask, cost, eps, softcap)
    assert (plain - want[0]).abs().max() > 0.05 * want[0].abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_window_half_precision_flash_rule(dtype):
    q, k, v, dout = inputs(1, 37, 29, seed=11)
    mask = key_padding(29, 5)
    window = (6, 2)
    check(f"window {dtype}", dtype, q, k, v, dout, lambda *t: windowed64(*t, window, mask),
          dict(window_size=window, attn_mask=mask, n_iters=2))


def test_window_at_extreme_logits_small_eps():
    """eps 0.05 with logits in the thousands: the shifted sums' bounds come from the plans, which the band
    does not change (a second walk with a running maximum catches the rows they leave too loose). The
    output and dv within the rule of float64; the gradients of this saturated plan through q and k are
    ~1e-9 in float64, below what the fp32 backward resolves (as without a window: test_fused_sinkhorn),
    so dq, dk are checked finite and equal to the folded-mask call's."""
    q, k, v, dout = inputs(1, 34, 34, seed=8, spread=6.0)
    q, k, v = rounded((q, k, v), torch.float32)
    window = (5, 2)
    kw = dict(eps=0.05, n_iters=2, backend="triton")
    want = run(lambda *t: windowed64(*t, window, eps=0.05), [q, k, v], torch.float64, dout)
    low = run(lambda *t: AF.sinkhorn(*t, window_size=window, eps=0.05, n_iters=2, backend="reference"), [q, k, v],
              torch.float32, dout)
    got = run(lambda *t: AF.sinkhorn(*t, window_size=window, **kw), [q, k, v], torch.float32, dout)
    folded = run(lambda *t: AF.sinkhorn(*t, attn_mask=in_window(window, 34, 34), **kw), [q, k, v], torch.float32,
                 dout)
    logit_size = float(logits(q, k, "l2", 0.05, None).abs().max())
    assert logit_size > 1e3
    assert_flash_rule("extreme", torch.float32, logit_size, [("out", got[0], low[0], want[0]),
                                                            ("dv", got[3], low[3], want[3])])
    for name, a, b in zip(["out", "dq", "dk", "dv"], got, folded):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=name)


def test_window_equals_the_folded_mask_with_empty_rows_and_columns():
    """The band in the kernels gives what the band folded into the mask gives, including rows with no key
    (queries 0..19 here: a zero output row) and keys in no row's band."""
    q, k, v, dout = inputs(1, 40, 20, seed=2)
    window = (2, 0)
    band = in_window(window, 40, 20)
    native = run(lambda *t: AF.sinkhorn(*t, window_size=window, backend="triton", n_iters=2), [q, k, v],
                 torch.float32, dout)
    folded = run(lambda *t: AF.sinkhorn(*t, attn_mask=band, backend="triton", n_iters=2), [q, k, v],
                 torch.float32, dout)
    for name, a, b in zip(["out", "dq", "dk", "dv"], native, folded):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=name)
    assert native[0][..., :20, :].abs().max() == 0
    want = windowed64(q, k, v, window)
    torch.testing.assert_close(native[0].double(), want, rtol=1e-5, atol=1e-5)


def test_window_is_taken_by_the_triton_backend_itself():
    from attnzoo.ops import variant as catalog
    q = torch.randn(1, 1, 5, D)
    choice = catalog.explain("sinkhorn", q, q, q, window_size=(2, 1), backend="triton")
    assert choice.backend.name == "triton"
    assert "window_size" in choice.backend.extras


@pytest.mark.parametrize("cost,dtype", [("l2", torch.float32), ("dot", torch.bfloat16)])
def test_window_on_a_kept_plan_equals_the_general_route(cost, dtype, monkeypatch):
    """A repeated windowed call runs its plan's bound launches (ops/sinkhorn/bound.py: the band bound into
    every pass, g^0 and delta from row-dot launches): the general route's numbers, bit for bit."""
    from attnzoo.ops import plan
    from attnzoo.ops.sinkhorn import bound
    from attnzoo.ops.sinkhorn.triton import sinkhorn_attention
    ran = []
    forward = bound.BoundSinkhorn.forward
    monkeypatch.setattr(bound.BoundSinkhorn, "forward", lambda self, *a: ran.append(1) or forward(self, *a))
    q, k, v, dout = inputs(1, 33, 24, seed=12)
    mask = key_padding(24, 2)
    kw = dict(window_size=(5, 3), attn_mask=mask, cost=cost, n_iters=2)
    plan.clear()
    kept = run(lambda *t: AF.sinkhorn(*t, backend="triton", **kw), [q, k, v], dtype, dout)
    assert ran
    general = run(lambda *t: sinkhorn_attention(*t, **kw), [q, k, v], dtype, dout)
    for name, a, b in zip(["out", "dq", "dk", "dv"], kept, general):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("side", ["keys", "queries"])
def test_window_skips_the_tiles_outside_every_band(side):
    """NaN planted in whole 16-row tiles no band reaches: the banded Triton passes never load them
    (tests/sinkhorn_math.assert_planted_nan_skipped), the folded mask does."""
    nq, nk, window, rows, planted, own = tiles_outside_every_band(side)
    q, k, v, dout = inputs(1, nq, nk, seed=9)
    dirty = with_planted_nan((q, k, v), planted, rows)
    call = lambda *t: AF.sinkhorn(*t, window_size=window, backend="triton", n_iters=2)
    folded = run(lambda *t: AF.sinkhorn(*t, attn_mask=in_window(window, nq, nk), backend="triton", n_iters=2),
                 dirty, torch.float32, dout)
    assert_planted_nan_skipped(run(call, [q, k, v], torch.float32, dout), run(call, dirty, torch.float32, dout),
                               folded, rows, own)


# --- causal + window: each row's window problem, batched ---------------------------------------------------

# (label, Nq, Nk, left, right, cost, softcap)
CAUSAL_CASES = [
    ("square_l2", 12, 12, 3, 0, "l2", None),
    ("longer_keys_dot_softcap", 9, 14, 4, 3, "dot", 2.0),
    ("more_queries", 13, 9, 2, -1, "l2", None),
    ("left_zero", 5, 5, 0, 0, "l2", None),
]


@pytest.mark.parametrize("case", CAUSAL_CASES, ids=[c[0] for c in CAUSAL_CASES])
def test_causal_window_rows_are_their_window_problems(case, monkeypatch):
    from attnzoo.ops.sinkhorn import triton as st
    label, nq, nk, left, right, cost, softcap = case
    q, k, v, dout = inputs(1, nq, nk, seed=len(label))
    q, k, v = rounded((q, k, v), torch.float32)
    calls = []
    fwd = st.sinkhorn_fwd
    monkeypatch.setattr(st, "sinkhorn_fwd", lambda *a: calls.append(a[0].shape) or fwd(*a))
    monkeypatch.setattr(st, "causal_by_prefix", lambda *a, **k: pytest.fail("ran the prefix loop"))
    kw = dict(is_causal=True, window_size=(left, right), cost=cost, softcap=softcap, n_iters=2)
    want_fn = lambda *t: causal64(*t, left, cost=cost, softcap=softcap)
    got, want = check(label, torch.float32, q, k, v, dout, want_fn, kw)
    # O(1) calls (short rows, full rows: each forward once, and once more recomputed by the backward)
    assert len(calls) <= 4, calls
    assert all(shape[-2] == left + 1 for shape in calls)
    # the formula's window problems are the package's rule (the reference backend's prefix problems)
    ref = AF.sinkhorn(q, k, v, backend="reference", **kw)
    torch.testing.assert_close(ref, want[0], rtol=1e-10, atol=1e-10)


def test_causal_window_with_a_mask_keeps_the_prefix_rule():
    """With a per-pair attn_mask the band is folded into it and each row runs its prefix problem by
    masking.coupled_causal_rows (exact; the windows are not sliced). A per-key mask is sliced:
    tests/test_sinkhorn_causal_window.py."""
    q, k, v, _ = inputs(1, 12, 12, seed=5)
    mask = torch.rand(12, 12, generator=torch.Generator().manual_seed(6)) > 0.25
    kw = dict(is_causal=True, window_size=(3, 0), attn_mask=mask, n_iters=2)
    got = AF.sinkhorn(q.float(), k.float(), v.float(), backend="triton", **kw)
    want = AF.sinkhorn(q, k, v, backend="reference", **kw)
    torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=2e-5)


def test_the_gpu_speed_grid_times_sinkhorn_windows():
    """`attnzoo bench`'s speed grid has a Sinkhorn window row on the Triton backend at long N (no SDPA or
    Flex row for it: they compute softmax, not this attention)."""
    from attnzoo.bench import speed_grid
    from attnzoo.bench.flops import Shape
    from attnzoo.bench.problem import Problem
    cases = [c for c in speed_grid.speed_cases(torch.device("cuda")) if "sinkhorn+window" in c.label]
    assert [c.label for c in cases] == ["sinkhorn+window256 / triton"]
    long = Problem(Shape(batch=1, heads=16, seq_q=16384, head_dim=128), torch.bfloat16, torch.device("cuda"),
                   "fwd+bwd", True)
    assert cases[0].applies(long) and cases[0].spec.kwargs["window_size"] == (255, 0)
