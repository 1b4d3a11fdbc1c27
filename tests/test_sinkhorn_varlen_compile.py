"""Packed Sinkhorn under torch.compile(fullgraph=True): the offsets stay tensors, so ops/varlen.py runs
the sequences as one padded batch (``varlen.padded_coupled``), its padded queries and keys masked out of
the transport problem. One graph, no host read, and every
sequence's answer its own: outputs and gradients equal a float64 Sinkhorn written here from the formula
(paper 002 sec 2.4; causal = eq 2.6's prefix rule) on each sequence alone. Nq < Nk, Nq > Nk and Nq = Nk
per sequence (so the column target log(n_q / n_k) differs per sequence and from the padded block's),
length 1, grouped-query heads, costs l2 / dot, softcap, non-causal and causal windows; backends
"reference" and "cpu" in float64, "triton" under the interpreter (its custom ops are opaque nodes)."""
from __future__ import annotations

import pytest
import torch

import attnzoo
import attnzoo.functional as AF
from attnzoo.ops import varlen
from tests.common import needs_interpreter
from tests.sinkhorn_math import causal64, windowed64

H, H_KV, D = 2, 1, 8
LEN_Q = [1, 20, 5]
LEN_K = [3, 17, 5]
OTHER_Q = [20, 4, 2]      # other lengths, same count and maxima: the graph is reused
OTHER_K = [17, 5, 3]
LENGTHS = ((LEN_Q, LEN_K), (OTHER_Q, OTHER_K))
# the interpreter runs the causal prefix loop's kernels slowly: shorter sequences (one above 4-row tiles)
SHORT = (([1, 6, 3], [3, 5, 3]), ([6, 3, 1], [5, 4, 2]))   # same totals and maxima


def offsets(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)


def inputs(len_q, len_k, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(sum(n), h, D, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
            for n, h in ((len_q, H), (len_k, H_KV), (len_k, H_KV))]


def each_alone(q, k, v, len_q, len_k, causal, window, cost, softcap, n_iters):
    """The float64 formula on each sequence alone, (H, n, D) blocks, grouped heads expanded."""
    cq, ck = offsets(len_q).tolist(), offsets(len_k).tolist()
    outs = []
    for s in range(len(len_q)):
        qs = q[cq[s]:cq[s + 1]].transpose(0, 1).double()
        ks, vs = (t[ck[s]:ck[s + 1]].transpose(0, 1).double().repeat_interleave(H // H_KV, 0) for t in (k, v))
        if causal:
            out = causal64(qs, ks, vs, left=window[0], cost=cost, softcap=softcap, n_iters=n_iters)
        else:
            out = windowed64(qs, ks, vs, window=window, cost=cost, softcap=softcap, n_iters=n_iters)
        outs.append(out.transpose(0, 1))
    return torch.cat(outs)


def compiled_packed(backend, causal, window, cost, softcap, n_iters, graphs, max_q, max_k):
    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def step(q, k, v, cu_q, cu_k):
        return AF.varlen("sinkhorn", q, k, v, cu_q, cu_k, max_q, max_k, is_causal=causal,
                         enable_gqa=True, backend=backend, n_iters=n_iters, cost=cost, softcap=softcap,
                         window_size=None if window == (-1, -1) else window)

    return torch.compile(step, fullgraph=True, backend=capture)


def assert_packed_equals_alone(backend, causal, window, cost, softcap, n_iters, dtype, tol, lengths=LENGTHS):
    torch._dynamo.reset()
    graphs = []
    max_q, max_k = max(lengths[0][0]), max(lengths[0][1])
    compiled = compiled_packed(backend, causal, window, cost, softcap, n_iters, graphs, max_q, max_k)
    for len_q, len_k in lengths:
        q, k, v = inputs(len_q, len_k, dtype)
        out = compiled(q, k, v, offsets(len_q), offsets(len_k))
        want = each_alone(q, k, v, len_q, len_k, causal, window, cost, softcap, n_iters)
        torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)
        w = torch.randn(want.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
        got = torch.autograd.grad((out.double() * w).sum(), (q, k, v))
        ref = torch.autograd.grad((want * w).sum(), (q, k, v))
        for name, a, b in zip("qkv", got, ref):
            torch.testing.assert_close(a.double(), b.double(), atol=tol, rtol=tol, msg=f"d{name}")
    assert len(graphs) == 1, f"{len(graphs)} graphs: the offsets must stay graph inputs"


CASES = [  # (causal, window, cost, softcap, n_iters)
    (False, (-1, -1), "l2", None, 3),
    (False, (3, 2), "dot", 4.0, 2),
    (True, (-1, -1), "l2", None, 2),
    (True, (-1, -1), "dot", 4.0, 1),
    (True, (4, 0), "l2", None, 2),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{'causal' if c[0] else 'full'}-w{c[1][0]}.{c[1][1]}-{c[2]}"
                                                      f"{'-cap' if c[3] else ''}-it{c[4]}")
@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_compiled_packed_sinkhorn_is_each_sequence_alone(backend, case, no_per_length):
    assert_packed_equals_alone(backend, *case, dtype=torch.float64, tol=1e-10)


@needs_interpreter
@pytest.mark.parametrize("case", [CASES[1], CASES[2]], ids=["full-window", "causal"])
def test_compiled_packed_sinkhorn_on_triton_under_the_interpreter(case, no_per_length):
    """Non-causal: the packed kernels' op in the graph; causal: the padded batch on the dense kernels
    (the packed route's causal prefixes read the offsets, so it declines while torch.compile traces)."""
    assert_packed_equals_alone("triton", *case, dtype=torch.float32, tol=2e-5, lengths=SHORT)


def test_padded_coupled_needs_its_masked_padding():
    """The padded batch without its padding masked gives other numbers: Sinkhorn's columns would count the
    padded queries (so the masking in padded_coupled is what makes it exact)."""
    q, k, v = inputs(LEN_Q, LEN_K)
    cu_q, cu_k = offsets(LEN_Q), offsets(LEN_K)
    want = each_alone(q, k, v, LEN_Q, LEN_K, False, (-1, -1), "l2", None, 3)

    def unmasked_queries(q, k, v, *, attn_mask, **kwargs):
        keys_only = attn_mask.any(-2, keepdim=True)                      # every query row kept
        return AF.sinkhorn(q, k, v, attn_mask=keys_only, **kwargs)

    kwargs = dict(n_iters=3, enable_gqa=True)
    got = varlen.padded_coupled(AF.sinkhorn, q, k, v, cu_q, cu_k, max(LEN_Q), max(LEN_K), False, kwargs)
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)
    wrong = varlen.padded_coupled(unmasked_queries, q, k, v, cu_q, cu_k, max(LEN_Q), max(LEN_K), False, kwargs)
    assert (wrong - want).abs().max() > 1e-3


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_a_packed_sinkhorn_layer_compiles_to_one_graph(causal):
    """A Sinkhorn layer's packed forward (cu_seqlens) under fullgraph=True equals the layer on each sequence."""
    torch.manual_seed(0)
    layer = attnzoo.create("sinkhorn", 16, 2).double()
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(n, 16, generator=g, dtype=torch.float64) for n in (3, 1, 6)]

    def forward(x, cu):
        return layer(x, cu_seqlens=cu, max_seqlen=6, is_causal=causal)

    compiled = torch.compile(forward, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(torch.cat(xs), offsets([3, 1, 6])),
                               torch.cat([layer(x[None], is_causal=causal)[0] for x in xs]), atol=1e-10, rtol=1e-10)
