"""attnzoo with Hugging Face transformers: AttentionInterface registration and attnzoo.swap on BERT / ViT
built from small random configs (no downloads)."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import attnzoo

from .swap_helpers import OTHER_VARIANTS, max_diff, reference_kernels, state_dict_roundtrip, train_steps  # noqa: F401

transformers = pytest.importorskip("transformers", minversion="5.0")
from transformers import (AutoModel, BertConfig, BertForSequenceClassification, BertModel,  # noqa: E402
                          ViTConfig, ViTForImageClassification)
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS  # noqa: E402
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: E402

E, HEADS, N = 32, 4, 6
IDS = torch.tensor([[5, 9, 12, 3, 0, 0], [7, 1, 4, 4, 8, 2]])
PADDING = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])  # HF: 1 = real token; left-padded so causal rows see it
REAL = PADDING.bool()


def bert_config(**kw):
    return BertConfig(vocab_size=20, hidden_size=E, num_hidden_layers=2, num_attention_heads=HEADS,
                      intermediate_size=64, max_position_embeddings=16, hidden_dropout_prob=0.0,
                      attention_probs_dropout_prob=0.0, num_labels=3, **kw)


def bert():
    return BertForSequenceClassification(bert_config())


def vit():
    return ViTForImageClassification(ViTConfig(image_size=16, patch_size=4, hidden_size=E, num_hidden_layers=2,
                                               num_attention_heads=HEADS, intermediate_size=64, num_labels=3,
                                               hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


PIXELS = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(2))
LABELS = torch.tensor([0, 2])
MODELS = {  # name -> (constructor, forward returning hidden states, loss)
    "bert": (bert, lambda m, ids=IDS: m.bert(ids, attention_mask=PADDING).last_hidden_state,
             lambda m: m(IDS, attention_mask=PADDING, labels=LABELS).loss),
    "vit": (vit, lambda m: m.vit(PIXELS).last_hidden_state, lambda m: m(PIXELS, labels=LABELS).loss),
}


def test_implementations_registered_on_import():
    # first test of the file: nothing has called register_hf_attention yet; importing attnzoo and
    # transformers (in either order) is enough for attn_implementation="attnzoo_..."
    for v in ("softmax", "sigmoid", "relu", "sinkhorn"):
        assert f"attnzoo_{v}" in ALL_ATTENTION_FUNCTIONS and f"attnzoo_{v}" in ALL_MASK_ATTENTION_FUNCTIONS
    model = AutoModel.from_config(bert_config(), attn_implementation="attnzoo_sigmoid")
    assert model.config._attn_implementation == "attnzoo_sigmoid"


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("family", list(MODELS))
def test_softmax_swap_keeps_outputs(family, mode):
    make, hidden, _ = MODELS[family]
    model = getattr(make(), mode)()
    before = hidden(model)
    attnzoo.swap(model, "softmax")
    assert model.config._attn_implementation == "attnzoo"
    assert max_diff(hidden(model), before) <= 1e-5


@pytest.mark.parametrize("variant", OTHER_VARIANTS)
@pytest.mark.parametrize("family", list(MODELS))
def test_every_variant_trains_and_reloads(family, variant):
    make, hidden, loss = MODELS[family]
    model = attnzoo.swap(make(), variant)
    losses = train_steps(model.train(), loss)
    assert losses[-1] < losses[0], losses
    state_dict_roundtrip(model, attnzoo.swap(make(), variant), hidden)


PADDING_SPECS = OTHER_VARIANTS + ["softmax", "fenchel(preference='t5')", "fenchel(preference='context')",
                                  "sigmoid(learnable_bias=True)", "l2(tie_qk=True)"]


@pytest.mark.parametrize("spec", PADDING_SPECS)
def test_padding_mask_reaches_the_kernel(spec):
    model = attnzoo.swap(bert(), spec).eval()
    other = IDS.clone()
    other[~REAL] = 17  # different padded tokens
    a, b = MODELS["bert"][1](model), MODELS["bert"][1](model, other)
    assert max_diff(a[REAL], b[REAL]) <= 1e-5
    unmasked = model.bert(other).last_hidden_state  # without the mask the padded tokens do matter
    assert max_diff(unmasked[REAL], a[REAL]) > 1e-4


def test_causal_mask_reaches_the_kernel():
    model = BertModel(bert_config(is_decoder=True)).eval()
    attnzoo.swap(model, "relu")
    ids = IDS[1:]
    later = ids.clone()
    later[0, 3:] = 19
    a, b = model(ids).last_hidden_state, model(later).last_hidden_state
    assert max_diff(a[:, :3], b[:, :3]) <= 1e-5 and max_diff(a[:, 3:], b[:, 3:]) > 1e-4


def _self_attention_reference(module, h, variant):
    """float64 (B, N, H*D) self-attention context from the module's own query/key/value weights."""
    def proj(lin):
        return (h.double() @ lin.weight.double().T + lin.bias.double()).view(1, N, HEADS, -1).transpose(1, 2)
    q, k, v = proj(module.query), proj(module.key), proj(module.value)
    D = q.shape[-1]
    if variant == "sigmoid":   # paper 002 eq 2.5, b = -log n
        w = torch.sigmoid(q @ k.transpose(-1, -2) / math.sqrt(D) - math.log(N))
    else:                      # l2 with tied keys: softmax(-||q_i - q_j||^2 / sqrt(D))
        w = torch.softmax(-((q[..., :, None, :] - q[..., None, :, :]) ** 2).sum(-1) / math.sqrt(D), -1)
    return (w @ v).transpose(1, 2).reshape(1, N, -1)


@pytest.mark.parametrize("how,spec,variant", [("interface", "attnzoo_sigmoid", "sigmoid"),
                                              ("swap", "sigmoid", "sigmoid"),
                                              ("swap", "l2(tie_qk=True)", "l2_tied")])
def test_kernel_matches_the_formula(how, spec, variant):
    model = BertModel(bert_config()).eval()
    if how == "interface":
        attnzoo.register_hf_attention()
        model.set_attn_implementation(spec)
    else:
        attnzoo.swap(model, spec)
    module = model.encoder.layer[0].attention.self
    h = torch.randn(1, N, E, generator=torch.Generator().manual_seed(4))
    out = module(h)[0]
    torch.testing.assert_close(out.double(), _self_attention_reference(module, h, variant), rtol=1e-4, atol=1e-5)


def test_registered_implementations_and_mask_functions():
    names = attnzoo.register_hf_attention()
    for v in ("softmax", "l2", "sinkhorn", "sigmoid", "relu", "linear", "masked", "fenchel", "ot"):
        assert f"attnzoo_{v}" in names
    for name in names:
        assert name in ALL_ATTENTION_FUNCTIONS and name in ALL_MASK_ATTENTION_FUNCTIONS
    assert attnzoo.register_hf_attention("sinkhorn(n_iters=2)", name="sinkhorn2") == ["sinkhorn2", "attnzoo"]
    with pytest.raises(ValueError, match="attnzoo.swap"):
        attnzoo.register_hf_attention("sigmoid(learnable_bias=True)")
    with pytest.raises(ValueError, match="unknown attention variant"):
        attnzoo.register_hf_attention("sigmiod")


@pytest.mark.parametrize("impl", ["attnzoo_softmax", "attnzoo_sinkhorn", "sinkhorn2"])
def test_attn_implementation_at_construction(impl):
    attnzoo.register_hf_attention()
    attnzoo.register_hf_attention("sinkhorn(n_iters=2)", name="sinkhorn2")
    reference = BertModel(bert_config()).eval()
    model = AutoModel.from_config(bert_config(), attn_implementation=impl).eval()
    model.load_state_dict(reference.state_dict())
    assert model.config._attn_implementation == impl
    out = model(IDS, attention_mask=PADDING).last_hidden_state
    other = IDS.clone()
    other[~REAL] = 17
    assert max_diff(out[REAL], model(other, attention_mask=PADDING).last_hidden_state[REAL]) <= 1e-5
    diff = max_diff(out, reference(IDS, attention_mask=PADDING).last_hidden_state)
    assert diff <= 1e-5 if impl == "attnzoo_softmax" else diff > 1e-4


def test_parameters_added_and_initialised_as_documented():
    model = bert().eval()
    before = MODELS["bert"][1](model)
    report = attnzoo.plan_swap(model, "fenchel(preference='t5')")
    assert all(any("relative_bias.weight" in a and "zeros" in a for a in e.added) for e in report.entries)
    attnzoo.swap(model, "fenchel(preference='t5')")
    assert "bert.encoder.layer.1.attention.self.attnzoo_kernel.relative_bias.weight" in model.state_dict()
    assert max_diff(MODELS["bert"][1](model), before) <= 1e-5  # zero preference = plain softmax


def test_include_last_layer_and_unswap():
    model = bert().eval()
    hidden = MODELS["bert"][1]
    before = hidden(model)
    attnzoo.swap(model, "softmax", include=r"bert\.encoder\.layer\.1\..*")
    assert not hasattr(model.bert.encoder.layer[0].attention.self, "attnzoo_kernel")
    assert max_diff(hidden(model), before) <= 1e-5  # layer 0 runs SDPA under the "attnzoo" implementation
    attnzoo.swap(model, "relu", include="bert.encoder.layer.1")
    assert max_diff(hidden(model), before) > 1e-4
    attnzoo.unswap(model)
    assert model.config._attn_implementation == "sdpa"
    assert not any(n.endswith("attnzoo_kernel") for n, _ in model.named_modules())
    assert max_diff(hidden(model), before) <= 1e-6


def test_unswap_restores_the_implementation_the_config_had():
    model = BertForSequenceClassification(bert_config(attn_implementation="eager")).eval()
    attnzoo.swap(model, "relu", include="bert.encoder.layer.1")
    attnzoo.swap(model, "sigmoid", include="bert.encoder.layer.0")  # the config is already "attnzoo" here
    assert model.config._attn_implementation == "attnzoo"
    attnzoo.unswap(model, include="bert.encoder.layer.1")
    assert model.config._attn_implementation == "attnzoo"  # layer 0 still runs a kernel
    attnzoo.unswap(model)
    assert model.config._attn_implementation == "eager"
    state_keys = set(model.state_dict())
    attnzoo.swap(model, "relu")
    attnzoo.unswap(model)
    assert model.config._attn_implementation == "eager" and set(model.state_dict()) == state_keys


class LegacyAttention(nn.Module):
    """An attention module that does not call transformers' AttentionInterface."""
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(E, 3 * E)


def test_unsupported_and_unknown_and_dry_run():
    holder = nn.ModuleDict({"bert": bert(), "legacy": LegacyAttention()})
    state = {k: v.clone() for k, v in holder.state_dict().items()}
    with pytest.raises(ValueError, match="unknown attention variant"):
        attnzoo.swap(holder, "reluu")
    report = attnzoo.swap(holder, "relu", dry_run=True)
    assert report.unsupported == ["legacy"] and len(report.swapped) == 2
    assert holder["bert"].config._attn_implementation == "sdpa"
    assert all(torch.equal(state[k], v) for k, v in holder.state_dict().items())
    with pytest.raises(ValueError, match="legacy"):
        attnzoo.swap(holder, "relu", strict=True)
    with pytest.warns(UserWarning, match="legacy"):
        attnzoo.swap(holder, "relu")
    assert holder.attnzoo_swap_report.unsupported == ["legacy"]
