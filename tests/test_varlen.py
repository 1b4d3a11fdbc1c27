"""Packed (varlen) sequences, ``attnzoo.functional.varlen``: every variant's packed answer equals the
float64 formula (tests/formulas.py) run on each sequence alone, forward and gradients, with grouped
heads, causal and not, Nq != Nk per sequence and a length-1 sequence; every backend on packed input;
the padded route torch.compile takes; one clear error per malformed offset."""
from __future__ import annotations

import pytest
import torch

import attnzoo.functional as AF
from attnzoo.ops import dispatch, plan, varlen
from attnzoo.ops.kernels import blockwise
from tests import formulas as R
from tests.common import INTERPRET
from tests.flash_rule import assert_flash_rule, reference_or_rounded

H, H_KV, D, DV = 4, 2, 4, 3
LEN_Q = [1, 5, 3]              # a length-1 sequence; Nq != Nk in every sequence but the middle one
LEN_K = [2, 5, 6]

# name -> (variant, options, formula(q, k, v, allow, add, scale, causal))
CASES = {
    "softmax": ("softmax", {}, lambda q, k, v, a, add, s, c: R.softmax(q, k, v, a, add, s)),
    "l2": ("l2", {}, lambda q, k, v, a, add, s, c: R.l2(q, k, v, a, add, s)),
    "sinkhorn": ("sinkhorn", {"n_iters": 3, "eps": 0.7},
                 lambda q, k, v, a, add, s, c: R.sinkhorn(q, k, v, torch.ones_like(a), add, s, 3, 0.7, "l2", c)),
    "sigmoid": ("sigmoid", {}, lambda q, k, v, a, add, s, c: R.sigmoid(q, k, v, a, add, s)),
    "relu": ("relu", {}, lambda q, k, v, a, add, s, c: R.relu(q, k, v, a, add, s)),
    "linear": ("linear", {}, lambda q, k, v, a, add, s, c: R.linear(q, k, v, a, add, "elu")),
    "linear_identity": ("linear", {"feature_map": "identity"},
                        lambda q, k, v, a, add, s, c: R.linear(q, k, v, a, add, "identity")),
    "fenchel": ("fenchel", {"alpha": 0.8}, lambda q, k, v, a, add, s, c: R.fenchel_first(q, k, v, a, add, s, None, 0.8)),
    "ot": ("ot", {"alpha": 0.5}, lambda q, k, v, a, add, s, c: R.ot(q, k, v, a, add, s, 0.5)),
}
SCALE = {"linear": 1.0}        # linear attention has no logits: its scale defaults to 1


def offsets(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)


def packed_inputs(dtype, len_q=LEN_Q, len_k=LEN_K, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(len_q), H, D, generator=g, dtype=torch.float64)
    k = torch.randn(sum(len_k), H_KV, D, generator=g, dtype=torch.float64)
    v = torch.randn(sum(len_k), H_KV, DV, generator=g, dtype=torch.float64)
    return [t.to(dtype).requires_grad_() for t in (q, k, v)]


def one_by_one(case, q, k, v, len_q, len_k, causal):
    """The formula on each sequence alone, in float64, grouped heads expanded as SDPA's enable_gqa does."""
    variant, _, formula = CASES[case]
    scale = SCALE.get(variant, D ** -0.5)
    outs, cq, ck = [], 0, 0
    for nq, nk in zip(len_q, len_k):
        qs = q[cq:cq + nq].double().transpose(0, 1)[None]
        ks, vs = (t[ck:ck + nk].double().transpose(0, 1)[None].repeat_interleave(H // H_KV, dim=1) for t in (k, v))
        allow, add = R.allow_and_add(None, causal, 1, H, nq, nk)
        outs.append(formula(qs, ks, vs, allow, add, scale, causal)[0].transpose(0, 1))
        cq, ck = cq + nq, ck + nk
    return torch.cat(outs)


def grads(out, inputs, seed=1):
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return torch.autograd.grad((out.double() * w).sum(), inputs)


def assert_matches(case, call, causal, dtype, tol, len_q=LEN_Q, len_k=LEN_K):
    q, k, v = packed_inputs(dtype, len_q, len_k)
    out = call(q, k, v)
    ref_inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = one_by_one(case, *ref_inputs, len_q, len_k, causal)
    assert out.shape == (sum(len_q), H, DV) and out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    for name, got, want in zip("qkv", grads(out, (q, k, v)), grads(ref, ref_inputs)):
        torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_packed_equals_each_sequence_alone(case, causal):
    variant, options, _ = CASES[case]
    assert_matches(case, lambda q, k, v: AF.varlen(variant, q, k, v, offsets(LEN_Q), offsets(LEN_K), max(LEN_Q),
                                                   max(LEN_K), is_causal=causal, enable_gqa=True, **options),
                   causal, torch.float64, 1e-9)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", sorted(c for c in CASES if c != "sinkhorn"))
def test_padded_route_equals_each_sequence_alone(case, causal):
    """The route torch.compile traces (one padded batch, per-sequence key mask) for every variant whose
    queries are independent; Sinkhorn takes ``padded_coupled`` instead (the next test)."""
    variant, options, _ = CASES[case]
    call = AF.VARIANT_FUNCTIONS[variant]
    assert_matches(case, lambda q, k, v: varlen.padded(call, q, k, v, offsets(LEN_Q), offsets(LEN_K), max(LEN_Q),
                                                       max(LEN_K), causal, dict(enable_gqa=True, **options)),
                   causal, torch.float64, 1e-9)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("lengths", ["cross", "self"])
def test_coupled_padded_route_equals_each_sequence_alone(lengths, causal):
    """Sinkhorn's traced route: one padded batch with the padded queries and keys masked out of the problem,
    placed so that the causal prefix rule and its bottom-right diagonal are each sequence's; "cross": other
    key lengths (Nq < Nk and Nq > Nk per sequence, a key block of max_q + max_k - 1), "self": the same
    offsets tensor (a block of max_q)."""
    variant, options, _ = CASES["sinkhorn"]
    len_k = LEN_K if lengths == "cross" else LEN_Q
    cu_q = offsets(LEN_Q)
    cu_k = offsets(len_k) if lengths == "cross" else cu_q

    def call(q, k, v):
        return varlen.padded_coupled(AF.VARIANT_FUNCTIONS[variant], q, k, v, cu_q, cu_k, max(LEN_Q), max(len_k),
                                     causal, dict(enable_gqa=True, **options))

    assert_matches("sinkhorn", call, causal, torch.float64, 1e-9, LEN_Q, len_k)


@pytest.mark.parametrize("causal, window, lengths, width", [
    (False, None, "cross", max(LEN_K)), (False, (1, 1), "cross", max(LEN_Q) + max(LEN_K) - 1),
    (True, None, "cross", max(LEN_Q) + max(LEN_K) - 1), (True, None, "self", max(LEN_Q))])
def test_coupled_padded_route_key_block(causal, window, lengths, width):
    """The key block is only as wide as the alignment needs: max_k when nothing is aligned, max_q for
    self-attention, max_q + max_k - 1 otherwise; the answer is each sequence's either way."""
    variant, options, _ = CASES["sinkhorn"]
    len_k = LEN_K if lengths == "cross" else LEN_Q
    cu_q = offsets(LEN_Q)
    cu_k = offsets(len_k) if lengths == "cross" else cu_q
    widths = []

    def recording(q, k, v, **kwargs):
        widths.append(k.shape[2])
        return AF.sinkhorn(q, k, v, **kwargs)

    q, k, v = packed_inputs(torch.float64, LEN_Q, len_k)
    got = varlen.padded_coupled(recording, q, k, v, cu_q, cu_k, max(LEN_Q), max(len_k), causal,
                                dict(enable_gqa=True, window_size=window, **options))
    want = AF.varlen("sinkhorn", q, k, v, cu_q, cu_k, max(LEN_Q), max(len_k), is_causal=causal, enable_gqa=True,
                     window_size=window, **options)
    assert widths == [width]
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)


def _backend_cases():
    """Every backend that runs CPU tensors: FlexAttention runs on CUDA only (this file's tensors are CPU
    ones) and the Triton kernels under the interpreter. Left out: "triton_implicit" (its implicit
    backward takes ~30 s under the interpreter even at these sizes; its forward is "triton"'s, its
    backward "cpu_implicit"'s fixed point, both run here)."""
    cases = []
    for case, (variant, _, _) in sorted(CASES.items()):
        for name in dispatch.backends(variant):
            if name not in ("reference", "flex", "triton_implicit") and (name != "triton" and not name.startswith("triton_") or INTERPRET):
                cases.append((case, name))
    return cases


# causal Sinkhorn solves one problem per prefix: under the Triton interpreter that costs ~10 s per call,
# so its Triton backends run the full (non-causal) case; its causal packing runs through "cpu" here
INTERPRETER_FULL_ONLY = {("sinkhorn", "triton")}


@pytest.mark.parametrize("case,backend", _backend_cases())
def test_every_backend_runs_packed(case, backend, monkeypatch):
    """float32 through each backend (the CPU blockwise path with 4 x 4 tiles, so sequences span tiles)
    against the float64 formula per sequence. The implicit Sinkhorn backward differentiates the converged
    fixed point, not the 3 unrolled rounds of the formula: its gradients are checked against the same
    backend run on each sequence alone, unpacked."""
    monkeypatch.setattr(blockwise, "DEFAULT_BLOCK_Q", 4)
    monkeypatch.setattr(blockwise, "DEFAULT_BLOCK_K", 4)
    plan.clear()
    variant, options, _ = CASES[case]
    causal = (case, backend) not in INTERPRETER_FULL_ONLY
    kw = dict(is_causal=causal, enable_gqa=True, backend=backend, **options)

    def packed(q, k, v):
        return AF.varlen(variant, q, k, v, offsets(LEN_Q), offsets(LEN_K), max(LEN_Q), max(LEN_K), **kw)

    if not backend.endswith("_implicit"):
        assert_matches(case, packed, causal, torch.float32, 2e-4)
    else:
        q, k, v = packed_inputs(torch.float32)
        out = packed(q, k, v)
        torch.testing.assert_close(out.double(), one_by_one(case, q.detach(), k.detach(), v.detach(), LEN_Q, LEN_K,
                                                            causal), atol=2e-4, rtol=2e-4)
        alone, cq, ck = [], 0, 0
        for nq, nk in zip(LEN_Q, LEN_K):
            part = [t.transpose(0, 1)[None] for t in (q[cq:cq + nq], k[ck:ck + nk], v[ck:ck + nk])]
            alone.append(AF.VARIANT_FUNCTIONS[variant](*part, **kw)[0].transpose(0, 1))
            cq, ck = cq + nq, ck + nk
        for name, got, want in zip("qkv", grads(out, (q, k, v)), grads(torch.cat(alone), (q, k, v))):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=lambda m: f"d{name}: {m}")
    plan.clear()


@pytest.mark.parametrize("case", sorted(CASES))
def test_bf16_packed_follows_flash_rule(case):
    """bf16 in and out, causal, grouped heads: the output and every gradient within FlashAttention's rule
    of the float64 formula per sequence (on the bf16-rounded inputs), the reference backend on the same
    packed bf16 input being the yardstick."""
    variant, options, _ = CASES[case]
    leaves64 = [t.detach().bfloat16().double() for t in packed_inputs(torch.float64)]
    cot = torch.randn(sum(LEN_Q), H, DV, generator=torch.Generator().manual_seed(4), dtype=torch.float64)

    def run(fn, dtype):
        leaves = [t.to(dtype).requires_grad_() for t in leaves64]
        out = fn(*leaves)
        return [out] + list(torch.autograd.grad((out.double() * cot).sum(), leaves))

    def packed(backend):
        return lambda q, k, v: AF.varlen(variant, q, k, v, offsets(LEN_Q), offsets(LEN_K), max(LEN_Q), max(LEN_K),
                                         is_causal=True, enable_gqa=True, backend=backend, **options)

    want = run(lambda q, k, v: one_by_one(case, q, k, v, LEN_Q, LEN_K, True), torch.float64)
    got = run(packed(None), torch.bfloat16)
    low = run(packed("reference"), torch.bfloat16)
    assert got[0].dtype == torch.bfloat16
    assert_flash_rule(case, torch.bfloat16, 1.0, list(zip(("out", "dq", "dk", "dv"), got,
                                                          reference_or_rounded(got, low, want, torch.bfloat16), want)))


def test_equal_lengths_share_one_call_and_keep_their_order():
    """Sequences of one length are stacked into one batch: the outputs must still land in packed order."""
    lens = [3, 2, 3, 1, 3]
    assert_matches("sinkhorn", lambda q, k, v: AF.varlen("sinkhorn", q, k, v, offsets(lens), None, 3, None,
                                                         is_causal=True, enable_gqa=True, n_iters=3, eps=0.7),
                   True, torch.float64, 1e-9, lens, lens)


@pytest.mark.parametrize("variant", ["softmax", "sinkhorn"])
def test_compile_takes_offsets_as_tensors(variant):
    """The padded route inside one graph (fullgraph=True): softmax's with a per-sequence key mask,
    Sinkhorn's with its padded queries masked out of the problem too (varlen.padded_coupled)."""
    q, k, v = (t.detach() for t in packed_inputs(torch.float32, LEN_Q, LEN_Q))
    cu = offsets(LEN_Q)

    def step(q, k, v, cu):
        return AF.varlen(variant, q, k, v, cu, cu, max(LEN_Q), max(LEN_Q), is_causal=True, enable_gqa=True)

    compiled = torch.compile(step, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(q, k, v, cu), step(q, k, v, cu), atol=1e-6, rtol=1e-6)
    other = offsets([4, 4, 1])                          # new offsets, same graph: read as a tensor
    torch.testing.assert_close(compiled(q, k, v, other), step(q, k, v, other), atol=1e-6, rtol=1e-6)


def _call(cu_q, cu_k=None, max_q=5, max_k=6, q_len=9, k_len=13):
    q = torch.randn(q_len, H, D)
    k, v = torch.randn(k_len, H, D), torch.randn(k_len, H, D)
    return AF.varlen("softmax", q, k, v, cu_q, cu_k if cu_k is not None else offsets(LEN_K), max_q, max_k)


@pytest.mark.parametrize("args,error,match", [
    ((offsets([1, 0, 8]),), ValueError, "sequence 1 length 0"),
    ((torch.tensor([0, 5, 1, 9], dtype=torch.int32),), ValueError, "must be sorted"),
    ((torch.tensor([0, 1, 6, 10], dtype=torch.int32),), ValueError, "cu_seq_q must run from 0 to the packed length 9"),
    ((torch.tensor([1, 1, 6, 9], dtype=torch.int32),), ValueError, "cu_seq_q must run from 0"),
    ((offsets(LEN_Q).to("meta"),), ValueError, "cu_seq_q must be on q's device"),
    ((offsets(LEN_Q).float(),), TypeError, "cu_seq_q must hold int32"),
    ((offsets(LEN_Q)[None],), ValueError, "cu_seq_q must be 1-D"),
    ((offsets(LEN_Q), None, 4), ValueError, "max_q=4 is shorter than the longest sequence"),
    ((offsets(LEN_Q), None, 5, 6.0), ValueError, "max_k must be a Python int"),
    ((offsets(LEN_Q), offsets([13]), 5, 13), ValueError, "the same number of sequences"),
], ids=["length_0", "unsorted", "past_the_end", "not_from_0", "device", "dtype", "2d", "max_q", "max_k_float",
        "count"])
def test_malformed_offsets_get_one_clear_error(args, error, match):
    with pytest.raises(error, match=match):
        _call(*args)


def test_unpacked_layout_is_refused():
    q = torch.randn(1, H, 9, D)
    with pytest.raises(ValueError, match=r"packed q must have shape \(T, H, D\)"):
        AF.varlen("softmax", q, q, q, offsets(LEN_Q), None, 5, None)


@pytest.mark.parametrize("variant", ["softmax", "sinkhorn"])
def test_compiled_call_asserts_malformed_offsets(variant):
    """Under torch.compile the offsets are not read on the host: the eager checks are asserts in the graph,
    so a length-0 sequence, unsorted or out-of-range offsets and a too-small max_q raise, naming the
    argument, instead of giving a silent answer."""
    q, k, v = (t.detach() for t in packed_inputs(torch.float32, LEN_Q, LEN_Q))
    total = sum(LEN_Q)

    def step(q, k, v, cu):
        return AF.varlen(variant, q, k, v, cu, cu, max(LEN_Q), max(LEN_Q), enable_gqa=True)

    compiled = torch.compile(step, fullgraph=True, backend="eager")
    compiled(q, k, v, offsets(LEN_Q))
    bad = {"length 0": ([0, 3, 3, total], "cu_seq_q must be sorted, every sequence at least one token"),
           "unsorted": ([0, total - 1, 2, total], "cu_seq_q must be sorted"),
           "short": ([0, 3, 4, total - 1], f"cu_seq_q must run from 0 to the packed length {total}"),
           "too long": ([0, 1, 2, total], f"max_q={max(LEN_Q)} is shorter than the longest sequence")}
    for case, (cu, message) in bad.items():
        with pytest.raises(RuntimeError, match=message):
            compiled(q, k, v, torch.tensor(cu, dtype=torch.int32))
