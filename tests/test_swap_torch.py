"""attnzoo.swap on torch.nn: nn.MultiheadAttention alone and inside nn.TransformerEncoder/DecoderLayer."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import attnzoo
from attnzoo.adapters.torch_nn import SwappedMultiheadAttention

from .swap_helpers import OTHER_VARIANTS, max_diff, reference_kernels, state_dict_roundtrip, train_steps  # noqa: F401

E, HEADS, N = 32, 4, 6
PAD = torch.tensor([[False] * N, [False] * 4 + [True] * 2])  # torch convention: True = padding


def encoder(**kw):
    layer = nn.TransformerEncoderLayer(E, HEADS, 64, dropout=0.0, batch_first=True, **kw)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=True)


def tokens(seed=1):
    return torch.randn(2, N, E, generator=torch.Generator().manual_seed(seed))


MASK_CASES = {  # name -> (src_mask, src_key_padding_mask)
    "none": (None, None),
    "padding": (None, PAD),
    "causal": (nn.Transformer.generate_square_subsequent_mask(N), None),
}


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("masks", list(MASK_CASES))
def test_softmax_swap_keeps_encoder_outputs(mode, masks):
    model = getattr(encoder(), mode)()
    src_mask, kpm = MASK_CASES[masks]
    x = tokens()
    with torch.no_grad():  # eval + no_grad + padding is where torch takes its nested-tensor fast path
        before = model(x, mask=src_mask, src_key_padding_mask=kpm)
        attnzoo.swap(model, "softmax")
        after = model(x, mask=src_mask, src_key_padding_mask=kpm)
    assert all(isinstance(layer.self_attn, SwappedMultiheadAttention) for layer in model.layers)
    keep = ~PAD if kpm is not None else torch.ones(2, N, dtype=torch.bool)
    assert max_diff(after[keep], before[keep]) <= 1e-5  # torch zeroes padded rows on its fast path


def test_softmax_swap_keeps_decoder_outputs_and_weights():
    layer = nn.TransformerDecoderLayer(E, HEADS, 64, dropout=0.0, batch_first=True).eval()
    x, memory = tokens(1), tokens(2)
    causal = nn.Transformer.generate_square_subsequent_mask(N)
    before = layer(x, memory, tgt_mask=causal, memory_key_padding_mask=PAD)
    mha = nn.MultiheadAttention(E, HEADS, kdim=8, vdim=12, batch_first=True)
    q, k, v = tokens(3), torch.randn(2, 5, 8), torch.randn(2, 5, 12)
    out_ref, w_ref = mha(q, k, v)
    holder = nn.ModuleDict({"dec": layer, "mha": mha})
    attnzoo.swap(holder, "softmax")
    assert isinstance(layer.self_attn, SwappedMultiheadAttention) and isinstance(layer.multihead_attn, SwappedMultiheadAttention)
    assert max_diff(layer(x, memory, tgt_mask=causal, memory_key_padding_mask=PAD), before) <= 1e-5
    out, w = holder["mha"](q, k, v)
    assert max_diff(out, out_ref) <= 1e-5 and max_diff(w, w_ref) <= 1e-6


def _relu_encoder_layer_reference(layer, x, pad):
    """float64 post-norm encoder layer with ReLU attention (paper 002 eq 2.5: relu(s_ij)/n_i over kept keys)."""
    d = {k: v.double() for k, v in layer.state_dict().items()}
    x = x.double()
    B, L, _ = x.shape
    hd = E // HEADS
    q, k, v = (x @ d["self_attn.in_proj_weight"].T + d["self_attn.in_proj_bias"]).split(E, dim=-1)
    q, k, v = (t.reshape(B, L, HEADS, hd).transpose(1, 2) for t in (q, k, v))
    keep = (~pad).view(B, 1, 1, L).double()
    n = keep.sum(-1, keepdim=True)
    w = torch.relu(q @ k.transpose(-1, -2) / math.sqrt(hd)) * keep / n
    a = (w @ v).transpose(1, 2).reshape(B, L, E) @ d["self_attn.out_proj.weight"].T + d["self_attn.out_proj.bias"]

    def ln(t, name):
        return nn.functional.layer_norm(t, (E,), d[name + ".weight"], d[name + ".bias"], layer.norm1.eps)
    h = ln(x + a, "norm1")
    ff = torch.relu(h @ d["linear1.weight"].T + d["linear1.bias"]) @ d["linear2.weight"].T + d["linear2.bias"]
    return ln(h + ff, "norm2")


def test_eval_fast_path_does_not_bypass_the_swap():
    layer = nn.TransformerEncoderLayer(E, HEADS, 64, dropout=0.0, batch_first=True).eval()
    x = tokens()
    with torch.no_grad():
        softmax_out = layer(x, src_key_padding_mask=PAD)
        attnzoo.swap(layer, "relu")
        out = layer(x, src_key_padding_mask=PAD)
    keep = ~PAD
    assert max_diff(out[keep], softmax_out[keep]) > 1e-2  # a fused softmax kernel did not run instead
    ref = _relu_encoder_layer_reference(layer, x, PAD)
    torch.testing.assert_close(out[keep].double(), ref[keep], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("variant", OTHER_VARIANTS)
def test_every_variant_trains_reloads_and_respects_padding(variant):
    model = encoder()
    attnzoo.swap(model, variant)
    assert model.use_nested_tensor is False
    x, target = tokens(), tokens(5)
    losses = train_steps(model.train(), lambda m: (m(x, src_key_padding_mask=PAD) - target).pow(2).mean())
    assert losses[-1] < losses[0], losses
    state_dict_roundtrip(model, attnzoo.swap(encoder(), variant), lambda m: m(x, src_key_padding_mask=PAD))
    with torch.no_grad():
        changed = x.clone()
        changed[PAD] = 100.0  # whatever the padded tokens hold, unpadded outputs stay the same
        a = model(x, src_key_padding_mask=PAD)
        b = model(changed, src_key_padding_mask=PAD)
    assert max_diff(a[~PAD], b[~PAD]) <= 1e-5


PARAMETER_SPECS = [  # spec, parameter added to the kernel (None: nothing added)
    ("sigmoid(learnable_bias=True)", "variant_layer.bias_shift"),
    ("fenchel(preference='t5')", "variant_layer.relative_bias.weight"),
    ("fenchel(preference='context', context_hidden=8)", "variant_layer.context_net.2.weight"),
    ("l2(tie_qk=True)", None),
    ("multihead(kind='sinkhorn', n_iters=2)", None),
]


@pytest.mark.parametrize("spec,added", PARAMETER_SPECS)
def test_variants_with_parameters_in_multihead_attention(spec, added):
    model = encoder()
    attnzoo.swap(model, spec)
    keys = model.state_dict().keys()
    if added:
        assert f"layers.0.self_attn.{added}" in keys
    x = tokens()
    train_steps(model, lambda m: m(x, src_key_padding_mask=PAD).pow(2).mean(), steps=2)


def test_unswap_restores_module_outputs_and_fast_path():
    model = encoder().eval()
    x = tokens()
    with torch.no_grad():
        before = model(x)
        attnzoo.swap(model, "sinkhorn")
        assert max_diff(model(x), before) > 1e-3
        attnzoo.unswap(model)
        assert all(type(layer.self_attn) is nn.MultiheadAttention for layer in model.layers)
        assert model.use_nested_tensor is True
        assert max_diff(model(x), before) <= 1e-6


class CustomAttention(nn.Module):
    """An attention-looking module no adapter converts."""
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(E, 3 * E)


def test_unsupported_module_is_reported():
    holder = nn.ModuleDict({"plain": nn.MultiheadAttention(E, HEADS), "custom": CustomAttention()})
    with pytest.warns(UserWarning, match="custom"):
        attnzoo.swap(holder, "relu")
    assert isinstance(holder["plain"], SwappedMultiheadAttention) and type(holder["custom"]) is CustomAttention
    assert holder.attnzoo_swap_report.unsupported == ["custom"]
    fresh = nn.ModuleDict({"plain": nn.MultiheadAttention(E, HEADS), "custom": CustomAttention()})
    with pytest.raises(ValueError, match="custom"):
        attnzoo.swap(fresh, "relu", strict=True)
    assert type(fresh["plain"]) is nn.MultiheadAttention


@pytest.mark.parametrize("bias_kv,zero_attn", [(True, False), (False, True), (True, True)])
def test_bias_kv_and_zero_attn_are_carried(bias_kv, zero_attn):
    """nn.MultiheadAttention(add_bias_kv=, add_zero_attn=): the softmax swap keeps outputs and weights,
    bias_k / bias_v move over as the same Parameters, and unswap gives torch's module back."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, HEADS, add_bias_kv=bias_kv, add_zero_attn=zero_attn, batch_first=True).eval()
    holder = nn.ModuleDict({"mha": mha})
    x = tokens()
    before = mha(x, x, x, key_padding_mask=PAD)
    ids = {n: id(p) for n, p in mha.named_parameters()}
    attnzoo.swap(holder, "softmax")
    swapped = holder["mha"]
    assert isinstance(swapped, SwappedMultiheadAttention) and {n: id(p) for n, p in swapped.named_parameters()
                                                              if not n.startswith("variant_layer")} == ids
    after = swapped(x, x, x, key_padding_mask=PAD)
    assert max_diff(after[0], before[0]) <= 1e-5 and max_diff(after[1], before[1]) <= 1e-6
    attnzoo.swap(holder, "sinkhorn")
    assert max_diff(holder["mha"](x, x, x, key_padding_mask=PAD)[0], before[0]) > 1e-3
    attnzoo.unswap(holder)
    assert type(holder["mha"]) is nn.MultiheadAttention
    assert max_diff(holder["mha"](x, x, x, key_padding_mask=PAD)[0], before[0]) <= 1e-6
    with pytest.raises(ValueError, match="add_bias_kv / add_zero_attn"):
        attnzoo.swap(holder, "fenchel(preference='context')")


def test_unknown_variant_and_dry_run_leave_the_model_alone():
    model = encoder()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="unknown attention variant"):
        attnzoo.swap(model, "sinkhorm")
    report = attnzoo.plan_swap(model, "ot", include="layers.1")
    assert report.swapped == ["layers.1.self_attn"] and report.excluded == ["layers.0.self_attn"]
    assert all(type(layer.self_attn) is nn.MultiheadAttention for layer in model.layers)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert model.use_nested_tensor is True
