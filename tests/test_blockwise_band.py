"""The blockwise path's batched band (ops/kernels/blockwise_band.py): query blocks of a sliding window
taken G at a time through strided views of k and v, checked against float64 attention written here
from the definitions (the band, FlashAttention's bottom-right alignment, Gemma 2's cap, gpt-oss's sinks,
sigmoid's n_i), forward and every gradient, on shapes where most blocks are batched and a few (the
edges) take the per-block loop."""
from __future__ import annotations

import math

import pytest
import torch

from attnzoo.ops.kernels import blockwise, blockwise_band

from .common import band_allowed
from .memory_probe import LargestAllocation, PeakAllocated

B, H, D = 2, 2, 4
SCALE = 0.7


def reference(kind, q, k, v, allow, add, softcap, sinks):
    """Float64 weights from the formulas; ``allow`` (B, H, nq, nk) and ``add`` (broadcastable) finite."""
    logits = SCALE * torch.einsum("bhid,bhjd->bhij", q, k)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    logits = logits + add
    n = allow.sum(-1, keepdim=True).double().clamp_min(1)
    if kind == "softmax":
        e = torch.where(allow, torch.exp(logits), torch.zeros_like(logits))
        total = e.sum(-1, keepdim=True)
        if sinks is not None:
            total = total + torch.exp(sinks).view(1, -1, 1, 1)
        w = e / torch.where(total > 0, total, torch.ones_like(total))
    elif kind == "sigmoid":
        w = torch.where(allow, 1 / (1 + torch.exp(-logits)), torch.zeros_like(logits))
    elif kind == "sigmoid_default":
        w = torch.where(allow, 1 / (1 + n * torch.exp(-logits)), torch.zeros_like(logits))
    else:
        w = torch.where(allow, logits.clamp_min(0), torch.zeros_like(logits)) / n
    return w @ v


# kind, nq, nk, window, causal, keep, add_a, add_b, softcap, sinks (keep / add shapes; "-inf": with dropped keys)
CASES = [
    ("softmax", 48, 48, (7, 0), True, None, None, None, None, False),
    ("softmax", 40, 48, (5, 3), False, (B, H, 40, 48), None, None, 1.5, True),
    ("softmax", 48, 40, (6, 2), True, None, (1, 1, 1, 40, "-inf"), (1, H, 1, 40), None, True),
    ("softmax", 44, 44, (3, -1), True, None, (B, H, 44, 44), None, 2.0, True),
    ("softmax", 48, 56, (9, 9), False, (B, 1, 1, 56), (1, 1, 48, 1), (1, 1, 1, 1), 1.0, False),
    ("sigmoid", 48, 48, (9, 4), False, None, None, (B, H, 48, 48), 1.5, False),
    ("sigmoid_default", 48, 48, (7, 0), True, (B, 1, 1, 48), None, None, None, False),
    ("relu", 40, 48, (7, 1), False, None, (1, 1, 40, 1, "-inf"), None, 1.2, False),
]


def _make(shape, g, kind="float"):
    if shape is None:
        return None
    dims, special = shape[:4], shape[4:]
    if kind == "bool":
        return torch.rand(*dims, generator=g) > 0.25
    t = torch.randn(*dims, generator=g, dtype=torch.float64)
    if special:
        t = t.masked_fill(torch.rand(*dims, generator=g) < 0.2, -math.inf)
    return t


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[1]}x{c[2]}-{c[3]}" for c in CASES])
def test_batched_band_against_float64(case, monkeypatch):
    kind, nq, nk, window, causal, keep_shape, add_a_shape, add_b_shape, softcap, with_sinks = case
    g = torch.Generator().manual_seed(11)
    q = torch.randn(B, H, nq, D, generator=g, dtype=torch.float64).requires_grad_()
    k, v = (torch.randn(B, H, nk, D, generator=g, dtype=torch.float64).requires_grad_() for _ in range(2))
    keep = _make(keep_shape, g, "bool")
    add_a, add_b = _make(add_a_shape, g), _make(add_b_shape, g)
    sinks = torch.tensor([0.4, -0.3], dtype=torch.float64, requires_grad=True) if with_sinks else None
    leaves = [q, k, v]
    for t in (add_a, add_b):
        if t is not None and torch.isfinite(t).all():  # a float mask with -inf takes no gradient
            leaves.append(t.requires_grad_())
    if sinks is not None:
        leaves.append(sinks)

    batched = []
    real = blockwise_band.Band.forward
    monkeypatch.setattr(blockwise_band.Band, "forward", lambda self, *a: batched.append(1) or real(self, *a))
    out = blockwise.blockwise_attention(q, k, v, kind=kind, scale=SCALE, is_causal=causal, keep=keep, add_a=add_a,
                                        add_b=add_b, block_q=8, block_k=8, window_size=window, softcap=softcap,
                                        sinks=sinks)
    assert batched, "no query block took the batched band"

    allow = band_allowed(nq, nk, window, causal).expand(B, H, nq, nk)
    add = torch.zeros((), dtype=torch.float64)
    for t in (add_a, add_b):
        if t is not None:
            allow = allow & (t > -math.inf)
            add = add + torch.where(t > -math.inf, t, torch.zeros_like(t))
    if keep is not None:
        allow = allow & keep
    want = reference(kind, q, k, v, allow, add, softcap, sinks)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-12)
    grad = torch.randn(out.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad(out, leaves, grad)
    expect = torch.autograd.grad(want, leaves, grad)
    for name, a, b in zip(("dq", "dk", "dv", "d_add", "d_add/d_sinks", "d_sinks"), got, expect):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11, msg=name)


def test_batched_rows_cover_the_interior_and_the_edges_take_the_loop(monkeypatch):
    """A causal window (8, 0) at N = 64 in blocks of 8: rows 8..63 are batched (their runs of 16 keys start
    at qs - 8 >= 0); rows 0..7 (their run would start at key -8) take the per-block loop."""
    batched, looped = [], []
    real_band, real_loop = blockwise_band.Band.scores, blockwise._Masks.scores
    monkeypatch.setattr(blockwise_band.Band, "scores",
                        lambda self, masks, qb, kr, qs, *a: batched.append((qs, qb.shape[0], kr.shape[1]))
                        or real_band(self, masks, qb, kr, qs, *a))
    monkeypatch.setattr(blockwise._Masks, "scores",
                        lambda self, qb, k, qs, qe, ks, ke, *a: looped.append((qs, qe, ks, ke))
                        or real_loop(self, qb, k, qs, qe, ks, ke, *a))
    monkeypatch.setattr(blockwise_band, "CHUNK_SCORES", 8 * 16 * 3)  # 3 blocks per chunk (one head: B = H = 1)
    q, k, v = (torch.randn(1, 1, 64, 4, dtype=torch.float64) for _ in range(3))
    blockwise.forward_impl(q, k, v, None, None, None, "softmax", 0.5, True, 8, 8, 8, -1)
    assert looped == [(0, 8, 0, 8)]
    assert [(qs, blocks) for qs, blocks, _ in batched] == [(8, 3), (32, 3), (56, 1)]
    assert {width for *_, width in batched} == {16}  # 8 rows + 8 keys to the left, rounded to 2 x 8


def test_band_temporaries_stay_a_few_chunks(monkeypatch):
    """The largest tensor the windowed forward and backward allocate is a chunk's scores (CHUNK_SCORES, one
    head at a time) or a returned (B, H, N, D) gradient, far below N x N (here N = 1024, window 32)."""
    n, d = 1024, 4
    monkeypatch.setattr(blockwise_band, "CHUNK_SCORES", 2 ** 12)  # 2 blocks of 32 x 64 per chunk
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, n, d, generator=g) for _ in range(3))
    with LargestAllocation() as probe:
        out, stat = blockwise.forward_impl(q, k, v, None, None, None, "softmax", 0.5, True, 32, 32, 31, 0)
        blockwise.backward_impl(torch.ones_like(out), q, k, v, out, stat, None, None, None, "softmax", 0.5, True,
                                32, 32, 31, 0)
    chunk = blockwise_band.CHUNK_SCORES * 4  # bytes: a chunk's float32 scores (one head at a time)
    assert probe.largest <= max(chunk, 2 * n * d * 4), probe.largest
    assert probe.largest < 2 * n * n * 4 // 16


def test_batched_band_reads_strided_heads():
    """q, k, v as HF passes them, (B, N, H, D) transposed to (B, H, N, D) (rows H * D apart): the strided
    runs of keys follow the tensors' own strides, forward and backward, against float64."""
    nq = nk = 48
    g = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(B, n, H, D, generator=g, dtype=torch.float64).transpose(1, 2).requires_grad_()
               for n in (nq, nk, nk))
    assert not q.is_contiguous()
    out = blockwise.blockwise_attention(q, k, v, kind="softmax", scale=SCALE, is_causal=True, block_q=8, block_k=8,
                                        window_size=(7, 0), softcap=2.0)
    want = reference("softmax", q, k, v, band_allowed(nq, nk, (7, 0), True).expand(B, H, nq, nk),
                     torch.zeros((), dtype=torch.float64), 2.0, None)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-12)
    grad = torch.randn(out.shape, generator=g, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(want, (q, k, v), grad)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_band_backward_holds_two_score_chunks_at_most(monkeypatch):
    """The windowed forward + backward's own temporaries (the peak of every tensor alive at once, from the
    profiler's allocation records, less the output, its row statistic and dq, dk, dv) stay within two
    chunks of scores (the weights and dL/dw, one buffer each, reused by every chunk and head), a few
    numbers per row and the band's patterns: no (G, L, D) product of dK / dV runs, no scaled copy of q, no
    separate dS block."""
    b, h, n, d = 1, 2, 512, 64
    rows, width = 32, 96  # a causal window of 64 keys: 32 + 63 keys a block, rounded up to 3 x 32
    monkeypatch.setattr(blockwise_band, "CHUNK_SCORES", 4 * rows * width)  # 4 blocks per chunk
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(b, h, n, d, generator=g) for _ in range(3))
    grad = torch.randn(b, h, n, d, generator=g)
    with PeakAllocated() as probe:
        out, stat = blockwise.forward_impl(q, k, v, None, None, None, "softmax", 0.125, True, rows, 1024, 63, 0)
        grads = blockwise.backward_impl(grad, q, k, v, out, stat, None, None, None, "softmax", 0.125, True, rows,
                                        1024, 63, 0)
    returned = sum(t.untyped_storage().nbytes() for t in (out, stat, *grads[:3]))
    chunk = blockwise_band.CHUNK_SCORES * 4  # bytes of one chunk's float32 scores
    per_row = 4 * b * h * n * 4  # a few float32 numbers per row (max, sum, lse)
    patterns = 2 * rows * width * 4  # per call: the band's (rows, width) pattern as bool and as 0 / -inf, ...
    assert probe.peak - returned <= 2 * chunk + per_row + patterns, (probe.peak - returned, chunk)
