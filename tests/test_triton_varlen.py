"""The varlen Triton kernels through the packed functional ``attnzoo.functional.varlen``: the softmax family
(ops/kernels/flash_softmax/varlen.py: softmax, l2, fenchel) and the pointwise family
(ops/kernels/pointwise/varlen.py: sigmoid, relu, whose -log n_i and 1 / n_i count each sequence's keys
alone). Each packed answer equals the float64 formula (tests/formulas.py) run on each sequence alone,
forward and gradients, fp32 tightly and bf16 / fp16 by FlashAttention's rule; grouped heads, causal and
not, Nq != Nk per sequence (a causal sequence with more queries than keys, so rows with no key), lengths
1 and longer than the interpreter's 16-row tiles; the route is taken (no per-length or padded call) and
stays one graph under torch.compile(fullgraph=True) with the offsets as tensors; the calls it declines
are named. On CPU the kernels run under TRITON_INTERPRET=1 (backend="triton" by name, as auto picks
Triton on CUDA only); the GPU tests at the end compile them for real."""
from __future__ import annotations

import pytest
import torch

import attnzoo.functional as AF
from attnzoo.ops import varlen_triton
from tests import formulas as R
from tests.common import needs_gpu, needs_interpreter, refuse_other_packed_routes
from tests.flash_rule import assert_flash_rule

H, H_KV, D, DV = 2, 1, 8, 6
LEN_Q = [1, 18, 3, 9]    # 17 to 20 rows cross the interpreter's 16-row tiles; sequence 3 has more queries
LEN_K = [1, 17, 20, 4]   # than keys (causal: rows with no key)
ALPHA = 0.7

# case -> (variant, options, formula(q, k, v, allow, add, scale))
CASES = {
    "softmax": ("softmax", {}, R.softmax),
    "l2": ("l2", {}, R.l2),
    "fenchel": ("fenchel", {"alpha": ALPHA}, lambda q, k, v, a, add, s: R.fenchel_first(q, k, v, a, add, s, None, ALPHA)),
    "sigmoid": ("sigmoid", {}, R.sigmoid),                        # bias -log n_i, n_i of the sequence
    "sigmoid_bias": ("sigmoid", {"bias": -1.5}, lambda q, k, v, a, add, s: R.sigmoid(q, k, v, a, add, s, -1.5)),
    "relu": ("relu", {}, R.relu),                                 # 1 / n_i of the sequence
}


def offsets(lengths, device="cpu"):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=device)


def packed_inputs(dtype, h_kv=H_KV, seed=0, device="cpu"):
    """float64 draws rounded to ``dtype`` (so the float64 truth sees exactly the tested inputs)."""
    g = torch.Generator().manual_seed(seed)
    shapes = ((sum(LEN_Q), H, D), (sum(LEN_K), h_kv, D), (sum(LEN_K), h_kv, DV))
    return [torch.randn(s, generator=g, dtype=torch.float64).to(dtype).to(device) for s in shapes]


def one_by_one(case, q, k, v, causal):
    """The formula on each sequence alone in float64, grouped heads expanded as SDPA's enable_gqa does."""
    formula = CASES[case][2]
    outs, cq, ck = [], 0, 0
    for nq, nk in zip(LEN_Q, LEN_K):
        qs = q[cq:cq + nq].transpose(0, 1)[None]
        ks, vs = (t[ck:ck + nk].transpose(0, 1)[None].repeat_interleave(H // k.shape[1], dim=1) for t in (k, v))
        allow, add = R.allow_and_add(None, causal, 1, H, nq, nk)
        outs.append(formula(qs, ks, vs, allow, add, D ** -0.5)[0].transpose(0, 1))
        cq, ck = cq + nq, ck + nk
    return torch.cat(outs)


def packed(case, causal, backend="triton", max_q=max(LEN_Q), max_k=max(LEN_K), device="cpu"):
    variant, options, _ = CASES[case]
    return lambda q, k, v: AF.varlen(variant, q, k, v, offsets(LEN_Q, device), offsets(LEN_K, device), max_q,
                                     max_k, is_causal=causal, enable_gqa=True, backend=backend, **options)


def out_and_grads(fn, leaves, cot):
    leaves = [t.detach().requires_grad_() for t in leaves]
    out = fn(*leaves)
    return [out] + list(torch.autograd.grad((out.double() * cot).sum(), leaves))


def cotangent(seed=3):
    return torch.randn(sum(LEN_Q), H, DV, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def on_the_triton_route(fn):
    """``fn`` with every other packed route refused while it runs (its backward included)."""
    def run(*args):
        with pytest.MonkeyPatch.context() as patch:
            refuse_other_packed_routes(patch)
            return fn(*args)
    return run


@pytest.fixture
def only_the_triton_route(monkeypatch):
    refuse_other_packed_routes(monkeypatch)


@needs_interpreter
@pytest.mark.parametrize("case,causal", [("softmax", False), ("softmax", True), ("l2", False), ("l2", True),
                                         ("fenchel", True), ("sigmoid", False), ("sigmoid", True),
                                         ("sigmoid_bias", True), ("relu", False), ("relu", True)],
                         ids=lambda x: {False: "full", True: "causal"}.get(x, x) if isinstance(x, bool) else x)
def test_packed_triton_equals_each_sequence_alone_fp32(case, causal, only_the_triton_route):
    inputs = packed_inputs(torch.float32)
    got = out_and_grads(packed(case, causal), inputs, cotangent())
    want = out_and_grads(lambda q, k, v: one_by_one(case, q, k, v, causal), [t.double() for t in inputs],
                         cotangent())
    assert got[0].shape == (sum(LEN_Q), H, DV) and got[0].dtype == torch.float32
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


@needs_interpreter
def test_equal_heads_and_maxima_above_the_longest_sequence(only_the_triton_route):
    """No grouped heads, and max_q / max_k larger than any sequence (the programs past every sequence
    return at once): still each sequence's own answer."""
    inputs = packed_inputs(torch.float32, h_kv=H)
    got = out_and_grads(packed("softmax", True, max_q=max(LEN_Q) + 19, max_k=max(LEN_K) + 3), inputs, cotangent())
    want = out_and_grads(lambda q, k, v: one_by_one("softmax", q, k, v, True), [t.double() for t in inputs],
                         cotangent())
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


@needs_interpreter
@pytest.mark.parametrize("case,dtype", [("softmax", torch.bfloat16), ("softmax", torch.float16),
                                        ("l2", torch.bfloat16), ("fenchel", torch.bfloat16),
                                        ("sigmoid", torch.bfloat16), ("relu", torch.float16)],
                         ids=["softmax-bf16", "softmax-fp16", "l2-bf16", "fenchel-bf16", "sigmoid-bf16", "relu-fp16"])
def test_low_precision_follows_flash_rule(case, dtype):
    """Causal, grouped heads: output and gradients within FlashAttention's rule of the float64 formula on
    the rounded inputs, the reference backend on the same packed half-precision inputs the yardstick."""
    inputs = packed_inputs(dtype)
    cot = cotangent()
    got = on_the_triton_route(out_and_grads)(packed(case, True), inputs, cot)
    low = out_and_grads(packed(case, True, backend="reference"), inputs, cot)
    want = out_and_grads(lambda q, k, v: one_by_one(case, q, k, v, True), [t.double() for t in inputs], cot)
    assert got[0].dtype == dtype
    assert_flash_rule(f"{case}-varlen-triton", dtype, 1.0, list(zip(("out", "dq", "dk", "dv"), got, low, want)))


@needs_interpreter
def test_compile_traces_one_graph_with_offsets_as_tensors():
    """fullgraph=True: the packed Triton op is in the graph (under the interpreter it is an opaque op), the
    offsets are graph inputs, not constants: other offsets of the same total length reuse the graph;
    outputs and gradients equal eager."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def step(q, k, v, cu):
        return AF.varlen("softmax", q, k, v, cu, cu, 20, 20, is_causal=True, enable_gqa=True, backend="triton")

    compiled = torch.compile(step, fullgraph=True, backend=backend)
    g = torch.Generator().manual_seed(5)
    q, k, v = torch.randn(24, H, D, generator=g), torch.randn(24, H_KV, D, generator=g), torch.randn(24, H_KV, DV, generator=g)
    for lengths in ([4, 20], [17, 7]):       # as many sequences (the offsets' shape), other values
        cu = offsets(lengths)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        eager_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        got, want = compiled(*leaves, cu), step(*eager_leaves, cu)
        torch.testing.assert_close(got, want, atol=0, rtol=0)
        cot = torch.randn(want.shape, generator=g)
        for a, b in zip(torch.autograd.grad((got * cot).sum(), leaves), torch.autograd.grad((want * cot).sum(),
                                                                                              eager_leaves)):
            torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert len(graphs) == 1
    assert "softmax_family_varlen_fwd" in str(graphs[0].graph)


def test_route_is_chosen_by_backend_and_device():
    q = torch.zeros(3, H, D)
    assert varlen_triton.chosen("softmax", q, "triton")
    assert not varlen_triton.chosen("softmax", q, "auto")            # auto runs Triton on CUDA only
    assert not varlen_triton.chosen("softmax", q, "cpu")
    assert not varlen_triton.chosen("no_such_variant", q, "triton")  # no varlen Triton route registered
    assert varlen_triton.chosen("softmax", q.to("meta"), "triton")


@needs_interpreter
@pytest.mark.parametrize("variant,extra", [
    ("softmax", {"dropout_p": 0.1}), ("fenchel", {"solve": "second_order"}),
    ("fenchel", {"log_u": torch.zeros(1)}), ("softmax", {"unknown": 1}), ("sigmoid", {"bias": torch.zeros(1)}),
    ("relu", {"sinks": torch.zeros(H)})],
    ids=["dropout", "second_order", "log_u", "unknown_option", "sigmoid_tensor_bias", "relu_sinks"])
def test_declined_calls_take_the_other_routes(variant, extra):
    """What the varlen kernels do not compute is declined (None: the caller runs the sequences per
    length, where the variant's own function computes or refuses it), never run wrongly. softcap, sinks
    and window_size are taken (tests/test_triton_varlen_extras.py)."""
    q, k, v = packed_inputs(torch.float32)
    kwargs = {**dict(scale=None, dropout_p=0.0, backend="triton", enable_gqa=True), **extra}
    assert varlen_triton.run(variant, q, k, v, offsets(LEN_Q), offsets(LEN_K), max(LEN_Q), max(LEN_K), False,
                             kwargs) is None


@needs_interpreter
def test_offsets_and_heads_are_still_checked_on_the_triton_route():
    q, k, v = packed_inputs(torch.float32)
    with pytest.raises(ValueError, match="sequence 1 length 0"):
        AF.varlen("softmax", q, k, v, offsets([1, 0, sum(LEN_Q) - 2, 1]), offsets(LEN_K), sum(LEN_Q), max(LEN_K),
                  backend="triton", enable_gqa=True)
    with pytest.raises(ValueError, match="pass enable_gqa=True"):
        AF.varlen("softmax", q, k, v, offsets(LEN_Q), offsets(LEN_K), max(LEN_Q), max(LEN_K), backend="triton")


# --- on a GPU (skipped elsewhere): compiled kernels, auto's route, torch.compile with inductor -------------

@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_gpu_auto_runs_the_varlen_kernels_within_flash_rule(case, dtype):
    inputs = packed_inputs(dtype, device="cuda")
    cot = cotangent().cuda()
    got = on_the_triton_route(out_and_grads)(packed(case, True, backend=None, device="cuda"), inputs, cot)
    low = out_and_grads(packed(case, True, backend="reference"), [t.cpu() for t in inputs], cot.cpu())
    want = out_and_grads(lambda q, k, v: one_by_one(case, q, k, v, True), [t.cpu().double() for t in inputs],
                         cot.cpu())
    assert_flash_rule(f"{case}-varlen-gpu", dtype, 1.0,
                      list(zip(("out", "dq", "dk", "dv"), [t.cpu() for t in got], low, want)))


@needs_gpu
def test_gpu_inductor_compiles_the_varlen_kernels_in_one_graph():
    def step(q, k, v, cu_q, cu_k):
        return AF.varlen("softmax", q, k, v, cu_q, cu_k, max(LEN_Q), max(LEN_K), is_causal=True, enable_gqa=True)

    inputs = packed_inputs(torch.bfloat16, device="cuda")
    cot = cotangent().cuda()
    cus = (offsets(LEN_Q, "cuda"), offsets(LEN_K, "cuda"))
    got = out_and_grads(lambda q, k, v: torch.compile(step, fullgraph=True)(q, k, v, *cus), inputs, cot)
    want = out_and_grads(lambda q, k, v: step(q, k, v, *cus), inputs, cot)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2, msg=lambda m, n=name: f"{n}: {m}")
