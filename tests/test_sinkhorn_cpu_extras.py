"""Sinkhorn's "cpu" streaming backend with softcap and a non-causal window (issue 29): every pass caps the
logits itself, and a window's passes visit only the tiles that meet the band. Tiny shapes, 16-row tiles
(``small_tiles``): the shapes cross several tiles, the windows are narrower and wider than one.

The float64 formulas are written here from docs/usage.md and docs/kernels_sinkhorn.md, not from the code:

    L_ij = cap(-scale |q_i - k_j|^2 / (2 eps)) (cost l2) or cap(scale q_i.k_j / eps) (dot), cap(s) =
    softcap tanh(s / softcap), then + a float mask; key j takes part for query i iff the mask keeps it and
    i + off - left <= j <= i + off + right (off = Nk - Nq, -1 unbounded);
    f = -lse_j(L + g), g = log(Nq / Nk) - lse_i(L + f), n_iters times from g = 0, out = softmax_j(L + g) v
    (an empty row or column: lse = 0, a zero output row).

Causal (no window): row i is the last row of that Sinkhorn on queries 0..i and keys 0..i + off (the prefix
rule); causal with a window of left w: on keys max(0, i + off - w)..i + off and the queries of those
positions.
"""
from __future__ import annotations

import math

import pytest
import torch

import attnzoo
import attnzoo.functional as AF
from attnzoo.ops.sinkhorn import cpu
from tests.sinkhorn_math import (assert_planted_nan_skipped, causal64, in_window, tiles_outside_every_band,
                                  windowed64, with_planted_nan)

D = 8
SCALE = D ** -0.5
NAMES = ["out", "dq", "dk", "dv"]


# --- helpers (the float64 formulas: tests/sinkhorn_math.py) ---------------------------------------------

@pytest.fixture
def small_tiles(monkeypatch):
    """16 x 16 tiles for the "cpu" backend at these sizes (its smallest side)."""
    monkeypatch.setattr(cpu, "TILE_ELEMENTS", 64)


def inputs(H, nq, nk, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, H, n, D, generator=g, dtype=torch.float64) for n in (nq, nk, nk))
    return q, k, v, torch.randn(1, H, nq, D, generator=g, dtype=torch.float64)


def run(fn, tensors, dout):
    """(out, dq, dk, dv) of fn on fresh leaves."""
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    out = fn(*leaves)
    return [out, *torch.autograd.grad(out, leaves, dout)]


def assert_all_close(got, want, tol=1e-10):
    for name, a, b in zip(NAMES, got, want):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=name)


def key_padding(nk, seed):
    keep = torch.rand(1, 1, 1, nk, generator=torch.Generator().manual_seed(seed)) > 0.25
    keep[..., -1] = True
    return keep


def pair_mask(kind, nq, nk, seed):
    """A bool mask with an empty row and an empty key column, or a float one with -inf entries."""
    g = torch.Generator().manual_seed(seed)
    if kind == "bool":
        mask = torch.rand(nq, nk, generator=g) > 0.3
        mask[3] = False
        mask[:, 5] = False
        return mask
    return torch.randn(nq, nk, generator=g).masked_fill(torch.rand(nq, nk, generator=g) < 0.2, -math.inf)


# --- softcap, non-causal and causal ----------------------------------------------------------------------

# (label, H, Nq, Nk, mask, cost, softcap, eps)
SOFTCAP_CASES = [
    ("l2", 2, 37, 37, None, "l2", 1.5, 1.0),
    ("dot_bool_mask_longer_keys", 1, 21, 40, "bool", "dot", 0.7, 0.5),
    ("l2_float_mask_more_queries", 1, 40, 27, "float", "l2", 2.0, 1.0),
    ("dot_key_padding", 2, 33, 33, "keys", "dot", 1.0, 1.0),
]


@pytest.mark.parametrize("case", SOFTCAP_CASES, ids=[c[0] for c in SOFTCAP_CASES])
def test_softcap_forward_and_gradients_are_the_formula(case, small_tiles):
    label, H, nq, nk, mask_kind, cost, softcap, eps = case
    q, k, v, dout = inputs(H, nq, nk, seed=len(label))
    mask = key_padding(nk, 2) if mask_kind == "keys" else None if mask_kind is None else pair_mask(mask_kind, nq,
                                                                                                    nk, 3)
    kw = dict(attn_mask=mask, cost=cost, eps=eps, n_iters=2)
    got = run(lambda *t: AF.sinkhorn(*t, backend="cpu", softcap=softcap, **kw), (q, k, v), dout)
    want = run(lambda *t: windowed64(*t, mask=mask, cost=cost, eps=eps, softcap=softcap), (q, k, v), dout)
    assert_all_close(got, want)
    # the cap moved every output (logits of size ~2-4 under caps of 0.7-2): a pass ignoring it fails above
    plain = run(lambda *t: windowed64(*t, mask=mask, cost=cost, eps=eps), (q, k, v), dout)
    assert all((a - b).abs().max() > 1e-3 for a, b in zip(plain, want))


@pytest.mark.parametrize("nq,nk,cost", [(9, 9, "l2"), (7, 11, "dot")])
def test_softcap_causal_prefix_rule(nq, nk, cost, small_tiles):
    q, k, v, dout = inputs(1, nq, nk, seed=nq)
    got = run(lambda *t: AF.sinkhorn(*t, is_causal=True, softcap=0.8, cost=cost, n_iters=2, backend="cpu"),
              (q, k, v), dout)
    want = run(lambda *t: causal64(*t, cost=cost, softcap=0.8), (q, k, v), dout)
    assert_all_close(got, want)


@pytest.mark.parametrize("nq,nk,left", [(40, 40, 5), (30, 37, 3)])
def test_softcap_causal_window_batches(nq, nk, left, small_tiles, monkeypatch):
    """The batched window problems (causal_window.py) call the non-causal run: the cap reaches them."""
    monkeypatch.setattr(cpu, "causal_by_prefix", lambda *a, **k: pytest.fail("ran the prefix loop"))
    q, k, v, dout = inputs(1, nq, nk, seed=left)
    got = run(lambda *t: AF.sinkhorn(*t, is_causal=True, window_size=(left, 0), softcap=0.6, n_iters=2,
                                     backend="cpu"), (q, k, v), dout)
    want = run(lambda *t: causal64(*t, left=left, softcap=0.6), (q, k, v), dout)
    assert_all_close(got, want)


def test_implicit_backward_refuses_softcap():
    q = torch.randn(1, 1, 6, D)
    with pytest.raises(ValueError, match="softcap"):
        cpu.sinkhorn_attention(q, q, q, softcap=1.0, grad_mode="implicit")
    with pytest.raises(ValueError, match="softcap"):
        AF.sinkhorn(q, q, q, softcap=1.0, backend="cpu_implicit")


def test_auto_picks_cpu_for_a_capped_call_and_names_it():
    q = torch.randn(1, 1, 2048, 4)
    k = torch.randn(1, 1, 1024, 4)   # Nq * Nk = 2^21: auto's size for the streaming path
    choice = attnzoo.explain("sinkhorn", q, k, k, softcap=2.0)
    assert choice.backend.name == "cpu"
    assert attnzoo.explain("sinkhorn", q, k, k, softcap=2.0, backend="cpu").backend.name == "cpu"
    assert "softcap" in choice.backend.extras


# --- non-causal windows: only the band's tiles -----------------------------------------------------------

# (label, H, Nq, Nk, window, mask, softcap, cost)
WINDOW_CASES = [
    ("left_only", 1, 40, 40, (5, 0), None, None, "l2"),
    ("right_only_longer_keys", 1, 21, 50, (0, 7), None, None, "dot"),
    ("left_unbounded_key_padding", 2, 50, 33, (-1, 4), "keys", None, "l2"),
    ("right_unbounded_softcap", 1, 36, 36, (6, -1), None, 1.5, "dot"),
    ("two_sided_wider_than_a_tile_float_mask_softcap", 1, 33, 45, (20, 3), "float", 2.0, "l2"),
    ("two_sided_bool_mask_more_queries", 1, 45, 30, (4, 4), "bool", None, "l2"),
]


@pytest.mark.parametrize("case", WINDOW_CASES, ids=[c[0] for c in WINDOW_CASES])
def test_window_forward_and_gradients_are_the_formula(case, small_tiles):
    label, H, nq, nk, window, mask_kind, softcap, cost = case
    q, k, v, dout = inputs(H, nq, nk, seed=len(label))
    mask = key_padding(nk, 3) if mask_kind == "keys" else None if mask_kind is None else pair_mask(mask_kind, nq,
                                                                                                    nk, 4)
    kw = dict(attn_mask=mask, softcap=softcap, cost=cost, n_iters=2)
    got = run(lambda *t: AF.sinkhorn(*t, window_size=window, backend="cpu", **kw), (q, k, v), dout)
    want = run(lambda *t: windowed64(*t, window, mask, cost, softcap=softcap), (q, k, v), dout)
    assert_all_close(got, want)
    plain = windowed64(q, k, v, (-1, -1), mask, cost, softcap=softcap)   # the window changes the answer
    assert (plain - want[0]).abs().max() > 0.05 * want[0].abs().max()


def test_window_equals_the_folded_mask_with_empty_rows_and_columns(small_tiles):
    """Queries 0..19 see no key and keys 0..1 no query: the band gives what the folded mask gives (zero
    rows, zero gradients there), the rest to float64 roundoff."""
    q, k, v, dout = inputs(1, 40, 20, seed=2)
    window = (2, 0)
    band = in_window(window, 40, 20)
    native = run(lambda *t: AF.sinkhorn(*t, window_size=window, backend="cpu", n_iters=2), (q, k, v), dout)
    folded = run(lambda *t: AF.sinkhorn(*t, attn_mask=band, backend="cpu", n_iters=2), (q, k, v), dout)
    assert_all_close(native, folded, tol=1e-12)
    for name, a, b, empty in zip(NAMES, native, folded, [slice(0, 20), slice(0, 20), slice(0, 0), slice(0, 0)]):
        assert torch.equal(a[..., empty, :], b[..., empty, :]), name
    assert native[0][..., :20, :].abs().max() == 0
    assert_all_close(native, run(lambda *t: windowed64(*t, window), (q, k, v), dout))


@pytest.mark.parametrize("side", ["keys", "queries"])
def test_window_skips_the_tiles_outside_every_band(side, small_tiles):
    """NaN planted in whole 16-row tiles no band reaches: the banded "cpu" passes never compute them
    (tests/sinkhorn_math.assert_planted_nan_skipped), the folded mask does."""
    nq, nk, window, rows, planted, own = tiles_outside_every_band(side)
    q, k, v, dout = inputs(1, nq, nk, seed=9)
    dirty = with_planted_nan((q, k, v), planted, rows)
    call = lambda *t: AF.sinkhorn(*t, window_size=window, softcap=1.5, backend="cpu", n_iters=2)
    folded = run(lambda *t: AF.sinkhorn(*t, attn_mask=in_window(window, nq, nk), softcap=1.5, backend="cpu",
                                        n_iters=2), dirty, dout)
    assert_planted_nan_skipped(run(call, (q, k, v), dout), run(call, dirty, dout), folded, rows, own)


def test_window_work_is_linear_in_n(monkeypatch):
    """A pass computes about 2 N w logits, not N^2: the logits of one forward and backward, counted tile by
    tile, at N = 256 under a window of (8, 8) (band of 17 keys; the tiles the band asks for: 16 x 32)."""
    sizes = []
    tile = cpu.TorchEngine._tile
    monkeypatch.setattr(cpu.TorchEngine, "_tile", lambda self, p, *a, **kw: sizes.append(
        (a[0].stop - a[0].start) * (a[1].stop - a[1].start)) or tile(self, p, *a, **kw))
    n, n_iters = 256, 2
    q, k, v, dout = inputs(1, n, n, seed=1)
    run(lambda *t: AF.sinkhorn(*t, window_size=(8, 8), n_iters=n_iters, backend="cpu"), (q, k, v), dout)
    passes = (2 * n_iters + 1) + (2 * n_iters + 1)   # forward; backward: dv, the adjoint's 2 n_iters - 1, dq/dk
    per_pass = sum(sizes) / passes
    assert per_pass <= n * 2 * 17, per_pass
    assert per_pass < n * n / 3


def test_implicit_backward_walks_the_band_as_the_folded_mask(small_tiles):
    """A direct call with grad_mode="implicit" and a window walks the band too (the Neumann series' passes
    included): the folded mask's output and gradients to float64 roundoff."""
    q, k, v, dout = inputs(1, 40, 40, seed=5)
    kw = dict(scale=SCALE, eps=4.0, n_iters=40, grad_mode="implicit")   # near the fixed point: the series converges
    native = run(lambda *t: cpu.sinkhorn_attention(*t, window_size=(12, 12), **kw), (q, k, v), dout)
    folded = run(lambda *t: cpu.sinkhorn_attention(*t, attn_mask=in_window((12, 12), 40, 40), **kw), (q, k, v),
                 dout)
    assert_all_close(native, folded, tol=1e-9)
