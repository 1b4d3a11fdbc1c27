"""torch.fx on swapped models: timm's feature extraction and node names, torchvision's, and plain
``torch.fx.symbolic_trace`` give the untraced model's outputs and gradients, bit for bit; the attnzoo
layer is one call of the graph (layers/tracing.py). TorchScript is refused with a message."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.fx

import attnzoo
from attnzoo.layers import AttentionLayer

from .swap_helpers import reference_kernels  # noqa: F401

timm = pytest.importorskip("timm")
from timm.models import create_feature_extractor, get_graph_node_names  # noqa: E402

SPECS = ["softmax", "sinkhorn", "sigmoid(learnable_bias=True)", "fenchel(preference='t5')", "ot"]


def tiny_vit(spec, name="vit_tiny_patch16_224", **kw):
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, img_size=32, patch_size=8, depth=2, embed_dim=48,
                              num_heads=3, num_classes=5, **kw)
    return attnzoo.swap(model, spec)


def images():
    return torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))


def attention_calls(graph_module):
    return [n.target for n in graph_module.graph.nodes if n.op == "call_module" and n.target.endswith(".attn")]


def test_timm_is_told_the_layers_are_leaves_whichever_is_imported_first():
    code = ("import {0}, {1}; from timm.layers import is_notrace_module; import attnzoo.layers as L; "
            "assert is_notrace_module(L.AttentionLayer) and is_notrace_module(L.MultiheadAttention)")
    for first, second in (("timm", "attnzoo"), ("attnzoo", "timm")):
        subprocess.run([sys.executable, "-c", code.format(first, second)], check=True)


@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("spec", SPECS)
def test_timm_feature_extraction(spec, mode):
    """What timm's own FX tests do (tests/test_models.py: _create_fx_model): the node names, then a
    feature extractor returning the last node; forward and backward as the untraced model."""
    model = getattr(tiny_vit(spec), mode)()
    train_nodes, eval_nodes = get_graph_node_names(model)
    nodes = eval_nodes if mode == "eval" else train_nodes
    assert "blocks.0.attn" in nodes and "blocks.1.attn" in nodes
    assert not any(n.startswith("blocks.0.attn.") for n in nodes)  # a leaf: nothing traced inside it
    extractor = create_feature_extractor(model, return_nodes={nodes[-1]: "out", "blocks.0.attn": "attn0"})
    x = images()
    seen = []
    handle = model.blocks[0].attn.register_forward_hook(lambda m, i, o: seen.append(o.detach()))
    torch.manual_seed(5)
    want = model(x)
    handle.remove()
    want.square().sum().backward()
    want_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    torch.manual_seed(5)
    got = extractor(x)
    assert torch.equal(got["out"], want) and torch.equal(got["attn0"], seen[0])
    got["out"].square().sum().backward()
    got_grads = dict(extractor.named_parameters())
    assert all(torch.equal(got_grads[n].grad, g) for n, g in want_grads.items())


@pytest.mark.parametrize("spec", SPECS)
def test_plain_symbolic_trace_and_torchvision(spec):
    """Tracers that know nothing of attnzoo: the layer records itself as one call_module node."""
    from torchvision.models.feature_extraction import create_feature_extractor as torchvision_extractor
    model = tiny_vit(spec).eval()
    x = images()
    traced = torch.fx.symbolic_trace(model)
    assert attention_calls(traced) == ["blocks.0.attn", "blocks.1.attn"]
    assert torch.equal(traced(x), model(x))
    extractor = torchvision_extractor(model, return_nodes={"blocks.1.attn": "attn1", "head": "logits"})
    got = extractor(x)
    assert torch.equal(got["logits"], model(x)) and got["attn1"].shape == (2, 17, 48)


def test_eva_rotary_embeddings_reach_the_traced_call():
    model = tiny_vit("sinkhorn", name="eva02_tiny_patch14_224").eval()
    x = images()
    traced = torch.fx.symbolic_trace(model)
    calls = [n for n in traced.graph.nodes if n.op == "call_module" and n.target.endswith(".attn")]
    assert len(calls) == 2 and all(n.kwargs["rope"] is not None for n in calls)
    assert torch.equal(traced(x), model(x))


def test_a_layer_alone_is_not_a_trace_root_and_torchscript_is_refused():
    layer = attnzoo.create("sinkhorn", 48, num_heads=3)
    with pytest.raises(TypeError, match="root of an FX trace.*Trace the model"):
        torch.fx.symbolic_trace(layer)
    with pytest.raises(TypeError, match="does not support TorchScript.*torch.compile"):
        torch.jit.script(tiny_vit("softmax"))
    with pytest.raises(TypeError, match="does not support TorchScript"):
        torch.jit.script(attnzoo.MultiheadAttention(48, 3, kind="relu"))


class Block(torch.nn.Module):
    """A block that calls a MultiheadAttention as torch code does (nn.TransformerEncoder itself is not
    FX-traceable, swapped or not: its fast-path checks branch on the inputs)."""
    def __init__(self, attn):
        super().__init__()
        self.norm, self.attn = torch.nn.LayerNorm(48), attn

    def forward(self, x, pad):
        h = self.norm(x)
        out, weights = self.attn(h, h, h, key_padding_mask=pad)
        return x + out, weights


@pytest.mark.parametrize("how", ["swapped nn.MultiheadAttention", "attnzoo.MultiheadAttention"])
def test_multihead_attention_is_one_call_of_the_trace(how):
    torch.manual_seed(0)
    if how == "attnzoo.MultiheadAttention":
        model = Block(attnzoo.MultiheadAttention(48, 3, batch_first=True, kind="sigmoid", add_bias_kv=True))
    else:
        model = attnzoo.swap(Block(torch.nn.MultiheadAttention(48, 3, batch_first=True)), "sinkhorn")
    model.eval()
    x = torch.randn(2, 7, 48, generator=torch.Generator().manual_seed(2))
    pad = torch.tensor([[False] * 7, [False] * 5 + [True] * 2])
    traced = torch.fx.symbolic_trace(model)
    assert [n.target for n in traced.graph.nodes if n.op == "call_module"] == ["norm", "attn"]
    for got, want in zip(traced(x, pad), model(x, pad)):
        assert torch.equal(got, want)
