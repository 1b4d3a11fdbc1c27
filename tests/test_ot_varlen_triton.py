"""Packed (varlen) OT attention on its Triton kernels (ops/ot/varlen.py), under the interpreter on CPU or
on a GPU: every sequence's output and gradients equal paper 004 eq (22) run on that sequence alone, written
here from the formula in float64 (A = the sequence's keys, u uniform over them, the inner softmax over A,
causal = each query's prefix problem, bottom-right); FlashAttention's rule (tests/flash_rule.py) against
the same formula in fp32 for fp32, bf16 and fp16 inputs. Grouped heads (4 query heads on 2 key heads),
causal and not, n_q != n_k both ways, a length-1 sequence, sequences longer than the interpreter's
16-wide tiles, and torch.compile(fullgraph=True)."""
from __future__ import annotations

import math

import pytest
import torch

import attnzoo.functional as AF
from attnzoo.ops import varlen
from tests.common import INTERPRET, KERNEL_DEVICE, needs_kernels
from tests.flash_rule import assert_flash_rule

H, H_KV, D, DV = 4, 2, 5, 3
# (n_q, n_k): one query on two keys, equal lengths, n_q > n_k past a tile (causal: queries that see no
# key), a single key, n_k > n_q past a tile
LEN_Q = [1, 5, 19, 3, 2]
LEN_K = [2, 5, 17, 1, 18]
ALPHA, GAMMA = 0.7, 1.3


def offsets(lengths, device, dtype=torch.int32):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=dtype, device=device)


def one_sequence(q, k, v, causal, alpha, gamma):
    """Eq (22) with M(a, b) = -a.b for one head: q (n_q, D), k (n_k, D), v (n_k, Dv). Query i's
    problem keeps keys j <= i + n_k - n_q when causal; its sources and templates are those keys, u = 1/n."""
    n_q, n_k = q.shape[0], k.shape[0]
    rows = []
    for i in range(n_q):
        n = min(n_k, i + n_k - n_q + 1) if causal else n_k
        if n <= 0:
            rows.append(torch.zeros_like(v[0]))
            continue
        a_k, a_v = k[:n], v[:n]
        logits = (alpha * (q[i] @ a_k.T)[None, :] + k[:n] @ a_k.T) / gamma      # (source j, template t)
        weights = torch.softmax(logits, dim=-1).sum(0) / n                      # sum_j u_j softmax_t
        rows.append(weights @ a_v)
    return torch.stack(rows)


def formula(q, k, v, causal, len_q=LEN_Q, len_k=LEN_K, alpha=ALPHA, gamma=GAMMA):
    """Packed q (T_q, H, D), k, v (T_k, H_KV, .) -> (T_q, H, Dv), each sequence and head on its own; query
    head h reads key head h // (H / H_KV)."""
    out, cq, ck = [], 0, 0
    for nq, nk in zip(len_q, len_k):
        heads = [one_sequence(q[cq:cq + nq, h], k[ck:ck + nk, h // (H // H_KV)], v[ck:ck + nk, h // (H // H_KV)],
                              causal, alpha, gamma) for h in range(H)]
        out.append(torch.stack(heads, dim=1))
        cq, ck = cq + nq, ck + nk
    return torch.cat(out)


def inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(sum(n), h, width, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
            for n, h, width in ((LEN_Q, H, D), (LEN_K, H_KV, D), (LEN_K, H_KV, DV))]


def packed(q, k, v, causal, len_q=LEN_Q, len_k=LEN_K, **kw):
    dev = KERNEL_DEVICE
    return AF.varlen("ot", q.to(dev), k.to(dev), v.to(dev), offsets(len_q, dev), offsets(len_k, dev),
                     max(len_q), max(len_k), is_causal=causal, alpha=ALPHA, gamma=GAMMA, enable_gqa=True,
                     backend="triton", **kw).cpu()


@pytest.fixture
def kernels_only(monkeypatch):
    """The per-length route fails the test: a packed call must take the varlen kernels."""
    monkeypatch.setattr(varlen, "per_sequence", lambda *a, **k: pytest.fail("the packed kernels were not taken"))


def check(causal, dtype):
    q, k, v = inputs(dtype)
    out = packed(q, k, v, causal)
    assert out.shape == (sum(LEN_Q), H, DV) and out.dtype == dtype
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got_g = torch.autograd.grad(out, (q, k, v), grad.to(dtype))
    wide = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = formula(*wide, causal)
    want_g = torch.autograd.grad(want, wide, grad)
    same = [t.detach().float().requires_grad_() for t in (q, k, v)]   # the formula as a reference runs it
    low = formula(*same, causal)
    low_g = [g.to(dtype) for g in torch.autograd.grad(low, same, grad.float())]
    assert all(torch.isfinite(t).all() for t in (out,) + got_g)
    logit_size = float(max(t.detach().double().abs().max() for t in (q, k))) ** 2 * D * (1 + ALPHA) / GAMMA
    assert_flash_rule(f"packed ot causal={causal}", dtype, logit_size,
                      [("out", out, low.to(dtype), want)]
                      + [(f"d{n}", g, lo, w) for n, g, lo, w in zip("qkv", got_g, low_g, want_g)])


@needs_kernels
@pytest.mark.parametrize("causal", [False, True])
def test_packed_equals_each_sequence_alone(causal, kernels_only):
    check(causal, torch.float32)


@needs_kernels
@pytest.mark.parametrize("causal,dtype", [(False, torch.bfloat16), (True, torch.float16)], ids=str)
def test_packed_half_meets_the_flash_rule(causal, dtype, kernels_only):
    check(causal, dtype)


@needs_kernels
def test_the_rule_sees_a_sequence_that_leaks_into_the_next():
    """The test's own power: the formula with the second and third sequences merged (one transport
    problem) differs from the packed kernels' answer by far more than the rule allows."""
    q, k, v = (t.detach().float() for t in inputs(torch.float32))
    out = packed(q, k, v, False)
    merged_q, merged_k = [LEN_Q[0], LEN_Q[1] + LEN_Q[2]] + LEN_Q[3:], [LEN_K[0], LEN_K[1] + LEN_K[2]] + LEN_K[3:]
    leaky = formula(q.double(), k.double(), v.double(), False, merged_q, merged_k)
    assert (out.double() - leaky).abs().max() > 1e-2


@needs_kernels
@pytest.mark.parametrize("causal", [False, True])
def test_other_sequences_garbage_changes_nothing(causal, kernels_only):
    """Sequence 2's output, bit for bit, whatever the other sequences' tokens hold (huge values, NaN)."""
    q, k, v = (t.detach().float() for t in inputs(torch.float32))
    out = packed(q, k, v, causal)
    cq, ck = offsets(LEN_Q, "cpu").tolist(), offsets(LEN_K, "cpu").tolist()
    inside_q, inside_k = slice(cq[2], cq[3]), slice(ck[2], ck[3])
    dirty = []
    for t, inside in ((q, inside_q), (k, inside_k), (v, inside_k)):
        d = torch.full_like(t, 1e30)
        d[::3] = math.nan
        d[inside] = t[inside]
        dirty.append(d)
    again = packed(*dirty, causal)
    assert torch.equal(again[inside_q], out[inside_q])


@needs_kernels
def test_declined_calls_run_per_length(monkeypatch):
    """What the kernels do not take (log_u, templates, a window) runs the sequences per length, with the
    variant's own answer: the packed route returns None for it instead of a wrong answer."""
    from attnzoo.ops.ot import varlen as ot_varlen
    seen = []
    real = varlen.per_sequence
    monkeypatch.setattr(varlen, "per_sequence", lambda *a, **k: seen.append(1) or real(*a, **k))
    q, k, v = (t.detach().float() for t in inputs(torch.float32))
    assert ot_varlen.route(q, k, v, offsets(LEN_Q, "cpu"), offsets(LEN_K, "cpu"), 19, 18, False,
                           dict(backend="triton", log_u=torch.zeros(18))) is None
    assert ot_varlen.route(q, k, v, offsets(LEN_Q, "cpu"), offsets(LEN_K, "cpu"), 19, 18, False,
                           dict(backend="triton", window_size=(2, 0))) is None
    assert ot_varlen.route(q, k, v, offsets(LEN_Q, "cpu"), offsets(LEN_K, "cpu"), 19, 18, False,
                           dict(backend="triton", dropout_p=0.1)) is None
    same = [1, 5, 5]     # per length: equal lengths stack into one call of the variant's own function
    qs, ks, vs = (t[:sum(same)] for t in (q, k, v))
    with pytest.raises(ValueError, match="window_size|softcap"):
        packed(qs, ks, vs, False, same, same, softcap=2.0)
    assert seen == [1]


@pytest.mark.skipif(not INTERPRET, reason="CPU tensors reach the Triton kernels only under the interpreter")
def test_auto_keeps_cpu_calls_off_the_interpreter(monkeypatch):
    """auto takes the packed kernels on CUDA tensors only: a CPU call runs the sequences per length."""
    seen = []
    monkeypatch.setattr(varlen, "per_sequence", lambda *a, **k: seen.append(1) or torch.zeros(sum(LEN_Q), H, DV))
    q, k, v = (t.detach().float() for t in inputs(torch.float32))
    AF.varlen("ot", q, k, v, offsets(LEN_Q, "cpu"), offsets(LEN_K, "cpu"), max(LEN_Q), max(LEN_K), enable_gqa=True)
    assert seen == [1]


@needs_kernels
def test_compiles_in_one_graph_with_offsets_as_tensors(monkeypatch):
    """torch.compile(fullgraph=True) keeps the packed kernels (no host read of the offsets, no padded
    route): the compiled forward and gradients equal the eager call's, and new offsets of the same shape
    run in the same graph."""
    monkeypatch.setattr(varlen, "padded", lambda *a, **k: pytest.fail("the padded route was taken"))
    q, k, v = (t.detach().float().to(KERNEL_DEVICE).requires_grad_() for t in inputs(torch.float32))

    def step(q, k, v, cu_q, cu_k):
        return AF.varlen("ot", q, k, v, cu_q, cu_k, 19, 18, is_causal=True, alpha=ALPHA, gamma=GAMMA,
                         enable_gqa=True, backend="triton")

    compiled = torch.compile(step, fullgraph=True, backend="eager" if INTERPRET else "inductor")
    for len_q, len_k in ((LEN_Q, LEN_K), ([2, 19, 1, 3, 5], [18, 1, 5, 2, 17])):
        cu_q, cu_k = offsets(len_q, KERNEL_DEVICE), offsets(len_k, KERNEL_DEVICE)
        got = compiled(q, k, v, cu_q, cu_k)
        want = step(q, k, v, cu_q, cu_k)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
        g = torch.randn_like(want)
        for a, b in zip(torch.autograd.grad(got, (q, k, v), g), torch.autograd.grad(want, (q, k, v), g)):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
