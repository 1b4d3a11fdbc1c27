"""Linear attention under a sliding window on the "band" backend (ops/linear/band.py, O(N w)) against
float64 math written here from the formula: out_i = sum_{j in band_i} w_ij v_j / (sum_{j in band_i} w_ij
+ 1e-6), w_ij = phi(q_i) . phi(k_j) * keep_j * exp(bias_j) (elu + 1, relu), or (1 / n_i) sum (q_i . k_j)
v_j over the n_i kept keys of the band (identity, paper 002 eq 2.2); band_i = {j : -left <= j - (i + Nk -
Nq) <= right}, right capped at 0 by is_causal."""
from __future__ import annotations

import math

import pytest
import torch

import attnzoo
import attnzoo.functional as AF
from attnzoo.ops.linear.band import BLOCK

PHI = {"elu": lambda x: torch.nn.functional.elu(x) + 1.0, "relu": torch.relu, "identity": lambda x: x}


def formula(q, k, v, window, is_causal, feature_map, keep=None, bias=None):
    nq, nk = q.shape[-2], k.shape[-2]
    rel = torch.arange(nk)[None, :] - torch.arange(nq)[:, None] - (nk - nq)    # j - (i + Nk - Nq)
    left, right = window
    band = torch.ones(nq, nk, dtype=torch.bool)
    if left >= 0:
        band &= rel >= -left
    if right >= 0:
        band &= rel <= right
    if is_causal:
        band &= rel <= 0
    if keep is not None:
        band = band & keep
    w = PHI[feature_map](q) @ PHI[feature_map](k).transpose(-1, -2)
    if bias is not None:
        w = w * torch.exp(bias)
    w = torch.where(band, w, torch.zeros((), dtype=w.dtype))
    if feature_map == "identity":
        return (w @ v) / band.sum(-1, keepdim=True).clamp_min(1).to(w.dtype)
    return (w @ v) / (w.sum(-1, keepdim=True) + 1e-6)


def _inputs(nq, nk, dtype=torch.float64, heads=(2, 2), seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, heads[0], nq, 8, generator=g, dtype=dtype)
    k, v = (torch.randn(2, heads[1], nk, 8, generator=g, dtype=dtype) for _ in range(2))
    return [t.requires_grad_() for t in (q, k, v)]


SHAPES = [(150, 150), (70, 2 * BLOCK + 3), (2 * BLOCK + 3, 70), (5, 5), (1, 40)]
WINDOWS = [((3, 0), True), ((0, 5), False), ((7, 2), False), ((100, 100), False), ((9, -1), True), ((4, 6), True)]


@pytest.mark.parametrize("feature_map", ["elu", "relu", "identity"])
@pytest.mark.parametrize("window,is_causal", WINDOWS, ids=lambda x: str(x))
@pytest.mark.parametrize("nq,nk", SHAPES)
def test_band_equals_the_formula_with_gradients(nq, nk, window, is_causal, feature_map):
    q, k, v = _inputs(nq, nk)
    kw = dict(is_causal=is_causal, window_size=window, feature_map=feature_map)
    assert attnzoo.explain("linear", q, k, v, **kw).backend.name == "band"
    out = AF.linear(q, k, v, **kw)
    ref = formula(q, k, v, window, is_causal, feature_map)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    for name, a, b in zip("qkv", got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10, msg=f"d{name}")


@pytest.mark.parametrize("feature_map", ["elu", "identity"])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_key_mask_inside_the_band(kind, feature_map):
    """Key padding (B, 1, 1, Nk) with the window: bool removes keys; float weighs them by exp(bias)
    (large biases included: the backend shifts them out of exp's overflow)."""
    q, k, v = _inputs(90, 90)
    g = torch.Generator().manual_seed(1)
    keep = torch.rand(2, 1, 1, 90, generator=g) > 0.3
    if kind == "bool":
        mask, bias = keep, None
    else:
        bias = torch.randn(2, 1, 1, 90, generator=g, dtype=torch.float64) * 3 + 200.0
        mask = bias.masked_fill(~keep, -math.inf)
    kw = dict(is_causal=True, window_size=(10, 0), feature_map=feature_map)
    assert attnzoo.explain("linear", q, k, v, attn_mask=mask, **kw).backend.name == "band"
    out = AF.linear(q, k, v, attn_mask=mask, **kw)
    ref = formula(q, k, v, (10, 0), True, feature_map, keep=keep,
                  bias=None if bias is None else bias.masked_fill(~keep, 0.0))   # exp(200) is finite in float64
    torch.testing.assert_close(out, ref, rtol=1e-8, atol=1e-9)


def test_grouped_heads_and_low_precision():
    q, k, v = _inputs(100, 100, heads=(4, 2))
    out = AF.linear(q, k, v, is_causal=True, window_size=(12, 0), enable_gqa=True)
    rep = [t.repeat_interleave(2, dim=1) for t in (k, v)]
    torch.testing.assert_close(out, formula(q, *rep, (12, 0), True, "elu"), rtol=1e-10, atol=1e-10)
    qb, kb, vb = (t.detach().to(torch.bfloat16) for t in (q, k, v))
    low = AF.linear(qb, kb.repeat_interleave(2, 1), vb.repeat_interleave(2, 1), is_causal=True, window_size=(12, 0))
    assert low.dtype == torch.bfloat16
    ref = formula(*(t.double() for t in (qb, kb.repeat_interleave(2, 1), vb.repeat_interleave(2, 1))), (12, 0),
                  True, "elu")
    assert (low.double() - ref).abs().max() < 3e-2 * ref.abs().max()


def test_nan_outside_the_band_stays_outside():
    q, k, v = _inputs(140, 140)
    clean = AF.linear(q, k, v, is_causal=True, window_size=(5, 0))
    k2 = k.detach().clone()
    k2[..., 0, :] = math.nan   # key 0 is outside the band of every query from 6 on
    dirty = AF.linear(q, k2, v, is_causal=True, window_size=(5, 0))
    assert torch.isnan(dirty[..., :6, :]).all(-1).all()
    torch.testing.assert_close(dirty[..., 6:, :], clean[..., 6:, :])


def test_query_masks_and_dropout_take_another_backend_unbounded_windows_the_band():
    q, k, v = _inputs(30, 30)
    for kw in (dict(window_size=(3, 2), attn_mask=torch.rand(30, 30) > 0.5), dict(window_size=(3, 0), dropout_p=0.5)):
        assert attnzoo.explain("linear", q, k, v, **kw).backend.name != "band", kw
    with pytest.raises(ValueError, match="query-dependent attn_mask"):
        AF.linear(q, k, v, window_size=(3, 2), attn_mask=torch.rand(30, 30) > 0.5, backend="band")
    assert attnzoo.explain("linear", q, k, v, window_size=(3, -1)).backend.name == "band"
    out = AF.linear(q, k, v, window_size=(3, -1))
    torch.testing.assert_close(out, formula(q, k, v, (3, -1), False, "elu"), rtol=1e-10, atol=1e-10)
    assert attnzoo.explain("linear", q, k, v).backend.name != "band"   # no window: cpu's O(N) forms
    torch.testing.assert_close(AF.linear(q, k, v, is_causal=True, backend="band"),
                               formula(q, k, v, (-1, -1), True, "elu"), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dims", [(0, 2), (2, 0)])
def test_no_batch_or_no_head(dims):
    q, k, v = (torch.randn(*dims, n, 8, requires_grad=True) for n in (3, 4, 4))
    out = AF.linear(q, k, v, window_size=(1, 1), backend="band")
    assert out.shape == (*dims, 3, 8)
    out.sum().backward()
    assert q.grad.shape == q.shape and v.grad.shape == v.shape


def test_the_gpu_speed_grid_times_the_band_against_the_folded_mask():
    from attnzoo.bench import speed_grid
    labels = [c.label for c in speed_grid.speed_cases(torch.device("cuda")) if c.label.startswith("linear+window")]
    assert labels == ["linear+window256 / band", "linear+window256 / reference"]
