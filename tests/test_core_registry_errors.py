"""Registry, spec strings, and the errors bad input must raise (naming the argument)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import attnzoo
import attnzoo.functional as AF

TEN = ["softmax", "l2", "sinkhorn", "sigmoid", "relu", "linear", "masked", "multihead", "fenchel", "ot"]


def test_available_lists_the_ten_variants():
    assert sorted(attnzoo.available()) == sorted(TEN)


@pytest.mark.parametrize("name", TEN)
def test_describe_capabilities(name):
    d = attnzoo.describe(name)
    for key in ("causal", "cross", "masks", "complexity", "paper"):
        assert key in d
    assert d["name"] == name


def test_create_from_spec_string_and_override():
    layer = attnzoo.create("sinkhorn(n_iters=5, eps=0.5)", 32, num_heads=4)
    assert (layer.n_iters, layer.eps, layer.num_heads) == (5, 0.5, 4)
    layer = attnzoo.create("sinkhorn(n_iters=5)", 32, n_iters=2)
    assert layer.n_iters == 2
    assert isinstance(attnzoo.create("multihead", 32, num_heads=4, kind="sigmoid"), attnzoo.MultiheadAttention)


def test_unknown_name_lists_known_and_closest():
    with pytest.raises(ValueError) as e:
        attnzoo.create("sinkhorm", 32)
    assert "'sinkhorn'" in str(e.value) and "softmax" in str(e.value)


@pytest.mark.parametrize("spec", ["sinkhorn(3)", "sinkhorn(n_iters=foo)", "sinkhorn(", "1+2", "sinkhorn(**x)"])
def test_malformed_specs(spec):
    with pytest.raises(ValueError):
        attnzoo.create(spec, 32)


def test_unknown_variant_kwarg_in_spec_fails():
    with pytest.raises(ValueError, match="n_iterz"):
        attnzoo.create("sinkhorn(n_iterz=3)", 32)


def test_register_a_new_variant():
    @attnzoo.register("half_softmax", causal=True, cross=True, masks=True, complexity="O(N^2)", paper="test")
    class Half(attnzoo.SoftmaxAttention):
        def attend(self, q, k, v, **kw):
            return 0.5 * super().attend(q, k, v, **kw)
    try:
        layer = attnzoo.create("half_softmax", 16, num_heads=2)
        assert isinstance(layer, Half) and "half_softmax" in attnzoo.available()
    finally:
        from attnzoo import registry
        registry._REGISTRY.pop("half_softmax")
        registry._INFO.pop("half_softmax")


def test_layer_binds_spec_for_timm():
    cls = attnzoo.layer("sinkhorn(n_iters=4)")
    m = cls(32, num_heads=4, qkv_bias=True)
    assert isinstance(m, attnzoo.SinkhornAttention) and m.n_iters == 4


def test_layer_classes_pickle_with_the_model(tmp_path):
    import copy
    m = attnzoo.layer("sinkhorn(n_iters=4)")(32, num_heads=4)
    x = torch.randn(2, 5, 32)
    torch.save(m, tmp_path / "m.pt")
    loaded = torch.load(tmp_path / "m.pt", weights_only=False)  # our own file, written just above
    for other in (loaded, copy.deepcopy(m)):
        assert isinstance(other, attnzoo.SinkhornAttention) and other.n_iters == 4
        torch.testing.assert_close(other(x), m(x))


# ---- bad input --------------------------------------------------------------------------------------

def t(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


BAD = [
    ("wrong rank", lambda: AF.softmax(t(2, 3, 4), t(2, 3, 4), t(2, 3, 4)), ValueError, "q must have shape"),
    ("batch", lambda: AF.l2(t(2, 1, 3, 4), t(3, 1, 3, 4), t(3, 1, 3, 4)), ValueError, "batch"),
    ("heads", lambda: AF.sigmoid(t(1, 2, 3, 4), t(1, 3, 3, 4), t(1, 3, 3, 4)), ValueError, "head count"),
    ("head dim", lambda: AF.relu(t(1, 1, 3, 4), t(1, 1, 3, 5), t(1, 1, 3, 4)), ValueError, "k must have head dim"),
    ("v rows", lambda: AF.linear(t(1, 1, 3, 4), t(1, 1, 3, 4), t(1, 1, 5, 4)), ValueError, "v must have Nk"),
    ("mask shape", lambda: AF.softmax(t(1, 1, 3, 4), t(1, 1, 5, 4), t(1, 1, 5, 4), attn_mask=torch.ones(3, 3, dtype=torch.bool)),
     ValueError, "attn_mask"),
    ("mask dtype", lambda: AF.softmax(t(1, 1, 3, 4), t(1, 1, 3, 4), t(1, 1, 3, 4), attn_mask=torch.ones(3, 3, dtype=torch.long)),
     TypeError, "attn_mask"),
    ("mixed dtype", lambda: AF.softmax(t(1, 1, 3, 4), t(1, 1, 3, 4, dtype=torch.float64), t(1, 1, 3, 4)), TypeError, "dtype"),
    ("meta device", lambda: AF.softmax(t(1, 1, 3, 4), torch.empty(1, 1, 3, 4, device="meta"), torch.empty(1, 1, 3, 4, device="meta")),
     ValueError, "device"),
    ("empty", lambda: AF.softmax(t(1, 1, 0, 4), t(1, 1, 3, 4), t(1, 1, 3, 4)), ValueError, "empty sequence"),
    ("empty keys", lambda: AF.ot(t(1, 1, 2, 4), t(1, 1, 0, 4), t(1, 1, 0, 4)), ValueError, "empty sequence"),
    ("n_iters", lambda: AF.sinkhorn(t(1, 1, 3, 4), t(1, 1, 3, 4), t(1, 1, 3, 4), n_iters=-1), ValueError, "n_iters"),
    ("eps", lambda: AF.sinkhorn(t(1, 1, 3, 4), t(1, 1, 3, 4), t(1, 1, 3, 4), eps=0.0), ValueError, "eps"),
    ("cost", lambda: AF.sinkhorn(t(1, 1, 3, 4), t(1, 1, 3, 4), t(1, 1, 3, 4), cost="l1"), ValueError, "cost"),
    ("feature map", lambda: AF.linear(t(1, 1, 3, 4), t(1, 1, 3, 4), t(1, 1, 3, 4), feature_map="tanh"), ValueError, "feature_map"),
    ("solve", lambda: AF.fenchel(t(1, 1, 3, 4), t(1, 1, 3, 4), t(1, 1, 3, 4), solve="third"), ValueError, "solve"),
    ("alpha", lambda: AF.fenchel(t(1, 1, 3, 4), t(1, 1, 3, 4), t(1, 1, 3, 4), alpha=-1), ValueError, "alpha"),
    ("log_u", lambda: AF.fenchel(t(1, 1, 3, 4), t(1, 1, 3, 4), t(1, 1, 3, 4), log_u=t(2, 2)), ValueError, "log_u"),
    ("ot log_u", lambda: AF.ot(t(1, 1, 3, 4), t(1, 1, 3, 4), t(1, 1, 3, 4), log_u=t(1, 1, 4)), ValueError, "log_u"),
    ("templates pair", lambda: AF.ot(t(1, 1, 3, 4), t(1, 1, 3, 4), t(1, 1, 3, 4), templates_k=t(1, 1, 2, 4)), ValueError, "templates"),
    ("templates shape", lambda: AF.ot(t(1, 1, 3, 4), t(1, 1, 3, 4), t(1, 1, 3, 4), templates_k=t(1, 1, 2, 5), templates_v=t(1, 1, 2, 4)),
     ValueError, "templates_k"),
    ("gamma", lambda: AF.ot(t(1, 1, 3, 4), t(1, 1, 3, 4), t(1, 1, 3, 4), gamma=0), ValueError, "gamma"),
    ("dropout", lambda: AF.softmax(t(1, 1, 3, 4), t(1, 1, 3, 4), t(1, 1, 3, 4), dropout_p=1.5), ValueError, "dropout_p"),
    ("sigmoid bias", lambda: AF.sigmoid(t(1, 1, 3, 4), t(1, 1, 3, 4), t(1, 1, 3, 4), bias=float("nan")), ValueError, "bias"),
    ("backend", lambda: AF.softmax(t(1, 1, 3, 4), t(1, 1, 3, 4), t(1, 1, 3, 4), backend="cudnn9"), ValueError, "backend"),
    ("dim/heads", lambda: attnzoo.create("softmax", 30, num_heads=4), ValueError, "divisible"),
    ("layer n_iters", lambda: attnzoo.create("sinkhorn", 32, n_iters=-2), ValueError, "n_iters"),
    ("layer eps", lambda: attnzoo.create("sinkhorn(eps=-1.0)", 32), ValueError, "eps"),
    ("layer input", lambda: attnzoo.create("softmax", 32)(torch.randn(4, 32)), ValueError, "x must have shape"),
    ("mha dims", lambda: attnzoo.MultiheadAttention(30, 4), ValueError, "divisible"),
    ("mha kpm", lambda: attnzoo.MultiheadAttention(16, 4)(t(3, 2, 16), t(3, 2, 16), t(3, 2, 16),
                                                          key_padding_mask=torch.zeros(3, 2, dtype=torch.bool)),
     ValueError, "key_padding_mask"),
    ("masked kind", lambda: attnzoo.create("masked(kind='nope')", 32), ValueError, "kind"),
    # strings and bools where numbers / flags belong are refused, not converted
    ("scale str", lambda: AF.softmax(t(1, 1, 3, 4), t(1, 1, 3, 4), t(1, 1, 3, 4), scale="0.5"), TypeError, "scale"),
    ("is_causal str", lambda: AF.softmax(t(1, 1, 3, 4), t(1, 1, 3, 4), t(1, 1, 3, 4), is_causal="no"), TypeError,
     "is_causal"),
    ("is_causal int", lambda: AF.relu(t(1, 1, 3, 4), t(1, 1, 3, 4), t(1, 1, 3, 4), is_causal=1), TypeError, "is_causal"),
    ("bias str", lambda: AF.sigmoid(t(1, 1, 3, 4), t(1, 1, 3, 4), t(1, 1, 3, 4), bias="-1"), TypeError, "bias"),
    ("eps str", lambda: AF.sinkhorn(t(1, 1, 3, 4), t(1, 1, 3, 4), t(1, 1, 3, 4), eps="1"), TypeError, "eps"),
    ("alpha bool", lambda: AF.fenchel(t(1, 1, 3, 4), t(1, 1, 3, 4), t(1, 1, 3, 4), alpha=True), TypeError, "alpha"),
    ("dropout str", lambda: AF.softmax(t(1, 1, 3, 4), t(1, 1, 3, 4), t(1, 1, 3, 4), dropout_p="0.1"), TypeError, "dropout_p"),
    ("ot scale 0", lambda: AF.ot(t(1, 1, 3, 4), t(1, 1, 3, 4), t(1, 1, 3, 4), scale=0), ValueError, "scale must be nonzero"),
    ("layer bias str", lambda: attnzoo.create("sigmoid", 16, num_heads=2, bias="-1"), TypeError, "bias"),
    ("layer feature size", lambda: attnzoo.create("softmax", 32)(torch.randn(2, 5, 16)), ValueError,
     r"SoftmaxAttention: x must have shape \(B, N, dim=32\), got \(2, 5, 16\)"),
    ("layer dtype", lambda: attnzoo.create("relu", 32)(torch.randn(2, 5, 32, dtype=torch.float64)), TypeError,
     "ReLUAttention: x must have the layer's dtype torch.float32"),
    ("layer int input", lambda: attnzoo.create("linear", 32)(torch.ones(2, 5, 32, dtype=torch.long)), TypeError,
     "LinearAttention: x must have the layer's dtype"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input_raises_naming_the_argument(case):
    _, fn, exc, match = case
    with pytest.raises(exc, match=match):
        fn()


def test_layer_takes_any_float_input_under_autocast():
    layer = attnzoo.create("softmax", 16, num_heads=2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(torch.randn(2, 5, 16, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_numbers_and_flags_of_other_types_are_accepted():
    import numpy as np
    q = t(1, 1, 3, 4)
    ref = AF.softmax(q, q, q, is_causal=True, scale=0.5)
    torch.testing.assert_close(AF.softmax(q, q, q, is_causal=np.bool_(True), scale=np.float32(0.5)), ref)
    torch.testing.assert_close(AF.sigmoid(q, q, q, bias=-1), AF.sigmoid(q, q, q, bias=-1.0))


def test_module_init_default_norm_layer_for_qk_norm():
    layer = attnzoo.create("softmax", 16, num_heads=2, qk_norm=True)
    assert isinstance(layer.q_norm, nn.LayerNorm)
