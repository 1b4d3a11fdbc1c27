"""attnzoo.swap on timm models: weights preserved, every variant trains, filters, dry run, unswap."""
from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

import attnzoo
from attnzoo.layers import AttentionLayer

from .swap_helpers import OTHER_VARIANTS, max_diff, reference_kernels, state_dict_roundtrip, train_steps  # noqa: F401

timm = pytest.importorskip("timm")
from timm.layers import Attention  # noqa: E402


def tiny_vit(**kw):
    # vit_tiny_patch16_224 shrunk to img 32, patch 4 (64 tokens), plus depth/width cut for the test budget
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=4, depth=2,
                             embed_dim=48, num_heads=3, num_classes=5, **kw)


def images():
    g = torch.Generator().manual_seed(1)
    return torch.randn(2, 3, 32, 32, generator=g)


def attn_types(model):
    return [type(b.attn) for b in model.blocks]


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_softmax_swap_keeps_outputs(mode):
    model = tiny_vit()
    getattr(model, mode)()
    x = images()
    torch.manual_seed(3)
    before = model(x)
    attnzoo.swap(model, "softmax")
    assert all(issubclass(t, AttentionLayer) for t in attn_types(model))
    torch.manual_seed(3)
    assert max_diff(model(x), before) <= 1e-5


def test_swap_moves_the_same_parameters():
    model = tiny_vit(qk_norm=True)
    old = model.blocks[1].attn
    ids = {n: id(p) for n, p in old.named_parameters()}
    attnzoo.swap(model, "sinkhorn(n_iters=2)")
    new = model.blocks[1].attn
    assert {n: id(p) for n, p in new.named_parameters()} == ids  # q_norm/k_norm included
    assert new.n_iters == 2


@pytest.mark.parametrize("variant", OTHER_VARIANTS)
def test_every_variant_trains_and_reloads(variant):
    model = tiny_vit()
    attnzoo.swap(model, variant)
    x, y = images(), torch.tensor([1, 3])
    losses = train_steps(model.train(), lambda m: nn.functional.cross_entropy(m(x), y))
    assert losses[-1] < losses[0], losses
    fresh = attnzoo.swap(tiny_vit(), variant)
    state_dict_roundtrip(model, fresh, lambda m: m(x))


def _l2_reference(attn, x):
    """float64 L2 attention (paper 002 sec 2.3) from the layer's own qkv/proj weights."""
    x = x.double()
    W, b = attn.qkv.weight.double(), attn.qkv.bias.double()
    H, D = attn.num_heads, attn.head_dim
    B, N, C = x.shape
    q, k, v = (x @ W.T + b).reshape(B, N, 3, H, D).permute(2, 0, 3, 1, 4)
    d2 = ((q[..., :, None, :] - k[..., None, :, :]) ** 2).sum(-1)
    w = torch.softmax(-d2 / math.sqrt(D), dim=-1)
    out = (w @ v).transpose(1, 2).reshape(B, N, H * D)
    return out @ attn.proj.weight.double().T + attn.proj.bias.double()


def test_swapped_variant_uses_the_carried_weights():
    model = tiny_vit().eval()
    attnzoo.swap(model, "l2")
    attn = model.blocks[0].attn
    x = torch.randn(2, 7, 48)
    torch.testing.assert_close(attn(x).double(), _l2_reference(attn, x), rtol=1e-4, atol=1e-5)


def test_attn_layer_at_creation():
    plain = tiny_vit().eval()
    made = tiny_vit(attn_layer=attnzoo.layer("softmax")).eval()
    made.load_state_dict(plain.state_dict(), strict=True)  # same names as timm's Attention
    x = images()
    assert max_diff(made(x), plain(x)) <= 1e-5
    l2 = tiny_vit(attn_layer=attnzoo.layer("l2(tie_qk=True)"))
    assert all(isinstance(b.attn, attnzoo.L2Attention) and b.attn.tie_qk for b in l2.blocks)
    assert l2(x).shape == (2, 5)


FILTER_CASES = [  # include, exclude, blocks expected swapped
    ("blocks.1.*", None, [False, True]),
    ("blocks.1", None, [False, True]),          # an enclosing module's name selects what is inside
    (r"blocks\.[01]\.attn", "blocks.0.*", [False, True]),
    (None, ["*.0.attn"], [False, True]),
    (["blocks.0.attn", "blocks.1.attn"], None, [True, True]),
]


@pytest.mark.parametrize("include,exclude,expected", FILTER_CASES)
def test_include_exclude(include, exclude, expected):
    model = tiny_vit()
    attnzoo.swap(model, "ot", include=include, exclude=exclude)
    assert [isinstance(b.attn, attnzoo.OTAttention) for b in model.blocks] == expected
    report = model.attnzoo_swap_report
    assert sorted(report.swapped) == [f"blocks.{i}.attn" for i, e in enumerate(expected) if e]
    assert sorted(report.excluded) == [f"blocks.{i}.attn" for i, e in enumerate(expected) if not e]


def test_dry_run_changes_nothing():
    model = tiny_vit()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = attnzoo.plan_swap(model, "sigmoid(learnable_bias=True)", include="blocks.1.*")
    also = attnzoo.swap(model, "sigmoid(learnable_bias=True)", include="blocks.1.*", dry_run=True)
    assert attn_types(model) == [Attention, Attention]
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()) and before.keys() == model.state_dict().keys()
    for r in (report, also):
        assert r.swapped == ["blocks.1.attn"] and r.excluded == ["blocks.0.attn"]
        entry = [e for e in r.entries if e.action == "swap"][0]
        assert "qkv.weight" in entry.carried and any(a.startswith("bias_shift") and "zeros" in a for a in entry.added)
    assert "blocks.1.attn" in str(report)


def test_unswap_restores_outputs_and_type():
    model = tiny_vit().eval()
    x = images()
    before = model.forward_features(x)
    attnzoo.swap(model, "sigmoid(learnable_bias=True)")
    assert max_diff(model.forward_features(x), before) > 1e-3  # the variant really runs
    attnzoo.unswap(model)
    assert attn_types(model) == [Attention, Attention]
    assert max_diff(model.forward_features(x), before) <= 1e-6
    assert model.attnzoo_swap_report.entries[0].dropped == ["bias_shift"]


class WithUnsupported(nn.Module):
    def __init__(self):
        super().__init__()
        from timm.layers import AttentionRope
        from timm.models.eva import EvaAttention
        self.good = Attention(16, num_heads=2)
        self.rope = AttentionRope(16, num_heads=2)
        self.split = EvaAttention(16, num_heads=2, qkv_fused=False, norm_layer=nn.LayerNorm)


def test_unsupported_is_reported_by_name():
    model = WithUnsupported()
    with pytest.warns(UserWarning, match=r"rope \(AttentionRope.*split \(EvaAttention"):
        attnzoo.swap(model, "relu")
    assert isinstance(model.good, attnzoo.ReLUAttention)
    assert model.attnzoo_swap_report.unsupported == ["rope", "split"]


def test_strict_raises_before_touching():
    model = WithUnsupported()
    with pytest.raises(ValueError, match="rope"):
        attnzoo.swap(model, "relu", strict=True)
    assert type(model.good) is Attention
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        attnzoo.swap(model, "relu", strict=True, exclude=["rope", "split"])
    assert isinstance(model.good, attnzoo.ReLUAttention)


BAD_SPECS = [  # spec, kwargs, exception, message
    ("softmaxx", {}, ValueError, "unknown attention variant 'softmaxx'"),
    ("sinkhorn(n_iter=3)", {}, ValueError, "n_iter"),
    ("sinkhorn", {"eps": -1.0}, ValueError, "eps"),
    ("multihead(kind='nope')", {}, ValueError, "unknown attention variant 'nope'"),
    (attnzoo.SoftmaxAttention, {}, TypeError, "spec must be"),
]


@pytest.mark.parametrize("spec,kwargs,exc,match", BAD_SPECS)
def test_bad_spec_fails_before_touching(spec, kwargs, exc, match):
    model = tiny_vit()
    with pytest.raises(exc, match=match):
        attnzoo.swap(model, spec, **kwargs)
    assert attn_types(model) == [Attention, Attention]


def test_bad_filters_and_model():
    with pytest.raises(TypeError, match="include"):
        attnzoo.swap(tiny_vit(), "relu", include=3)
    with pytest.raises(TypeError, match="model"):
        attnzoo.swap("vit", "relu")
    with pytest.warns(UserWarning, match="no attention module"):
        attnzoo.swap(tiny_vit(), "relu", include="nothing.here")


def tiny_eva():
    model = timm.create_model("eva02_tiny_patch14_224", pretrained=False, img_size=32, patch_size=4, depth=2,
                              num_classes=5).eval()
    g = torch.Generator().manual_seed(5)
    for block in model.blocks:  # timm starts q/v biases at 0; non-zero ones show they are carried
        block.attn.q_bias.data.normal_(generator=g)
        block.attn.v_bias.data.normal_(generator=g)
    return model


@pytest.mark.parametrize("spec", ["softmax", "sigmoid(learnable_bias=True)"])
def test_eva_attention_with_rope(spec):
    from timm.models.eva import EvaAttention
    model = tiny_eva()
    assert model.rope is not None
    x = images()
    before = model.forward_features(x)
    attnzoo.swap(model, spec)
    assert all(isinstance(b.attn, attnzoo.layers.AttentionLayer) for b in model.blocks)
    after = model.forward_features(x)
    if spec == "softmax":
        assert max_diff(after, before) <= 1e-5
    else:
        assert max_diff(after, before) > 1e-3
        y = torch.tensor([0, 4])
        losses = train_steps(model.train(), lambda m: nn.functional.cross_entropy(m(x), y), steps=3)
        assert losses[-1] < losses[0]
        state_dict_roundtrip(model, attnzoo.swap(tiny_eva(), spec), lambda m: m(x))
        model.eval()
        before = model.forward_features(x)
        attnzoo.unswap(model)
        assert all(type(b.attn) is EvaAttention for b in model.blocks)
        assert max_diff(model.forward_features(x), before) > 1e-5  # the learned bias shift is dropped
        return
    attnzoo.unswap(model)
    assert all(type(b.attn) is EvaAttention for b in model.blocks)
    assert max_diff(model.forward_features(x), before) <= 1e-6
