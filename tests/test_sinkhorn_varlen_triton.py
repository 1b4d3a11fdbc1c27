"""Packed (varlen) Sinkhorn on the Triton kernels (ops/sinkhorn/varlen.py): every sequence of a packed call
in one launch per pass, each its own Sinkhorn problem (rows 1, columns n_q / n_k of its own lengths).

Each packed answer, forward and gradients, equals a float64 log-domain Sinkhorn written here from the
formula (paper 002 sec 2.4) run on each sequence alone; fp32 tightly, bf16 / fp16 by FlashAttention's
rule. Lengths 1, below and above the interpreter's 16-row tiles, Nq != Nk per sequence (so the column
target log(n_q / n_k) differs per sequence), grouped-query heads, costs l2 and dot, softcap, n_iters 0
to 3, and causal (each sequence's prefix loop, prefix i of all sequences at once). The route is shown taken (the per-length and padded routes patched to fail), a sequence shown
untouched by garbage in another (no tile crosses a boundary), the declined calls shown declined, and
the offsets still checked. CPU tensors under TRITON_INTERPRET=1 (backend="triton" by name: auto picks
Triton on CUDA only); the GPU test at the end runs the compiled kernels through auto."""
from __future__ import annotations

import math
import sys

import pytest
import torch

import attnzoo.functional as AF
from attnzoo.ops import varlen_triton
from tests.common import needs_gpu, needs_interpreter, refuse_other_packed_routes
from tests.flash_rule import assert_flash_rule
from tests.sinkhorn_math import lse

H, H_KV, D, DV = 2, 1, 8, 6
LEN_Q = [1, 20, 5]     # 1 token, more than a 16-row tile, below one; Nq != Nk in two of them
LEN_K = [3, 17, 5]
SCALE = D ** -0.5


def offsets(lengths, device="cpu"):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=device)


def packed_inputs(dtype, seed=0, device="cpu"):
    """float64 draws rounded to ``dtype`` (the float64 truth sees exactly the tested inputs)."""
    g = torch.Generator().manual_seed(seed)
    shapes = ((sum(LEN_Q), H, D), (sum(LEN_K), H_KV, D), (sum(LEN_K), H_KV, DV))
    return [torch.randn(s, generator=g, dtype=torch.float64).to(dtype).to(device) for s in shapes]


def cotangent(seed=3):
    return torch.randn(sum(LEN_Q), H, DV, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def sinkhorn_formula(q, k, v, n_iters, eps, cost, softcap):
    """One sequence, (H, n, D): logits L = -scale |q_i - k_j|^2 / (2 eps) (l2) or scale q_i.k_j / eps (dot),
    capped to softcap tanh(L / softcap); f_i = -lse_j(L_ij + g_j), g_j = log(n_q / n_k) - lse_i(L_ij + f_i)
    from g = 0, n_iters times; out = softmax_j(L_ij + g_j) v_j."""
    if cost == "l2":
        L = -SCALE * ((q[:, :, None, :] - k[:, None, :, :]) ** 2).sum(-1) / (2 * eps)
    else:
        L = SCALE * q @ k.transpose(-1, -2) / eps
    if softcap is not None:
        L = softcap * torch.tanh(L / softcap)
    nq, nk = L.shape[-2:]
    g = torch.zeros(L.shape[0], 1, nk, dtype=L.dtype)
    for _ in range(n_iters):
        f = -torch.logsumexp(L + g, dim=-1, keepdim=True)
        g = math.log(nq / nk) - torch.logsumexp(L + f, dim=-2, keepdim=True)
    return torch.softmax(L + g, dim=-1) @ v


def causal_formula(q, k, v, n_iters, eps, cost, softcap):
    """Causal Sinkhorn on one sequence (paper 002 eq 2.6): row i is the last row of the formula on its
    prefix, keys 0..i + n_k - n_q and the queries that have a position among them (a >= n_q - n_k);
    a row with no key is zero."""
    nq, nk = q.shape[1], k.shape[1]
    rows = []
    for i in range(nq):
        last = i + nk - nq
        if last < 0:
            rows.append(torch.zeros(q.shape[0], 1, v.shape[-1], dtype=v.dtype))
            continue
        first = max(0, nq - nk)
        out = sinkhorn_formula(q[:, first:i + 1], k[:, :last + 1], v[:, :last + 1], n_iters, eps, cost, softcap)
        rows.append(out[:, -1:])
    return torch.cat(rows, dim=1)


def one_by_one(q, k, v, n_iters=3, eps=1.0, cost="l2", softcap=None, is_causal=False):
    """The formula on each packed sequence alone, k and v's shared head expanded to q's heads."""
    formula = causal_formula if is_causal else sinkhorn_formula
    outs, cq, ck = [], 0, 0
    for nq, nk in zip(LEN_Q, LEN_K):
        ks, vs = (t[ck:ck + nk].transpose(0, 1).repeat_interleave(H // H_KV, dim=0) for t in (k, v))
        outs.append(formula(q[cq:cq + nq].transpose(0, 1), ks, vs, n_iters, eps, cost, softcap).transpose(0, 1))
        cq, ck = cq + nq, ck + nk
    return torch.cat(outs)


def packed(**options):
    return lambda q, k, v: AF.varlen("sinkhorn", q, k, v, offsets(LEN_Q), offsets(LEN_K), max(LEN_Q), max(LEN_K),
                                     enable_gqa=True, **{"backend": "triton", **options})


def out_and_grads(fn, inputs, cot):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    return [out] + list(torch.autograd.grad((out.double() * cot).sum(), leaves))


@pytest.fixture
def only_the_packed_kernels(monkeypatch):
    """The per-length, padded and blockwise routes fail if reached: what passes ran the varlen kernels."""
    refuse_other_packed_routes(monkeypatch)


@needs_interpreter
@pytest.mark.parametrize("cost,softcap,n_iters,eps", [("l2", None, 3, 1.0), ("dot", None, 2, 0.7),
                                                      ("l2", 2.0, 1, 0.5), ("dot", 1.5, 0, 1.0)],
                         ids=["l2", "dot", "l2-softcap", "dot-softcap-0-iters"])
def test_fp32_packed_equals_each_sequence_alone(cost, softcap, n_iters, eps, only_the_packed_kernels):
    """Output and dq, dk, dv (k, v with one head shared by two query heads) to 1e-5 of the float64
    formula per sequence (measured: ~5e-7)."""
    inputs, cot = packed_inputs(torch.float32), cotangent()
    options = dict(cost=cost, softcap=softcap, n_iters=n_iters, eps=eps)
    got = out_and_grads(packed(**options), inputs, cot)
    want = out_and_grads(lambda q, k, v: one_by_one(q, k, v, **options), [t.double() for t in inputs], cot)
    assert got[0].dtype == torch.float32
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def banded_formula(q, k, v, window):
    """One sequence, (H, n, D), cost l2, n_iters 3, eps 1: Sinkhorn on the band's entries only (key j for
    query i iff -left <= j - (i + n_k - n_q) <= right), columns still to n_q / n_k; a row or column with
    no entry drops out (its potential 0, its output row 0)."""
    nq, nk = q.shape[1], k.shape[1]
    rel = torch.arange(nk)[None, :] - torch.arange(nq)[:, None] - (nk - nq)
    band = (rel >= -window[0]) & ((rel <= window[1]) if window[1] >= 0 else torch.ones_like(rel, dtype=torch.bool))
    L = -SCALE * ((q[:, :, None, :] - k[:, None, :, :]) ** 2).sum(-1) / 2
    L = L.masked_fill(~band, -math.inf)
    g = torch.zeros(L.shape[0], 1, nk, dtype=L.dtype)
    for _ in range(3):
        f = -lse(L + g, -1)
        g = math.log(nq / nk) - lse(L + f, -2)
    z = L + g
    return torch.exp(z - lse(z, -1)) @ v


@needs_interpreter
@pytest.mark.parametrize("window", [(2, 1), (0, 3), (4, -1)])
def test_fp32_window_is_each_sequences_own_band(window, only_the_packed_kernels):
    """A non-causal window on the packed kernels: each sequence's band (bottom-right on its own lengths,
    rows without a key in it zero), output and gradients to 1e-5 of the float64 formula."""
    inputs, cot = packed_inputs(torch.float32), cotangent()
    got = out_and_grads(packed(window_size=window), inputs, cot)

    def one_by_one_banded(q, k, v):
        outs, cq, ck = [], 0, 0
        for nq, nk in zip(LEN_Q, LEN_K):
            ks, vs = (t[ck:ck + nk].transpose(0, 1).repeat_interleave(H // H_KV, dim=0) for t in (k, v))
            outs.append(banded_formula(q[cq:cq + nq].transpose(0, 1), ks, vs, window).transpose(0, 1))
            cq, ck = cq + nq, ck + nk
        return torch.cat(outs)
    want = out_and_grads(one_by_one_banded, [t.double() for t in inputs], cot)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


@needs_interpreter
def test_fp32_causal_runs_each_prefix_of_every_sequence_at_once(monkeypatch, only_the_packed_kernels):
    """Causal: prefix i of every sequence in one packed problem. Sequences with more queries than keys
    (their first n_q - n_k queries take part in no problem, their first rows see no key: zero), fewer,
    as many, and one token; output and gradients to 1e-5 of the formula per sequence and row. Lengths
    below a tile: the prefix loop is the host's, the kernels are the non-causal tests' (17+ prefixes
    would cost seconds each under the interpreter)."""
    monkeypatch.setattr(sys.modules[__name__], "LEN_Q", [1, 5, 3, 4])
    monkeypatch.setattr(sys.modules[__name__], "LEN_K", [3, 3, 5, 4])
    inputs, cot = packed_inputs(torch.float32, seed=8), cotangent(seed=9)
    options = dict(n_iters=1, eps=0.8, cost="l2")
    got = out_and_grads(packed(is_causal=True, **options), inputs, cot)
    want = out_and_grads(lambda q, k, v: one_by_one(q, k, v, is_causal=True, **options), [t.double() for t in inputs],
                         cot)
    assert float(want[0][1:3].detach().abs().max()) == 0.0      # sequence 1's first two rows see no key
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


@needs_interpreter
def test_fp32_terms_taken_one_exponential_each(monkeypatch, only_the_packed_kernels):
    """FACTOR_MAX below every factor: _grad_qk_kernel takes each unrolled term by its own exponential
    (its slow path, which indexes the per-sequence stacks by iteration, as at tiny eps). Gradients to
    1e-5 of the formula."""
    from attnzoo.ops.sinkhorn import triton as sinkhorn_triton
    monkeypatch.setattr(sinkhorn_triton, "FACTOR_MAX", -1e4)
    inputs, cot = packed_inputs(torch.float32, seed=4), cotangent(seed=5)
    got = out_and_grads(packed(n_iters=2, eps=0.5), inputs, cot)
    want = out_and_grads(lambda q, k, v: one_by_one(q, k, v, n_iters=2, eps=0.5), [t.double() for t in inputs], cot)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


@needs_interpreter
def test_fp32_large_call_path(monkeypatch, only_the_packed_kernels):
    """FOLD_BELOW at 0: the path of large calls, g^0 = -a |k|^2 and delta = dout.out by the row-dot
    launch on the blocked rows instead of inside the first passes. Output and gradients to 1e-5."""
    from attnzoo.ops.sinkhorn import varlen as sinkhorn_varlen
    monkeypatch.setattr(sinkhorn_varlen, "FOLD_BELOW", 0)
    inputs, cot = packed_inputs(torch.float32, seed=6), cotangent(seed=7)
    got = out_and_grads(packed(n_iters=1), inputs, cot)
    want = out_and_grads(lambda q, k, v: one_by_one(q, k, v, n_iters=1), [t.double() for t in inputs], cot)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_packed_follows_flash_rule(dtype, only_the_packed_kernels):
    """bf16 / fp16 in and out: output and gradients within FlashAttention's rule of the float64 formula,
    the yardstick being the same formula computed in fp32 on the half inputs and stored in the dtype."""
    inputs, cot = packed_inputs(dtype, seed=1), cotangent(seed=2)
    got = out_and_grads(packed(n_iters=2), inputs, cot)
    low = [t.to(dtype) for t in out_and_grads(lambda q, k, v: one_by_one(q, k, v, n_iters=2),
                                              [t.float() for t in inputs], cot)]
    want = out_and_grads(lambda q, k, v: one_by_one(q, k, v, n_iters=2), [t.double() for t in inputs], cot)
    assert got[0].dtype == dtype
    assert_flash_rule(f"sinkhorn-varlen-{dtype}", dtype, 1.0, list(zip(("out", "dq", "dk", "dv"), got, low, want)))


@needs_interpreter
@pytest.mark.filterwarnings("ignore::RuntimeWarning")   # numpy's, on the NaN sequence inside the interpreter
def test_garbage_in_one_sequence_leaves_the_others_bit_for_bit(only_the_packed_kernels):
    """Sequence 1's tokens (q, k and v) replaced by NaN: every other sequence's output and gradients are
    unchanged to the bit. A tile that crossed a boundary, or a marginal counting another sequence's
    tokens, would read the NaNs."""
    inputs, cot = packed_inputs(torch.float32), cotangent()
    spoiled = [t.clone() for t in inputs]
    (q0, q1), (k0, k1) = offsets(LEN_Q)[1:3].tolist(), offsets(LEN_K)[1:3].tolist()
    spoiled[0][q0:q1] = float("nan")
    spoiled[1][k0:k1] = float("nan")
    spoiled[2][k0:k1] = float("nan")
    clean, dirty = out_and_grads(packed(n_iters=1), inputs, cot), out_and_grads(packed(n_iters=1), spoiled, cot)
    assert dirty[0][q0:q1].isnan().all()        # the garbage did reach the kernels
    keep_q = torch.ones(sum(LEN_Q), dtype=torch.bool)
    keep_q[q0:q1] = False
    keep_k = torch.ones(sum(LEN_K), dtype=torch.bool)
    keep_k[k0:k1] = False
    for name, a, b, keep in zip(("out", "dq", "dk", "dv"), clean, dirty, (keep_q, keep_q, keep_k, keep_k)):
        assert torch.equal(a[keep], b[keep]), name


def test_route_is_registered_and_chosen_by_backend():
    q = torch.zeros(3, H, D)
    assert varlen_triton.chosen("sinkhorn", q, "triton")
    assert not varlen_triton.chosen("sinkhorn", q, "triton_implicit")     # the implicit backward: per length
    assert not varlen_triton.chosen("sinkhorn", q, "cpu")


@needs_interpreter
@pytest.mark.parametrize("extra", [{"is_causal": True, "window_size": (2, 0)},
                                   {"dropout_p": 0.1}, {"sinks": torch.zeros(H)}, {"unknown": 1}],
                         ids=["causal_window", "dropout", "sinks", "unknown_option"])
def test_declined_calls_take_the_other_routes(extra):
    """What the packed kernels do not compute is declined (None: the caller runs the sequences per length
    through the variant's own function, which computes or refuses it), never run wrongly."""
    q, k, v = packed_inputs(torch.float32)
    extra = dict(extra)
    causal = extra.pop("is_causal", False)
    kwargs = {**dict(scale=None, dropout_p=0.0, backend="triton", enable_gqa=True, n_iters=2), **extra}
    assert varlen_triton.run("sinkhorn", q, k, v, offsets(LEN_Q), offsets(LEN_K), max(LEN_Q), max(LEN_K), causal,
                             kwargs) is None


@needs_interpreter
def test_sinks_are_refused_by_the_variant():
    q, k, v = packed_inputs(torch.float32)
    with pytest.raises(ValueError, match="sinks"):
        packed(sinks=torch.zeros(H))(q, k, v)


@needs_interpreter
def test_options_offsets_and_heads_are_still_checked():
    q, k, v = packed_inputs(torch.float32)
    with pytest.raises(ValueError, match="n_iters"):
        packed(n_iters=-1)(q, k, v)
    with pytest.raises(ValueError, match="cost"):
        packed(cost="cosine")(q, k, v)
    with pytest.raises(ValueError, match="eps"):
        packed(eps=0.0)(q, k, v)
    with pytest.raises(ValueError, match="sequence 1 length 0"):
        AF.varlen("sinkhorn", q, k, v, offsets([1, 0, sum(LEN_Q) - 1]), offsets(LEN_K), sum(LEN_Q), max(LEN_K),
                  backend="triton", enable_gqa=True)
    with pytest.raises(ValueError, match="sorted"):
        AF.varlen("sinkhorn", q, k, v, torch.tensor([0, 21, 6, sum(LEN_Q)], dtype=torch.int32),
                  offsets(LEN_K), sum(LEN_Q), max(LEN_K), backend="triton", enable_gqa=True)
    with pytest.raises(ValueError, match="pass enable_gqa=True"):
        AF.varlen("sinkhorn", q, k, v, offsets(LEN_Q), offsets(LEN_K), max(LEN_Q), max(LEN_K), backend="triton")


@needs_interpreter
def test_compile_traces_one_graph_with_offsets_as_tensors():
    """fullgraph=True: the packed Sinkhorn op is in the graph with the offsets as inputs (other offsets of
    the same count reuse it; no host read of them), and equals eager."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def step(q, k, v, cu):
        return AF.varlen("sinkhorn", q, k, v, cu, cu, 20, 20, enable_gqa=True, backend="triton", n_iters=1)

    compiled = torch.compile(step, fullgraph=True, backend=backend)
    g = torch.Generator().manual_seed(5)
    q, k, v = torch.randn(24, H, D, generator=g), torch.randn(24, H_KV, D, generator=g), torch.randn(24, H_KV, DV,
                                                                                                    generator=g)
    for lengths in ([4, 20], [17, 7]):
        cu = offsets(lengths)
        torch.testing.assert_close(compiled(q, k, v, cu), step(q, k, v, cu), atol=0, rtol=0)
    assert len(graphs) == 1
    assert "sinkhorn_varlen_fwd" in str(graphs[0].graph)


# --- on a GPU (skipped elsewhere): the compiled kernels, through auto ---------------------------------------

@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gpu_auto_runs_the_packed_kernels_within_flash_rule(dtype, only_the_packed_kernels):
    inputs, cot = packed_inputs(dtype, device="cuda"), cotangent()
    got = out_and_grads(packed(backend=None), inputs, cot.cuda())
    low = [t.to(dtype) for t in out_and_grads(one_by_one, [t.cpu().float() for t in inputs], cot)]
    want = out_and_grads(one_by_one, [t.cpu().double() for t in inputs], cot)
    assert_flash_rule(f"sinkhorn-varlen-gpu-{dtype}", dtype, 1.0,
                      list(zip(("out", "dq", "dk", "dv"), [t.cpu() for t in got], low, want)))
