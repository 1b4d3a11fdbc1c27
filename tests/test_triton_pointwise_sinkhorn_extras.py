"""softcap and window_size fused in the Triton pointwise (sigmoid, relu) and Sinkhorn kernels, under
TRITON_INTERPRET=1 (16 x 16 tiles, so the tiny shapes below cross several blocks and a window is
narrower or wider than a tile), against float64 formulas written here from docs/usage.md:

    s_ij = cap(scale q_i.k_j) + add_ij,  cap(s) = c tanh(s / c),
    key j takes part for query i iff the mask, causality and the band i + (Nk - Nq) - left <= j <=
    i + (Nk - Nq) + right all let it; n_i counts those keys;
    sigmoid: w = sigmoid(s + b_i), b_i = -log n_i (or a given bias);  relu: w = relu(s) / n_i.

fp32 results by FlashAttention's rule with the fp32 floor (tests/flash_rule.py), bf16 / fp16 by the
rule itself.
"""
from __future__ import annotations

import pytest
import torch

import attnzoo.functional as AF
from tests.common import needs_interpreter
from tests import formulas as F
from tests.flash_rule import assert_flash_rule, max_error

D = 8
SCALE = D ** -0.5


def band(window, nq, nk):
    """(nq, nk) bool: key j in query i's band, from the offsets d = j - i - (nk - nq), as loops."""
    allow = torch.ones(nq, nk, dtype=torch.bool)
    if window is None:
        return allow
    left, right = window
    for i in range(nq):
        for j in range(nk):
            d = j - i - (nk - nq)
            allow[i, j] = not ((left >= 0 and d < -left) or (right >= 0 and d > right))
    return allow


def pointwise_formula(name, q, k, v, *, mask=None, causal=False, window=None, softcap=None, bias=None):
    """float64 (B, H, Nq, Dv) from the formula; k, v may have fewer heads (grouped queries)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    nq, nk = q.shape[2], k.shape[2]
    s = SCALE * torch.einsum("bhid,bhjd->bhij", q, k)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    allow = band(window, nq, nk).expand(s.shape)
    if causal:
        allow = allow & band((-1, 0), nq, nk)
    if mask is not None:
        if mask.dtype == torch.bool:
            allow = allow & mask
        else:
            allow = allow & (mask > -torch.inf)
            s = s + torch.where(mask > -torch.inf, mask, torch.zeros_like(mask))
    n = allow.sum(-1, keepdim=True).double().clamp_min(1)
    if name == "sigmoid":
        b = -torch.log(n) if bias is None else bias
        w = torch.sigmoid(s + b)
    else:
        w = s.clamp_min(0) / n
    return torch.where(allow, w, torch.zeros_like(w)) @ v


def inputs(B, H, H_kv, nq, nk, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, nq, D, generator=g, dtype=torch.float64) * 2  # logits ~ 4: the cap matters
    k = torch.randn(B, H_kv, nk, D, generator=g, dtype=torch.float64) * 2
    v = torch.randn(B, H_kv, nk, D, generator=g, dtype=torch.float64)
    return [t.to(dtype).double() for t in (q, k, v)]  # rounded to dtype: the rule counts no input rounding


def run(fn, tensors, dtype, grad_out, **kw):
    """(out, *grads) of fn on copies of ``tensors`` in ``dtype`` that require grad."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in tensors]
    out = fn(*leaves, **kw)
    grads = torch.autograd.grad(out, leaves, grad_out.to(out.dtype))
    return [out, *grads]


# (name, B, H, H_kv, Nq, Nk, causal, mask kind, window, softcap): windows narrower than a 16-wide tile,
# wider than two (an inside stage between the edges), one-sided, with Nq != Nk both ways
CASES = [
    ("softcap_key_padding", 2, 1, 1, 29, 29, False, "keys", None, 2.0),
    ("softcap_causal_gqa_float_mask", 1, 4, 2, 20, 37, True, "float", None, 1.5),
    ("narrow_window", 1, 1, 1, 40, 53, False, None, (3, 2), None),
    ("wide_causal_window", 1, 1, 1, 70, 70, True, None, (35, 20), None),
    ("window_softcap_mask_gqa", 1, 2, 1, 50, 33, False, "bool", (20, 9), 3.0),
    ("left_only_window_causal_softcap", 1, 2, 2, 45, 30, True, "float", (12, -1), 2.5),
    ("right_only_window", 1, 1, 1, 33, 41, False, None, (-1, 5), None),
]


def make_mask(kind, B, H, nq, nk, seed):
    g = torch.Generator().manual_seed(seed + 100)
    if kind == "keys":
        return torch.rand(B, 1, 1, nk, generator=g) > 0.3
    if kind == "bool":
        return torch.rand(B, H, nq, nk, generator=g) > 0.2
    if kind == "float":
        m = torch.randn(nq, nk, generator=g, dtype=torch.float64)
        return m.masked_fill(torch.rand(nq, nk, generator=g) < 0.2, -torch.inf)
    return None


def check(name, case, dtype, bias_tensor=False, calls=1):
    label, B, H, H_kv, nq, nk, causal, mask_kind, window, softcap = case
    q, k, v = inputs(B, H, H_kv, nq, nk, seed=len(label), dtype=dtype)
    mask = make_mask(mask_kind, B, H, nq, nk, len(label))
    bias = None
    tensors = [q, k, v]
    if bias_tensor:  # a per-row bias tensor (the kernels' BIAS_ROWS mode) and its gradient
        bias = torch.randn(1, H, nq, 1, generator=torch.Generator().manual_seed(3), dtype=torch.float64) - 2
        tensors.append(bias)
    grad_out = torch.randn(B, H, nq, D, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    fn = AF.VARIANT_FUNCTIONS[name]

    def call(*t, backend):
        kw = dict(attn_mask=None if mask is None else mask.to(t[0].dtype) if mask.is_floating_point() else mask,
                  is_causal=causal, window_size=window, softcap=softcap, backend=backend,
                  enable_gqa=H != H_kv)
        if bias_tensor:
            kw["bias"] = t[3]
        return fn(*t[:3], **kw)

    def formula(*t):
        return pointwise_formula(name, *t[:3], mask=mask, causal=causal, window=window, softcap=softcap,
                                 bias=t[3] if bias_tensor else None)

    want = run(formula, tensors, torch.float64, grad_out)
    low = run(lambda *t: call(*t, backend="reference"), tensors, dtype, grad_out)
    names = ["out", "dq", "dk", "dv", "dbias"]
    for i in range(calls):  # a later call of the same signature runs the plan kept by the first
        got = run(lambda *t: call(*t, backend="triton"), tensors, dtype, grad_out)
        assert_flash_rule(f"{name} {label} call {i}", dtype, 5.0, zip(names, got, low, want))
    # the extras moved the answer: a kernel ignoring them would be far off
    plain = run(lambda *t: pointwise_formula(name, *t[:3], mask=mask, causal=causal,
                                             bias=t[3] if bias_tensor else None), tensors, torch.float64, grad_out)
    assert max_error(plain[0], want[0]) > 0.05 * float(want[0].detach().abs().max())


@needs_interpreter
@pytest.mark.parametrize("name", ["sigmoid", "relu"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_pointwise_fp32_forward_and_gradients(name, case):
    check(name, case, torch.float32)


@needs_interpreter
def test_sigmoid_bias_tensor_gradient_sees_the_capped_logit():
    check("sigmoid", CASES[4], torch.float32, bias_tensor=True)


@needs_interpreter
@pytest.mark.parametrize("name,dtype", [("sigmoid", torch.bfloat16), ("relu", torch.float16)])
def test_pointwise_low_precision_flash_rule(name, dtype):
    check(name, CASES[5], dtype)


@needs_interpreter
@pytest.mark.parametrize("name", ["sigmoid", "relu"])
def test_pointwise_kept_plan_with_softcap_equals_the_formula(name, monkeypatch):
    """A softcap call's plan binds its launches (kernels/pointwise/bound.py), and the second call of the
    signature runs them: they must carry the cap too."""
    from attnzoo.ops import plan
    from attnzoo.ops.kernels.pointwise import bound
    plan.clear()
    bound_calls = []
    original = bound.BoundLaunch.__call__
    monkeypatch.setattr(bound.BoundLaunch, "__call__", lambda self, *a, **kw: bound_calls.append(self.meta["SOFTCAP"])
                        or original(self, *a, **kw))
    check(name, CASES[1], torch.float32, calls=2)
    assert bound_calls and all(c == CASES[1][-1] for c in bound_calls)


@needs_interpreter
@pytest.mark.parametrize("name", ["sigmoid", "relu"])
def test_pointwise_window_skips_the_key_blocks_outside_the_band(name):
    """Keys 0..15 (the first 16-wide key block) hold NaN. A causal window of 5 keys puts them outside
    every band from query 20 on, so query blocks from 32 on never load that block: their outputs and
    gradients equal the clean run's, and key blocks from 16 on get clean dk, dv. The same band given
    as a dense mask visits the block (0 * NaN = NaN in the product), which shows the check can fail."""
    nq = nk = 64
    q, k, v = inputs(1, 1, 1, nq, nk, seed=5, dtype=torch.float32)
    grad_out = torch.randn(1, 1, nq, D, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    fn = AF.VARIANT_FUNCTIONS[name]
    windowed = lambda *t: fn(*t, is_causal=True, window_size=(4, 0), backend="triton")
    clean = run(windowed, [q, k, v], torch.float32, grad_out)
    k_nan, v_nan = k.clone(), v.clone()
    k_nan[:, :, :16], v_nan[:, :, :16] = torch.nan, torch.nan
    dirty = run(windowed, [q, k_nan, v_nan], torch.float32, grad_out)
    for name_, (a, b), rows in zip(["out", "dq", "dk", "dv"], zip(dirty, clean), [32, 32, 16, 16]):
        assert torch.isfinite(a[:, :, rows:]).all(), name_
        assert torch.equal(a[:, :, rows:], b[:, :, rows:]), name_
    dense = fn(q.float(), k_nan.float(), v_nan.float(), attn_mask=band((4, 0), nq, nk), backend="triton")
    assert torch.isnan(dense[:, :, 32:]).any()


# --- Sinkhorn -------------------------------------------------------------------------------------------
# L_ij = cap(-scale |q_i - k_j|^2 / (2 eps)) (l2) or cap(scale q_i.k_j / eps) (dot), + the float mask; the
# window is a mask of the transport problem (docs/usage.md); causal = Sinkhorn on every prefix, the mask
# (band included) shaping each prefix problem by tests/formulas.py's rule.

def sinkhorn_formula(q, k, v, *, mask=None, causal=False, window=None, softcap=None, cost="l2", eps=1.0,
                     n_iters=3):
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    nq, nk = q.shape[2], k.shape[2]
    if cost == "l2":
        L = -SCALE * ((q[:, :, :, None, :] - k[:, :, None, :, :]) ** 2).sum(-1) / (2 * eps)
    else:
        L = SCALE * torch.einsum("bhid,bhjd->bhij", q, k) / eps
    if softcap is not None:
        L = softcap * torch.tanh(L / softcap)
    allow = band(window, nq, nk).expand(L.shape)
    add = torch.zeros_like(L)
    if mask is not None:
        allow = allow & mask if mask.dtype == torch.bool else allow & (mask > -torch.inf)
        if mask.is_floating_point():
            add = torch.where(mask > -torch.inf, mask, torch.zeros_like(mask)).expand(L.shape)
    if not causal:
        return F.sinkhorn_plan(L + add, allow, n_iters) @ v
    out = torch.zeros(q.shape[:-1] + (v.shape[-1],), dtype=torch.float64)
    for i in range(nq):
        last = i + nk - nq  # query i's prefix problem: queries 0..i, keys 0..last
        if last < 0:
            continue
        allow_i, add_i = F.causal_row_problem(allow, add, i)
        P = F.sinkhorn_plan(L[..., : i + 1, : last + 1] + add_i, allow_i, n_iters)
        out[..., i, :] = (P[..., i:i + 1, :] @ v[..., : last + 1, :])[..., 0, :]
    return out


# (name, H, H_kv, Nq, Nk, causal, mask kind, window, softcap, cost, eps)
SINKHORN_CASES = [
    ("softcap_l2_key_padding", 1, 1, 20, 27, False, "keys", None, 1.5, "l2", 1.0),
    ("softcap_dot_window_mask_gqa", 2, 1, 23, 18, False, "bool", (4, 3), 2.0, "dot", 0.5),
    ("softcap_causal_window", 1, 1, 6, 8, True, None, (3, 0), 1.0, "l2", 1.0),
]


def check_sinkhorn(case, dtype):
    label, H, H_kv, nq, nk, causal, mask_kind, window, softcap, cost, eps = case
    q, k, v = inputs(1, H, H_kv, nq, nk, seed=len(label), dtype=dtype)
    mask = make_mask(mask_kind, 1, H, nq, nk, len(label))
    grad_out = torch.randn(1, H, nq, D, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    kw = dict(attn_mask=mask, is_causal=causal, window_size=window, softcap=softcap, cost=cost, eps=eps,
              n_iters=3, enable_gqa=H != H_kv)
    formula_kw = dict(mask=mask, causal=causal, window=window, cost=cost, eps=eps)
    want = run(lambda *t: sinkhorn_formula(*t, softcap=softcap, **formula_kw), [q, k, v], torch.float64, grad_out)
    got = run(lambda *t: AF.sinkhorn(*t, backend="triton", **kw), [q, k, v], dtype, grad_out)
    low = run(lambda *t: AF.sinkhorn(*t, backend="reference", **kw), [q, k, v], dtype, grad_out)
    assert_flash_rule(f"sinkhorn {label}", dtype, 5.0, zip(["out", "dq", "dk", "dv"], got, low, want))
    plain = run(lambda *t: sinkhorn_formula(*t, **formula_kw), [q, k, v], torch.float64, grad_out)
    assert max_error(plain[0], want[0]) > 0.05 * float(want[0].detach().abs().max())


@needs_interpreter
@pytest.mark.parametrize("case", SINKHORN_CASES, ids=[c[0] for c in SINKHORN_CASES])
def test_sinkhorn_fp32_forward_and_gradients(case):
    check_sinkhorn(case, torch.float32)


@needs_interpreter
def test_sinkhorn_bf16_flash_rule():
    check_sinkhorn(SINKHORN_CASES[0], torch.bfloat16)


@needs_interpreter
def test_sinkhorn_softcap_runs_on_triton_and_the_implicit_backward_declines_it():
    from attnzoo.ops import variant as catalog
    q = torch.randn(1, 1, 5, D)
    choice = catalog.explain("sinkhorn", q, q, q, softcap=1.0, backend="triton")
    assert choice.backend.name == "triton"
    with pytest.raises(ValueError, match="does not implement softcap"):
        AF.sinkhorn(q, q, q, softcap=1.0, backend="triton_implicit")
