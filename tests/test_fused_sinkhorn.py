"""Streaming Sinkhorn (ops/sinkhorn/{cpu,triton}.py) against float64 math written here from the formulas.

Paper 002 sec 2.4 / the reference's docstring: L_ij = -scale ||q_i - k_j||^2 / (2 eps) (l2) or
scale q_i.k_j / eps (dot) plus the float mask; g^0 = 0, f = -lse_j(L + g), g = log(Nq/Nk) - lse_i(L + f)
n_iters times, P = softmax_j(L + g), out = P v. Causal = Sinkhorn on every prefix (eq 2.6).
The Triton kernels run under TRITON_INTERPRET=1 (set by `make test`) on tiny shapes.
"""
from __future__ import annotations

import inspect
import math

import pytest
import torch

import attnzoo.functional as AF
from attnzoo.ops import dispatch, plan
from attnzoo.ops.sinkhorn import cpu as sk_cpu
from attnzoo.ops.sinkhorn.streaming import Problem
from tests.common import (HAVE_TRITON, INTERPRET, KERNEL_DEVICE, float_mask, needs_gpu, needs_interpreter,
                          needs_kernels, needs_triton, padding_mask, qkv, seeded)
from tests.formulas import causal_row_problem
from tests.flash_rule import LOW_PRECISION, assert_flash_rule, autocast_triples, reference_or_rounded, scale_grad
from tests.memory_probe import LargestAllocation

if HAVE_TRITON:
    from attnzoo.ops.sinkhorn import triton as sk_triton
else:  # pragma: no cover
    sk_triton = None


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def fresh_plans():
    """Tests here change triton.py's module constants (MIN_SUM, SPREAD_MAX, FOLD_BELOW, FACTOR_MAX), which
    a kept plan's bound launches hold (ops/sinkhorn/bound.py): no plan outlives a test, so each test's
    constants are the ones its calls run with."""
    plan.clear()
    yield
    plan.clear()


# ---------------------------------------------------------------- float64 math from the formulas
def _lse(x, keep, dim):
    """logsumexp over the kept entries of x along dim (keepdim); 0 where none is kept."""
    m = torch.where(keep, x, torch.full_like(x, -math.inf)).amax(dim, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m)).detach()
    e = torch.where(keep, torch.exp(torch.where(keep, x, m) - m), torch.zeros_like(x))
    s = e.sum(dim, keepdim=True)
    return torch.where(s > 0, m + torch.log(torch.where(s > 0, s, torch.ones_like(s))), torch.zeros_like(s))


def _plan(L, keep, n_iters):
    nq, nk = L.shape[-2:]
    g = torch.zeros_like(L[..., :1, :])
    for _ in range(n_iters):
        f = -_lse(L + g, keep, -1)
        g = math.log(nq / nk) - _lse(L + f, keep, -2)
    S = L + g
    return torch.where(keep, torch.exp(torch.where(keep, S, torch.zeros_like(S)) - _lse(S, keep, -1)),
                       torch.zeros_like(S))


def math_sinkhorn(q, k, v, keep, bias, *, scale, eps, cost, n_iters, causal):
    q, k, v = (t.double() for t in (q, k, v))
    if cost == "l2":
        L = -scale * (q[..., :, None, :] - k[..., None, :, :]).pow(2).sum(-1) / (2 * eps)
    else:
        L = scale * torch.einsum("bhid,bhjd->bhij", q, k) / eps
    nq, nk = L.shape[-2:]
    keep = torch.ones(L.shape, dtype=torch.bool) if keep is None else keep.expand(L.shape)
    bias = torch.zeros(L.shape, dtype=torch.float64) if bias is None else bias.double().expand(L.shape)
    if not causal:
        return _plan(L + bias, keep, n_iters) @ v
    rows = []
    for i in range(nq):  # query i's problem: queries <= i, keys visible to query i, the mask's rule
        last = i + nk - nq
        if last < 0:
            rows.append(torch.zeros_like(v[..., :1, :]))
            continue
        allow_i, add_i = causal_row_problem(keep, bias, i)
        P = _plan(L[..., : i + 1, : last + 1] + add_i, allow_i, n_iters)
        rows.append(P[..., i:i + 1, :] @ v[..., : last + 1, :])
    return torch.cat(rows, dim=-2)


# ---------------------------------------------------------------- the table of cases
def make_mask(kind, B, nq, nk, gen):
    """(attn_mask for the kernel, keep, bias) for the math above."""
    if kind is None:
        return None, None, None
    # "bool" and "query" draw rand > 0.3, not common.bool_mask's rand < keep: the seeded cases keep the
    # masks their tolerances are checked on
    if kind == "bool":  # random, with query 0 seeing no key (zero row) and key 1 seen by nobody
        keep = torch.rand(B, 1, nq, nk, generator=gen) > 0.3
        keep[:, :, 0, :] = False
        keep[:, :, :, 1] = False
        return keep, keep, None
    if kind == "query":  # broadcast along the key axis (B, 1, Nq, 1): query 0 sees no key, a few others neither
        keep = torch.rand(B, 1, nq, 1, generator=gen) > 0.3
        keep[:, :, 0] = False
        return keep, keep, None
    if kind == "pad":  # key padding: the last 3 keys of the last batch element are padding
        keep = padding_mask([nk] * (B - 1) + [nk - 3], nk)
        return keep, keep, None
    if kind == "float":  # finite biases plus -inf entries
        mask = float_mask((nq, nk), 0.2, generator=gen)
        keep = torch.isfinite(mask)
        return mask, keep, torch.where(keep, mask, torch.zeros_like(mask))
    raise ValueError(kind)


def case(name, nq=7, nk=9, mask=None, causal=False, n_iters=3, eps=1.0, cost="l2", dtype=torch.float32,
         B=2, H=2, D=5, DV=3, big=1.0, marks=()):
    return pytest.param(dict(nq=nq, nk=nk, mask=mask, causal=causal, n_iters=n_iters, eps=eps, cost=cost,
                             dtype=dtype, B=B, H=H, D=D, DV=DV, big=big), id=name, marks=marks)


# Issue 21: these two cases were strict xfails (dq / dk 7.7x / 23x the reference's error in bf16; fp16
# out / dq / dk 2.2e3x / 2.8e4x / 4.2e4x). At eps = 0.05 the backward's adjoint terms cancel dS to a small
# residual, so the float32 plan of the backward must match the plan the forward's output and dv were made
# from: the kernels now take the plan tile as hi + lo parts in the dtype and delta from the unrounded
# output (docs/kernels_sinkhorn.md, "Half precision"). fp16 also lost whole plan tiles below its range
# under the bounded shifts: its attend keeps the running maximum and its dv pass the row potential.
CPU_CASES = [
    case("f64-plain", dtype=torch.float64),
    case("f64-iters0", n_iters=0, dtype=torch.float64),
    case("f64-iters1-dot", n_iters=1, cost="dot", dtype=torch.float64),
    case("f64-bool-mask", mask="bool", dtype=torch.float64),
    case("f64-float-mask-dot", mask="float", cost="dot", dtype=torch.float64),
    case("f64-padding-cross", nq=5, nk=11, mask="pad", dtype=torch.float64),
    case("f64-causal", nq=6, nk=6, causal=True, dtype=torch.float64),
    case("f64-causal-cross-mask", nq=4, nk=7, mask="bool", causal=True, cost="dot", dtype=torch.float64),
    case("f64-causal-nq>nk", nq=7, nk=4, causal=True, dtype=torch.float64),
    case("f32-eps0.05", eps=0.05),
    case("f32-eps0.05-dot-mask", eps=0.05, cost="dot", mask="bool"),
    case("f32-odd-long", nq=37, nk=53, mask="float"),
    case("bf16-eps0.05", eps=0.05, dtype=torch.bfloat16),
    case("bf16-pad", mask="pad", dtype=torch.bfloat16),
]
TRITON_CASES = [
    case("t-f32-plain", nq=7, nk=19),
    case("t-f32-iters0-dot", n_iters=0, cost="dot", H=1),
    case("t-f32-iters1-bool", n_iters=1, mask="bool", H=1),
    case("t-f32-float-mask-cross", nq=17, nk=5, mask="float", cost="dot", H=1),
    case("t-f32-pad-odd", nq=19, nk=23, mask="pad", D=20, DV=17, H=1),
    case("t-f32-eps0.05", eps=0.05, H=1),
    case("t-bf16-eps0.05-dot", eps=0.05, cost="dot", dtype=torch.bfloat16, H=1),
    case("t-bf16-pad", mask="pad", dtype=torch.bfloat16, H=1),
    case("t-f16-eps0.05-dot", eps=0.05, cost="dot", dtype=torch.float16, H=1),
    case("t-f16-bool", mask="bool", dtype=torch.float16, H=1),
    case("t-f32-causal", nq=3, nk=4, B=1, causal=True, H=1),
    case("t-f32-query-mask-dot", nq=18, nk=7, mask="query", cost="dot", H=1),
    # logits in the hundreds: reduced potentials and the one-exponential adjoint terms far from 1
    case("t-f32-eps0.05-big-iters1", nq=19, nk=23, eps=0.05, big=2.0, n_iters=1, H=1),
    # 11 factor columns: dq / dk take the unrolled terms in two rounds of 8
    case("t-f32-iters5-pad", nq=9, nk=17, mask="pad", n_iters=5, H=1),
]
# float64 / float32: tolerance on max|err| / max|expected| (x5 for the gradients). bf16 / fp16 inputs get
# FlashAttention's rule instead (tests/flash_rule.py): at most ~2x the error of the reference backend
# on the same half inputs, a bar a 5% error of the output or of any gradient cannot pass.
TOL = {torch.float64: 1e-10, torch.float32: 2e-4}


def make_inputs(c, seed=0):
    gen = seeded(seed)
    B, H = c["B"], c["H"]
    q, k, v = qkv(B, H, c["nq"], c["nk"], c["D"], c["DV"], generator=gen)
    q, k = q * c["big"], k * c["big"]
    w = torch.randn(B, H, c["nq"], c["DV"], generator=gen, dtype=torch.float64)  # loss weights
    attn_mask, keep, bias = make_mask(c["mask"], B, c["nq"], c["nk"], gen)
    q, k, v = (t.to(c["dtype"]).requires_grad_() for t in (q, k, v))
    return q, k, v, w, attn_mask, keep, bias


def rel_err(got, want):
    return ((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-6)).item()


def check_against_math(c, run):
    q, k, v, w, attn_mask, keep, bias = make_inputs(c)
    scale = 1.0 / math.sqrt(c["D"])
    kw = dict(scale=scale, eps=c["eps"], cost=c["cost"], n_iters=c["n_iters"])
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    want = math_sinkhorn(qd, kd, vd, keep, bias, causal=c["causal"], **kw)
    want_grads = torch.autograd.grad((want * w).sum(), (qd, kd, vd))
    got = run(q, k, v, attn_mask=attn_mask, is_causal=c["causal"], **kw)
    assert got.dtype == q.dtype and got.shape == want.shape
    got_grads = torch.autograd.grad((got.double() * w).sum(), (q, k, v))
    assert torch.isfinite(got).all() and all(torch.isfinite(g).all() for g in got_grads)
    for g in got_grads:
        assert g.dtype == c["dtype"]
    if c["dtype"] in LOW_PRECISION:
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        low = AF.sinkhorn(*leaves, attn_mask=attn_mask, is_causal=c["causal"], backend="reference", **kw)
        low_grads = torch.autograd.grad((low.double() * w).sum(), leaves)
        got_all, want_all = (got,) + got_grads, (want,) + want_grads
        assert_flash_rule(f"sinkhorn {c['cost']} eps={c['eps']} mask={c['mask']}", c["dtype"], 1.0,
                          zip(("out", "dq", "dk", "dv"), got_all,
                              reference_or_rounded(got_all, (low,) + low_grads, want_all, c["dtype"]), want_all))
    else:
        tol = TOL[c["dtype"]]
        assert rel_err(got, want) < tol, ("out", rel_err(got, want))
        for name, g, gw in zip("qkv", got_grads, want_grads):
            assert rel_err(g, gw) < tol * 5, (f"d{name}", rel_err(g, gw))
    if c["mask"] in ("bool", "query"):  # query 0 sees no key: a zero row, and no gradient flows from it
        assert (got[..., 0, :] == 0).all()


@pytest.mark.parametrize("c", CPU_CASES)
def test_cpu_matches_math(c):
    # blocks of 4 so every case streams over several query and key tiles
    check_against_math(c, lambda *a, **kw: sk_cpu.sinkhorn_attention(*a, block_q=4, block_k=4, **kw))


@pytest.mark.parametrize("c", CPU_CASES[:3] + CPU_CASES[6:7])
def test_functional_backend_cpu_matches_math(c):
    check_against_math(c, lambda *a, **kw: AF.sinkhorn(*a, backend="cpu", **kw))


AUTO_HOOK = "auto_prefers" in inspect.signature(dispatch.register_backend).parameters


@pytest.mark.parametrize("nq,nk,causal,want", [
    (64, 64, False, "reference" if AUTO_HOOK else "cpu"),   # small: the reference was measured faster
    (2048, 1024, False, "cpu"),
    (64, 64, True, "cpu"),                                 # causal: O(N) memory and less work per prefix
])
def test_auto_on_cpu(nq, nk, causal, want):
    q, k = torch.zeros(1, 1, nq, 2), torch.zeros(1, 1, nk, 2)
    choice = dispatch.choose("sinkhorn", None, q, k, k, attn_mask=None, is_causal=causal, scale=1.0, n_iters=3,
                             eps=1.0, cost="l2", dropout_p=0.0)
    assert choice.backend.name == want, str(choice)


@needs_kernels
@pytest.mark.parametrize("c", TRITON_CASES)
def test_triton_matches_math(c):
    device = KERNEL_DEVICE

    def run(q, k, v, attn_mask=None, **kw):  # .to() is differentiable: the gradients reach the CPU leaves
        out = AF.sinkhorn(q.to(device), k.to(device), v.to(device),
                          attn_mask=None if attn_mask is None else attn_mask.to(device), backend="triton", **kw)
        return out.cpu()

    check_against_math(c, run)


# ---------------------------------------------------------------- the half-precision checks can fail
def _perturbed(run, what, factor):
    """``run`` with its output, or the gradient of one input (dq, dk, dv), scaled by ``factor``."""
    def go(q, k, v, **kw):
        if what == "out":
            return run(q, k, v, **kw) * factor
        q, k, v = (scale_grad(t, factor) if what == f"d{n}" else t for n, t in zip("qkv", (q, k, v)))
        return run(q, k, v, **kw)
    return go


def _cpu_run(*a, **kw):
    return sk_cpu.sinkhorn_attention(*a, block_q=4, block_k=4, **kw)


def _triton_run(q, k, v, attn_mask=None, **kw):
    dev = KERNEL_DEVICE
    return AF.sinkhorn(q.to(dev), k.to(dev), v.to(dev), attn_mask=None if attn_mask is None else attn_mask.to(dev),
                       backend="triton", **kw).cpu()


_BY_ID = {p.id: p.values[0] for p in CPU_CASES + TRITON_CASES}
MUTATIONS = [  # (engine, case, what is scaled, factor): issue 23's 15% dq error, and 5% of each of the rest
    ("cpu", "bf16-eps0.05", "dq", 0.85), ("cpu", "bf16-eps0.05", "dq", 0.95), ("cpu", "bf16-pad", "dk", 0.95),
    ("cpu", "bf16-pad", "dv", 1.05), ("cpu", "bf16-eps0.05", "out", 0.95),
]
if INTERPRET or HAVE_TRITON and KERNEL_DEVICE == "cuda":
    MUTATIONS += [("triton", "t-bf16-pad", "dq", 0.95), ("triton", "t-f16-bool", "dk", 0.95),
                  ("triton", "t-f16-bool", "out", 1.05)]


@pytest.mark.parametrize("engine,case_id,what,factor", MUTATIONS, ids=lambda x: str(x))
def test_half_precision_check_sees_a_scaled_output_or_gradient(engine, case_id, what, factor):
    """The bf16 / fp16 cases above fail when one output or gradient is off by 5% (issue 23: a 20%
    tolerance let dq * 0.85 pass); the unperturbed run passes (test_*_matches_math)."""
    run = _perturbed(_cpu_run if engine == "cpu" else _triton_run, what, factor)
    with pytest.raises(AssertionError, match=f"{what} error"):
        check_against_math(_BY_ID[case_id], run)


# ---------------------------------------------------------------- properties
def _plan_via_identity_values(run, nq, nk, n_iters, eps):
    """With v = I (one value per key) the output rows are the plan P itself."""
    q, k, _ = qkv(1, 1, nq, nk, 4, generator=seeded(1))
    v = torch.eye(nk)[None, None]
    return run(q, k, v, scale=0.5, n_iters=n_iters, eps=eps).double()


MARGINAL_RUNS = [pytest.param(lambda *a, **kw: sk_cpu.sinkhorn_attention(*a, block_q=4, block_k=4, **kw), id="cpu")]
if INTERPRET:
    MARGINAL_RUNS.append(pytest.param(lambda *a, **kw: sk_triton.sinkhorn_attention(*a, **kw), id="triton"))


@pytest.mark.parametrize("run", MARGINAL_RUNS)
def test_rows_sum_to_one_columns_approach_nq_over_nk(run):
    nq, nk = 6, 9
    errs = []
    for n_iters in (0, 2, 10):
        P = _plan_via_identity_values(run, nq, nk, n_iters, eps=1.0)
        assert torch.allclose(P.sum(-1), torch.ones(nq, dtype=P.dtype), atol=1e-5)
        errs.append((P.sum(-2) - nq / nk).abs().max().item())
    assert errs[0] > 0.05           # softmax alone is far from the column marginal
    assert errs[2] < errs[1] < errs[0] and errs[2] < 1e-5


IMPLICIT_RUNS = [pytest.param("cpu", (1, 30), 1.0, id="cpu")]
if INTERPRET:  # the interpreter is slow: converged case only (eps=2 converges fast)
    IMPLICIT_RUNS.append(pytest.param("triton", (8,), 2.0, id="triton"))


@pytest.mark.parametrize("engine,iters,eps", IMPLICIT_RUNS)
def test_implicit_gradient_approaches_unrolled_as_iterations_grow(engine, iters, eps):
    """grad_mode="implicit" differentiates the fixed point: it differs from the n_iters-unrolled
    gradient for few iterations and agrees with it once the forward has converged."""
    gen = seeded(2)
    dtype = torch.float64 if engine == "cpu" else torch.float32
    H = 2 if engine == "cpu" else 1
    q, k, v = qkv(1, H, 6, 8, 4, dtype=dtype, generator=gen)
    w = torch.randn(1, H, 6, 4, generator=gen, dtype=torch.float64)
    fn = sk_cpu.sinkhorn_attention if engine == "cpu" else sk_triton.sinkhorn_attention
    errs = []
    for n_iters in iters:
        qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
        want = torch.autograd.grad((math_sinkhorn(qd, kd, vd, None, None, scale=0.5, eps=eps, cost="l2",
                                                  n_iters=n_iters, causal=False) * w).sum(), (qd, kd))
        qi, ki = q.clone().requires_grad_(), k.clone().requires_grad_()
        out = fn(qi, ki, v, scale=0.5, eps=eps, n_iters=n_iters, grad_mode="implicit")
        got = torch.autograd.grad((out.double() * w).sum(), (qi, ki))
        errs.append(max(rel_err(g, gw) for g, gw in zip(got, want)))
    if len(errs) > 1:
        assert errs[0] > 1e-3                           # one iteration is far from the fixed point
    assert errs[-1] < (1e-8 if dtype == torch.float64 else 1e-4)


@needs_kernels
def test_triton_implicit_gradient_matches_the_float64_implicit_gradient():
    """grad_mode="implicit" away from the fixed point (n_iters = 3), several tiles, key padding: the
    Triton kernels (fp32) against the same implicit-function adjoint in float64 (CPU engine, whose
    implicit path test_implicit_gradient_approaches_unrolled checks against the formulas)."""
    device = KERNEL_DEVICE
    gen = seeded(3)
    q, k, v = qkv(2, 1, 19, 23, 6, dtype=torch.float64, generator=gen)
    keep = padding_mask([23, 20], 23)
    w = torch.randn(2, 1, 19, 6, generator=gen, dtype=torch.float64)
    grads = []
    runs = ((sk_cpu.sinkhorn_attention, torch.float64, "cpu"), (sk_triton.sinkhorn_attention, torch.float32, device))
    for fn, dtype, dev in runs:
        leaves = [t.to(dev, dtype).requires_grad_() for t in (q, k, v)]
        out = fn(*leaves, attn_mask=keep.to(dev), scale=0.4, n_iters=3, eps=1.0, grad_mode="implicit")
        grads.append(torch.autograd.grad((out.double() * w.to(dev)).sum(), leaves))
    for want, got in zip(*grads):
        assert rel_err(got.cpu(), want) < 2e-5


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_cpu_path_never_allocates_n_by_n(causal):
    B, H, N, D, block = (1, 2, 12, 4, 4) if causal else (1, 2, 48, 16, 16)
    q, k, v = (t.requires_grad_() for t in qkv(B, H, N, N, D, generator=seeded(3)))
    pad = padding_mask([N - 5] * B, N)
    inputs = B * H * N * D * 4
    with LargestAllocation() as probe:
        out = sk_cpu.sinkhorn_attention(q, k, v, attn_mask=None if causal else pad, is_causal=causal, scale=0.3,
                                        n_iters=2, block_q=block, block_k=block)
        out.sum().backward()
    assert probe.largest <= inputs             # nothing beyond input-sized buffers; tiles are B*H*16*16
    assert inputs < B * H * N * N * 4          # ... which is less than one N x N fp32 matrix
    with LargestAllocation() as control:       # the probe does see an N x N tensor when one is made
        AF.sinkhorn(q, k, v, attn_mask=pad, scale=0.3, n_iters=2, backend="reference").sum().backward()
    assert control.largest >= B * H * N * N * 4


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_cpu_path_saves_o_n_for_backward(causal):
    """Everything autograd keeps between forward and backward (deduplicated storages) is O(N):
    q, k, v, plus for the non-causal call the output, the row lse and 2 n_iters + 1 potentials. The
    causal prefix loop must not keep each prefix's outputs and potentials (that would be O(N^2))."""
    B, H, D, n_iters = 1, 2, 4, 3
    sizes = {}
    for N in (12, 24):
        q, k, v = (t.requires_grad_() for t in qkv(B, H, N, N, D))
        storages = {}

        def pack(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = sk_cpu.sinkhorn_attention(q, k, v, is_causal=causal, scale=0.5, n_iters=n_iters, block_q=8, block_k=8)
        out.sum().backward()
        sizes[N] = sum(storages.values())
        vec = B * H * N * 4
        assert sizes[N] <= 4 * vec * D + (2 * n_iters + 2) * vec
    assert sizes[24] <= 2 * sizes[12] + 64   # linear in N, not quadratic


EXTREME_RUNS = [pytest.param(sk_cpu.sinkhorn_attention, torch.float32, id="cpu-f32"),
                pytest.param(sk_cpu.sinkhorn_attention, torch.bfloat16, id="cpu-bf16")]
if INTERPRET:
    EXTREME_RUNS += [pytest.param(sk_triton.sinkhorn_attention, torch.bfloat16, id="triton-bf16")]


@pytest.mark.parametrize("fn,dtype", EXTREME_RUNS)
@pytest.mark.parametrize("cost", ["l2", "dot"])
def test_eps_0_05_with_large_logits_stays_finite(fn, dtype, cost):
    """|L| in the thousands (exp would overflow outside the log domain), a fully masked row and a
    fully masked key: finite output and gradients, zero row where no key takes part, and the plan
    itself (v = I) within FlashAttention's rule of the float64 plan (bf16: at most ~2x the reference
    backend's error on the same inputs). The float64 gradients of this saturated plan are ~1e-14 (and
    NaN through the formula's masked row for l2): only their finiteness is checked."""
    q, k, _ = qkv(1, 2, 5, 7, 8, generator=seeded(4))
    q, k = (t.mul(6).to(dtype).requires_grad_() for t in (q, k))
    keep = torch.ones(1, 1, 5, 7, dtype=torch.bool)
    keep[..., 2, :] = False
    keep[..., :, 4] = False
    v = torch.eye(7, dtype=dtype)[None, None].expand(1, 2, 7, 7).clone().requires_grad_()
    kw = dict(attn_mask=keep, scale=1.0, eps=0.05, cost=cost, n_iters=3)
    P = fn(q, k, v, **kw)
    P.float().pow(2).sum().backward()
    assert torch.isfinite(P).all() and all(torch.isfinite(t.grad).all() for t in (q, k, v))
    assert (P[..., 2, :] == 0).all() and (P[..., 4] == 0).all()
    q64, k64, v64 = (t.detach().double() for t in (q, k, v))
    want = math_sinkhorn(q64, k64, v64, keep, None, causal=False, **{n: kw[n] for n in ("scale", "eps", "cost", "n_iters")})
    low = AF.sinkhorn(q.detach(), k.detach(), v.detach(), backend="reference", **kw)
    logits = (k64.unsqueeze(-3) - q64.unsqueeze(-2)).square().sum(-1) / 0.1 if cost == "l2" else q64 @ k64.mT / 0.05
    assert_flash_rule(f"sinkhorn |L| ~ 1e3 {cost}", dtype, float(logits.abs().max()), [("out (the plan)", P, low, want)])


# ---------------------------------------------------------------- the Triton kernels' shifted sums and their fallbacks
# Every pass after the first sums exp2(t - s) under one shift per program (no running maximum), the
# backward's weighted sums take their row potential out of the exponent, and dq / dk take every
# adjoint term from one product of rank-one factors; each falls back to the exact walk (running
# maximum, potential per logit, one exponential per term) where the shortcut could lose terms
# (ops/sinkhorn/triton_kernels.py). Forcing one side everywhere: each must match float64 alone where
# it applies; at extreme logits the shortcuts alone fail, so the default's agreement shows the
# fallbacks are taken.
SHIFTED_ONLY = dict(MIN_SUM=0.0, SPREAD_MAX=1e30, FACTOR_MAX=1e30)
EXACT_ONLY = dict(MIN_SUM=1e30, SPREAD_MAX=-1.0, FACTOR_MAX=-1e30)
WALK_CASES = [c for c in TRITON_CASES if c.id in ("t-f32-plain", "t-f32-pad-odd", "t-f32-float-mask-cross",
                                                  "t-f32-query-mask-dot", "t-f32-iters1-bool")]
EXTREME = next(c for c in TRITON_CASES if c.id == "t-f32-eps0.05-big-iters1")


def _triton_run(q, k, v, attn_mask=None, **kw):
    out = AF.sinkhorn(q.to(KERNEL_DEVICE), k.to(KERNEL_DEVICE), v.to(KERNEL_DEVICE),
                      attn_mask=None if attn_mask is None else attn_mask.to(KERNEL_DEVICE), backend="triton", **kw)
    return out.cpu()


@needs_kernels
@pytest.mark.parametrize("limits", [SHIFTED_ONLY, EXACT_ONLY], ids=["shifted-only", "exact-only"])
@pytest.mark.parametrize("c", WALK_CASES)
def test_triton_each_walk_alone_matches_math(c, limits, monkeypatch):
    for name, value in limits.items():
        monkeypatch.setattr(sk_triton, name, value)
    check_against_math(c, _triton_run)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the forced shortcut overflows (interpreted: numpy warns)
@needs_kernels
@pytest.mark.parametrize("n_iters", [1, 3])
@pytest.mark.parametrize("shortcut", ["MIN_SUM", "SPREAD_MAX"])
def test_triton_extreme_logits_take_the_exact_walks(shortcut, n_iters, monkeypatch):
    """eps = 0.05 with logits in the hundreds (SPREAD_MAX: backward blocks whose row potentials span
    more than 2^40) or thousands (MIN_SUM: rows whose sum underflows even under their own bound).
    Without the fallback the outputs or the gradients are wrong or not finite; with it (the
    default, also in the table above) they match."""
    c = dict(EXTREME.values[0], n_iters=n_iters, big=3.0 if shortcut == "MIN_SUM" else 2.0)
    check_against_math(c, _triton_run)
    monkeypatch.setattr(sk_triton, shortcut, SHIFTED_ONLY[shortcut])
    plan.clear()  # the kept plan holds the constants it was bound with
    with pytest.raises(AssertionError):
        check_against_math(c, _triton_run)


@needs_kernels
@pytest.mark.parametrize("c", [c for c in TRITON_CASES if c.id in ("t-f32-plain", "t-f32-iters0-dot", "t-f32-pad-odd")])
def test_triton_large_call_path_matches_math(c, monkeypatch):
    """Calls from FOLD_BELOW on launch a row-dot kernel for g^0 = -a|k|^2 and for dout.out instead
    of computing them inside the first pass that reads them: the same numbers."""
    monkeypatch.setattr(sk_triton, "FOLD_BELOW", 0)
    check_against_math(c, _triton_run)


def _far_apart_terms(T=2, nq=19, nk=23, spread=100.0, seed=5):
    """A dot-cost problem with synthetic potential stacks hundreds apart that still make every plan
    entry <= 1 (as the kernels assume): F[t] = -lse_j(L + max(G[t + 1] - c, G[t])), lse = lse_j(L + G[T])."""
    gen = seeded(seed)
    q, k, v = qkv(1, 1, nq, nk, 8, generator=gen)
    scale, eps = 0.5, 1.0
    L = scale / eps * q.double() @ k.double().transpose(-1, -2)
    c = math.log(nq / nk)
    G = torch.randn(T + 1, 1, 1, nk, generator=gen, dtype=torch.float64) * spread
    F = torch.stack([-torch.logsumexp(L + torch.maximum(G[t + 1] - c, G[t])[..., None, :], -1) for t in range(T)])
    lse = torch.logsumexp(L + G[T][..., None, :], -1)
    DG = torch.randn(T, 1, 1, nk, generator=gen, dtype=torch.float64)
    DF = torch.randn(T, 1, 1, nq, generator=gen, dtype=torch.float64)
    dout = torch.randn(1, 1, nq, 8, generator=gen)
    delta = torch.randn(1, 1, nq, generator=gen, dtype=torch.float64)
    return (q, k, v, scale, eps), (G, F, lse, DG, DF, dout, delta)


def _grad_qk_both(problem, stacks):
    """dq, dk of the CPU engine in float64 and of the Triton engine in float32 on the same terms."""
    (q, k, v, scale, eps), (G, F, lse, DG, DF, dout, delta) = problem, stacks
    p64 = Problem(q.double(), k.double(), v.double(), None, None, scale, eps, "dot")
    want = sk_cpu.TorchEngine(4, 4).grad_qk(p64, G[-1], lse, dout.double(), delta, (F, G, DG, DF))
    dev = lambda t: t.float().to(KERNEL_DEVICE)
    p32 = sk_triton._problem(dev(q), dev(k), dev(v), None, scale, eps, False, False)
    got = sk_triton.ENGINE.grad_qk(p32, dev(G[-1]), dev(lse), dev(dout), dev(delta),
                                   tuple(dev(t) for t in (F, G, DG, DF)))
    return want, tuple(t.cpu() for t in got)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the forced shortcut overflows (interpreted: numpy warns)
@needs_kernels
def test_triton_adjoint_terms_with_potentials_hundreds_apart(monkeypatch):
    """dq / dk take the unrolled terms C^t dg^t + R^t df^t = P (rank-one factors) from one product when
    the factors fit in float32, else one exponential per term (_factors_kernel decides per iteration).
    With potentials hundreds apart (after one iteration at tiny eps) the factors would overflow:
    forced, they give garbage; the default and the forced exponentials match float64 (fp32
    potentials ~300: relative rounding ~2e-5)."""
    problem, stacks = _far_apart_terms()
    for limit in (sk_triton.FACTOR_MAX, -1e30):
        monkeypatch.setattr(sk_triton, "FACTOR_MAX", limit)
        want, got = _grad_qk_both(problem, stacks)
        for w, g in zip(want, got):
            assert torch.isfinite(g).all() and rel_err(g, w) < 1e-4, (limit, rel_err(g, w))
    monkeypatch.setattr(sk_triton, "FACTOR_MAX", 1e30)
    want, got = _grad_qk_both(problem, stacks)
    assert not all(torch.isfinite(g).all() and rel_err(g, w) < 1e-4 for w, g in zip(want, got))
    # moderate potentials: the factored product alone matches too
    problem, stacks = _far_apart_terms(spread=2.0)
    want, got = _grad_qk_both(problem, stacks)
    for w, g in zip(want, got):
        assert rel_err(g, w) < 1e-5, rel_err(g, w)


# ---------------------------------------------------------------- compiled kernels on a GPU
# FlashAttention's rule: error vs float64 <= 2x the eager reference's own error in the same dtype
# (the reference computes half inputs in float32) plus a floor (tests/flash_rule.py).
GPU_SHAPES = {  # (B, H, Nq, Nk, D, Dv, cost, mask)
    "d64-odd": (2, 3, 333, 517, 64, 64, "l2", None),
    "d128-pad-dot": (1, 2, 300, 300, 128, 128, "dot", "pad"),
    "d64-n4096": (1, 2, 4096, 4096, 64, 64, "l2", None),
    "d128-bool": (1, 2, 200, 177, 128, 96, "l2", "bool"),
}


def _gpu_check(shape, dtype, n_iters=3, eps=1.0, grad_mode="unrolled", device="cuda"):
    from attnzoo.ops.sinkhorn import reference
    B, H, nq, nk, D, DV, cost, mask_kind = shape
    gen = seeded(7)
    q, k, v = qkv(B, H, nq, nk, D, DV, generator=gen)
    mask, _, _ = make_mask(mask_kind, B, nq, nk, gen)
    mask = None if mask is None else mask.to(device)
    w = torch.randn(B, H, nq, DV, generator=gen).to(device)
    kw = dict(attn_mask=mask, scale=D ** -0.5, n_iters=n_iters, eps=eps, cost=cost)

    def run(fn, dt):
        leaves = [t.to(device, dt).requires_grad_() for t in (q, k, v)]
        out = fn(*leaves, **kw)
        return [out] + list(torch.autograd.grad((out.double() * w).sum(), leaves))

    want = run(reference.sinkhorn_attention, torch.float64)
    low = run(reference.sinkhorn_attention, dtype)
    got = run(lambda *a, **k: sk_triton.sinkhorn_attention(*a, grad_mode=grad_mode, **k), dtype)
    assert all(torch.isfinite(t).all() for t in got)
    assert_flash_rule(f"sinkhorn {shape}", dtype, 1.0, list(zip(("out", "dq", "dk", "dv"), got, low, want)))


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(1, 2, 19, 21, 20, 12, "l2", "query"), (2, 1, 23, 17, 16, 16, "dot", "pad")],
                         ids=["l2-query-mask", "dot-key-padding"])
def test_flash_rule_under_the_interpreter(shape, dtype):
    """The GPU tests' comparison on CPU tensors and tiny shapes: FlashAttention's rule against float64,
    outputs and every gradient. The interpreter's dots are fp32, but the kernels still round P and dL
    to the input dtype before their products, as on a GPU."""
    _gpu_check(shape, dtype, device="cpu")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", list(GPU_SHAPES), ids=str)
def test_gpu_matches_float64_by_flash_rule(shape, dtype):
    _gpu_check(GPU_SHAPES[shape], dtype)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("index", [0, 1, 2])
@pytest.mark.parametrize("shape", ["d64-odd", "d128-pad-dot"])
def test_gpu_every_tile_candidate(shape, index):
    """Large calls autotune among a few tiles per kernel: each one must pass the same rule."""
    with sk_triton.pinned_tile(index):
        _gpu_check(GPU_SHAPES[shape], torch.bfloat16)


@pytest.mark.gpu
@needs_gpu
def test_gpu_implicit_gradient_matches_unrolled_near_the_fixed_point():
    q, k, v = (t.cuda() for t in qkv(1, 2, 300, 300, 64, generator=seeded(8)))
    grads = []
    for mode in ("unrolled", "implicit"):
        leaves = [t.clone().requires_grad_() for t in (q, k)]
        out = sk_triton.sinkhorn_attention(*leaves, v, scale=0.125, n_iters=40, eps=2.0, grad_mode=mode)
        grads.append(torch.autograd.grad(out.square().sum(), leaves))
    for a, b in zip(*grads):
        assert rel_err(b, a.double()) < 1e-3


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "autocast-bf16"])
def test_gpu_layer_compiles_fullgraph(autocast):
    """torch.compile(fullgraph=True) of the layer: the forward and the unrolled backward are custom
    ops torch.compile traces through; no data-dependent Python on the way (a graph break would fail).
    fp32: compiled equals eager; bf16 autocast: FlashAttention's rule against the float64 layer."""
    import attnzoo
    torch.manual_seed(0)
    layer = attnzoo.SinkhornAttention(64, num_heads=2).cuda()
    layer.backend = "triton"
    x = torch.randn(2, 37, 64, device="cuda", requires_grad=True)
    compiled = torch.compile(layer, fullgraph=True)
    if autocast:  # the compiled layer by FlashAttention's rule against the float64 layer (tests/flash_rule.py)
        assert_flash_rule("compiled sinkhorn layer under bf16 autocast", torch.bfloat16, 1.0,
                          autocast_triples(layer, (x,), device="cuda", tested=compiled))
        return
    results = []
    for fn in (layer, compiled):
        out = fn(x)
        grads = torch.autograd.grad(out.float().square().sum(), [x] + list(layer.parameters()))
        results.append((out.float(), grads))
    tol = 2e-4
    (out_e, g_e), (out_c, g_c) = results
    assert (out_e - out_c).abs().max() <= tol * max(1.0, float(out_e.abs().max()))
    for a, b in zip(g_e, g_c):
        assert (a - b).abs().max() <= tol * max(1.0, float(a.abs().max()))


# ---------------------------------------------------------------- bad input
BAD = [
    pytest.param(dict(grad_mode="exact"), ValueError, "grad_mode", id="grad_mode"),
    pytest.param(dict(dropout_p=0.1), ValueError, "dropout_p", id="dropout"),
]


@pytest.mark.parametrize("kw,err,word", BAD)
def test_cpu_rejects_bad_options(kw, err, word):
    q = torch.randn(1, 1, 3, 4)
    with pytest.raises(err, match=word):
        sk_cpu.sinkhorn_attention(q, q, q, **kw)


def test_named_backends_explain_what_they_cannot_do():
    q = torch.randn(1, 1, 3, 4)
    with pytest.raises(ValueError, match="dropout"):
        AF.sinkhorn(q, q, q, dropout_p=0.5, backend="cpu")
    assert AF.sinkhorn(q, q, q, dropout_p=0.5).shape == (1, 1, 3, 4)  # auto falls back to the reference
    if HAVE_TRITON:
        with pytest.raises(ValueError, match="float64"):
            AF.sinkhorn(q.double(), q.double(), q.double(), backend="triton")
        wide_v = torch.randn(1, 1, 3, 320)  # past MAX_HEAD_DIM: would not fit sm_90's shared memory
        with pytest.raises(ValueError, match="head dims above 256"):
            AF.sinkhorn(q, q, wide_v, backend="triton")
        bias = torch.zeros(3, 3, requires_grad=True)
        with pytest.raises(ValueError, match="attn_mask"):
            AF.sinkhorn(q, q, q, attn_mask=bias, backend="cpu")
