"""FLOP counts of attnzoo.bench.flops: against counts derived by hand (worked out in the comments)
and, for the variants whose reference does exactly the counted matrix products, against
torch.utils.flop_counter on the reference's forward."""
from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import attnzoo
from attnzoo import functional as AF
from attnzoo.bench.flops import Shape, flops
from tests.common import qkv

pytestmark = pytest.mark.usefixtures("one_thread")


S = Shape

# (variant, shape, mode, causal, kwargs, expected): every expected number is worked out by hand
HAND = [
    # 4 B H N^2 D = 4 * 2 * 3 * 25 * 4
    ("softmax", S(2, 3, 5, 4), "fwd", False, {}, 2400),
    # backward 2.5x: 2400 * 3.5
    ("softmax", S(2, 3, 5, 4), "fwd+bwd", False, {}, 8400),
    # FlashAttention halves the count when causal
    ("softmax", S(2, 3, 5, 4), "fwd", True, {}, 1200),
    ("l2", S(2, 3, 5, 4), "fwd", False, {}, 2400),
    ("sigmoid", S(2, 3, 5, 4), "fwd+bwd", True, {}, 4200),
    ("relu", S(2, 3, 5, 4), "fwd", False, {}, 2400),
    ("fenchel", S(2, 3, 5, 4), "fwd", False, {"solve": "first_order"}, 2400),
    # cross attention: QK^T 2*3*7*2 = 84, PV 2*3*7*5 = 210
    ("softmax", S(1, 1, 3, 2, seq_k=7, head_dim_v=5), "fwd", False, {}, 294),
    # masked = causal softmax
    ("masked", S(2, 3, 5, 4), "fwd", False, {}, 1200),
    ("masked", S(2, 3, 5, 4), "fwd", False, {"kind": "relu"}, 1200),
    # sinkhorn N=4, D=2, 3 iters: 6 passes x 16 pairs x 2D = 384, final pass 16 x 2(D+Dv) = 128
    ("sinkhorn", S(1, 1, 4, 2), "fwd", False, {"n_iters": 3}, 512),
    ("sinkhorn", S(1, 1, 4, 2), "fwd+bwd", False, {"n_iters": 3}, 1792),
    # n_iters = 0 is softmax(L): 4 N^2 D = 4 * 16 * 2
    ("sinkhorn", S(1, 1, 4, 2), "fwd", False, {"n_iters": 0}, 128),
    # causal N=3, D=Dv=2, 1 iter: prefix problems hold 1, 3, 6 kept pairs, 2 passes x 2D = 8 each -> 80;
    # final rows see 1 + 2 + 3 keys at 2(D+Dv) = 8 -> 48
    ("sinkhorn", S(1, 1, 3, 2), "fwd", True, {"n_iters": 1}, 128),
    # linear H=2, N=8, D=Dv=4: 2*2*4*4*(8+8) = 1024, normaliser 2*2*8*4 = 128; backward 2x
    ("linear", S(1, 2, 8, 4), "fwd", False, {}, 1152),
    ("linear", S(1, 2, 8, 4), "fwd", True, {}, 1152),
    ("linear", S(1, 2, 8, 4), "fwd+bwd", False, {}, 3456),
    ("linear", S(1, 2, 8, 4), "fwd", False, {"feature_map": "identity"}, 1024),
    # ot N=4, D=Dv=2, |A|=4: Q A^T 64, K A^T 64, sum over sources 2*4*4*4 = 128, W A_v 64
    ("ot", S(1, 1, 4, 2), "fwd", False, {}, 320),
    # with 2 extra templates |A|=6: 96 + 96 + 192 + 96
    ("ot", S(1, 1, 4, 2), "fwd", False, {"n_templates": 2}, 480),
    # causal N=3, D=Dv=1: products 2*3*(6 + 3) = 54, kept (i, j, t) triples 1 + 4 + 9 = 14 -> 28
    ("ot", S(1, 1, 3, 1), "fwd", True, {}, 82),
    # multihead B=2 H=2 N=3 D=4 (E=8): kernel 4*2*2*9*4 = 576, projections 8*2*3*64 = 3072
    ("multihead", S(2, 2, 3, 4), "fwd", False, {}, 3648),
    # backward: kernel 2.5 x 576 = 1440, projections 2 x 3072 = 6144
    ("multihead", S(2, 2, 3, 4), "fwd+bwd", False, {}, 3648 + 1440 + 6144),
    # fenchel second order N=2, D=Dv=3: 48 + moments 2*2*2*(3 + 9) = 96 + solves 2/3 * 2 * 27 = 36
    ("fenchel", S(1, 1, 2, 3), "fwd", False, {"solve": "second_order"}, 180),
]


@pytest.mark.parametrize("variant,shape,mode,causal,kwargs,expected", HAND,
                         ids=[f"{c[0]}-{c[2]}-{'causal' if c[3] else 'full'}-{i}" for i, c in enumerate(HAND)])
def test_flops_match_hand_counts(variant, shape, mode, causal, kwargs, expected):
    assert flops(variant, shape, mode, causal=causal, **kwargs) == expected


# (variant, kwargs, shape) whose eager reference performs exactly the counted products in forward
COUNTED = [
    ("softmax", {}, S(2, 3, 16, 8)),
    ("softmax", {}, S(1, 2, 5, 8, seq_k=11, head_dim_v=4)),
    ("l2", {}, S(2, 3, 16, 8)),
    ("sigmoid", {}, S(1, 2, 9, 8)),
    ("relu", {}, S(1, 2, 9, 8)),
    ("fenchel", {}, S(1, 2, 9, 8)),
    ("linear", {"feature_map": "elu"}, S(2, 2, 12, 8, head_dim_v=6)),
    ("linear", {"feature_map": "identity"}, S(2, 2, 12, 8)),
]


def _inputs(s: Shape):
    return qkv(s.batch, s.heads, s.seq_q, s.nk, s.head_dim, s.dv)


@pytest.mark.parametrize("variant,kwargs,shape", COUNTED, ids=[f"{c[0]}-{i}" for i, c in enumerate(COUNTED)])
def test_flops_match_flop_counter_on_reference(variant, kwargs, shape):
    q, k, v = _inputs(shape)
    with FlopCounterMode(display=False) as counter:
        AF.VARIANT_FUNCTIONS[variant](q, k, v, backend="reference", **kwargs)
    assert flops(variant, shape, "fwd", **kwargs) == counter.get_total_flops()


def test_ot_products_match_flop_counter():
    # the reference's matrix products are Q A^T, K A^T and W A_v; its sum over sources is elementwise
    s = S(1, 2, 6, 4)
    q, k, v = _inputs(s)
    with FlopCounterMode(display=False) as counter:
        AF.ot(q, k, v, backend="reference")
    source_sum = 2 * s.bh * s.seq_q * s.nk * s.nk
    assert flops("ot", s, "fwd") - source_sum == counter.get_total_flops()


def test_multihead_matches_flop_counter():
    s = S(2, 2, 5, 4)
    layer = attnzoo.MultiheadAttention(8, 2, batch_first=True, backend="reference")
    x = torch.randn(2, 5, 8)
    with FlopCounterMode(display=False) as counter:
        layer(x, x, x, need_weights=False)
    assert flops("multihead", s, "fwd") == counter.get_total_flops()


@pytest.mark.parametrize("call,match", [
    (lambda: flops("nope", S(1, 1, 2, 2)), "variant"),
    (lambda: flops("softmax", S(1, 1, 2, 2), mode="bwd"), "mode"),
    (lambda: flops("masked", S(1, 1, 2, 2), kind="nope"), "kind"),
    (lambda: flops("fenchel", S(1, 1, 2, 2), solve="nope"), "solve"),
])
def test_flops_bad_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call()
