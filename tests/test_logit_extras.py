"""softcap, sinks and window_size (ops/logit_extras.py) for every variant, against float64 math written
here from the definitions (Gemma 2's cap, gpt-oss's sinks, FlashAttention's window), on every backend
that runs on CPU; the refusals name the argument and the variant."""
from __future__ import annotations

import math

import pytest
import torch

import attnzoo.functional as AF
from attnzoo.ops import dispatch
from attnzoo.ops import variant as catalog

from . import formulas as F

B, H, D = 2, 2, 4
SCALE = D ** -0.5


def qkv(nq=5, nk=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, n, D, generator=g, dtype=torch.float64) * 2 for n in (nq, nk, nk))
    return q, k, v


def band(left, right, nq, nk):
    """Key j in query i's band, written as loops: bottom-right aligned offsets d = j - i - (nk - nq)."""
    allow = torch.ones(B, H, nq, nk, dtype=torch.bool)
    for i in range(nq):
        for j in range(nk):
            d = j - i - (nk - nq)
            if (left >= 0 and d < -left) or (right >= 0 and d > right):
                allow[..., i, j] = False
    return allow


def cap(s, c):
    return s if c is None else c * torch.tanh(s / c)


def softmax_family(logits, allow, sinks):
    """p_ij = exp(l_ij) / (sum_{allowed l} exp(l_il) + exp(sink_h)), zero outside allow (small logits:
    no shift needed in float64)."""
    e = torch.where(allow, torch.exp(logits), torch.zeros_like(logits))
    total = e.sum(-1, keepdim=True)
    if sinks is not None:
        total = total + torch.exp(sinks).reshape(1, -1, 1, 1)
    return e / torch.where(total > 0, total, torch.ones_like(total))


def expected(name, q, k, v, allow, add, softcap=None, sinks=None):
    dots = SCALE * torch.einsum("bhid,bhjd->bhij", q, k)
    n = allow.sum(-1, keepdim=True).double()
    if name == "softmax":
        return softmax_family(cap(dots, softcap) + add, allow, sinks) @ v
    if name == "l2":
        d2 = ((q[:, :, :, None, :] - k[:, :, None, :, :]) ** 2).sum(-1)
        return softmax_family(cap(-SCALE * d2, softcap) + add, allow, sinks) @ v
    if name == "fenchel":  # first order, alpha = 1, no preference
        return softmax_family(cap(dots, softcap) + add, allow, sinks) @ v
    if name == "sigmoid":
        s = cap(dots, softcap) + add - torch.log(n.clamp_min(1))
        return torch.where(allow, 1 / (1 + torch.exp(-s)), torch.zeros_like(s)) @ v
    if name == "relu":
        s = cap(dots, softcap) + add
        return torch.where(allow, s.clamp_min(0), torch.zeros_like(s)) / n.clamp_min(1) @ v
    if name == "sinkhorn":  # non-causal, cost l2, eps 1, 3 iterations
        d2 = ((q[:, :, :, None, :] - k[:, :, None, :, :]) ** 2).sum(-1)
        return F.sinkhorn_plan(cap(-SCALE * d2 / 2, softcap) + add, allow, 3) @ v
    raise AssertionError(name)


def cpu_backends(name):
    """Every backend of the variant that may run on CPU tensors (the Triton ones only on CUDA here)."""
    return [b for b in dispatch.backends(name) if b != "triton" and b != "flex"]


def run_or_decline(name, backend, q, k, v, **kw):
    """The backend's answer, or None when it declines the call (its reason must name the argument)."""
    try:
        return AF.VARIANT_FUNCTIONS[name](q, k, v, backend=backend, **kw)
    except ValueError as e:
        assert "cannot run this" in str(e), e
        return None


SOFTCAP_VARIANTS = ["softmax", "l2", "fenchel", "sigmoid", "relu", "sinkhorn"]
SINK_VARIANTS = ["softmax", "l2", "fenchel"]


@pytest.mark.parametrize("name", SOFTCAP_VARIANTS)
def test_softcap_every_backend_equals_the_formula(name, small_blocks):
    q, k, v = qkv()
    mask = torch.rand(B, 1, 5, 5, generator=torch.Generator().manual_seed(1)) > 0.3
    allow, add = F.allow_and_add(mask, False, B, H, 5, 5)
    want = expected(name, q, k, v, allow, add, softcap=0.7)
    ran = []
    for backend in cpu_backends(name):
        out = run_or_decline(name, backend, q, k, v, attn_mask=mask, softcap=0.7)
        if out is not None:
            torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10, msg=f"{name} {backend}")
            ran.append(backend)
    assert "reference" in ran
    # the cap moved the answer (0.7 bounds logits of size ~4): a backend ignoring it would fail above
    assert (expected(name, q, k, v, allow, add) - want).abs().max() > 1e-2
    torch.testing.assert_close(AF.VARIANT_FUNCTIONS[name](q, k, v, attn_mask=mask, softcap=0.7), want,
                               rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", SINK_VARIANTS)
def test_sinks_every_backend_equals_the_formula(name, small_blocks):
    q, k, v = qkv(3, 6)
    sinks = torch.tensor([0.5, -1.0], dtype=torch.float64)
    allow, add = F.allow_and_add(None, True, B, H, 3, 6)
    want = expected(name, q, k, v, allow, add, sinks=sinks)
    ran = []
    for backend in cpu_backends(name):
        out = run_or_decline(name, backend, q, k, v, is_causal=True, sinks=sinks)
        if out is not None:
            torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10, msg=f"{name} {backend}")
            ran.append(backend)
    assert "reference" in ran
    if name == "softmax":  # SDPA takes the sink as one more zero key whose mask logit is the sink
        assert "torch" in ran
    assert (expected(name, q, k, v, allow, add) - want).abs().max() > 1e-2


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 2 queries x 3 keys: the blockwise path crosses block edges, the diagonal and the band's."""
    from attnzoo.ops.kernels import blockwise
    monkeypatch.setattr(blockwise, "DEFAULT_BLOCK_Q", 2)
    monkeypatch.setattr(blockwise, "DEFAULT_BLOCK_K", 3)


@pytest.mark.parametrize("name", SINK_VARIANTS + ["sigmoid", "relu"])
def test_gradients_through_the_cap_into_the_sinks_and_inside_the_window(name, small_blocks):
    nq, nk = 5, 7
    q, k, v = (t.requires_grad_() for t in qkv(nq, nk, seed=3))
    sinks = torch.tensor([0.3, -0.2], dtype=torch.float64, requires_grad=True) if name in SINK_VARIANTS else None
    g = torch.randn(B, H, nq, D, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    allow, add = F.allow_and_add(None, True, B, H, nq, nk)
    allow = allow & band(2, -1, nq, nk)
    inputs = (q, k, v) + ((sinks,) if sinks is not None else ())
    want = torch.autograd.grad(expected(name, q, k, v, allow, add, softcap=1.5, sinks=sinks), inputs, g)
    ran = []
    for backend in cpu_backends(name):
        out = run_or_decline(name, backend, q, k, v, is_causal=True, softcap=1.5, sinks=sinks, window_size=(2, -1))
        if out is None:
            continue
        got = torch.autograd.grad(out, inputs, g)
        for a, b, what in zip(got, want, ("dq", "dk", "dv", "dsinks")):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10, msg=f"{name} {backend} {what}")
        ran.append(backend)
    assert "reference" in ran and (name == "l2" or "cpu" in ran)  # l2's blockwise form cannot cap (see l2_cpu)
    if sinks is not None:
        assert want[3].abs().min() > 1e-4  # every head's sink takes a gradient


def test_the_blockwise_path_visits_only_the_blocks_in_the_band(monkeypatch):
    from attnzoo.ops.kernels import blockwise, blockwise_band
    visited = []  # (first row, rows, keys) of every score block built
    real, real_band = blockwise._Masks.scores, blockwise_band.Band.scores

    def spy(self, q_scaled, k, qs, qe, ks, ke, *a):
        visited.append((qs, qe - qs, ke - ks))
        return real(self, q_scaled, k, qs, qe, ks, ke, *a)

    def spy_band(self, masks, qb, kr, qs, *a):  # G blocks of rows at once (one head), each with its run of keys
        visited.extend((qs + g * qb.shape[1], qb.shape[1], kr.shape[1]) for g in range(qb.shape[0]))
        return real_band(self, masks, qb, kr, qs, *a)

    monkeypatch.setattr(blockwise._Masks, "scores", spy)
    monkeypatch.setattr(blockwise_band.Band, "scores", spy_band)
    q, k, v = (torch.randn(1, 1, 64, 4, dtype=torch.float64) for _ in range(3))
    out = blockwise.blockwise_attention(q, k, v, kind="softmax", scale=0.5, is_causal=True, window_size=(8, -1),
                                        block_q=8, block_k=8)
    # rows qs..qs+7 see keys qs-8 .. qs+7: 16 keys per row (8 at the start), not all qs + 8 before them
    assert sorted(visited) == [(0, 8, 8)] + [(qs, 8, 16) for qs in range(8, 64, 8)]
    allow, add = F.allow_and_add(None, True, 1, 1, 64, 64)
    torch.testing.assert_close(out, F.softmax(q, k, v, allow & band(8, -1, 64, 64)[:1, :1], add, 0.5),
                               rtol=1e-10, atol=1e-10)


WINDOWS = [((1, 0), True, 5, 5), ((2, 1), False, 5, 5), ((-1, 1), False, 4, 6), ((1, -1), True, 3, 6),
           ((0, 0), False, 4, 4)]


@pytest.mark.parametrize("name", ["softmax", "l2", "fenchel", "sigmoid", "relu", "linear", "ot"])
@pytest.mark.parametrize("window,causal,nq,nk", WINDOWS)
def test_window_is_the_variant_restricted_to_the_band(name, window, causal, nq, nk, small_blocks):
    q, k, v = qkv(nq, nk, seed=5)
    mask = torch.rand(1, 1, nq, nk, generator=torch.Generator().manual_seed(6)) > 0.2
    allow, add = F.allow_and_add(mask, causal, B, H, nq, nk)
    allow = allow & band(*window, nq, nk)
    formula = {"softmax": F.softmax, "l2": F.l2, "fenchel": F.fenchel_first, "sigmoid": F.sigmoid,
               "relu": F.relu, "ot": F.ot}.get(name)
    if name == "linear":
        want = F.linear(q, k, v, allow, add)
    else:
        want = formula(q, k, v, allow, add, SCALE)
    got = AF.VARIANT_FUNCTIONS[name](q, k, v, attn_mask=mask, is_causal=causal, window_size=window)
    torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-8)
    for backend in cpu_backends(name):
        out = run_or_decline(name, backend, q, k, v, attn_mask=mask, is_causal=causal, window_size=window)
        if out is not None:
            torch.testing.assert_close(out, want, rtol=1e-8, atol=1e-8, msg=backend)


@pytest.mark.parametrize("window", [(1, 1), (2, 0), (-1, 0)])
def test_sinkhorn_non_causal_window_is_a_transport_problem_on_the_band(window):
    """Rows and columns are normalised over the band's entries only (the band is Sinkhorn's mask)."""
    q, k, v = qkv(5, 5, seed=7)
    sk_allow = band(*window, 5, 5)
    want = F.sinkhorn(q, k, v, sk_allow, torch.zeros(B, H, 5, 5, dtype=torch.float64), SCALE)
    for backend in cpu_backends("sinkhorn"):
        out = run_or_decline("sinkhorn", backend, q, k, v, window_size=window)
        if out is not None:
            torch.testing.assert_close(out, want, rtol=1e-8, atol=1e-8, msg=backend)


def test_float_mask_and_window_combine():
    q, k, v = qkv(4, 4, seed=8)
    mask = torch.randn(1, 1, 4, 4, dtype=torch.float64)
    mask[..., 0, 0] = -math.inf
    allow, add = F.allow_and_add(mask, False, B, H, 4, 4)
    want = F.softmax(q, k, v, allow & band(1, 1, 4, 4), add, SCALE)
    torch.testing.assert_close(AF.softmax(q, k, v, mask, window_size=(1, 1)), want, rtol=1e-10, atol=1e-10)


def test_no_window_and_none_are_the_plain_call():
    q, k, v = qkv()
    plain = AF.softmax(q, k, v, is_causal=True)
    assert torch.equal(AF.softmax(q, k, v, is_causal=True, window_size=(-1, -1)), plain)
    assert torch.equal(AF.softmax(q, k, v, is_causal=True, softcap=None, sinks=None), plain)


@pytest.mark.parametrize("name,argument,words", [
    ("linear", "softcap", "logit softcapping"), ("linear", "sinks", "attention sinks"),
    ("ot", "softcap", "logit softcapping"), ("ot", "sinks", "attention sinks"),
    ("sigmoid", "sinks", "attention sinks"), ("relu", "sinks", "attention sinks"),
    ("sinkhorn", "sinks", "attention sinks")])
def test_undefined_arguments_are_refused_by_name(name, argument, words):
    q, k, v = qkv()
    value = 1.0 if argument == "softcap" else torch.zeros(H, dtype=torch.float64)
    with pytest.raises(ValueError, match=rf"{name} attention does not support {words} \({argument}\)"):
        AF.VARIANT_FUNCTIONS[name](q, k, v, **{argument: value})


@pytest.mark.parametrize("kw,match", [
    ({"window_size": (1,)}, "window_size must be a pair"), ({"window_size": (-2, 0)}, "window_size must be"),
    ({"window_size": (1.5, 0)}, "window_size must be"), ({"window_size": 3}, "window_size must be"),
    ({"softcap": 0.0}, "softcap must be"), ({"softcap": math.inf}, "softcap must be"),
    ({"softcap": True}, "softcap must be"),
    ({"sinks": torch.zeros(3, dtype=torch.float64)}, r"sinks must have shape \(H,\) = \(2,\)"),
    ({"sinks": torch.tensor([0.0, math.nan], dtype=torch.float64)}, "sinks"),
    ({"sinks": torch.zeros(2, dtype=torch.long)}, "sinks must be a floating-point tensor"),
    ({"sinks": [0.0, 0.0]}, "sinks must be None or a tensor")])
def test_bad_values_get_one_clear_error(kw, match):
    q, k, v = qkv()
    with pytest.raises((ValueError, TypeError), match=match):
        AF.softmax(q, k, v, **kw)


def test_a_backend_named_that_cannot_run_softcap_says_so():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="backend='torch' cannot run this softmax call: does not implement softcap"):
        AF.softmax(q, k, v, softcap=1.0, backend="torch")
    choice = catalog.explain("softmax", q, k, v, softcap=1.0, sinks=torch.zeros(H, dtype=torch.float64))
    assert "softcap" in choice.backend.fn.__code__.co_varnames  # chosen: one that takes both
    assert "does not implement softcap" in choice.reasons["torch"]  # SDPA takes sinks, not a cap


def test_a_fully_masked_row_with_a_sink_is_zero_not_nan():
    q, k, v = (t.requires_grad_() for t in qkv(3, 3))
    sinks = torch.zeros(H, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(3, 3, dtype=torch.bool)
    mask[1] = False
    out = AF.softmax(q, k, v, mask, sinks=sinks)
    assert torch.equal(out[:, :, 1], torch.zeros_like(out[:, :, 1]))
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v, sinks))


def test_a_layer_built_with_them_computes_the_functional_and_learns_its_sinks():
    import attnzoo
    torch.manual_seed(0)
    layer = attnzoo.create("softmax(softcap=0.8, sinks=True, window_size=(2, 0))", H * D, num_heads=H).double()
    assert layer.sinks.shape == (H,) and "sinks" in layer.state_dict()
    with torch.no_grad():
        layer.sinks.copy_(torch.tensor([0.5, -1.0]))
    x = torch.randn(B, 6, H * D, dtype=torch.float64) * 3
    q, k, v = layer.project_qkv(x)
    allow, add = F.allow_and_add(None, True, B, H, 6, 6)
    want = expected("softmax", q, k, v, allow & band(2, 0, 6, 6), add, softcap=0.8, sinks=layer.sinks)
    torch.testing.assert_close(layer.attend(q, k, v, is_causal=True), want, rtol=1e-10, atol=1e-10)
    layer(x, is_causal=True).sum().backward()
    assert layer.sinks.grad is not None and layer.sinks.grad.abs().min() > 0


@pytest.mark.parametrize("spec,words", [("linear(softcap=1.0)", "logit softcapping"),
                                        ("relu(sinks=True)", "attention sinks"),
                                        ("softmax(window_size=(1, 2, 3))", "window_size must be a pair"),
                                        ("softmax(sinks=1)", "sinks must be True")])
def test_a_layer_refuses_them_when_built(spec, words):
    import attnzoo
    with pytest.raises((ValueError, TypeError), match=words):
        attnzoo.create(spec, 16, num_heads=H)


@pytest.mark.parametrize("window", [(1, 0), (2, -1)])
def test_causal_sinkhorn_with_a_window_solves_each_prefix_on_the_band(window):
    """is_causal: query i's plan is Sinkhorn over queries 0..i and the keys it sees, the band a mask
    inside that prefix problem (paper 002 eq 2.6 with the band as attn_mask)."""
    q, k, v = qkv(5, 5, seed=9)
    want = F.sinkhorn(q, k, v, band(*window, 5, 5), torch.zeros(B, H, 5, 5, dtype=torch.float64), SCALE,
                      is_causal=True)
    for backend in cpu_backends("sinkhorn"):
        out = run_or_decline("sinkhorn", backend, q, k, v, is_causal=True, window_size=window)
        if out is not None:
            torch.testing.assert_close(out, want, rtol=1e-8, atol=1e-8, msg=backend)


def test_grouped_heads_with_a_window_on_the_blockwise_path(small_blocks):
    q, _, _ = qkv(6, 6, seed=10)
    k, v = (torch.randn(B, 1, 6, D, dtype=torch.float64, generator=torch.Generator().manual_seed(s)) for s in (11, 12))
    allow, add = F.allow_and_add(None, True, B, H, 6, 6)
    want = F.softmax(q, k.expand(B, H, 6, D), v.expand(B, H, 6, D), allow & band(1, 0, 6, 6), add, SCALE)
    got = AF.softmax(q, k, v, is_causal=True, window_size=(1, 0), enable_gqa=True, backend="cpu")
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_explain_says_which_backend_takes_the_window_itself():
    q, k, v = qkv()
    native = catalog.explain("softmax", q, k, v, window_size=(2, 0), backend="cpu")
    assert native.backend.name == "cpu" and "skips what lies outside the band" in str(native)
    folded = catalog.explain("softmax", q, k, v, window_size=(2, 0), backend="torch")
    assert folded.backend.name == "torch"


@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
def test_sdpa_sinks_gradients_equal_the_formula(gqa):
    """The SDPA route's sinks (one zero key whose mask logit is the sink): forward and every gradient,
    dsinks included, against the float64 formula, with grouped heads, causal bottom-right (Nq < Nk), a
    per-query padding mask and a row that keeps no key (zero, no NaN)."""
    g = torch.Generator().manual_seed(4)
    heads_kv = 1 if gqa else H
    q = torch.randn(B, H, 4, D, dtype=torch.float64, generator=g, requires_grad=True)
    k, v = (torch.randn(B, heads_kv, 6, D, dtype=torch.float64, generator=g, requires_grad=True) for _ in range(2))
    sinks = torch.tensor([0.7, -1.2], dtype=torch.float64, requires_grad=True)
    mask = torch.rand(B, 1, 4, 6, generator=g) > 0.3
    mask[0, 0, 1] = False
    out = AF.softmax(q, k, v, attn_mask=mask, is_causal=True, sinks=sinks, backend="torch", enable_gqa=gqa)
    kk, vv = (t.repeat_interleave(H // heads_kv, dim=1) for t in (k, v))
    allow, add = F.allow_and_add(mask, True, B, H, 4, 6)
    want = expected("softmax", q, kk, vv, allow, add, sinks=sinks)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    assert out[0, :, 1].abs().max() == 0
    cot = torch.randn(out.shape, dtype=torch.float64, generator=g)
    got = torch.autograd.grad(out, (q, k, v, sinks), cot)
    ref = torch.autograd.grad(want, (q, k, v, sinks), cot)
    for what, a, b in zip("q k v sinks".split(), got, ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=what)
    assert got[3].abs().max() > 1e-3  # the sinks do move the answer
