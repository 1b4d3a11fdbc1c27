"""How a causal mask with more structure than the triangle (packed blocks, a band, padding, a bias)
reaches a variant that couples queries (Sinkhorn), issue 31 items 1-3.

The rule (attnzoo/ops/masking.py, docs/usage.md): with is_causal=True and a mask M, row i is the last
row of the variant solved non-causally on the tokens row i sees, T_i = {j <= i + Nk - Nq : M keeps
(i, j)}, with query i; a pair of those tokens takes part (with its bias) as M lets the later of the two
see the earlier. ``rule_reference`` below is written from that sentence, independently of the package:
a loop over rows that gathers T_i into a small dense problem and runs Sinkhorn from the formula.
"""
from __future__ import annotations

import math

import pytest
import torch

import attnzoo.functional as AF
from tests.common import INTERPRET, KERNEL_DEVICE, ON_GPU

pytestmark = pytest.mark.usefixtures("one_thread")

SCALE, N_ITERS, EPS = 0.4, 4, 1.0
F64 = dict(rtol=1e-10, atol=1e-10)


# ---- the independent float64 reference ---------------------------------------------------------
def _sinkhorn_last_row(q, k, v, logit_bias, allowed):
    """Sinkhorn (paper 002 sec 2.4) on one small dense problem, written from the formula: L = -scale
    ||q_a - k_b||^2 / (2 eps) + bias, N_ITERS (row, column) rounds with column target n_q / n_k, then
    the final row normalisation; the last row's output."""
    L = -SCALE * ((q[:, None, :] - k[None, :, :]) ** 2).sum(-1) / (2 * EPS) + logit_bias
    L = L.masked_fill(~allowed, -math.inf)
    n_q, n_k = L.shape

    def lse(x, dim):
        m = x.amax(dim, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        s = torch.exp(x - m).sum(dim, keepdim=True)
        return torch.where(s > 0, torch.log(torch.where(s > 0, s, torch.ones_like(s))) + m, torch.zeros_like(s))

    g = torch.zeros(1, n_k, dtype=L.dtype)
    for _ in range(N_ITERS):
        f = -lse(L + g, 1)
        g = math.log(n_q / n_k) - lse(L + f, 0)
    row = L[-1] + g[0]
    if not torch.isfinite(row).any():
        return torch.zeros(v.shape[-1], dtype=v.dtype)
    return torch.softmax(row, 0) @ v


def rule_reference(q, k, v, mask):
    """(B, H, Nq, D) x3 and a bool or float mask broadcastable to (B, H, Nq, Nk) -> causal output."""
    B, H, nq, _ = q.shape
    nk = k.shape[2]
    off = nk - nq
    mask = torch.zeros(1, 1, nq, nk, dtype=torch.float64) if mask is None else mask
    mask = mask.expand(B, H, nq, nk)
    keep = mask if mask.dtype == torch.bool else mask > -math.inf
    bias = torch.zeros(mask.shape, dtype=torch.float64) if mask.dtype == torch.bool else \
        torch.where(keep, mask, torch.zeros((), dtype=mask.dtype))
    out = torch.zeros(B, H, nq, v.shape[-1], dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            for i in range(nq):
                pos_i = i + off
                tokens = [j for j in range(0, pos_i + 1) if keep[b, h, i, j]]   # T_i
                if not tokens:
                    continue
                # queries: those of the tokens in T_i that have a query row, and query i itself
                queries = [j - off for j in tokens if 0 <= j - off < i] + [i]

                def pair(a_row, key):   # (query row, key): M's entry for the later seeing the earlier
                    later, earlier = max(a_row + off, key), min(a_row + off, key)
                    return keep[b, h, later - off, earlier].item(), bias[b, h, later - off, earlier]
                allowed = torch.tensor([[pair(a, j)[0] for j in tokens] for a in queries])
                lb = torch.stack([torch.stack([pair(a, j)[1] for j in tokens]) for a in queries])
                out[b, h, i] = _sinkhorn_last_row(q[b, h, queries], k[b, h, tokens], v[b, h, tokens], lb, allowed)
    return out


# ---- masks ---------------------------------------------------------------------------------------
def tril(nq, nk):
    return torch.arange(nk)[None, :] <= torch.arange(nq)[:, None] + (nk - nq)


def block_causal(lengths):
    seq = torch.cat([torch.full((n,), s) for s, n in enumerate(lengths)])
    return (seq[:, None] == seq[None, :]) & tril(len(seq), len(seq))


def band(n, width, nq=None):
    nq = n if nq is None else nq
    i = torch.arange(nq)[:, None] + (n - nq)
    j = torch.arange(n)[None, :]
    return (j <= i) & (j > i - width)


def padded(n, left, right):
    """(2, 1, 1, n): batch 0 left-padded by ``left``, batch 1 right-padded by ``right``."""
    keep = torch.ones(2, 1, 1, n, dtype=torch.bool)
    keep[0, ..., :left] = False
    keep[1, ..., n - right:] = False
    return keep


def alibi_like(n, width=None):
    """A float mask: a per-pair bias on the causal part (ALiBi's -slope (i - j)), -inf above it."""
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    m = (-0.3 * (i - j)).double()
    hidden = j > i if width is None else (j > i) | (j <= i - width)
    return m.masked_fill(hidden, -math.inf)


def with_empty_row(n):
    m = band(n, 3).clone()
    m[2] = False      # query 2 sees nothing: a zero row
    return m


N = 7
CASES = {  # name -> (nq, nk, mask)
    "triangle": (N, N, None),
    "triangle as a mask": (N, N, tril(N, N)),
    "packed blocks": (N, N, block_causal([3, 4])),
    "packed blocks & tril": (N, N, block_causal([2, 3, 2]) & tril(N, N)),
    "band": (N, N, band(N, 3)),
    "padding left and right": (N, N, padded(N, 2, 3)),
    "padding & band": (N, N, padded(N, 1, 2) & band(N, 4)),
    "float bias": (N, N, alibi_like(N)),
    "float bias band": (N, N, alibi_like(N, 3)),
    "cached rows (Nq < Nk), band": (3, N, band(N, 3, nq=3)),
    "cached rows (Nq < Nk), padding": (3, N, padded(N, 2, 0)),
    "cached rows (Nq < Nk), float bias band": (3, N, alibi_like(N, 3)[-3:]),
    "more queries than keys": (N, 5, None),
    "more queries than keys, band": (N, 5, band(5, 2, nq=N)),
    "fully masked row": (N, N, with_empty_row(N)),
    # (B, H, N, N): each batch row and head its own structure (the kernels index the mask per head)
    "per batch row and head": (N, N, torch.stack([torch.stack([block_causal([3, 4]), band(N, 3)]),
                                                  torch.stack([with_empty_row(N), padded(N, 2, 0)[0, 0] & tril(N, N)])])),
}


def _inputs(nq, nk, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(2, 2, n, 4, generator=g, dtype=torch.float64) for n in (nq, nk, nk))


def _backends():
    out = ["reference", "cpu"]
    if INTERPRET or ON_GPU:
        out.append("triton")
    return out


def _run(backend, q, k, v, mask, **kw):
    dev = KERNEL_DEVICE if backend == "triton" else "cpu"
    dtype = torch.float32 if backend == "triton" else torch.float64
    to = lambda t: None if t is None else t.to(dev, dtype if t.is_floating_point() else t.dtype)
    out = AF.sinkhorn(to(q), to(k), to(v), attn_mask=to(mask), is_causal=True, scale=SCALE, n_iters=N_ITERS,
                      eps=EPS, backend=backend, **kw)
    return out.double().cpu()


def _tol(backend):
    return F64 if backend != "triton" else dict(rtol=2e-3, atol=2e-3)


# the Triton interpreter takes seconds per causal call (one launch sequence per row): a few cases there
TRITON_CASES = ("packed blocks & tril", "cached rows (Nq < Nk), float bias band")
PAIRS = [(c, b) for b in _backends() for c in CASES if b != "triton" or c in TRITON_CASES]


@pytest.mark.parametrize("case,backend", PAIRS)
def test_every_backend_follows_the_rule(case, backend):
    nq, nk, mask = CASES[case]
    q, k, v = _inputs(nq, nk)
    want = rule_reference(q, k, v, mask)
    torch.testing.assert_close(_run(backend, q, k, v, mask), want, **_tol(backend))


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_block_and_block_and_tril_are_one_call(backend):
    """Nothing above the diagonal is read: a packed batch's block mask with or without the triangle."""
    q, k, v = _inputs(N, N)
    block = block_causal([3, 4])
    torch.testing.assert_close(_run(backend, q, k, v, block), _run(backend, q, k, v, block & tril(N, N)),
                               **_tol(backend))


def test_gradients_follow_the_rule():
    """The cpu backend's gradient (streaming passes, per-row problems) equals autograd through the
    independent reference."""
    q, k, v = (t.requires_grad_(True) for t in _inputs(N, N, seed=3))
    mask = block_causal([3, 4]) & band(N, 3)
    grads = torch.autograd.grad(_run("cpu", q, k, v, mask).square().sum(), (q, k, v))
    want = torch.autograd.grad(rule_reference(q, k, v, mask).square().sum(), (q, k, v))
    for got, w in zip(grads, want):
        torch.testing.assert_close(got, w, **F64)


# ---- the properties the rule exists for ------------------------------------------------------------
STRUCTURED = {"packed blocks": block_causal([3, 4]), "band": band(N, 3), "padding": padded(N, 1, 2),
              "float bias band": alibi_like(N, 3)}


@pytest.mark.parametrize("name", list(STRUCTURED))
def test_a_later_token_moves_no_earlier_output(name):
    mask = STRUCTURED[name]
    q, k, v = _inputs(N, N)
    base = _run("reference", q, k, v, mask)
    for t in (3, 5):
        q2, k2, v2 = (x.clone() for x in (q, k, v))
        for x in (q2, k2, v2):
            x[..., t, :] += 1.5
        moved = _run("reference", q2, k2, v2, mask)
        torch.testing.assert_close(moved[..., :t, :], base[..., :t, :], **F64)
        assert (moved[..., t, :] - base[..., t, :]).abs().max() > 1e-3  # the perturbation is seen


def test_packed_sequences_equal_each_sequence_alone():
    q, k, v = _inputs(N, N)
    packed = _run("cpu", q, k, v, block_causal([3, 4]))
    for lo, hi in ((0, 3), (3, 7)):
        alone = _run("cpu", q[..., lo:hi, :], k[..., lo:hi, :], v[..., lo:hi, :], None)
        torch.testing.assert_close(packed[..., lo:hi, :], alone, **F64)


def test_an_output_does_not_depend_on_how_many_tokens_follow():
    q, k, v = _inputs(9, 9)
    long = _run("cpu", q, k, v, band(9, 3))
    short = _run("cpu", q[..., :4, :], k[..., :4, :], v[..., :4, :], band(4, 3))
    torch.testing.assert_close(long[..., :4, :], short, **F64)
