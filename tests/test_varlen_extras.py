"""window_size, softcap and sinks on packed sequences (``attnzoo.functional.varlen``, the layers' packed
forward, the HF packed routes): the window is bottom-right aligned inside each sequence, so every
sequence's answer is the float64 formula on that sequence alone, restricted to its own band."""
from __future__ import annotations

import pytest
import torch

import attnzoo
import attnzoo.functional as AF
from attnzoo.ops import varlen
from tests import formulas as R
from tests.test_logit_extras import expected as capped_formula
from tests.test_varlen import D, H, grads, offsets, packed_inputs

SCALE = D ** -0.5
# longer sequences than test_varlen's, so a window of 2 cuts every one of them (Nq != Nk in two)
WIN_Q, WIN_K = [1, 6, 4], [3, 6, 7]


def band(window, nq, nk):
    """Key j in query i's band: d = j - i - (nk - nq) within [-left, right] (-1: unbounded), as loops."""
    left, right = window
    allow = torch.ones(1, 1, nq, nk, dtype=torch.bool)
    for i in range(nq):
        for j in range(nk):
            d = j - i - (nk - nq)
            allow[..., i, j] = not ((left >= 0 and d < -left) or (right >= 0 and d > right))
    return allow


FORMULAS = {
    "softmax": lambda q, k, v, a, add, c: R.softmax(q, k, v, a, add, SCALE),
    "l2": lambda q, k, v, a, add, c: R.l2(q, k, v, a, add, SCALE),
    "sigmoid": lambda q, k, v, a, add, c: R.sigmoid(q, k, v, a, add, SCALE),
    "relu": lambda q, k, v, a, add, c: R.relu(q, k, v, a, add, SCALE),
    "fenchel": lambda q, k, v, a, add, c: R.fenchel_first(q, k, v, a, add, SCALE, None, 1.0),
    "ot": lambda q, k, v, a, add, c: R.ot(q, k, v, a, add, SCALE, 1.0),
    "linear": lambda q, k, v, a, add, c: R.linear(q, k, v, a, add, "elu"),
}


def per_sequence(formula, q, k, v, len_q, len_k, causal, window, heads=H):
    """formula(q_i, k_i, v_i, allow_i, add_i, causal) per sequence in float64, grouped heads expanded."""
    outs, cq, ck = [], 0, 0
    for nq, nk in zip(len_q, len_k):
        qs = q[cq:cq + nq].double().transpose(0, 1)[None]
        ks, vs = (t[ck:ck + nk].double().transpose(0, 1)[None].repeat_interleave(heads // t.shape[1], dim=1)
                  for t in (k, v))
        allow, add = R.allow_and_add(None, causal, 1, heads, nq, nk)
        outs.append(formula(qs, ks, vs, allow & band(window, nq, nk), add, causal)[0].transpose(0, 1))
        cq, ck = cq + nq, ck + nk
    return torch.cat(outs)


def check_against(call, formula, causal, window, extra_inputs=()):
    q, k, v = packed_inputs(torch.float64, WIN_Q, WIN_K, seed=2)
    out = call(q, k, v)
    ref_inputs = [t.detach().double().requires_grad_() for t in (q, k, v, *extra_inputs)]
    ref = per_sequence(lambda *a: formula(*a, *ref_inputs[3:]), *ref_inputs[:3], WIN_Q, WIN_K, causal, window)
    torch.testing.assert_close(out, ref, atol=1e-9, rtol=1e-9)
    for name, got, want in zip(("dq", "dk", "dv", "dsinks"), grads(out, (q, k, v, *extra_inputs)),
                               grads(ref, ref_inputs)):
        torch.testing.assert_close(got, want, atol=1e-9, rtol=1e-9, msg=lambda m: f"{name}: {m}")


WINDOWS = [((2, 0), True), ((1, 1), False), ((-1, 1), False), ((2, -1), True)]


@pytest.mark.parametrize("window,causal", WINDOWS, ids=str)
@pytest.mark.parametrize("name", sorted(FORMULAS))
def test_window_is_each_sequences_own_band(name, window, causal):
    check_against(lambda q, k, v: AF.varlen(name, q, k, v, offsets(WIN_Q), offsets(WIN_K), max(WIN_Q), max(WIN_K),
                                            is_causal=causal, enable_gqa=True, window_size=window),
                  FORMULAS[name], causal, window)


@pytest.mark.parametrize("window,causal", WINDOWS, ids=str)
@pytest.mark.parametrize("name", sorted(n for n in FORMULAS if n != "linear"))
def test_padded_route_aligns_the_window_per_sequence(name, window, causal):
    """The route torch.compile traces: one (N, max_q, max_k) batch, where a window handed to the variant
    would align to the padded block's corner; the band is each sequence's own."""
    fn = AF.VARIANT_FUNCTIONS[name]
    check_against(lambda q, k, v: varlen.padded(fn, q, k, v, offsets(WIN_Q), offsets(WIN_K), max(WIN_Q), max(WIN_K),
                                                causal, dict(enable_gqa=True, window_size=window)),
                  FORMULAS[name], causal, window)


@pytest.mark.parametrize("window", [(1, 0), (2, -1)], ids=str)
def test_causal_sinkhorn_window_per_sequence(window):
    """Each sequence's prefix problems on its own band (Sinkhorn couples queries: never padded)."""
    check_against(lambda q, k, v: AF.varlen("sinkhorn", q, k, v, offsets(WIN_Q), offsets(WIN_K), max(WIN_Q),
                                            max(WIN_K), is_causal=True, enable_gqa=True, window_size=window,
                                            n_iters=3, eps=0.7),
                  lambda q, k, v, a, add, c: R.sinkhorn(q, k, v, band(window, q.shape[2], k.shape[2]), add, SCALE,
                                                        3, 0.7, "l2", True),
                  True, window)


@pytest.mark.parametrize("name", ["softmax", "l2", "fenchel", "sigmoid", "relu"])
@pytest.mark.parametrize("route", ["per_sequence", "padded"])
def test_softcap_and_sinks_with_a_window(name, route):
    """A cap of 0.7 on logits of size ~1 and sinks of size ~1 (the softmax family), gradients into the
    sinks included; both packed routes."""
    with_sinks = name in ("softmax", "l2", "fenchel")
    sinks = torch.tensor([0.5, -0.4, 0.9, 0.1], dtype=torch.float64, requires_grad=True)
    extra = dict(softcap=0.7, window_size=(2, 0), **({"sinks": sinks} if with_sinks else {}))

    def call(q, k, v):
        if route == "padded":
            return varlen.padded(AF.VARIANT_FUNCTIONS[name], q, k, v, offsets(WIN_Q), offsets(WIN_K), max(WIN_Q),
                                 max(WIN_K), True, dict(enable_gqa=True, **extra))
        return AF.varlen(name, q, k, v, offsets(WIN_Q), offsets(WIN_K), max(WIN_Q), max(WIN_K), is_causal=True,
                         enable_gqa=True, **extra)

    def formula(q, k, v, allow, add, causal, s=None):
        return capped_formula(name, q, k, v, allow, add, softcap=0.7, sinks=s)

    check_against(call, formula, True, (2, 0), (sinks,) if with_sinks else ())


@pytest.mark.parametrize("spec", ["softmax(window_size=(2, 0), sinks=True, softcap=0.7)",
                                  "sigmoid(window_size=(1, 1))", "sinkhorn(window_size=(2, 0))"])
def test_layer_packed_forward_takes_its_window(spec):
    """A layer built with a window (and sinks, a cap) on a packed batch equals the same layer run on each
    sequence alone (its unpacked forward, itself checked against the formulas in test_logit_extras)."""
    torch.manual_seed(0)
    layer = attnzoo.create(spec, 16, num_heads=2).double()
    if "sinks" in spec:
        with torch.no_grad():
            layer.sinks.copy_(torch.tensor([0.8, -0.6]))
    lengths = [5, 1, 6]
    x = torch.randn(sum(lengths), 16, dtype=torch.float64, requires_grad=True)
    causal = "sigmoid" not in spec
    packed = layer(x, cu_seqlens=offsets(lengths), max_seqlen=max(lengths), is_causal=causal)
    alone = torch.cat([layer(part[None], is_causal=causal)[0] for part in x.split(lengths)])
    torch.testing.assert_close(packed, alone, atol=1e-10, rtol=1e-10)
    w = torch.randn(packed.shape, dtype=torch.float64)
    got = torch.autograd.grad((packed * w).sum(), [x] + list(layer.parameters()))
    want = torch.autograd.grad((alone * w).sum(), [x] + list(layer.parameters()))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)
    # the window must matter here: without it the packed answer moves
    layer.window_size = None
    assert (layer(x, cu_seqlens=offsets(lengths), max_seqlen=max(lengths), is_causal=causal) - packed).abs().max() > 1e-3


def test_windowless_call_differs():
    """The band changes these sequences' answers (otherwise the tests above could not fail)."""
    q, k, v = packed_inputs(torch.float64, WIN_Q, WIN_K, seed=2)
    args = ("softmax", q, k, v, offsets(WIN_Q), offsets(WIN_K), max(WIN_Q), max(WIN_K))
    kw = dict(is_causal=True, enable_gqa=True)
    assert (AF.varlen(*args, **kw, window_size=(1, 0)) - AF.varlen(*args, **kw)).abs().max() > 1e-2
