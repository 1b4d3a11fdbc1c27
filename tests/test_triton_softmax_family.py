"""The softmax-family Triton kernels (softmax, L2, per-key preference, T5 bias) against float64 math.

The expected values are written here from the formulas (paper 002 sec 2.3, paper 004 eqs 16-18, T5's
bucketing) with explicit (B, H, Nq, Nk) masks, not with attnzoo's helpers. On CPU the real kernels run
under TRITON_INTERPRET=1 (set by `make test`); tests/test_triton_gpu.py reruns the same table on a GPU.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import attnzoo
import attnzoo.functional as AF
from attnzoo.ops import dispatch
from attnzoo.ops.fenchel.t5 import t5_bias_attention
from attnzoo.ops.kernels.flash_softmax import triton as fused
from attnzoo.ops.triton_utils import INTERPRETED
from tests.flash_rule import assert_flash_rule, max_error

NEEDS_KERNELS = pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1 set before import "
                                   "(the GPU run is tests/test_triton_gpu.py)")
NUM_BUCKETS, MAX_DISTANCE = 8, 20  # no T5 bucket boundary falls on an integer offset below 40 (see t5_bucket)


@dataclass
class Case:
    name: str
    kind: str             # softmax | l2 | fenchel | pref_l2 | t5
    nq: int
    nk: int
    d: int = 16
    dv: int = 16
    b: int = 1
    h: int = 2
    mask: str = "none"    # none | bool | float | padding | extreme | rows (Nq, 1) bool | keys (Nk,) float
    causal: bool = False
    bidirectional: bool = True
    alpha: float = 1.0
    pref_shape: str = "head"  # head: (1, H, 1, Nk); batch: (B, 1, 1, Nk)
    q_gain: float = 1.0
    logit_size: float = 1.0  # ~max |logit|: rounding s + 1e4 in fp32 costs ~1e-3 whatever the kernel



CASES = [
    Case("softmax-self-16", "softmax", 16, 16),
    Case("softmax-causal-33", "softmax", 33, 33, causal=True),
    Case("softmax-cross-7x33-causal-bool", "softmax", 7, 33, mask="bool", causal=True),
    Case("softmax-cross-33x7-causal", "softmax", 33, 7, causal=True),       # rows 0..25 see no key
    Case("softmax-decode-1x16-padding", "softmax", 1, 16, b=2, mask="padding"),
    Case("softmax-float-mask-d32-dv16", "softmax", 16, 16, d=32, dv=16, mask="float"),
    Case("softmax-extreme-1e4", "softmax", 16, 16, mask="extreme", logit_size=1e4),
    Case("softmax-large-logits", "softmax", 7, 16, q_gain=300.0, logit_size=3e3),
    # masks broadcast along the key axis / over queries (stride 0), tiles cut by both lengths
    Case("softmax-row-mask-33x20-causal", "softmax", 33, 20, mask="rows", causal=True),
    Case("l2-key-mask-20x33", "l2", 20, 33, mask="keys"),
    Case("fenchel-row-mask-32x48-causal", "fenchel", 32, 48, mask="rows", causal=True),  # whole blocks only
    Case("l2-cross-33x20", "l2", 33, 20),
    Case("l2-causal-bool-16", "l2", 16, 16, mask="bool", causal=True),
    Case("l2-padding-d24", "l2", 7, 16, d=24, dv=24, b=2, mask="padding"),
    Case("fenchel-pref-float-mask", "fenchel", 16, 16, mask="float", alpha=0.7),
    Case("fenchel-pref-batch-causal", "fenchel", 16, 33, b=2, causal=True, pref_shape="batch"),
    Case("pref-l2-padding", "pref_l2", 7, 16, b=2, mask="padding"),
    Case("t5-bidirectional-33", "t5", 33, 33),
    Case("t5-causal-16x33-bool", "t5", 16, 33, mask="bool", causal=True, bidirectional=False, alpha=1.5),
    Case("t5-33x7-padding", "t5", 33, 7, b=2, mask="padding"),
]
LOW_PRECISION = [
    ("softmax-causal-33", torch.bfloat16), ("softmax-cross-7x33-causal-bool", torch.float16),
    ("softmax-extreme-1e4", torch.bfloat16), ("l2-cross-33x20", torch.bfloat16),
    ("fenchel-pref-batch-causal", torch.float16), ("t5-bidirectional-33", torch.bfloat16),
]
BY_NAME = {c.name: c for c in CASES}


# --- inputs -------------------------------------------------------------------------------------

def make_mask(case: Case):
    B, H, nq, nk = case.b, case.h, case.nq, case.nk
    if case.mask == "bool":
        m = torch.rand(B, 1, nq, nk) < 0.7
        m[:, :, min(1, nq - 1)] = False                       # a row with no key left
        return m
    if case.mask == "float":
        m = torch.randn(1, H, nq, nk)
        m[torch.rand(1, H, nq, nk) < 0.2] = -math.inf
        m[:, :, nq // 2] = -math.inf                          # a row with no key left
        return m
    if case.mask == "padding":
        m = torch.ones(B, 1, 1, nk, dtype=torch.bool)
        m[0, ..., nk - 3:] = False
        if B > 1:
            m[1, ..., nk // 2:] = False
        return m
    if case.mask == "extreme":
        return torch.randint(-1, 2, (1, 1, nq, nk)).float() * 1e4
    if case.mask == "rows":  # (Nq, 1): whole query rows masked out
        m = torch.rand(nq, 1) < 0.7
        m[min(2, nq - 1)] = False
        return m
    if case.mask == "keys":  # (Nk,): a float bias per key, -inf removes a key
        m = torch.randn(nk)
        m[nk // 3] = -math.inf
        return m
    return None


def make_inputs(case: Case, device="cpu", dtype=torch.float32):
    """Leaf tensors (on CPU first so CPU and GPU runs see the same numbers)."""
    B, H = case.b, case.h
    t = {
        "q": torch.randn(B, H, case.nq, case.d) * case.q_gain,
        "k": torch.randn(B, H, case.nk, case.d),
        "v": torch.randn(B, H, case.nk, case.dv),
        "mask": make_mask(case),
    }
    if case.kind in ("fenchel", "pref_l2"):
        shape = (1, H, 1, case.nk) if case.pref_shape == "head" else (B, 1, 1, case.nk)
        pref = torch.randn(shape)
        pref[..., 2] = -math.inf                               # a key removed by its preference
        t["pref"] = pref
    if case.kind == "t5":
        t["table"] = torch.randn(NUM_BUCKETS, H)
    out = {}
    for name, x in t.items():
        if x is None:
            out[name] = None
            continue
        x = x.to(device)
        if name in ("q", "k", "v"):
            x = x.to(dtype)
        if x.is_floating_point() and name != "mask":
            x.requires_grad_(True)
        out[name] = x
    return out


def differentiable(case: Case, inp):
    names = ["q", "k", "v"] + [n for n in ("pref", "table") if n in inp]
    return names, [inp[n] for n in names]


def scale_of(case):
    return case.d ** -0.5


# --- the kernel under test ----------------------------------------------------------------------

def run_kernel(case: Case, inp):
    q, k, v, mask = inp["q"], inp["k"], inp["v"], inp["mask"]
    s = scale_of(case)
    if case.kind == "softmax":
        return AF.softmax(q, k, v, attn_mask=mask, is_causal=case.causal, scale=s, backend="triton")
    if case.kind == "l2":
        return AF.l2(q, k, v, attn_mask=mask, is_causal=case.causal, scale=s, backend="triton")
    if case.kind == "fenchel":
        return AF.fenchel(q, k, v, attn_mask=mask, is_causal=case.causal, scale=s, log_u=inp["pref"],
                          alpha=case.alpha, backend="triton")
    if case.kind == "pref_l2":
        return fused.preference_attention(q, k, v, inp["pref"][:, :, 0, :], attn_mask=mask, is_causal=case.causal,
                                          scale=s, l2=True)
    return t5_bias_attention(q, k, v, inp["table"], NUM_BUCKETS, MAX_DISTANCE, case.bidirectional,
                                   attn_mask=mask, is_causal=case.causal, scale=s, alpha=case.alpha)


# --- the formulas, written out -------------------------------------------------------------------

def t5_bucket(rel: int, num_buckets: int, max_distance: int, bidirectional: bool) -> int:
    """T5 (Raffel et al. 2020): exact buckets for |offset| < max_exact, then log-spaced up to
    max_distance; bidirectional gives each sign half of the buckets, causal only counts j <= i."""
    base = 0
    if bidirectional:
        num_buckets //= 2
        base = num_buckets if rel > 0 else 0
        dist = abs(rel)
    else:
        dist = max(-rel, 0)
    max_exact = num_buckets // 2
    if dist < max_exact:
        return base + dist
    large = max_exact + int(math.log(dist / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact))
    return base + min(large, num_buckets - 1)


def expected(case: Case, inp, dtype=torch.float64):
    """out_i = sum_j p_ij v_j, p_i = softmax over the allowed keys of the case's logits, in `dtype`."""
    q, k, v = (inp[n].detach().to(dtype).requires_grad_(True) for n in ("q", "k", "v"))
    leaves = {"q": q, "k": k, "v": v}
    B, H, nq, nk = case.b, case.h, case.nq, case.nk
    s_ = scale_of(case)
    if case.kind in ("l2", "pref_l2"):
        logits = -s_ * ((q[:, :, :, None, :] - k[:, :, None, :, :]) ** 2).sum(-1)
    else:
        logits = case.alpha * s_ * torch.einsum("bhid,bhjd->bhij", q, k)
    allow = torch.ones(B, H, nq, nk, dtype=torch.bool, device=q.device)
    i = torch.arange(nq, device=q.device)[:, None]
    j = torch.arange(nk, device=q.device)[None, :]
    if case.causal:
        allow &= j <= i + (nk - nq)
    mask = inp["mask"]
    if mask is not None:
        m = mask.expand(B, H, nq, nk)
        if m.dtype == torch.bool:
            allow &= m
        else:
            allow &= m > -math.inf
            logits = logits + torch.where(m > -math.inf, m, 0.0).to(dtype)
    if "pref" in inp:
        g = inp["pref"].detach().to(dtype).requires_grad_(True)
        leaves["pref"] = g
        allow &= (g > -math.inf).expand(B, H, nq, nk)
        logits = logits + torch.where(g > -math.inf, g, torch.zeros((), dtype=dtype, device=q.device))
    if "table" in inp:
        table = inp["table"].detach().to(dtype).requires_grad_(True)
        leaves["table"] = table
        rows = [[t5_bucket(jj - (ii + nk - nq), NUM_BUCKETS, MAX_DISTANCE, case.bidirectional) for jj in range(nk)]
                for ii in range(nq)]
        bucket = torch.tensor(rows, device=q.device)
        logits = logits + table[bucket].permute(2, 0, 1).unsqueeze(0)
    logits = logits.masked_fill(~allow, -math.inf)
    top = logits.amax(-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top)).detach()
    e = torch.exp(logits - top)
    z = e.sum(-1, keepdim=True)
    p = e / torch.where(z > 0, z, torch.ones_like(z))           # a row with no key: all zeros
    return p @ v, leaves


# --- checks --------------------------------------------------------------------------------------


def check_case(case: Case, device="cpu", dtype=torch.float32):
    inp = make_inputs(case, device, dtype)
    out = run_kernel(case, inp)
    assert out.shape == (case.b, case.h, case.nq, case.dv) and out.dtype == dtype
    names, xs = differentiable(case, inp)
    grad_out = torch.randn(out.shape, device=device).to(dtype)
    grads = torch.autograd.grad(out, xs, grad_out)
    for name, t in [("out", out)] + list(zip(names, grads)):
        assert torch.isfinite(t).all(), f"{case.name}: {name} has NaN/Inf"

    ref, leaves = expected(case, inp)
    empty = ref.detach().abs().amax(-1) == 0
    assert (out.detach()[empty] == 0).all(), f"{case.name}: a row with no key is not exactly zero"
    ref_grads = torch.autograd.grad(ref, [leaves[n] for n in names], grad_out.double())
    # FlashAttention's rule: the kernel's error is at most ~2x that of the same math run in `dtype`
    # (that covers logits of 1e4, where fp32 itself keeps only ~1e-3 of s), plus a small floor
    low, low_leaves = expected(case, inp, dtype)
    low_grads = torch.autograd.grad(low, [low_leaves[n] for n in names], grad_out)
    assert_flash_rule(case.name, dtype, case.logit_size,
                      [("out", out, low, ref)] + list(zip(names, grads, low_grads, ref_grads)))


@NEEDS_KERNELS
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_forward_and_gradients_fp32(case):
    check_case(case)


@NEEDS_KERNELS
@pytest.mark.parametrize("name,dtype", LOW_PRECISION, ids=lambda x: str(x).replace("torch.", ""))
def test_low_precision_flash_rule(name, dtype):
    check_case(BY_NAME[name], dtype=dtype)


# --- dispatch and argument checks (no kernel launch unless said) ---------------------------------

def _qkv(nq=7, nk=9, d=16, dtype=torch.float32):
    return torch.randn(1, 2, nq, d, dtype=dtype), torch.randn(1, 2, nk, d, dtype=dtype), torch.randn(1, 2, nk, d, dtype=dtype)


class _OpLog(TorchDispatchMode):
    """Records every op that reaches the dispatcher (the custom ops included)."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


@NEEDS_KERNELS
@pytest.mark.parametrize("variant,op", [("softmax", "softmax_family_fwd"), ("l2", "softmax_family_fwd"),
                                        ("fenchel", "softmax_family_fwd"), ("sigmoid", "pointwise_fwd"),
                                        ("relu", "pointwise_fwd")])
def test_named_triton_backend_runs_the_kernel(variant, op):
    q, k, v = _qkv()
    assert attnzoo.explain(variant, q, k, v, backend="triton").backend.name == "triton"
    assert attnzoo.explain(variant, q, k, v).backend.name != "triton"  # auto never interprets on CPU
    with _OpLog() as log:
        getattr(AF, variant)(q, k, v, backend="triton")
    assert any(f"attnzoo.{op}" in name for name in log.names), log.names


@pytest.mark.parametrize("variant,kwargs,expect", [
    ("softmax", {"dropout_p": 1.0}, "dropout_p"),  # dropout itself runs in the kernel (test_triton_dropout.py)
    ("fenchel", {"solve": "second_order"}, "first-order"),
    ("fenchel", {"log_u": torch.zeros(7, 9)}, "varies with the query"),
    ("sigmoid", {"bias": torch.zeros(1, 2, 1, 9)}, "varies with the key"),
    ("l2", {"attn_mask": torch.zeros(1, 1, 7, 9, requires_grad=True)}, "requires grad"),
])
def test_supports_gives_reasons(variant, kwargs, expect, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q, k, v = _qkv()
    if not INTERPRETED:
        pytest.skip("the kernels were compiled for a GPU in this process")
    with pytest.raises(ValueError, match=expect):
        getattr(AF, variant)(q, k, v, backend="triton", **kwargs)


def test_cpu_without_interpreter_is_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        AF.softmax(q, k, v, backend="triton")
    assert "TRITON_INTERPRET=1" in dispatch._TABLE["relu"]["triton"].supports(q, k, v)


@pytest.mark.parametrize("call,exc,expect", [
    (lambda q, k, v: t5_bias_attention(q, k, v, torch.zeros(8, 3), 8, 20, True), ValueError, "table must have shape"),
    (lambda q, k, v: t5_bias_attention(q, k, v, torch.zeros(8, 2, dtype=torch.long), 8, 20, True), TypeError, "table"),
    (lambda q, k, v: t5_bias_attention(q, k, v, torch.zeros(8, 2), 8, 1.5, True), ValueError, "max_distance"),
    (lambda q, k, v: fused.preference_attention(q, k, v, None), ValueError, "log_pref"),
    (lambda q, k, v: fused.preference_attention(q, k, v, torch.zeros(1, 2, 5)), ValueError, "log_pref"),
    (lambda q, k, v: fused.preference_attention(q, k[..., :8], v, torch.zeros(9)), ValueError, "head dim"),
])
def test_entry_points_check_arguments(call, exc, expect):
    q, k, v = _qkv()
    with pytest.raises(exc, match=expect):
        call(q, k, v)


# --- the layer uses the T5 kernel when triton is asked for ----------------------------------------

@NEEDS_KERNELS
def test_fenchel_t5_layer_matches_reference_backend():
    layer = attnzoo.FenchelAttention(32, num_heads=2, preference="t5", num_buckets=NUM_BUCKETS,
                                     max_distance=MAX_DISTANCE, alpha=0.8, backend="triton")
    torch.nn.init.normal_(layer.relative_bias.weight)
    x = torch.randn(1, 21, 32)
    out = layer(x, is_causal=True)
    (g_fused,) = torch.autograd.grad(out.square().sum(), layer.relative_bias.weight)
    layer.backend = "reference"
    ref = layer(x, is_causal=True)
    (g_ref,) = torch.autograd.grad(ref.square().sum(), layer.relative_bias.weight)
    assert max_error(out, ref) < 1e-5 and max_error(g_fused, g_ref) < 1e-4 * max(1.0, float(g_ref.abs().max()))
    assert g_ref.abs().sum() > 0


@NEEDS_KERNELS
def test_ops_are_registered_custom_ops():
    q, k, v = (t.requires_grad_(True) for t in _qkv(nq=3, nk=5))
    torch.library.opcheck(torch.ops.attnzoo.softmax_family_fwd.default,
                          (q, k, v, None, torch.zeros(1, 2, 5), None, None, 0.25, True, False),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
