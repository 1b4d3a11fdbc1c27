"""The "cpu" (blockwise) and "torch" (SDPA) backends of softmax, l2, fenchel, sigmoid and relu against
float64 math written here from the formulas (paper 002 eqs 2.2-2.6, paper 004 eq 16), forward and
every gradient (q, k, v, float masks, log u, sigmoid bias), on one table of cases; plus bf16 /
extreme-logit / fully-masked-row safety, the choices `auto` makes, and a memory property of the
blockwise path (no tensor with Nq * Nk entries per head is ever allocated)."""
from __future__ import annotations

import math
import os

import pytest
import torch

import attnzoo
import attnzoo.functional as AF
from attnzoo.ops.kernels import blockwise
from tests.common import bool_mask, float_mask, padding_mask, qkv
from tests.flash_rule import (assert_flash_rule, flash_rule_failures, reference_or_rounded, scale_grad,
                              yardstick_dtype)
from tests.memory_probe import LargestOutput

# --- float64 ground truth, straight from the formulas ---------------------------------------------


def _keep_and_add(case, mask, nq, nk):
    """Which keys take part (bool (.., nq, nk)) and the finite float added to the logits."""
    i = torch.arange(nq)[:, None]
    j = torch.arange(nk)[None, :]
    keep = torch.ones(nq, nk, dtype=torch.bool)
    if case["causal"]:
        keep = j <= i + (nk - nq)  # bottom-right aligned
    add = torch.zeros((), dtype=torch.float64)
    if mask is not None:
        if mask.dtype == torch.bool:
            keep = keep & mask
        else:
            keep = keep & (mask > -math.inf)
            add = torch.where(mask > -math.inf, mask, torch.zeros((), dtype=mask.dtype))
    return keep, add


def _softmax_rows(s, keep):
    s = torch.where(keep, s, torch.full_like(s, -math.inf))
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)  # exp(-inf) = 0 on the keys that do not take part
    z = e.sum(-1, keepdim=True)
    return e / torch.where(z > 0, z, torch.ones_like(z))


def expected(variant, q, k, v, case, mask, scale, log_u=None, bias=None, alpha=1.0):
    nq, nk = q.shape[-2], k.shape[-2]
    keep, add = _keep_and_add(case, mask, nq, nk)
    dot = scale * torch.einsum("bhid,bhjd->bhij", q, k)
    if variant == "softmax":
        w = _softmax_rows(dot + add, keep)
    elif variant == "l2":
        dist = ((q[:, :, :, None, :] - k[:, :, None, :, :]) ** 2).sum(-1)  # ||q_i - k_j||^2 directly
        w = _softmax_rows(-scale * dist + add, keep)
    elif variant == "fenchel":  # softmax(alpha s_ij + log u_ij), -inf in log u drops the key
        lu = torch.zeros(()) if log_u is None else log_u
        keep = keep & (lu > -math.inf)
        lu = torch.where(lu > -math.inf, lu, torch.zeros((), dtype=dot.dtype))
        w = _softmax_rows(alpha * dot + lu + add, keep)
    else:
        n = keep.expand(dot.shape).sum(-1, keepdim=True).to(dot.dtype)
        s = dot + add
        if variant == "sigmoid":
            b = -torch.log(n.clamp_min(1)) if bias is None else bias
            w = torch.sigmoid(s + b)
        else:
            w = torch.relu(s) / n.clamp_min(1)
        w = torch.where(keep, w, torch.zeros_like(w))
    return w @ v


# --- the table of cases ----------------------------------------------------------------------------

CASES = [
    dict(id="plain", nq=19, nk=19, d=8, mask=None, causal=False),
    dict(id="cross_odd", nq=13, nk=29, d=5, mask=None, causal=False),
    dict(id="causal_square", nq=21, nk=21, d=8, mask=None, causal=True),
    dict(id="causal_nq<nk", nq=9, nk=26, d=8, mask=None, causal=True),
    dict(id="causal_nq>nk_empty_rows", nq=27, nk=11, d=8, mask=None, causal=True),
    dict(id="bool_padding", nq=17, nk=23, d=8, mask="padding", causal=False),
    dict(id="bool_empty_rows", nq=17, nk=23, d=8, mask="bool", causal=False),
    dict(id="float_mask_inf", nq=18, nk=31, d=8, mask="float", causal=False),
    dict(id="float_mask_causal", nq=25, nk=25, d=4, mask="float", causal=True),
    dict(id="bool_causal_cross", nq=11, nk=30, d=8, mask="bool", causal=True),
    dict(id="logits_1e4", nq=15, nk=20, d=8, mask="bool", causal=True, scale=2e3),
]
_BY_ID = {c["id"]: c for c in CASES}
B, H = 2, 3
BACKENDS = [("cpu", v) for v in ("softmax", "l2", "fenchel", "sigmoid", "relu")] + \
           [("torch", v) for v in ("softmax", "l2", "fenchel")]
ALIASES = [("torch", "sigmoid"), ("torch", "relu")]  # the blockwise path, also registered as "torch"


def _make_mask(case, g, dtype=torch.float64):
    nq, nk = case["nq"], case["nk"]
    every = slice(None)
    if case["mask"] == "padding":  # (B, 1, 1, Nk) key padding
        return padding_mask([nk - 5, nk], nk)
    if case["mask"] == "bool":  # per batch, broadcast over heads, with rows that keep no key
        return bool_mask((B, 1, nq, nk), 0.6, generator=g, empty_rows=[(0, every, 2), (1, every, -1)])
    if case["mask"] == "float":  # per head, some -inf entries and a fully -inf row
        return float_mask((1, H, nq, nk), 0.3, generator=g, dtype=dtype, empty_rows=[(0, 1, 3)]).requires_grad_()
    return None


def _inputs(case, g, dtype=torch.float64):
    qkv64 = qkv(B, H, case["nq"], case["nk"], case["d"], case["d"] + 1, dtype=torch.float64, generator=g)
    return [t.to(dtype).requires_grad_() for t in qkv64]


def _variant_kwargs(variant, case, g, dtype=torch.float64):
    """Extra learnable inputs: Fenchel's per-key log u (with a dropped key) and a sigmoid bias."""
    if variant == "fenchel":
        lu = torch.randn(B, H, 1, case["nk"], generator=g, dtype=torch.float64)
        lu[:, :, :, 1] = -math.inf
        return {"log_u": lu.to(dtype).requires_grad_(), "alpha": 0.7}
    if variant == "sigmoid" and case["id"] in ("plain", "float_mask_inf"):
        return {"bias": torch.randn(1, H, case["nq"], 1, generator=g, dtype=torch.float64).to(dtype).requires_grad_()}
    return {}


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 8 queries x 16 keys: every case spans several blocks, most end in a partial one."""
    monkeypatch.setattr(blockwise, "DEFAULT_BLOCK_Q", 8)
    monkeypatch.setattr(blockwise, "DEFAULT_BLOCK_K", 16)


def _leaves(qkv, mask, kw):
    extra = [t for t in kw.values() if isinstance(t, torch.Tensor)]
    return list(qkv) + ([mask] if mask is not None and mask.requires_grad else []) + extra


# the aliases run the same code as "cpu": three cases show the name reaches it
FORMULA = [(b, v, c) for b, v in BACKENDS for c in CASES] + \
          [(b, v, _BY_ID[i]) for b, v in ALIASES for i in ("cross_odd", "bool_causal_cross", "float_mask_inf")]


@pytest.mark.parametrize("backend,variant,case", FORMULA, ids=[f"{b}-{v}-{c['id']}" for b, v, c in FORMULA])
def test_matches_float64_formula(backend, variant, case, small_blocks):
    g = torch.Generator().manual_seed(hash((variant, case["id"])) % 2**31)
    qkv = _inputs(case, g)
    mask = _make_mask(case, g)
    kw = _variant_kwargs(variant, case, g)
    scale = case.get("scale", 0.35)
    got = AF.VARIANT_FUNCTIONS[variant](*qkv, attn_mask=mask, is_causal=case["causal"], scale=scale,
                                        backend=backend, **kw)
    want = expected(variant, *qkv, case, mask, scale, **kw)
    leaves = _leaves(qkv, mask, kw)
    cot = torch.randn(want.shape, generator=g, dtype=torch.float64)
    g_got = torch.autograd.grad((got * cot).sum(), leaves, allow_unused=True)
    g_want = torch.autograd.grad((want * cot).sum(), leaves, allow_unused=True)
    tol = dict(rtol=1e-9, atol=1e-9) if "scale" not in case else dict(rtol=1e-7, atol=1e-6)
    torch.testing.assert_close(got, want, **tol)
    for name, a, b in zip(["q", "k", "v", "mask/log_u/bias", "log_u/bias"], g_got, g_want):
        if b is None:
            assert a is None or not a.abs().any(), f"{name}: unexpected gradient"
            continue
        assert a is not None, f"{name}: no gradient"
        torch.testing.assert_close(a, b, **tol, msg=lambda m, n=name: f"grad {n}: {m}")


# --- low precision: FlashAttention's rule for the output and every gradient -----------------------

# bf16 on four cases, fp16 on two (fp16 is left out of logits_1e4 on purpose: there the true
# gradients, ~1e7, exceed fp16's range).
LOW_CASES = [(_BY_ID[i], torch.bfloat16) for i in ("causal_nq>nk_empty_rows", "bool_empty_rows", "float_mask_inf",
                                                   "logits_1e4")] + \
            [(_BY_ID[i], torch.float16) for i in ("bool_empty_rows", "float_mask_inf")]


@torch.no_grad()
def _logit_size(variant, q, k, scale):
    """About the largest |logit| (the rule's logit_size: fp32 rounds logits of size s by ~eps32 s)."""
    if variant == "l2":
        return float(scale * (q[..., :, None, :] - k[..., None, :, :]).square().sum(-1).max())
    return float(scale * (q @ k.mT).abs().max())


def low_precision_triples(backend, variant, case, dtype, perturb=None):
    """(name, ``backend`` on half inputs, the reference backend on the same inputs (or, where ``backend``
    gave exactly the reference's bits, the formula below in fp32 stored in ``dtype``), the float64 formula
    on those inputs) for the output and the gradient of q, k, v, log u / sigmoid bias; and the logit
    size. ``perturb``: leaves -> leaves, to make the tested path wrong on purpose."""
    g = torch.Generator().manual_seed(7)
    qkv64 = _inputs(case, g)
    mask = _make_mask(case, g)
    mask = None if mask is None else mask.detach()
    kw64 = _variant_kwargs(variant, case, g)
    # the half inputs the backends get; the float64 truth is computed from exactly these numbers
    half = [t.detach().to(dtype) for t in qkv64]
    half_mask = mask if mask is None or mask.dtype == torch.bool else mask.to(dtype)
    half_kw = {n: (x.detach().to(dtype) if isinstance(x, torch.Tensor) else x) for n, x in kw64.items()}
    scale = case.get("scale", 0.35)
    tensor_names = [n for n, x in half_kw.items() if isinstance(x, torch.Tensor)]
    cot = torch.randn(B, H, case["nq"], case["d"] + 1, generator=g, dtype=torch.float64)

    def run(call, to, tested=False):
        leaves = [t.to(to).requires_grad_() for t in half]
        kw = {n: (x.to(to).requires_grad_() if isinstance(x, torch.Tensor) else x) for n, x in half_kw.items()}
        m = half_mask if half_mask is None or half_mask.dtype == torch.bool else half_mask.to(to)
        args = perturb(leaves) if tested and perturb else leaves
        out = call(*args, m, kw)
        return [out] + list(torch.autograd.grad((out.double() * cot).sum(), leaves + [kw[n] for n in tensor_names]))

    fn = AF.VARIANT_FUNCTIONS[variant]
    want = run(lambda q, k, v, m, kw: expected(variant, q, k, v, case, m, scale, **kw), torch.float64)
    low = run(lambda q, k, v, m, kw: fn(q, k, v, attn_mask=m, is_causal=case["causal"], scale=scale,
                                        backend="reference", **kw), dtype)
    got = run(lambda q, k, v, m, kw: fn(q, k, v, attn_mask=m, is_causal=case["causal"], scale=scale,
                                        backend=backend, **kw), dtype, tested=True)
    assert got[0].dtype == dtype
    names = ["out", "dq", "dk", "dv"] + [f"d{n}" for n in tensor_names]
    def formula_as_the_reference_runs_it():  # fp32 arithmetic (logits of 1e4 lose ~1e-3 there), stored in dtype
        return [t.to(dtype) for t in run(lambda q, k, v, m, kw: expected(variant, q, k, v, case, m, scale, **kw),
                                         yardstick_dtype(dtype))]
    low = reference_or_rounded(got, low, want, dtype, formula_as_the_reference_runs_it)
    return list(zip(names, got, low, want)), _logit_size(variant, half[0].double(), half[1].double(), scale)


# Measured failures of the rule (issue 23: the old check compared outputs only, with a 1% floor). At
# logits ~1e4 the softmax is saturated: the float64 dq and dk are ~1e-48 (l2) or ~0.03 (softmax).
LOW_FAILURES = {
    ("cpu", "l2", "logits_1e4", torch.bfloat16):
        "cpu l2, bf16, logits ~1e4: dq, dk errors 3.5e-4 / 4.1e-4 where the float64 gradient and the "
        "reference backend's are ~1e-48 (fp32 cancellation in the blockwise backward, amplified by scale 2e3)",
    ("torch", "softmax", "logits_1e4", torch.bfloat16):
        "torch (SDPA) softmax, bf16, logits ~1e4: dq, dk errors 0.016 / 0.032 on a scale of 0.024 / 0.032, "
        "128x / 131x the reference backend's error (the rule allows 2x)",
    ("cpu", "sigmoid", "logits_1e4", torch.bfloat16):
        "cpu sigmoid (bit for bit the reference backend), bf16, logits ~1e4: dq, dk errors 3.1e-6 / 4.4e-6 on a "
        "scale of 1.8e-4 / 2.2e-4, 8.9x / 7.6x those of this file's formula run in fp32 and stored in bf16",
}


@pytest.mark.parametrize("case,dtype", LOW_CASES, ids=[f"{c['id']}-{str(d)[6:]}" for c, d in LOW_CASES])
@pytest.mark.parametrize("backend,variant", BACKENDS, ids=[f"{b}-{v}" for b, v in BACKENDS])
def test_low_precision_flash_rule(backend, variant, case, dtype, small_blocks, request):
    """bf16 / fp16 inputs: finite, and the output and every gradient within FlashAttention's rule (at most
    ~2x the reference backend's error on the same inputs against float64, tests/flash_rule.py)."""
    failure = LOW_FAILURES.get((backend, variant, case["id"], dtype))
    if failure:
        request.applymarker(pytest.mark.xfail(strict=True, reason=failure))
    triples, logit_size = low_precision_triples(backend, variant, case, dtype)
    for name, got, _, _ in triples:
        assert torch.isfinite(got).all(), name
    assert_flash_rule(f"{backend}-{variant}-{case['id']}", dtype, logit_size, triples)


LOW_MUTATIONS = [("cpu", "softmax", "bool_empty_rows", torch.bfloat16, "dq", 0.95),
                 ("cpu", "sigmoid", "float_mask_inf", torch.float16, "dk", 0.95),
                 ("torch", "l2", "causal_nq>nk_empty_rows", torch.bfloat16, "dv", 1.05),
                 ("torch", "fenchel", "float_mask_inf", torch.bfloat16, "out", 0.95),
                 ("cpu", "relu", "logits_1e4", torch.bfloat16, "dq", 0.85)]


@pytest.mark.parametrize("backend,variant,case_id,dtype,what,factor", LOW_MUTATIONS, ids=lambda x: str(x))
def test_low_precision_rule_sees_a_scaled_output_or_gradient(backend, variant, case_id, dtype, what, factor,
                                                              small_blocks):
    """The check above fails when one output or gradient is off by 5% (15% for issue 23's dq)."""
    def perturb(leaves):
        if what == "out":
            return leaves
        i = "qkv".index(what[1])
        return leaves[:i] + [scale_grad(leaves[i], factor)] + leaves[i + 1:]
    triples, logit_size = low_precision_triples(backend, variant, _BY_ID[case_id], dtype, perturb)
    if what == "out":
        triples = [(n, got * factor if n == "out" else got, low, want) for n, got, low, want in triples]
    assert any(f"{what} error" in f for f in flash_rule_failures("mutated", dtype, logit_size, triples))


# --- backends refuse what they cannot do, with a sentence -----------------------------------------

REFUSALS = [
    ("cpu", "softmax", dict(dropout_p=0.1), "dropout_p > 0"),
    ("cpu", "sigmoid", dict(dropout_p=0.1), "dropout_p > 0"),
    ("cpu", "fenchel", dict(solve="second_order"), "first_order"),
    ("torch", "fenchel", dict(solve="exact"), "first_order"),
]


@pytest.mark.parametrize("backend,variant,kw,words", REFUSALS, ids=[f"{r[0]}-{r[1]}-{r[3][:8]}" for r in REFUSALS])
def test_refusals_name_the_reason(backend, variant, kw, words):
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match=words):
        AF.VARIANT_FUNCTIONS[variant](q, q, q, backend=backend, **kw)


AUTO = [  # (variant, N, kwargs, grad, expected backend on CPU)
    ("softmax", 16, {}, False, "torch"),
    ("l2", 256, {}, True, "torch"),
    ("softmax", 256, {"dropout_p": 0.1}, True, "torch"),
    ("sigmoid", 8, {}, True, "reference"),
    ("sigmoid", 1024, {}, True, "reference"),  # 4 * 1024^2 scores: below SMALL_CALL_ELEMENTS
    ("sigmoid", 2048, {}, True, "cpu"),
    ("relu", 1024, {"dropout_p": 0.1}, True, "reference"),
    ("fenchel", 2048, {"log_u": "grad"}, True, "cpu"),
    ("fenchel", 2048, {"log_u": "grad"}, False, "torch"),
    ("fenchel", 64, {"solve": "exact"}, True, "reference"),
]


@pytest.mark.parametrize("variant,n,kw,grad,want", AUTO, ids=[f"{a[0]}-{a[1]}-{a[4]}" for a in AUTO])
def test_auto_choice_on_cpu(variant, n, kw, grad, want):
    q = torch.zeros(1, 4, n, 8)  # shapes only: explain runs nothing
    kw = dict(kw)
    if kw.get("log_u") == "grad":
        kw["log_u"] = torch.zeros(1, 4, 1, n, requires_grad=True)
    with torch.set_grad_enabled(grad):
        choice = attnzoo.explain(variant, q, q, q, **kw)
    assert choice.backend.name == want, str(choice)
    for why in choice.reasons.values():  # every skipped backend says why in a sentence
        assert len(why.split()) >= 4


# --- memory: the blockwise path never allocates an (Nq, Nk) tensor --------------------------------



MEMORY = [("softmax", {}), ("l2", {}), ("fenchel", {"log_u": True}), ("sigmoid", {}), ("relu", {})]


@pytest.mark.parametrize("variant,extra", MEMORY, ids=[m[0] for m in MEMORY])
def test_blockwise_never_allocates_n_by_n(variant, extra):
    """N = 512, blocks of 64 x 128: the op's inner loops (run through forward_impl/backward_impl,
    which the custom op calls) and the user-facing call around the op (masks, L2 augmentation,
    autograd) each allocate at most one block per head, far below Nq * Nk."""
    n, d, bq, bk = 512, 16, 64, 128
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, n, d, generator=g) for _ in range(3))
    pad = torch.ones(1, 1, 1, n, dtype=torch.bool)
    pad[..., -100:] = False
    log_u = torch.randn(1, 2, 1, n, generator=g) if extra.get("log_u") else None
    block = 2 * bq * bk
    kind = {"softmax": "softmax", "l2": "softmax", "fenchel": "softmax", "sigmoid": "sigmoid_default",
            "relu": "relu"}[variant]
    with LargestOutput() as inner:
        out, stat = blockwise.forward_impl(q, k, v, pad, None, log_u, kind, 0.25, True, bq, bk)
        blockwise.backward_impl(torch.ones_like(out), q, k, v, out, stat, pad, None, log_u, kind, 0.25, True, bq, bk)
    assert 0 < inner.largest <= block < n * n
    leaves = [t.requires_grad_() for t in (q, k, v)] + ([log_u.requires_grad_()] if log_u is not None else [])
    kw = {"log_u": log_u} if log_u is not None else {}
    with LargestOutput() as outer:
        o = AF.VARIANT_FUNCTIONS[variant](q, k, v, attn_mask=pad, is_causal=True, backend="cpu", **kw)
        torch.autograd.grad(o.sum(), leaves)
    assert outer.largest < n * n // 8, outer.largest


# --- FlexAttention: forward only, opt-in (it compiles a CPU kernel: ~1 min here; no backward on CPU) ---

FLEX_CASES = [c for c in CASES if c["id"] in ("plain", "causal_nq<nk", "causal_nq>nk_empty_rows", "bool_empty_rows")]


@pytest.mark.skipif(os.environ.get("ATTNZOO_FLEX_CPU") != "1",
                    reason="opt-in (ATTNZOO_FLEX_CPU=1): compiles FlexAttention for CPU, ~1 min")
@pytest.mark.parametrize("case", FLEX_CASES, ids=[c["id"] for c in FLEX_CASES])
@pytest.mark.parametrize("variant", ["l2", "fenchel"])
def test_flex_forward_matches_formula_on_cpu(variant, case):
    from attnzoo.ops.fenchel.backends import fenchel_flex
    from attnzoo.ops.l2.backends import l2_flex
    g = torch.Generator().manual_seed(11)
    q, k, v = (t.detach() for t in _inputs(case, g))
    mask = _make_mask(case, g)
    kw = {name: (t.detach() if isinstance(t, torch.Tensor) else t)
          for name, t in _variant_kwargs(variant, case, g).items()}
    want = expected(variant, q, k, v, case, mask, 0.35, **kw)
    fn = l2_flex if variant == "l2" else fenchel_flex
    f32 = {k_: (v_.float() if isinstance(v_, torch.Tensor) else v_) for k_, v_ in kw.items()}
    with torch.no_grad():
        got = fn(q.float(), k.float(), v.float(), attn_mask=mask, is_causal=case["causal"], scale=0.35, **f32)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)
