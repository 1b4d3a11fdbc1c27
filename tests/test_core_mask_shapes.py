"""Every broadcastable mask shape, on every backend of every variant, against the float64 formulas.

SDPA's rule: attn_mask (bool, True = take part, or float added to the logits, -inf = masked) is
broadcastable to (B, H, Nq, Nk). The shapes (Nk,), (Nq, 1), (Nq, Nk), (B, 1, 1, Nk) and (B, H, Nq, Nk)
each stress a different reading: (Nq, 1) keeps all keys of a row or none, so the key count n_i of
sigmoid / ReLU / identity-linear is Nk or 0, never 1; (Nk,) is one dim, which SDPA itself rejects.
Forward and the gradients of q, k, v are compared with tests/formulas.py (a fully masked row has
output 0 and gradient 0 there too). Also here: the NaN rule (NaN in a mask or bias is a ValueError
naming it; NaN in q, k, v propagates to the rows it reaches and no further).
Triton backends run under the interpreter (tiny shapes, a subset of the cases) or on a GPU.
"""
from __future__ import annotations

import functools
import math

import pytest
import torch

import attnzoo.functional as AF
from attnzoo.ops import dispatch
from attnzoo.ops import validate as V
from tests import formulas as R
from tests.common import INTERPRET, KERNEL_DEVICE, ON_GPU, bool_mask, broadcast_shapes, float_mask, seeded
from tests.common import qkv as random_qkv  # `qkv` names the leaves in _case

B, H, NQ, NK, D, DV = 2, 2, 5, 7, 4, 3

SHAPES = {name.replace(",", ""): shape for name, shape in broadcast_shapes(B, H, NQ, NK).items()}  # Nq1, B11Nk, ...
KINDS = ("bool", "float", "float_inf")  # bool; float without -inf; float with -inf entries
# the Triton backends under the interpreter take ~0.3-1.5 s a case: the 1-D mask and the (Nq, 1) mask
# (a whole row kept or not) with both kinds of key removal (their own tests cover the 2-D and 4-D shapes)
TRITON_CASES = [("Nk", "bool"), ("Nq1", "bool"), ("Nq1", "float_inf")]


def _keys(nk):
    return torch.randn(nk, generator=seeded(7), dtype=torch.float64)


# name -> (functional, kwargs(dtype, device), formula(q, k, v, allow, add, user_allow, scale))
VARIANTS = {
    "softmax": ("softmax", lambda dt, dev: {}, lambda q, k, v, a, add, ua, s: R.softmax(q, k, v, a, add, s)),
    "l2": ("l2", lambda dt, dev: {}, lambda q, k, v, a, add, ua, s: R.l2(q, k, v, a, add, s)),
    "sinkhorn": ("sinkhorn", lambda dt, dev: dict(n_iters=2, eps=0.7),
                 lambda q, k, v, a, add, ua, s: R.sinkhorn(q, k, v, ua, add, s, 2, 0.7, "l2", False)),
    "sigmoid": ("sigmoid", lambda dt, dev: {}, lambda q, k, v, a, add, ua, s: R.sigmoid(q, k, v, a, add, s)),
    # a per-head bias of 3 dims (H, 1, 1): broadcast like a mask
    "sigmoid_head_bias": ("sigmoid", lambda dt, dev: {"bias": torch.tensor([-0.5, 0.25], dtype=dt, device=dev).view(H, 1, 1)},
                          lambda q, k, v, a, add, ua, s: R.sigmoid(q, k, v, a, add, s,
                                                                   bias=torch.tensor([-0.5, 0.25], dtype=torch.float64).view(H, 1, 1))),
    "relu": ("relu", lambda dt, dev: {}, lambda q, k, v, a, add, ua, s: R.relu(q, k, v, a, add, s)),
    "linear_elu": ("linear", lambda dt, dev: {}, lambda q, k, v, a, add, ua, s: R.linear(q, k, v, a, add, "elu")),
    "linear_identity": ("linear", lambda dt, dev: {"feature_map": "identity"},
                        lambda q, k, v, a, add, ua, s: R.linear(q, k, v, a, add, "identity")),
    # a 1-D (Nk,) log u: broadcast like a mask
    "fenchel": ("fenchel", lambda dt, dev: {"log_u": _keys(NK).to(dt).to(dev), "alpha": 0.8},
                lambda q, k, v, a, add, ua, s: R.fenchel_first(q, k, v, a, add, s, _keys(NK), 0.8)),
    "ot": ("ot", lambda dt, dev: {"log_u": _keys(NK).to(dt).to(dev)},
           lambda q, k, v, a, add, ua, s: R.ot(q, k, v, a, add, s, log_u=_keys(NK).expand(B, H, NK))),
}


def _is_triton(backend):
    return backend.startswith("triton")


def _backends(fn_name):
    out = []
    for name in dispatch.backends(fn_name) + ["auto"]:
        if name == "flex":  # CUDA-only FlexAttention: tests/test_cpu_softmax_family.py (opt-in)
            continue
        if name.endswith("_implicit"):  # the forward of its unrolled sibling; only the backward differs
            continue
        if _is_triton(name) and not (INTERPRET or ON_GPU):
            continue
        out.append(name)
    return out


def _cases():
    cases = []
    for variant, (fn_name, _, _) in VARIANTS.items():
        for backend in _backends(fn_name):
            combos = TRITON_CASES if _is_triton(backend) else [(s, k) for s in SHAPES for k in KINDS]
            cases += [(variant, backend, s, k) for s, k in combos]
    return cases


CASES = _cases()


def make_mask(shape_name, kind, g):
    shape = SHAPES[shape_name]
    keep = bool_mask(shape, 0.7, generator=g)
    if shape_name == "Nq1":  # one row keeps every key, one keeps none
        keep[0], keep[1] = True, False
    elif shape_name == "Nk":
        keep[1], keep[2] = False, True
    if kind == "bool":
        return keep
    m = float_mask(shape, generator=g, dtype=torch.float64)
    return m.masked_fill(~keep, -math.inf) if kind == "float_inf" else m


def _run(variant, backend, q, k, v, mask, dtype, device):
    fn_name, kwargs, _ = VARIANTS[variant]
    return getattr(AF, fn_name)(q, k, v, attn_mask=mask, backend=backend, **kwargs(dtype, device))


@functools.lru_cache(maxsize=None)
def _case(variant, shape, kind):
    """Inputs, mask, cotangent and the formula's output and q/k/v gradients (float64), shared by
    every backend of the case (the formulas, OT's loops especially, cost more than the backends)."""
    g = seeded(hash((variant, shape, kind)) % 2**31)
    q, k, v = random_qkv(B, H, NQ, NK, D, DV, dtype=torch.float64, generator=g)
    mask = make_mask(shape, kind, g)
    cot = torch.randn(B, H, NQ, DV, generator=g, dtype=torch.float64)
    fn_name, _, formula = VARIANTS[variant]
    allow, add = R.allow_and_add(mask, False, B, H, NQ, NK)
    qkv = [t.clone().requires_grad_() for t in (q, k, v)]
    want = formula(*qkv, allow, add, allow, 1.0 if fn_name == "linear" else 1 / math.sqrt(D))
    want_grads = torch.autograd.grad((want * cot).sum(), qkv)
    return (q, k, v), mask, cot, want.detach(), want_grads


@pytest.mark.parametrize("variant,backend,shape,kind", CASES, ids=["-".join(c) for c in CASES])
def test_mask_shapes_match_the_formula(variant, backend, shape, kind):
    qkv, mask, cot, want, want_grads = _case(variant, shape, kind)
    triton = _is_triton(backend)
    dtype, device = (torch.float32, KERNEL_DEVICE) if triton else (torch.float64, "cpu")
    leaves = [t.to(dtype).to(device).requires_grad_() for t in qkv]
    m = mask.to(device) if mask.dtype == torch.bool else mask.to(dtype).to(device)
    try:
        out = _run(variant, backend, *leaves, m, dtype, device)
    except ValueError as e:  # a backend may decline a mask it cannot factorise, saying why
        assert "cannot run this" in str(e) and len(str(e).split()) > 12, str(e)
        return
    assert out.shape == want.shape and out.dtype == dtype
    # float32 (Triton): the inputs' rounding is part of the error, ~1e-7 relative
    tol = dict(atol=1e-10, rtol=1e-10) if dtype == torch.float64 else dict(atol=3e-5, rtol=3e-5)
    torch.testing.assert_close(out.double().cpu(), want, **tol)
    got_grads = torch.autograd.grad((out * cot.to(dtype).to(device)).sum(), leaves)
    gtol = tol if dtype == torch.float64 else dict(atol=2e-4, rtol=2e-4)
    for name, a, b in zip("qkv", got_grads, want_grads):
        torch.testing.assert_close(a.double().cpu(), b, **gtol, msg=lambda s, n=name: f"grad {n}: {s}")
    if shape == "Nq1" and kind != "float":  # row 1 keeps no key: its output and its query's gradient are exactly 0
        assert not out[..., 1, :].any() and not got_grads[0][..., 1, :].any()


def test_key_broadcast_mask_counts_every_kept_key_blockwise(monkeypatch):
    """The blockwise ('cpu') path counts n_i block by block: a float (Nq, 1) mask without -inf keeps
    all Nk keys of every row, not one per key block."""
    from attnzoo.ops.kernels import blockwise
    monkeypatch.setattr(blockwise, "DEFAULT_BLOCK_K", 4)  # 7 keys: blocks of 4 and 3
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, D, generator=g, dtype=torch.float64) for n in (NQ, NK, NK))
    mask = torch.randn(NQ, 1, generator=g, dtype=torch.float64)
    for fn in (AF.relu, AF.sigmoid):
        torch.testing.assert_close(fn(q, k, v, attn_mask=mask, backend="cpu"),
                                   fn(q, k, v, attn_mask=mask.expand(NQ, NK).clone(), backend="reference"))


# --- NaN: a ValueError in masks and biases, propagation in q / k / v ---------------------------------

def _qkv(n=4, dtype=torch.float32):
    return [t.to(dtype) for t in random_qkv(1, 2, n, n, D, generator=seeded(1))]


def _with(value, shape, index):
    t = torch.zeros(shape)
    t[index] = value
    return t


BAD_VALUES = [  # (argument, call with the bad tensor)
    ("attn_mask", lambda q, k, v, t: AF.softmax(q, k, v, attn_mask=t)),
    ("attn_mask", lambda q, k, v, t: AF.sigmoid(q, k, v, attn_mask=t, backend="cpu")),
    ("attn_mask", lambda q, k, v, t: AF.linear(q, k, v, attn_mask=t)),
    ("attn_mask", lambda q, k, v, t: AF.sinkhorn(q, k, v, attn_mask=t)),
    ("log_u", lambda q, k, v, t: AF.fenchel(q, k, v, log_u=t)),
    ("log_u", lambda q, k, v, t: AF.ot(q, k, v, log_u=t[2])),
    ("bias", lambda q, k, v, t: AF.sigmoid(q, k, v, bias=t)),
]


@pytest.mark.parametrize("value", [math.nan, math.inf], ids=["nan", "+inf"])
@pytest.mark.parametrize("name,call", BAD_VALUES, ids=[f"{i}-{b[0]}" for i, b in enumerate(BAD_VALUES)])
def test_nan_or_plus_inf_in_a_mask_or_bias_is_a_value_error(name, call, value):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=rf"^{name} holds"):
        call(q, k, v, _with(value, (4, 4), (2, 1)))
    assert torch.isfinite(call(q, k, v, _with(-math.inf, (4, 4), (2, 1)))).all()  # -inf stays valid


def test_value_check_follows_value_check_devices(monkeypatch):
    """The check reads data (a host sync on CUDA): it runs only on VALUE_CHECK_DEVICES (CPU by
    default) and never while torch.compile traces."""
    q, k, v = _qkv()
    bad = _with(math.nan, (4, 4), (0, 0))
    monkeypatch.setattr(V, "VALUE_CHECK_DEVICES", set())
    AF.softmax(q, k, v, attn_mask=bad, backend="reference")  # unchecked: no error
    monkeypatch.setattr(V, "VALUE_CHECK_DEVICES", {"cpu"})
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    AF.softmax(q, k, v, attn_mask=bad, backend="reference")


def test_value_check_keeps_fullgraph_compile():
    q, k, v = _qkv()
    mask = torch.zeros(4, 4)
    compiled = torch.compile(lambda q, k, v, m: AF.softmax(q, k, v, attn_mask=m, backend="reference"),
                             fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(q, k, v, mask), AF.softmax(q, k, v, attn_mask=mask, backend="reference"))


NAN_VARIANTS = {"softmax": {}, "l2": {}, "fenchel": {"alpha": 0.7}, "sigmoid": {}, "relu": {}, "linear": {},
                "linear_identity": {"feature_map": "identity"}, "sinkhorn": {"n_iters": 2}, "ot": {}}
NAN_CASES = [(var, be, where) for var in NAN_VARIANTS for be in _backends(var.split("_")[0])
             for where in ("q", "k", "v") if not (_is_triton(be) and where == "v")]  # v: a plain matmul
# Triton kernels (owned elsewhere) that drop NaN today: max(s, 0) skips it
NAN_KNOWN: set = set()  # (variant, backend, where) of kernels known to drop NaN scores


@pytest.mark.parametrize("variant,backend,where", NAN_CASES, ids=["-".join(c) for c in NAN_CASES])
def test_nan_in_qkv_reaches_its_rows_and_no_further(variant, backend, where, request):
    """A NaN in q_i gives a NaN row i (Sinkhorn: every row of that head, the column sums couple
    them); a NaN in k_j or v_j (a key every query sees) gives NaN rows in that head only. Every
    other row equals the clean output: nothing is zeroed, nothing else is touched."""
    if (variant, backend, where) in NAN_KNOWN:
        request.applymarker(pytest.mark.xfail(strict=True, reason="this Triton kernel drops NaN scores"))
    triton = _is_triton(backend)
    dtype, device = (torch.float32, KERNEL_DEVICE) if triton else (torch.float64, "cpu")
    q, k, v = (t.to(device) for t in _qkv(5, dtype))
    fn = getattr(AF, variant.split("_")[0])
    kw = NAN_VARIANTS[variant]
    clean = fn(q, k, v, backend=backend, **kw)
    bad = {"q": q.clone(), "k": k.clone(), "v": v.clone()}
    bad[where][0, 1, 2, 0] = math.nan
    out = fn(bad["q"], bad["k"], bad["v"], backend=backend, **kw)
    nan_rows = torch.isnan(out).any(-1)
    expect = torch.zeros_like(nan_rows)
    if where == "q" and variant != "sinkhorn":
        expect[0, 1, 2] = True
    else:
        expect[0, 1] = True
    assert torch.equal(nan_rows, expect), nan_rows
    torch.testing.assert_close(out[~expect], clean[~expect], atol=0, rtol=0)


def test_sinkhorn_reference_nan_query_is_not_an_empty_row():
    """safe_logsumexp read a NaN sum as 'no keys' (returning 0): the other rows came out finite
    but wrong. Causal Sinkhorn is Sinkhorn on each prefix, so only rows >= i see query i there."""
    q, k, v = _qkv(5, torch.float64)
    q[0, 0, 2, 1] = math.nan
    out = AF.sinkhorn(q, k, v, is_causal=True, backend="reference")
    assert torch.equal(torch.isnan(out).any(-1)[0, 0], torch.tensor([False, False, True, True, True]))
    assert torch.isfinite(out[0, 1]).all()


# --- documented input that crashed or overflowed -----------------------------------------------------

EMPTY_CASES = [(var, be, dims) for var in ("softmax", "l2", "sinkhorn", "sigmoid", "relu", "linear", "fenchel", "ot")
               for be in _backends(var) for dims in ((0, 2), (2, 0))]


@pytest.mark.parametrize("variant,backend,dims", EMPTY_CASES, ids=[f"{v}-{b}-B{d[0]}H{d[1]}" for v, b, d in EMPTY_CASES])
def test_no_batch_or_no_head_gives_an_empty_output(variant, backend, dims):
    device = KERNEL_DEVICE if _is_triton(backend) else "cpu"
    q, k, v = (torch.randn(*dims, n, d, device=device, requires_grad=True) for n, d in ((3, D), (4, D), (4, DV)))
    out = getattr(AF, variant)(q, k, v, backend=backend)
    assert out.shape == (*dims, 3, DV) and out.dtype == q.dtype
    out.sum().backward()
    assert q.grad.shape == q.shape and v.grad.shape == v.shape


@pytest.mark.parametrize("feature_map", ["elu", "relu"])
@pytest.mark.parametrize("backend,mask_shape", [("reference", (NQ, NK)), ("reference", (NK,)), ("cpu", (NK,))])
def test_linear_large_finite_float_mask_does_not_overflow(feature_map, backend, mask_shape):
    """A float mask is a log-weight exp(m_ij): m = +100 overflows float32's exp (inf / inf = NaN).
    Weights are taken relative to the row's largest m, which the normalisation cancels exactly."""
    g = seeded(2)
    q, k, v = random_qkv(1, 2, NQ, NK, D, DV, dtype=torch.float64, generator=g)
    mask = 100.0 + torch.randn(mask_shape, generator=g, dtype=torch.float64)
    mask[..., 0] = -100.0
    leaves = [t.float().requires_grad_() for t in (q, k, v)]
    out = AF.linear(*leaves, attn_mask=mask.float(), feature_map=feature_map, backend=backend)
    allow, add = R.allow_and_add(mask, False, 1, 2, NQ, NK)
    want = R.linear(q, k, v, allow, add, feature_map)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    out.sum().backward()  # feature_map="relu" has rows whose weights are all 0: 0 / eps, finite gradients
    assert all(torch.isfinite(t.grad).all() for t in leaves)
