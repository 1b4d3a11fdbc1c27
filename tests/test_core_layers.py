"""Modules: timm weight compatibility, torch MultiheadAttention equivalence, variant parameters."""
from __future__ import annotations

import pytest
import torch
from timm.layers import Attention as TimmAttention
from torch import nn

import attnzoo
import attnzoo.functional as AF

LAYER_NAMES = [n for n in attnzoo.available() if n != "multihead"]


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("name", LAYER_NAMES)
def test_timm_state_dict_loads_strict(name, qk_norm):
    timm_attn = TimmAttention(32, num_heads=4, qkv_bias=True, qk_norm=qk_norm, norm_layer=nn.LayerNorm)
    layer = attnzoo.create(name, 32, num_heads=4, qkv_bias=True, qk_norm=qk_norm, norm_layer=nn.LayerNorm)
    layer.load_state_dict(timm_attn.state_dict(), strict=True)
    assert set(layer.state_dict()) == set(timm_attn.state_dict())


@pytest.mark.parametrize("qk_norm", [False, True])
def test_softmax_layer_equals_timm_attention(qk_norm):
    timm_attn = TimmAttention(32, num_heads=4, qkv_bias=True, qk_norm=qk_norm, norm_layer=nn.LayerNorm).eval()
    layer = attnzoo.SoftmaxAttention(32, num_heads=4, qkv_bias=True, qk_norm=qk_norm, norm_layer=nn.LayerNorm).eval()
    layer.load_state_dict(timm_attn.state_dict())
    x = torch.randn(2, 7, 32)
    mask = torch.rand(2, 1, 7, 7) > 0.2
    mask[..., 0] = True
    torch.testing.assert_close(layer(x), timm_attn(x), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(layer(x, attn_mask=mask), timm_attn(x, attn_mask=mask), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(layer(x, is_causal=True), timm_attn(x, is_causal=True), atol=1e-5, rtol=1e-5)


def test_timm_extra_kwargs_are_accepted_and_typos_warned():
    attnzoo.create("l2", 16, num_heads=2, scale_norm=True, depth=3, device="cpu", dtype=torch.float64)
    with pytest.warns(UserWarning, match="n_iterz"):
        attnzoo.SinkhornAttention(16, num_heads=2, n_iterz=5)


@pytest.mark.parametrize("name", LAYER_NAMES)
def test_layer_forward_backward_and_matches_functional(name):
    layer = attnzoo.create(name, 24, num_heads=3).double()
    x = torch.randn(2, 5, 24, dtype=torch.float64, requires_grad=True)
    y = layer(x)
    y.sum().backward()
    assert y.shape == x.shape and torch.isfinite(x.grad).all()
    assert all(p.grad is not None for p in layer.parameters() if p.requires_grad)
    # the layer is projection -> functional -> projection, nothing else
    q, k, v = layer.project_qkv(x)
    fn = AF.VARIANT_FUNCTIONS.get(name, AF.softmax)
    expected_heads = (AF.masked(q, k, v, kind="softmax") if name == "masked"
                      else fn(q, k, v, scale=layer.scale))
    expected = layer.proj(expected_heads.transpose(1, 2).reshape(2, 5, 24))
    torch.testing.assert_close(y, expected)


@pytest.mark.parametrize("name", LAYER_NAMES)
def test_layer_takes_every_broadcastable_mask_shape(name):
    """(N,) and (N, 1) masks broadcast like the full 4-D one (a 1-D mask crashed SDPA's path)."""
    layer = attnzoo.create(name, 16, num_heads=2).double().eval()
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    keys = torch.tensor([True, True, False, True, True, False])
    rows = torch.tensor([True, False, True, True, True, True])[:, None]
    torch.testing.assert_close(layer(x, attn_mask=keys), layer(x, attn_mask=keys.expand(2, 1, 6, 6).clone()))
    torch.testing.assert_close(layer(x, attn_mask=rows), layer(x, attn_mask=rows.expand(2, 1, 6, 6).clone()))


def test_l2_tie_qk_uses_query_weights_for_keys():
    layer = attnzoo.L2Attention(16, num_heads=2, qkv_bias=True, tie_qk=True)
    x = torch.randn(1, 4, 16)
    q, k, _ = layer.project_qkv(x)
    torch.testing.assert_close(q, k)
    untied = attnzoo.L2Attention(16, num_heads=2, qkv_bias=True)
    untied.load_state_dict(layer.state_dict())
    q2, k2, _ = untied.project_qkv(x)
    assert not torch.allclose(q2, k2)


def test_sigmoid_learnable_bias_gets_gradient_and_starts_at_default():
    layer = attnzoo.SigmoidAttention(16, num_heads=2, learnable_bias=True)
    plain = attnzoo.SigmoidAttention(16, num_heads=2)
    plain.load_state_dict({k: v for k, v in layer.state_dict().items() if k != "bias_shift"})
    x = torch.randn(2, 5, 16)
    torch.testing.assert_close(layer(x), plain(x))
    layer(x, is_causal=True).sum().backward()
    assert layer.bias_shift.grad is not None and layer.bias_shift.grad.abs().sum() > 0


@pytest.mark.parametrize("preference", ["uniform", "t5", "context"])
def test_fenchel_preferences(preference):
    layer = attnzoo.FenchelAttention(16, num_heads=2, preference=preference)
    soft = attnzoo.SoftmaxAttention(16, num_heads=2)
    soft.load_state_dict({k: v for k, v in layer.state_dict().items() if k in soft.state_dict()})
    x = torch.randn(2, 6, 16)
    torch.testing.assert_close(layer(x), soft(x))  # learned preferences start uniform
    if preference != "uniform":
        with torch.no_grad():
            for p in layer.parameters():
                p.add_(0.3 * torch.randn_like(p))
        layer(x, is_causal=True).sum().backward()
        extra = layer.relative_bias.weight if preference == "t5" else layer.context_net[-1].weight
        assert extra.grad is not None and extra.grad.abs().sum() > 0


def test_t5_buckets_follow_the_t5_rule():
    from attnzoo.layers import t5_relative_buckets
    rel = torch.arange(-200, 201)
    b = t5_relative_buckets(rel, num_buckets=32, max_distance=128, bidirectional=True)
    assert b[rel == 0].item() == 0 and b[rel == 3].item() == 16 + 3 and b[rel == -3].item() == 3
    assert b.max().item() == 31 and b[rel == -200].item() == 15  # far offsets share the last bucket
    assert (b[(rel >= 1) & (rel < 8)].diff() == 1).all()  # exact buckets for small offsets
    c = t5_relative_buckets(rel, num_buckets=32, max_distance=128, bidirectional=False)
    assert (c[rel > 0] == 0).all() and c[rel == -5].item() == 5


def test_ot_layer_templates():
    layer = attnzoo.OTAttention(16, num_heads=2)
    x, t = torch.randn(2, 5, 16), torch.randn(2, 3, 16)
    y0, y1 = layer(x), layer(x, templates=t)
    assert y1.shape == y0.shape and not torch.allclose(y0, y1)
    torch.testing.assert_close(layer(x, templates=t[:, :0]), y0)
    with pytest.raises(ValueError, match="templates"):
        layer(x, templates=torch.randn(2, 3, 8))


def test_masked_layer_is_always_causal():
    layer = attnzoo.create("masked", 16, num_heads=2, kind="sinkhorn", n_iters=2)
    x = torch.randn(1, 6, 16)
    y = layer(x)
    x2 = x.clone()
    x2[:, 4:] += 1
    torch.testing.assert_close(layer(x2)[:, :4], y[:, :4])


# ---- MultiheadAttention --------------------------------------------------------------------------

def _pair(batch_first, bias=True, kdim=None):
    torch_mha = nn.MultiheadAttention(16, 4, bias=bias, batch_first=batch_first, kdim=kdim, vdim=kdim)
    ours = attnzoo.MultiheadAttention(16, 4, bias=bias, batch_first=batch_first, kdim=kdim, vdim=kdim)
    ours.load_state_dict(torch_mha.state_dict(), strict=True)
    return torch_mha.eval(), ours.eval()


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "float", "padding", "both", "causal"])
def test_multihead_equals_torch(batch_first, mask_kind):
    torch_mha, ours = _pair(batch_first)
    L, S, N = 5, 7, 3
    shape_q = (N, L, 16) if batch_first else (L, N, 16)
    shape_k = (N, S, 16) if batch_first else (S, N, 16)
    q, kv = torch.randn(shape_q), torch.randn(shape_k)
    kw = {}
    if mask_kind in ("bool", "both"):
        kw["attn_mask"] = torch.rand(L, S) > 0.7
        kw["attn_mask"][:, 0] = False
    if mask_kind == "float":
        kw["attn_mask"] = torch.randn(N * 4, L, S)
    if mask_kind in ("padding", "both"):
        kpm = torch.zeros(N, S, dtype=torch.bool)
        kpm[1, 4:] = True
        kw["key_padding_mask"] = kpm
    if mask_kind == "causal":
        L = S
        q = kv
        kw["attn_mask"] = nn.Transformer.generate_square_subsequent_mask(S)
        kw["is_causal"] = True
    out_t, w_t = torch_mha(q, kv, kv, **kw)
    out_o, w_o = ours(q, kv, kv, **kw)
    torch.testing.assert_close(out_o, out_t, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w_o, w_t, atol=1e-5, rtol=1e-5)
    _, w_t = torch_mha(q, kv, kv, average_attn_weights=False, **kw)
    _, w_o = ours(q, kv, kv, average_attn_weights=False, **kw)
    torch.testing.assert_close(w_o, w_t, atol=1e-5, rtol=1e-5)


def test_multihead_kdim_vdim_and_no_bias():
    torch_mha, ours = _pair(True, bias=False, kdim=8)
    q, kv = torch.randn(2, 5, 16), torch.randn(2, 6, 8)
    torch.testing.assert_close(ours(q, kv, kv)[0], torch_mha(q, kv, kv)[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("train", [False, True])
def test_multihead_inside_transformer_encoder_layer(train):
    ref = nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, dropout=0.0, batch_first=True)
    swapped = nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, dropout=0.0, batch_first=True)
    swapped.self_attn = attnzoo.MultiheadAttention(16, 4, batch_first=True)
    swapped.load_state_dict(ref.state_dict(), strict=True)
    ref.train(train)
    swapped.train(train)
    x = torch.randn(2, 6, 16)
    kpm = torch.zeros(2, 6, dtype=torch.bool)
    kpm[0, 4:] = True
    out_ref = ref(x, src_key_padding_mask=kpm)
    out = swapped(x, src_key_padding_mask=kpm)
    torch.testing.assert_close(out[~kpm], out_ref[~kpm], atol=1e-5, rtol=1e-5)
    # a different kernel must really run (the fused encoder fast path must not bypass it)
    swapped.self_attn.kind = "relu"
    assert not torch.allclose(swapped(x, src_key_padding_mask=kpm)[~kpm], out_ref[~kpm], atol=1e-3)


def test_multihead_other_kinds_run_and_backprop():
    for kind in ["l2", "sinkhorn", "sigmoid", "relu", "linear", "fenchel", "ot"]:
        mha = attnzoo.MultiheadAttention(16, 4, kind=kind, batch_first=True)
        x = torch.randn(2, 5, 16, requires_grad=True)
        out, w = mha(x, x, x)
        out.sum().backward()
        assert w.shape == (2, 5, 5) and torch.isfinite(x.grad).all()
