"""The "multihead" spec in a timm model is one module (issue 31 item 6): ``attn_layer=attnzoo.layer(
"multihead(kind=K)")`` and ``attnzoo.swap(vit, "multihead(kind=K)")`` both give K's own layer with timm's
layout, so state_dicts move between the two routes and a plain timm one loads with strict=True.
``attnzoo.create("multihead", ...)`` stays torch's nn.MultiheadAttention interface (tested elsewhere)."""
from __future__ import annotations

import pytest
import torch

import attnzoo

from . import formulas as FM
from .swap_helpers import reference_kernels  # noqa: F401

timm = pytest.importorskip("timm")
from timm.models.vision_transformer import VisionTransformer  # noqa: E402

SPEC = "multihead(kind='relu')"


def tiny_vit(attn_layer=None):
    torch.manual_seed(0)
    kw = {} if attn_layer is None else {"attn_layer": attn_layer}
    return VisionTransformer(img_size=16, patch_size=8, embed_dim=16, depth=2, num_heads=2, num_classes=3, **kw).eval()


def relu_attention_float64(attn, x):
    """timm's qkv / proj around ReLU attention (paper 002: relu(q k^T scale) / n), float64."""
    B, N, E = x.shape
    H = attn.num_heads
    qkv = torch.nn.functional.linear(x.double(), attn.qkv.weight.double(), attn.qkv.bias.double())
    q, k, v = qkv.view(B, N, 3, H, E // H).permute(2, 0, 3, 1, 4)
    allow, add = FM.allow_and_add(None, False, B, H, N, N)
    out = FM.relu(q, k, v, allow, add, (E // H) ** -0.5)
    return torch.nn.functional.linear(out.transpose(1, 2).reshape(B, N, E), attn.proj.weight.double(),
                                      attn.proj.bias.double())


def test_layer_and_swap_build_the_same_module():
    built = tiny_vit(attnzoo.layer(SPEC))
    swapped = attnzoo.swap(tiny_vit(), SPEC)
    for a, b in zip(built.blocks, swapped.blocks):
        assert isinstance(a.attn, attnzoo.ReLUAttention) and type(b.attn) is attnzoo.ReLUAttention
    assert built.state_dict().keys() == swapped.state_dict().keys()


def test_state_dicts_load_strictly_both_ways_and_from_plain_timm():
    plain, built, swapped = tiny_vit(), tiny_vit(attnzoo.layer(SPEC)), attnzoo.swap(tiny_vit(), SPEC)
    with torch.no_grad():
        for p in plain.parameters():
            p.normal_(0, 0.5)
    built.load_state_dict(plain.state_dict(), strict=True)       # a plain timm state_dict
    swapped.load_state_dict(built.state_dict(), strict=True)     # layer -> swap
    built.load_state_dict(swapped.state_dict(), strict=True)     # swap -> layer
    x = torch.randn(2, 5, 16)
    for model in (built, swapped):
        attn = model.blocks[0].attn
        with torch.no_grad():
            torch.testing.assert_close(attn(x).double(), relu_attention_float64(attn, x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("spec,error,words", [
    ("multihead(kind='masked')", ValueError, "wraps a wrapper"),
    ("multihead(kind='relux')", ValueError, "did you mean 'relu'"),
    ("multihead(kind=3)", TypeError, "kind must be a variant name"),
    ("multihead(kind='sinkhorn(n_iters=5)', n_iters=6)", TypeError, "give each option once"),
])
def test_bad_kinds_are_named(spec, error, words):
    with pytest.raises(error, match=words):
        attnzoo.layer(spec)
