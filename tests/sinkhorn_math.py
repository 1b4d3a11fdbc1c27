"""Float64 helpers the Sinkhorn test files share (their formulas are written in each file)."""
from __future__ import annotations

import math

import torch


def lse(x, dim):
    """logsumexp over dim (keepdim) with 0 for a row of -inf only, and finite gradients there."""
    m = x.amax(dim, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    s = torch.exp(x - m).sum(dim, keepdim=True)
    return torch.where(s > 0, torch.log(torch.where(s > 0, s, torch.ones_like(s))) + m, torch.zeros_like(s))


def logits(q, k, cost, eps, softcap):
    """Sinkhorn's logits at scale D^-1/2: -|q_i - k_j|^2 / 2 (l2) or q_i.k_j (dot), over eps, capped."""
    scale = q.shape[-1] ** -0.5
    if cost == "l2":
        L = -scale * ((q[..., :, None, :] - k[..., None, :, :]) ** 2).sum(-1) / (2 * eps)
    else:
        L = scale * (q @ k.transpose(-1, -2)) / eps
    return L if softcap is None else softcap * torch.tanh(L / softcap)


def in_window(window, nq, nk):
    """Bool (nq, nk): key j in query i's band, -left <= j - (i + nk - nq) <= right (-1: unbounded)."""
    d = torch.arange(nk)[None, :] - torch.arange(nq)[:, None] - (nk - nq)
    left, right = window
    return ((d >= -left) | (left < 0)) & ((d <= right) | (right < 0))


def sinkhorn64(q, k, v, allow, add, cost, eps, softcap, n_iters):
    """Log-domain Sinkhorn (paper 002 sec 2.4) on the entries ``allow`` keeps, ``add`` added to the
    logits: n_iters (row, column) rounds from g = 0, columns to n_q / n_k, then the row softmax."""
    nq, nk = q.shape[-2], k.shape[-2]
    L = (logits(q, k, cost, eps, softcap) + add).masked_fill(~allow, -math.inf)
    g = torch.zeros(L.shape[:-2] + (1, nk), dtype=L.dtype)
    for _ in range(n_iters):
        f = -lse(L + g, -1)
        g = math.log(nq / nk) - lse(L + f, -2)
    z = L + g
    return torch.exp(z - lse(z, -1)).masked_fill(~allow, 0.0) @ v


def windowed64(q, k, v, window=(-1, -1), mask=None, cost="l2", eps=1.0, softcap=None, n_iters=2):
    """``sinkhorn64`` on the band of ``window`` and an SDPA-style ``mask`` (bool keeps, float added)."""
    allow = in_window(window, q.shape[-2], k.shape[-2])
    add = torch.zeros(())
    if mask is not None:
        allow = allow & (mask if mask.dtype == torch.bool else mask > -math.inf)
        if mask.is_floating_point():
            add = torch.where(mask > -math.inf, mask, torch.zeros_like(mask))
    return sinkhorn64(q, k, v, allow, add, cost, eps, softcap, n_iters)


def causal64(q, k, v, left=-1, cost="l2", eps=1.0, softcap=None, n_iters=2):
    """Causal Sinkhorn by the rule (docs/usage.md): row i is the last row of ``sinkhorn64`` on the tokens it
    sees, its prefix, or with a window of ``left`` the last left + 1 of them, and the queries of those
    tokens (with more queries than keys the first n_q - n_k have no token among the keys: in no row's
    problem); a row with no key is 0."""
    nq, nk = q.shape[-2], k.shape[-2]
    off = nk - nq
    rows = []
    for i in range(nq):
        if i + off < 0:
            rows.append(torch.zeros_like(v[..., :1, :]))
            continue
        ka, qa = (0, max(0, -off)) if left < 0 else (max(0, i + off - left), max(0, i - left, -off))
        qs, ks, vs = q[..., qa:i + 1, :], k[..., ka:i + off + 1, :], v[..., ka:i + off + 1, :]
        allow = torch.ones(qs.shape[-2], ks.shape[-2], dtype=torch.bool)
        rows.append(sinkhorn64(qs, ks, vs, allow, torch.zeros(()), cost, eps, softcap, n_iters)[..., -1:, :])
    return torch.cat(rows, -2)


NAMES = ("out", "dq", "dk", "dv")


def tiles_outside_every_band(side):
    """(nq, nk, window, planted rows, which of q, k, v get them, their own gradients) for a skip test:
    whole 16-row tiles no band reaches. "keys": query i sees keys i + 40..i + 48, so keys 0..31 are in
    no band; "queries": key j is seen by queries j + 40..j + 48, so queries 0..31 see no key."""
    if side == "keys":
        return 16, 64, (8, 0), slice(0, 32), (1, 2), ("dk", "dv")
    return 64, 16, (0, 8), slice(0, 32), (0,), ("dq",)


def with_planted_nan(tensors, planted, rows):
    """Copies of ``tensors`` (q, k, v) with NaN in ``rows`` of those at the ``planted`` positions."""
    dirty = [t.clone() for t in tensors]
    for i in planted:
        dirty[i][..., rows, :] = math.nan
    return dirty


def assert_planted_nan_skipped(clean, got, folded, rows, own, n=64):
    """A banded call that never visits the planted tiles: outputs and every gradient outside the planted
    rows' own equal the clean run's and are finite; the folded-mask call, which visits them (0 * NaN in
    the plan @ v and dL^T products), shows NaN somewhere, so the test can fail."""
    keep = torch.ones(n, dtype=torch.bool)
    keep[rows] = False
    outside = lambda name, a: a[..., keep, :] if name in own else a
    for name, a, b in zip(NAMES, clean, got):
        assert torch.isfinite(outside(name, b)).all(), name
        assert torch.equal(outside(name, a), outside(name, b)), name
    assert any(torch.isnan(outside(name, a)).any() for name, a in zip(NAMES, folded))
