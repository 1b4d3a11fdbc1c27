"""softcap, sinks and window_size in the varlen (packed) Triton kernels (ops/kernels/flash_softmax/varlen.py,
ops/kernels/pointwise/varlen.py), through ``attnzoo.functional.varlen`` with backend="triton".

Each packed answer equals a float64 formula written here from the definitions (Gemma 2's cap
s -> c tanh(s / c), gpt-oss's sink: one more logit per head in the normaliser with no value,
FlashAttention's (left, right) window, bottom-right aligned inside each sequence) run on each sequence
alone: forward and gradients (dq, dk, dv and dsinks), fp32 tightly and bf16 / fp16 by FlashAttention's
rule, with grouped heads, sequences of length 1 and longer than the interpreter's 16-row tiles, a
sequence with more queries than keys (causal rows with no key), and windows narrower than a tile.
Every call here must stay on the varlen Triton route: the per-length, padded and blockwise routes fail
the test if reached. Kernels run under TRITON_INTERPRET=1 on CPU."""
from __future__ import annotations

import pytest
import torch

import attnzoo.functional as AF
from attnzoo.ops import varlen_triton
from tests.common import needs_gpu, needs_interpreter
from tests.flash_rule import assert_flash_rule
from tests.test_triton_varlen import offsets, on_the_triton_route

H, H_KV, D, DV = 2, 1, 8, 6
LEN_Q = [1, 18, 3, 9]    # 18 rows cross the 16-row tiles; the last sequence has more queries than keys
LEN_K = [1, 17, 20, 4]
SCALE = D ** -0.5
ALPHA = 0.7
SINKS = [0.8, -0.5]      # one logit per query head

# case -> (variant, options, kind of weights, logit scale multiplier)
CASES = {
    "softmax": ("softmax", {}, "softmax", 1.0),
    "l2": ("l2", {}, "l2", 1.0),
    "fenchel": ("fenchel", {"alpha": ALPHA}, "softmax", ALPHA),
    "sigmoid": ("sigmoid", {}, "sigmoid", 1.0),
    "sigmoid_bias": ("sigmoid", {"bias": -1.5}, "sigmoid", 1.0),
    "relu": ("relu", {}, "relu", 1.0),
}


def band_allow(nq, nk, causal, window):
    """(nq, nk) bool, written as loops: d = j - i - (nk - nq), causal keeps d <= 0, the window
    -left <= d <= right (-1: unbounded side)."""
    allow = torch.ones(nq, nk, dtype=torch.bool)
    left, right = window if window is not None else (-1, -1)
    for i in range(nq):
        for j in range(nk):
            d = j - i - (nk - nq)
            if (causal and d > 0) or (left >= 0 and d < -left) or (right >= 0 and d > right):
                allow[i, j] = False
    return allow


def sequence_formula(case, q, k, v, allow, softcap, sinks):
    """One sequence, (H, n, D) float64 -> (H, nq, Dv), straight from the definitions."""
    _, _, kind, mult = CASES[case]
    if kind == "l2":
        logits = -SCALE * ((q[:, :, None, :] - k[:, None, :, :]) ** 2).sum(-1)
    else:
        logits = mult * SCALE * q @ k.transpose(-1, -2)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    zero = torch.zeros_like(logits)
    n = allow.sum(-1, keepdim=True).double()
    if kind in ("softmax", "l2"):   # small logits: no shift needed in float64
        e = torch.where(allow, torch.exp(logits), zero)
        total = e.sum(-1, keepdim=True)
        if sinks is not None:
            total = total + torch.exp(sinks)[:, None, None]
        return e / torch.where(total > 0, total, torch.ones_like(total)) @ v
    if kind == "sigmoid":
        bias = CASES[case][1].get("bias")
        b = -torch.log(n.clamp_min(1)) if bias is None else bias
        return torch.where(allow, 1 / (1 + torch.exp(-(logits + b))), zero) @ v
    return torch.where(allow, logits.clamp_min(0), zero) / n.clamp_min(1) @ v


def one_by_one(case, q, k, v, sinks, causal, softcap, window):
    outs, cq, ck = [], 0, 0
    for nq, nk in zip(LEN_Q, LEN_K):
        qs = q[cq:cq + nq].transpose(0, 1)
        ks, vs = (t[ck:ck + nk].transpose(0, 1).repeat_interleave(H // k.shape[1], dim=0) for t in (k, v))
        outs.append(sequence_formula(case, qs, ks, vs, band_allow(nq, nk, causal, window), softcap,
                                     sinks).transpose(0, 1))
        cq, ck = cq + nq, ck + nk
    return torch.cat(outs)


def packed_call(case, causal, softcap, window, backend="triton", device="cpu"):
    variant, options, _, _ = CASES[case]
    extras = {"softcap": softcap, "window_size": window}

    def call(q, k, v, sinks=None):
        return AF.varlen(variant, q, k, v, offsets(LEN_Q, device), offsets(LEN_K, device), max(LEN_Q), max(LEN_K),
                         is_causal=causal, enable_gqa=True, backend=backend, sinks=sinks, **extras, **options)
    return call


def inputs(dtype, with_sinks, seed=0):
    """float64 draws rounded to ``dtype`` (the float64 truth sees exactly the tested inputs); logits
    scaled up so a cap of 1.5 bends them. Sinks stay fp32, as a model's parameter would."""
    g = torch.Generator().manual_seed(seed)
    shapes = ((sum(LEN_Q), H, D), (sum(LEN_K), H_KV, D), (sum(LEN_K), H_KV, DV))
    leaves = [(2 * torch.randn(s, generator=g, dtype=torch.float64)).to(dtype) for s in shapes]
    return leaves + ([torch.tensor(SINKS, dtype=torch.float32)] if with_sinks else [])


def out_and_grads(fn, leaves, cot):
    leaves = [t.detach().requires_grad_() for t in leaves]
    out = fn(*leaves)
    return [out] + list(torch.autograd.grad((out.double() * cot).sum(), leaves))


def cotangent():
    return torch.randn(sum(LEN_Q), H, DV, generator=torch.Generator().manual_seed(3), dtype=torch.float64)


NAMES = ("out", "dq", "dk", "dv", "dsinks")

# (case, causal, softcap, sinks, window): each extra alone, windows narrower than the 16-row tiles (one
# side unbounded, both bounded, a one-sided band past the diagonal), and the four together
FP32_CASES = [
    ("softmax", False, 1.5, False, None),
    ("softmax", False, None, True, None),
    ("softmax", False, None, False, (2, 5)),
    ("softmax", True, 1.5, True, (4, -1)),
    ("l2", True, 1.5, True, (3, -1)),
    ("fenchel", True, 1.5, True, (4, -1)),
    ("sigmoid", False, 1.5, False, (2, 2)),
    ("sigmoid_bias", False, None, False, (-1, 3)),
    ("relu", True, 1.5, False, (3, -1)),
]


def _id(case):
    name, causal, softcap, sinks, window = case
    parts = [name, "causal" if causal else "full"] + (["softcap"] if softcap else []) + (["sinks"] if sinks else [])
    return "-".join(parts + ([f"window{window[0]}_{window[1]}"] if window else []))


@needs_interpreter
@pytest.mark.parametrize("case,causal,softcap,with_sinks,window", FP32_CASES, ids=[_id(c) for c in FP32_CASES])
def test_packed_extras_equal_each_sequence_alone_fp32(case, causal, softcap, with_sinks, window):
    leaves = inputs(torch.float32, with_sinks)
    cot = cotangent()
    got = on_the_triton_route(out_and_grads)(packed_call(case, causal, softcap, window), leaves, cot)
    want = out_and_grads(lambda q, k, v, s=None: one_by_one(case, q, k, v, s, causal, softcap, window),
                         [t.double() for t in leaves], cot)
    assert len(got) == len(want) == 4 + with_sinks
    for name, a, b in zip(NAMES, got, want):
        torch.testing.assert_close(a.double(), b, atol=2e-5, rtol=2e-5, msg=lambda m, n=name: f"{n}: {m}")


LOW_CASES = [("softmax", torch.bfloat16), ("sigmoid", torch.bfloat16), ("relu", torch.float16)]


@needs_interpreter
@pytest.mark.parametrize("case,dtype", LOW_CASES, ids=[f"{c}-{str(d)[6:]}" for c, d in LOW_CASES])
def test_low_precision_extras_follow_flash_rule(case, dtype):
    """Window + causal + softcap (+ sinks in the softmax family), grouped heads: output and gradients
    within FlashAttention's rule of the float64 formula, the reference backend on the same packed
    half-precision inputs the yardstick."""
    with_sinks = CASES[case][2] in ("softmax", "l2")
    leaves = inputs(dtype, with_sinks)
    cot = cotangent()
    got = on_the_triton_route(out_and_grads)(packed_call(case, True, 1.5, (4, -1)), leaves, cot)
    low = out_and_grads(packed_call(case, True, 1.5, (4, -1), backend="reference"), leaves, cot)
    want = out_and_grads(lambda q, k, v, s=None: one_by_one(case, q, k, v, s, True, 1.5, (4, -1)),
                         [t.double() for t in leaves], cot)
    assert got[0].dtype == dtype
    assert_flash_rule(f"{case}-varlen-extras", dtype, 30.0, list(zip(NAMES, got, low, want)))


@needs_interpreter
@pytest.mark.parametrize("variant", ["softmax", "l2", "fenchel", "sigmoid", "relu"])
def test_extras_take_the_varlen_route(variant, monkeypatch):
    """softcap and window_size (and sinks where the variant normalises over keys) reach the varlen form,
    checked, instead of being declined to the per-length route (the form is stubbed: no kernel runs)."""
    seen = {}

    def form(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs):
        seen.update(kwargs)
        return "ran"
    monkeypatch.setitem(varlen_triton.ROUTES, variant, lambda *args: varlen_triton.family_route(form, *args))
    q, k, v = inputs(torch.float32, False)
    sinks = torch.zeros(H)
    kwargs = dict(scale=None, dropout_p=0.0, backend="triton", enable_gqa=True, softcap=30, sinks=sinks,
                  window_size=[4, -1])
    assert varlen_triton.run(variant, q, k, v, offsets(LEN_Q), offsets(LEN_K), max(LEN_Q), max(LEN_K), True,
                             kwargs) == "ran"
    assert seen["softcap"] == 30.0 and seen["sinks"] is sinks and seen["window_size"] == (4, -1)
    assert seen["is_causal"] is True


@needs_interpreter
@pytest.mark.parametrize("variant", ["sigmoid", "relu"])
def test_pointwise_sinks_are_refused_by_name(variant):
    """The pointwise forms decline sinks; the per-length route then refuses them with the variant's error."""
    q, k, v, sinks = inputs(torch.float32, True)
    assert varlen_triton.run(variant, q, k, v, offsets(LEN_Q), offsets(LEN_K), max(LEN_Q), max(LEN_K), False,
                             dict(backend="triton", enable_gqa=True, sinks=sinks)) is None
    with pytest.raises((ValueError, TypeError), match="sinks"):
        AF.varlen(variant, q, k, v, offsets(LEN_Q), offsets(LEN_K), max(LEN_Q), max(LEN_K), backend="triton",
                  enable_gqa=True, sinks=sinks)


@needs_interpreter
@pytest.mark.parametrize("extra,match", [({"softcap": -1.0}, "softcap must be"),
                                         ({"sinks": torch.zeros(H + 1)}, r"sinks must have shape \(H,\)"),
                                         ({"window_size": (4,)}, "window_size must be a pair")])
def test_bad_extras_get_one_clear_error_on_the_varlen_route(extra, match):
    q, k, v = inputs(torch.float32, False)
    with pytest.raises(ValueError, match=match):
        varlen_triton.run("softmax", q, k, v, offsets(LEN_Q), offsets(LEN_K), max(LEN_Q), max(LEN_K), False,
                          dict(backend="triton", enable_gqa=True, **extra))


@needs_interpreter
def test_compile_keeps_one_graph_with_the_extras():
    """fullgraph=True with softcap, sinks (a leaf) and a window: the packed op is in the one graph, and
    outputs and gradients (dsinks included) equal eager."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def step(q, k, v, sinks, cu):
        return AF.varlen("softmax", q, k, v, cu, cu, 17, 17, is_causal=True, enable_gqa=True, backend="triton",
                         softcap=1.5, sinks=sinks, window_size=(3, -1))

    g = torch.Generator().manual_seed(5)
    leaves = [torch.randn(20, H, D, generator=g), torch.randn(20, H_KV, D, generator=g),
              torch.randn(20, H_KV, DV, generator=g), torch.tensor(SINKS)]
    cu = offsets([3, 17])
    cot = torch.randn(20, H, DV, generator=g, dtype=torch.float64)
    got = out_and_grads(lambda *t: torch.compile(step, fullgraph=True, backend=backend)(*t, cu), leaves, cot)
    want = out_and_grads(lambda *t: step(*t, cu), leaves, cot)
    for name, a, b in zip(NAMES, got, want):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
    assert len(graphs) == 1 and "softmax_family_varlen_fwd" in str(graphs[0].graph)


@needs_gpu
@pytest.mark.parametrize("case", ["softmax", "l2", "sigmoid", "relu"])
def test_gpu_auto_runs_the_extras_in_the_varlen_kernels_within_flash_rule(case):
    """Compiled kernels, auto's route on CUDA: window + causal + softcap (+ sinks in the softmax family), bf16."""
    with_sinks = CASES[case][2] in ("softmax", "l2")
    leaves = inputs(torch.bfloat16, with_sinks)
    cot = cotangent()
    got = on_the_triton_route(out_and_grads)(packed_call(case, True, 1.5, (4, -1), backend=None, device="cuda"),
                                             [t.cuda() for t in leaves], cot.cuda())
    low = out_and_grads(packed_call(case, True, 1.5, (4, -1), backend="reference"), leaves, cot)
    want = out_and_grads(lambda q, k, v, s=None: one_by_one(case, q, k, v, s, True, 1.5, (4, -1)),
                         [t.double() for t in leaves], cot)
    assert_flash_rule(f"{case}-varlen-extras-gpu", torch.bfloat16, 30.0,
                      list(zip(NAMES, [t.cpu() for t in got], low, want)))
