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
# (n_q, n_k): one query on keys past a tile (n_k > n_q), n_q > n_k past a tile (causal: queries that see
# no key), a single key; three sequences keep the interpreter's time down
LEN_Q = [1, 19, 4]
LEN_K = [18, 6, 1]
ALPHA, GAMMA = 0.7, 1.3


def offsets(lengths, device, dtype=torch.int32):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=dtype, device=device)


def one_sequence(q, k, v, causal, alpha, gamma):
    """Eq (22) with M(a, b) = -a.b on one sequence: q (H, n_q, D), k (H, n_k, D), v (H, n_k, Dv) ->
    (H, n_q, Dv). Query i keeps the keys j <= i + n_k - n_q when causal (all of them otherwise); they are
    its sources, with u_j = 1 / (their number), and its templates: out_i = sum_t v_t sum_j u_j
    softmax_t((alpha q_i.k_t + k_j.k_t) / gamma). A query that keeps no key gets 0."""
    n_q, n_k = q.shape[1], k.shape[1]
    i, j = torch.arange(n_q)[:, None], torch.arange(n_k)[None, :]
    keep = (j <= i + n_k - n_q) if causal else torch.ones(n_q, n_k, dtype=torch.bool)   # (i, j)
    count = keep.sum(1)
    u = keep / count.clamp(min=1)[:, None]                                   # rows without keys: u = 0
    logits = (alpha * (q @ k.mT)[:, :, None, :] + (k @ k.mT)[:, None, :, :]) / gamma      # (H, i, j, t)
    templates = (keep | (count == 0)[:, None])[None, :, None, :]             # (such a row's u is 0 anyway)
    p = torch.softmax(logits.masked_fill(~templates, -math.inf), dim=-1)
    return (u[None, :, :, None] * p).sum(2) @ v                              # W (H, i, t) @ v


def formula(q, k, v, causal, len_q=LEN_Q, len_k=LEN_K, alpha=ALPHA, gamma=GAMMA):
    """Packed q (T_q, H, D), k, v (T_k, H_kv, .) -> (T_q, H, Dv), each sequence on its own; query head h
    reads key head h // (H / H_kv)."""
    out, cq, ck = [], 0, 0
    shared = torch.arange(q.shape[1]) // (q.shape[1] // k.shape[1])
    for nq, nk in zip(len_q, len_k):
        seq_q, seq_k, seq_v = (t.transpose(0, 1) for t in (q[cq:cq + nq], k[ck:ck + nk], v[ck:ck + nk]))
        out.append(one_sequence(seq_q, seq_k[shared], seq_v[shared], causal, alpha, gamma).transpose(0, 1))
        cq, ck = cq + nq, ck + nk
    return torch.cat(out)


def inputs(dtype, seed=0, heads=H, kv_heads=H_KV):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(sum(n), h, width, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
            for n, h, width in ((LEN_Q, heads, D), (LEN_K, kv_heads, D), (LEN_K, kv_heads, DV))]


def packed(q, k, v, causal, len_q=LEN_Q, len_k=LEN_K, maxima=None, **kw):
    dev = KERNEL_DEVICE
    max_q, max_k = maxima or (max(len_q), max(len_k))
    return AF.varlen("ot", q.to(dev), k.to(dev), v.to(dev), offsets(len_q, dev), offsets(len_k, dev),
                     max_q, max_k, is_causal=causal, alpha=ALPHA, gamma=GAMMA, enable_gqa=True,
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
@pytest.mark.parametrize("causal,chunked", [(False, False), (True, True)])
def test_packed_equals_each_sequence_alone(causal, chunked, kernels_only, monkeypatch):
    """chunked: CHUNK_BYTES holds 5 (sequence, head) pairs, so chunks start inside a sequence's heads
    (pair 5 is sequence 1's head 1) and the kernels find each pair's sequence from the chunk's start."""
    from attnzoo.ops.ot import triton as ot_triton
    starts = []
    if chunked:
        per_pair = ot_triton.pair_bytes(max(LEN_Q), max(LEN_K), max(LEN_K), D, DV, torch.float32, backward=True,
                                        need_dlu=False)
        monkeypatch.setattr(ot_triton, "CHUNK_BYTES", 5 * per_pair)
        real = ot_triton._backward_chunk
        monkeypatch.setattr(ot_triton, "_backward_chunk", lambda *a, **k: starts.append(a[10]) or real(*a, **k))
    check(causal, torch.float32)
    assert starts == ([0, 5, 10] if chunked else [])


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
@pytest.mark.filterwarnings("ignore::RuntimeWarning")       # numpy's, on the garbage in the other sequences
def test_other_sequences_garbage_changes_nothing(kernels_only):
    """The middle sequence's output and the gradients of its tokens, whatever the others' tokens hold
    (huge values, NaN): those of the sequence packed alone (N = 1) with the same maxima, the output bit
    for bit (the kernels do the same arithmetic on the same blocks), the gradients to 1e-6 (dq, dk come
    from batched host matmuls over the pairs, which may round differently for another batch count).
    Two query heads on one key head: half the interpreter's time of the other tests' four on two."""
    clean = [t.detach().float() for t in inputs(torch.float32, heads=2, kv_heads=1)]
    cq, ck = offsets(LEN_Q, "cpu").tolist(), offsets(LEN_K, "cpu").tolist()
    inside_q, inside_k = slice(cq[1], cq[2]), slice(ck[1], ck[2])
    dirty = []
    for t, inside in zip(clean, (inside_q, inside_k, inside_k)):
        d = torch.full_like(t, 1e30)
        d[::3] = math.nan
        d[inside] = t[inside]
        dirty.append(d)
    alone = [t[inside] for t, inside in zip(clean, (inside_q, inside_k, inside_k))]
    results = []
    for (q, k, v), len_q, len_k in ((dirty, LEN_Q, LEN_K), (alone, LEN_Q[1:2], LEN_K[1:2])):
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
        out = packed(q, k, v, True, len_q, len_k, maxima=(max(LEN_Q), max(LEN_K)))
        rows = inside_q if len(len_q) > 1 else slice(None)
        keys = inside_k if len(len_q) > 1 else slice(None)
        cotangent = torch.zeros_like(out)
        cotangent[rows] = torch.linspace(-1, 1, cotangent[rows].numel()).view_as(cotangent[rows])
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), cotangent)
        results.append((out[rows], dq[rows], dk[keys], dv[keys]))
    (out, *grads), (out_alone, *grads_alone) = results
    assert torch.equal(out, out_alone)
    for name, a, b in zip(("dq", "dk", "dv"), grads, grads_alone):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6, msg=lambda m: f"{name}: {m}")


@needs_kernels
@pytest.mark.parametrize("option", ["log_u", "templates", "window_size", "dropout_p", "softcap", "float64"])
def test_what_the_kernels_do_not_take_goes_per_length(option):
    """The packed route returns None (the sequences then run per length through ``attnzoo.functional.ot``,
    which computes or refuses them with its own reason) rather than a wrong answer."""
    from attnzoo.ops.ot import varlen as ot_varlen
    q, k, v = (t.detach().float() for t in inputs(torch.float32))
    extra = {"log_u": dict(log_u=torch.zeros(sum(LEN_K))),
             "templates": dict(templates_k=torch.zeros(1, H, 2, D), templates_v=torch.zeros(1, H, 2, DV)),
             "window_size": dict(window_size=(2, 0)), "dropout_p": dict(dropout_p=0.1),
             "softcap": dict(softcap=2.0), "float64": {}}[option]
    if option == "float64":
        q, k, v = q.double(), k.double(), v.double()
    kwargs = dict(backend="triton", enable_gqa=True, **extra)
    assert ot_varlen.route(q, k, v, offsets(LEN_Q, "cpu"), offsets(LEN_K, "cpu"), 19, 18, False, kwargs) is None


@needs_kernels
def test_a_refused_extra_gets_the_variants_own_error(monkeypatch):
    """softcap reaches the per-length route, where OT refuses it by name."""
    seen = []
    real = varlen.per_sequence
    monkeypatch.setattr(varlen, "per_sequence", lambda *a, **k: seen.append(1) or real(*a, **k))
    q, k, v = (t.detach().float() for t in inputs(torch.float32))
    with pytest.raises((ValueError, TypeError), match="softcap"):
        packed(q, k, v, False, softcap=2.0)
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
    route, no per-length route): the compiled forward and gradients equal the formula's, and new offsets
    of the same shape (other lengths) run in the same graph. Two query heads on one key head (time)."""
    monkeypatch.setattr(varlen, "padded", lambda *a, **k: pytest.fail("the padded route was taken"))
    q, k, v = (t.detach().float().to(KERNEL_DEVICE).requires_grad_()
               for t in inputs(torch.float32, heads=2, kv_heads=1))
    wide = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]

    def step(q, k, v, cu_q, cu_k):
        return AF.varlen("ot", q, k, v, cu_q, cu_k, 19, 18, is_causal=True, alpha=ALPHA, gamma=GAMMA,
                         enable_gqa=True, backend="triton")

    compiled = torch.compile(step, fullgraph=True, backend="eager" if INTERPRET else "inductor")
    got = compiled(q, k, v, offsets(LEN_Q, KERNEL_DEVICE), offsets(LEN_K, KERNEL_DEVICE))
    want = formula(*wide, True)
    torch.testing.assert_close(got.cpu().double(), want, atol=1e-5, rtol=1e-5)
    g = torch.randn(want.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), g.float().to(KERNEL_DEVICE)), torch.autograd.grad(want, wide, g)):
        torch.testing.assert_close(a.cpu().double(), b, atol=1e-4, rtol=1e-4)
    len_q, len_k = [4, 1, 19], [6, 1, 18]
    got = compiled(q, k, v, offsets(len_q, KERNEL_DEVICE), offsets(len_k, KERNEL_DEVICE))
    torch.testing.assert_close(got.detach().cpu().double(), formula(*wide, True, len_q, len_k), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not INTERPRET, reason="counts the interpreter's launches")
def test_one_launch_set_for_all_sequences(monkeypatch):
    """The packed call launches each kernel once for every sequence together (the dense call's set: two
    exponential passes, the pair normalisers, the output, the exact fallback; backward: the same first
    three, dC, dG, the fallback), where the per-length route launched a set per distinct length."""
    from triton.runtime.interpreter import InterpretedFunction
    seen = []
    monkeypatch.setattr(InterpretedFunction, "run", lambda self, *a, grid, warmup, **k: seen.append(self.fn.__name__))
    q, k, v = inputs(torch.float32)
    out = packed(q, k, v, True)
    forward = list(seen)
    seen.clear()
    torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert forward == ["_exp_kernel", "_exp_kernel", "_pair_kernel", "_out_kernel", "_fallback_fwd_kernel"]
    assert seen == ["_exp_kernel", "_exp_kernel", "_pair_kernel", "_dc_kernel", "_dg_kernel", "_fallback_bwd_kernel"]
