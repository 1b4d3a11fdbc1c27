"""OT Triton kernels skip the tiles a mask or causal empties (ops/ot/triton_kernels.py, _key_range).

_exp_kernel writes, per query, the range [lo, hi) of the keys it keeps; the pair, out, dC and dG
kernels visit only the template and source tiles of their rows' ranges plus the extra templates.
These tests check the ranges against the mask (so a skip that never happens, or a range that is
too small, fails here), and that out and every gradient stay eq (22) in float64 terms when whole
tiles are skipped, with 16-wide interpreter tiles: causal with Nq > Nk and Nq < Nk, key padding
that empties whole source tiles, extra templates after the skipped keys, a per-query bool mask.
"""
from __future__ import annotations

import pytest
import torch

import attnzoo.functional as AF
from attnzoo.ops.ot import triton as ot_triton

from . import formulas as FM
from tests.common import KERNEL_DEVICE, needs_kernels, padding_mask

B, H, D, DV = 2, 1, 5, 3


def _leaves(nq, nk, n_templates, seed):
    gen = torch.Generator().manual_seed(seed)

    def t(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float32).requires_grad_()
    tk, tv = (t(B, H, n_templates, D), t(B, H, n_templates, DV)) if n_templates else (None, None)
    return t(B, H, nq, D), t(B, H, nk, D), t(B, H, nk, DV), tk, tv, t(B, H, nk)


def _expected_ranges(keep):
    """(lo, hi) per (batch*head, query) from a bool keep (B, H, Nq, Nk): first kept key, one past the
    last; lo = Nk, hi = 0 for a query that keeps none."""
    nk = keep.shape[-1]
    idx = torch.arange(nk)
    lo = torch.where(keep, idx, nk).amin(-1)
    hi = torch.where(keep, idx + 1, 0).amax(-1)
    return lo.reshape(-1, keep.shape[-2]), hi.reshape(-1, keep.shape[-2])


CASES = [  # (causal, nq, nk, extra templates, mask)
    (True, 40, 37, 5, None),         # bottom-right causal, Nq > Nk: the first 3 queries keep no key
    (True, 19, 50, 0, None),         # Nq < Nk: every query keeps the first 32 keys, tiles past its diagonal skip
    (False, 21, 45, 7, "padding"),   # batch 1 keeps 13 of 45 keys: two whole source / template tiles skip
    (False, 18, 33, 3, "query_bool"),
]


def _mask(kind, nq, nk):
    if kind == "padding":
        return padding_mask([nk, 13], nk)
    if kind == "query_bool":
        m = torch.rand(B, H, nq, nk, generator=torch.Generator().manual_seed(4)) > 0.5
        m[..., 20:] = False          # no query keeps a key from 20 on: the last template tile skips
        return m
    return None


@needs_kernels
@pytest.mark.parametrize("causal,nq,nk,n_templates,mask_kind", CASES)
def test_skipped_tiles_leave_eq22_unchanged(monkeypatch, causal, nq, nk, n_templates, mask_kind):
    ranges = []
    real = ot_triton._key_ranges

    def record(n, nq_, skip, unused):
        got = real(n, nq_, skip, unused)
        ranges.append(got)
        return got
    monkeypatch.setattr(ot_triton, "_key_ranges", record)
    leaves = _leaves(nq, nk, n_templates, seed=nq + nk)
    q, k, v, tk, tv, log_u = leaves
    mask = _mask(mask_kind, nq, nk)
    scale, alpha = 0.6, 1.1
    dev = KERNEL_DEVICE

    def on(x):
        return None if x is None else x.to(dev)
    out = AF.ot(on(q), on(k), on(v), attn_mask=on(mask), is_causal=causal, scale=scale, alpha=alpha,
                log_u=on(log_u), templates_k=on(tk), templates_v=on(tv), backend="triton").cpu()
    used = [x for x in leaves if x is not None]
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    got_g = torch.autograd.grad(out, used, grad)

    # the ranges the kernels used, forward and backward, are the mask's
    allow, add = FM.allow_and_add(mask, causal, B, H, nq, nk)
    want_lo, want_hi = _expected_ranges(allow.expand(B, H, nq, nk))
    assert len(ranges) == 2
    for lo, hi in ranges:
        assert lo.dtype == torch.int32, "no key ranges were made: the kernels did not skip"
        torch.testing.assert_close(lo.cpu().long(), want_lo, rtol=0, atol=0)
        torch.testing.assert_close(hi.cpu().long(), want_hi, rtol=0, atol=0)
    assert (want_hi < nk).any() or (want_lo > 16).any()   # some whole 16-wide tile lies outside a range

    # out and every gradient: eq (22) in float64
    wide = [None if x is None else x.detach().double().requires_grad_() for x in leaves]
    wq, wk, wv, wtk, wtv, wlu = wide
    want = FM.ot(wq, wk, wv, allow, add, scale, alpha=alpha, log_u=wlu, tk=wtk, tv=wtv)
    torch.testing.assert_close(out.double(), want, rtol=2e-5, atol=2e-5)
    want_g = torch.autograd.grad(want, [x for x in wide if x is not None], grad.double())
    names = [n for n, x in zip(("q", "k", "v", "templates_k", "templates_v", "log_u"), leaves) if x is not None]
    for name, g, w in zip(names, got_g, want_g):
        torch.testing.assert_close(g.double(), w, rtol=2e-5, atol=2e-5, msg=lambda m, n=name: f"d{n}: {m}")


@needs_kernels
def test_no_mask_runs_the_plain_loops(monkeypatch):
    # without a mask or causal every row keeps every key: no ranges are made or read
    seen = []
    real = ot_triton._key_ranges
    monkeypatch.setattr(ot_triton, "_key_ranges", lambda *a: seen.append(a[2]) or real(*a))
    q, k, v, *_ = _leaves(9, 7, 0, seed=0)
    AF.ot(q.to(KERNEL_DEVICE), k.to(KERNEL_DEVICE), v.to(KERNEL_DEVICE), backend="triton")
    assert seen == [False]
