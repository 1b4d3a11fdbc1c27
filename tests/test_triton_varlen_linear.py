"""Packed (varlen) linear attention on its Triton kernels (ops/linear/varlen.py), under the interpreter on
CPU or on a GPU: every sequence's output and gradients equal linear attention's formula run on that
sequence alone, written here from the definition (phi, the 1e-6, causal prefix sums restarting at each
sequence's start), in float64; FlashAttention's rule (tests/flash_rule.py) against the same formula in
fp32 for fp32, bf16 and fp16 inputs. Grouped heads (4 query heads on 2 key heads), causal and not,
n_q != n_k both ways, a length-1 sequence, sequences longer than the interpreter's 16-row chunks and
16-row query tiles, head dims across its 16-wide tiles, q, k, v read in place from wider rows, and
torch.compile(fullgraph=True)."""
from __future__ import annotations

import pytest
import torch

import attnzoo.functional as AF
from attnzoo.ops import varlen
from tests.common import INTERPRET, KERNEL_DEVICE, needs_kernels
from tests.flash_rule import assert_flash_rule

H, H_KV, D, DV = 4, 2, 5, 3
# (n_q, n_k): a query with one key, equal lengths, n_q > n_k past a chunk (causal: queries that see no
# key), a single key, n_k > n_q by more than a chunk (causal: keys every query sees)
LEN_Q = [1, 5, 19, 3, 2]
LEN_K = [2, 5, 17, 1, 19]
SCALE = 0.8
EPS = 1e-6


def offsets(lengths, device, dtype=torch.int32):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=dtype, device=device)


def phi(x, feature_map):
    if feature_map == "elu":                  # elu(x) + 1
        return torch.where(x > 0, x + 1, torch.exp(x))
    if feature_map == "relu":
        return x.clamp(min=0)
    return x


def one_sequence(q, k, v, causal, feature_map, scale):
    """q (n_q, D), k (n_k, D), v (n_k, Dv) of one head: the formula with the key sums as prefix sums."""
    fq, fk = phi(q * scale, feature_map), phi(k, feature_map)
    states = torch.cumsum(fk[:, :, None] * v[:, None, :], dim=0)        # (n_k, D, Dv): sum_{j<=m} phi(k_j) v_j^T
    norms = torch.cumsum(fk, dim=0)                                      # (n_k, D): sum_{j<=m} phi(k_j)
    n_q, n_k = q.shape[0], k.shape[0]
    rows = []
    for i in range(n_q):
        last = i + n_k - n_q if causal else n_k - 1                      # the last key query i sees
        if last < 0:
            rows.append(torch.zeros_like(v[0]))
            continue
        num = fq[i] @ states[last]
        rows.append(num / (last + 1) if feature_map == "identity" else num / (fq[i] @ norms[last] + EPS))
    return torch.stack(rows)


def formula(q, k, v, causal, feature_map, len_q=LEN_Q, len_k=LEN_K):
    """Packed q (T_q, H, D), k, v (T_k, H_KV, .) -> (T_q, H, Dv), each sequence and head on its own; query
    head h reads key head h // (H / H_KV)."""
    out, cq, ck = [], 0, 0
    for nq, nk in zip(len_q, len_k):
        heads = [one_sequence(q[cq:cq + nq, h], k[ck:ck + nk, h // (H // H_KV)], v[ck:ck + nk, h // (H // H_KV)],
                              causal, feature_map, SCALE) for h in range(H)]
        out.append(torch.stack(heads, dim=1))
        cq, ck = cq + nq, ck + nk
    return torch.cat(out)


def inputs(dtype, seed=0, d=D, dv=DV):
    """q, k, v as CPU leaves of ``dtype``; each is a column slice of a wider tensor, so rows are strided."""
    g = torch.Generator().manual_seed(seed)
    wide = [torch.randn(sum(n), h, width + 2, generator=g, dtype=torch.float64)
            for n, h, width in ((LEN_Q, H, d), (LEN_K, H_KV, d), (LEN_K, H_KV, dv))]
    return [w.to(dtype)[..., 2:].requires_grad_() for w in wide]


def check(causal, feature_map, dtype, monkeypatch, offsets_dtype=torch.int32, d=D, dv=DV):
    monkeypatch.setattr(varlen, "per_sequence", lambda *a, **k: pytest.fail("the packed kernels were not taken"))
    q, k, v = inputs(dtype, d=d, dv=dv)
    dev = KERNEL_DEVICE
    cu_q, cu_k = offsets(LEN_Q, dev, offsets_dtype), offsets(LEN_K, dev, offsets_dtype)
    out = AF.varlen("linear", q.to(dev), k.to(dev), v.to(dev), cu_q, cu_k,
                    max(LEN_Q), max(LEN_K), is_causal=causal, scale=SCALE, feature_map=feature_map,
                    enable_gqa=True, backend="triton").cpu()
    assert out.shape == (sum(LEN_Q), H, dv) and out.dtype == dtype
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got_g = torch.autograd.grad(out, (q, k, v), grad.to(dtype))
    wide = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = formula(*wide, causal, feature_map)
    want_g = torch.autograd.grad(want, wide, grad)
    same = [t.detach().float().requires_grad_() for t in (q, k, v)]   # the formula as a reference runs it
    low = formula(*same, causal, feature_map)
    low_g = [g.to(dtype) for g in torch.autograd.grad(low, same, grad.float())]
    assert all(torch.isfinite(t).all() for t in (out,) + got_g)
    assert_flash_rule(f"packed linear {feature_map} causal={causal}", dtype, 1.0,
                      [("out", out, low.to(dtype), want)]
                      + [(f"d{n}", g, lo, w) for n, g, lo, w in zip("qkv", got_g, low_g, want_g)])


@needs_kernels
@pytest.mark.parametrize("causal,feature_map", [(False, "elu"), (False, "identity"), (True, "elu"), (True, "relu"),
                                                (True, "identity")])
def test_packed_equals_each_sequence_alone(causal, feature_map, monkeypatch):
    check(causal, feature_map, torch.float32, monkeypatch)


@needs_kernels
@pytest.mark.parametrize("causal,dtype", [(False, torch.bfloat16), (True, torch.float16)], ids=str)
def test_packed_half_meets_the_flash_rule(causal, dtype, monkeypatch):
    """(int64 offsets here: varlen accepts them beside varlen_attn's int32.)"""
    check(causal, "elu", dtype, monkeypatch, offsets_dtype=torch.int64)


@needs_kernels
@pytest.mark.parametrize("causal,feature_map", [(True, "identity"), (False, "relu")])
def test_head_dims_across_tiles(causal, feature_map, monkeypatch):
    """D = 20, Dv = 18: several 16-wide head-dim tiles under the interpreter (state tiles, the dq / dk
    tiles of the causal backward, the non-causal reductions' row tiles)."""
    check(causal, feature_map, torch.float32, monkeypatch, d=20, dv=18)


@needs_kernels
def test_noncausal_key_ranges_split_per_sequence(monkeypatch):
    """The non-causal reductions split into 16-row ranges of max_k / max_q (a GPU splits when sequences x
    heads leave it idle): the 19-row sequence takes two ranges, the shorter ones one and an empty one."""
    from attnzoo.ops.linear import noncausal
    splits = []
    monkeypatch.setattr(noncausal, "_splits", lambda n_rows, programs, rows: splits.append(-(-n_rows // 16)) or
                        (splits[-1], 16))
    check(False, "elu", torch.float32, monkeypatch)
    assert splits == [2, 2]             # the keys' reduction (max_k 19), the backward's over queries (max_q 19)


@needs_kernels
def test_the_rule_sees_a_sequence_that_leaks_into_the_next():
    """The test's own power: the formula with the second and third sequences merged (their sums not
    restarted) differs from the packed kernels' answer by far more than the rule allows."""
    q, k, v = (t.detach().float() for t in inputs(torch.float32))
    dev = KERNEL_DEVICE
    out = AF.varlen("linear", q.to(dev), k.to(dev), v.to(dev), offsets(LEN_Q, dev), offsets(LEN_K, dev),
                    max(LEN_Q), max(LEN_K), scale=SCALE, enable_gqa=True, backend="triton").cpu()
    merged_q, merged_k = [LEN_Q[0], LEN_Q[1] + LEN_Q[2]] + LEN_Q[3:], [LEN_K[0], LEN_K[1] + LEN_K[2]] + LEN_K[3:]
    leaky = formula(q.double(), k.double(), v.double(), False, "elu", merged_q, merged_k)
    assert (out.double() - leaky).abs().max() > 1e-2


@pytest.mark.skipif(not INTERPRET, reason="CPU tensors reach the Triton kernels only under the interpreter")
def test_auto_keeps_cpu_calls_off_the_interpreter(monkeypatch):
    """auto takes the packed kernels on CUDA tensors only: a CPU call runs the sequences per length."""
    seen = []
    monkeypatch.setattr(varlen, "per_sequence", lambda *a, **k: seen.append(1) or torch.zeros(sum(LEN_Q), H, DV))
    q, k, v = (t.detach().float() for t in inputs(torch.float32))
    AF.varlen("linear", q, k, v, offsets(LEN_Q, "cpu"), offsets(LEN_K, "cpu"), max(LEN_Q), max(LEN_K),
              enable_gqa=True)
    assert seen == [1]


@needs_kernels
def test_compiles_in_one_graph_with_offsets_as_tensors(monkeypatch):
    """torch.compile(fullgraph=True) keeps the packed causal kernels (no host read of the offsets, no padded
    route): the compiled forward and gradients equal the eager call's, and new offsets of the same shape
    run in the same graph."""
    monkeypatch.setattr(varlen, "padded", lambda *a, **k: pytest.fail("the padded route was taken"))
    q, k, v = (t.detach().float().to(KERNEL_DEVICE).requires_grad_() for t in inputs(torch.float32))

    def step(q, k, v, cu_q, cu_k):
        return AF.varlen("linear", q, k, v, cu_q, cu_k, 19, 19, is_causal=True, scale=SCALE, enable_gqa=True,
                         backend="triton")

    compiled = torch.compile(step, fullgraph=True, backend="eager" if INTERPRET else "inductor")
    for len_q, len_k in ((LEN_Q, LEN_K), ([2, 19, 1, 3, 5], [19, 1, 5, 2, 17])):
        cu_q, cu_k = offsets(len_q, KERNEL_DEVICE), offsets(len_k, KERNEL_DEVICE)
        got = compiled(q, k, v, cu_q, cu_k)
        want = step(q, k, v, cu_q, cu_k)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
        g = torch.randn_like(want)
        for a, b in zip(torch.autograd.grad(got, (q, k, v), g), torch.autograd.grad(want, (q, k, v), g)):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
