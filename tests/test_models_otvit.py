"""ViT / OT-ViT models: the OT last layer against float64 math written from paper 004 eq (22),
the class-token shortcut, template rows, parameter counts of the paper configs, bad input."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import attnzoo
from attnzoo.layers import OTAttention
from attnzoo.models import OTBlock, OTViT, ViT, build_model, count_parameters
from attnzoo.train.config import load_config
from attnzoo.train.datasets import dataset_info
from attnzoo.train.loop import model_from_config
from tests.common import needs_cuda
from tests.flash_rule import assert_flash_rule, autocast_triples

pytestmark = pytest.mark.usefixtures("one_thread")


TINY = dict(img_size=8, patch_size=4, in_chans=1, num_classes=3, embed_dim=16, depth=2, num_heads=2, dropout=0.0)


def reference_ot_logits(model: OTViT, x, t, alpha, gamma):
    """Logits from the tokens x (B, N, D) entering the last layer and partner tokens t (B, M, D) or None,
    in float64, from eq (22) with M(a, b) = -a.b + C and uniform u over the input's tokens."""
    blk = model.blocks[-1]
    D, H = x.shape[-1], blk.attn.num_heads
    hd = D // H

    def ln(mod, z):
        return F.layer_norm(z, (D,), mod.weight.double(), mod.bias.double(), mod.eps)

    W, b = blk.attn.qkv.weight.double(), blk.attn.qkv.bias.double()
    logits = []
    for n in range(x.shape[0]):
        xn = ln(blk.norm1, x[n])
        q, k, v = (xn @ W[i * D:(i + 1) * D].T + b[i * D:(i + 1) * D] for i in range(3))
        if t is not None:
            tn = ln(blk.norm1, t[n])
            k_all = torch.cat([k, tn @ W[D:2 * D].T + b[D:2 * D]])
            v_all = torch.cat([v, tn @ W[2 * D:].T + b[2 * D:]])
        else:
            k_all, v_all = k, v
        heads = []
        for h in range(H):
            s = slice(h * hd, (h + 1) * hd)
            q0, ka, va, kin = q[0, s], k_all[:, s], v_all[:, s], k[:, s]
            w = torch.zeros(ka.shape[0], dtype=torch.float64)
            for j in range(kin.shape[0]):  # u_j = 1/N over the input's own templates
                w += torch.softmax((alpha * ka @ q0 + ka @ kin[j]) / gamma, dim=0) / kin.shape[0]
            heads.append(w @ va)
        attn_out = torch.cat(heads) @ blk.attn.proj.weight.double().T + blk.attn.proj.bias.double()
        h0 = x[n, 0] + attn_out
        mlp = blk.mlp
        hidden = F.gelu(ln(blk.norm2, h0) @ mlp.fc1.weight.double().T + mlp.fc1.bias.double())
        h0 = h0 + hidden @ mlp.fc2.weight.double().T + mlp.fc2.bias.double()
        logits.append(ln(model.norm, h0) @ model.head.weight.double().T + model.head.bias.double())
    return torch.stack(logits)


CASES = [  # (ot_queries, template_tokens, partner rows)
    ("cls", "all", [True, False, True, False]),
    ("all", "all", [True, False, True, False]),
    ("cls", "patches", [False, True, True, True]),
    ("all", "patches", None),
    ("cls", "all", [False, False, False, False]),
]


@pytest.mark.parametrize("ot_queries,template_tokens,rows", CASES)
def test_otvit_matches_eq22_in_float64(ot_queries, template_tokens, rows):
    model = OTViT(**TINY, ot_queries=ot_queries, template_tokens=template_tokens).double().eval()
    with torch.no_grad():  # non-trivial LayerNorm affine parameters
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    images, partners = torch.randn(4, 1, 8, 8, dtype=torch.float64), torch.randn(4, 1, 8, 8, dtype=torch.float64)
    mask = None if rows is None else torch.tensor(rows)
    got = model(images, templates=partners, template_mask=mask)
    x, t_all = model.trunk(images), model.trunk(partners)
    if template_tokens == "patches":
        t_all = t_all[:, 1:]
    gamma = math.sqrt(TINY["embed_dim"])  # the paper's sqrt(hidden dim)
    with_t = reference_ot_logits(model, x, t_all, 1.0, gamma)
    without = reference_ot_logits(model, x, None, 1.0, gamma)
    use = torch.ones(4, dtype=torch.bool) if rows is None else mask
    want = torch.where(use[:, None], with_t, without)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(model(images), without, rtol=1e-10, atol=1e-10)  # test time: own templates


def test_partner_templates_change_the_output_and_get_gradients():
    model = OTViT(**TINY)
    images, partners = torch.randn(2, 1, 8, 8), torch.randn(2, 1, 8, 8, requires_grad=True)
    out = model(images, templates=partners)
    assert (out - model(images)).abs().max() > 1e-4
    out.sum().backward()
    assert partners.grad is not None and partners.grad.abs().sum() > 0
    frozen = OTViT(**TINY, template_grad=False)
    partners.grad = None
    frozen(images, templates=partners).sum().backward()
    assert partners.grad is None


def test_otvit_last_block_is_ot_with_the_papers_gamma():
    model = OTViT(**{**TINY, "embed_dim": 32, "num_heads": 4})
    assert isinstance(model.blocks[-1], OTBlock) and isinstance(model.blocks[-1].attn, OTAttention)
    assert model.blocks[-1].attn.gamma == pytest.approx(math.sqrt(32))
    assert model.blocks[-1].attn.alpha == 1.0
    assert not any(isinstance(b.attn, OTAttention) for b in model.blocks[:-1])
    assert OTViT(**TINY, ot_gamma="sqrt_head_dim").blocks[-1].attn.gamma == pytest.approx(math.sqrt(8))
    assert OTViT(**TINY, ot_gamma=3.5).blocks[-1].attn.gamma == 3.5


@pytest.mark.parametrize("spec", attnzoo.available())
def test_vit_uses_the_requested_attention_everywhere(spec):
    model = ViT(**TINY, attention=spec)
    resolved = attnzoo.registry.resolve(spec)
    # a wrapper in a timm block is its kind's own layer, timm's qkv/proj layout (issue 31 item 6: the same
    # module swap() makes); multihead's kind defaults to softmax
    name = resolved.kind if resolved.wrapper is not None and resolved.wrapper.name == "multihead" else resolved.name
    for block in model.blocks:
        assert isinstance(block.attn, attnzoo.registry._REGISTRY[name])


@pytest.mark.parametrize("config,dataset", [("vit_fashion_mnist", "fashion_mnist"), ("otvit_fashion_mnist", "fashion_mnist"),
                                            ("vit_cifar10", "cifar10"), ("otvit_cifar10", "cifar10"),
                                            ("vit_cifar100", "cifar100"), ("otvit_cifar100", "cifar100")])
def test_paper_configs_have_about_3_2M_parameters(config, dataset):
    cfg = load_config(f"configs/{config}.yaml")
    with torch.device("meta"):  # shapes only: no memory, no initialisation cost
        n = count_parameters(model_from_config(cfg, dataset_info(dataset)))
    assert 3.1e6 < n < 3.3e6, n
    assert cfg.model.depth == 6 and cfg.model.patch_size == 4 and cfg.model.dropout == 0.2


BAD = [
    (lambda m: m(torch.randn(2, 1, 8, 8), templates=torch.randn(3, 1, 8, 8)), ValueError, "templates"),
    (lambda m: m(torch.randn(2, 1, 8, 8), templates=torch.randn(2, 1, 8, 8), template_mask=torch.ones(2)), ValueError, "template_mask"),
    (lambda m: m(torch.randn(2, 8, 8)), ValueError, "images"),
    (lambda m: OTViT(**TINY, ot_gamma="sqrt_width"), ValueError, "ot_gamma"),
    (lambda m: OTViT(**TINY, ot_gamma=-1.0), ValueError, "ot_gamma"),
    (lambda m: OTViT(**TINY, template_tokens="some"), ValueError, "template_tokens"),
    (lambda m: ViT(**{**TINY, "img_size": 10}), ValueError, "img_size"),
    (lambda m: build_model("resnet"), ValueError, "model name"),
    (lambda m: ViT(**TINY, attention="softmaxx"), ValueError, "softmax"),
    (lambda m: m.blocks[-1](torch.randn(2, 5, 16), n_queries=6), ValueError, "n_queries"),
]


@pytest.mark.parametrize("call,exc,match", BAD)
def test_bad_input_is_named(call, exc, match):
    with pytest.raises(exc, match=match):
        call(OTViT(**TINY))


def _logits_and_grads(model, *args, **kwargs):
    logits = model(*args, **kwargs)
    return logits, torch.autograd.grad(logits.square().sum(), [p for p in model.parameters() if p.requires_grad])


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("template_grad", [True, False])
def test_otvit_compiles_fullgraph_with_partner_templates(masked, template_grad):
    """torch.compile(fullgraph=True) on the training forward (partner templates for the rows of
    template_mask): the compiled graph has no data-dependent shapes (every row runs the last layer
    with and without templates, the mask picks), and it equals the eager forward, which gathers the
    borrowing rows, in logits and every parameter gradient."""
    torch.manual_seed(0)
    model = OTViT(**TINY, template_grad=template_grad)
    images, partners = torch.randn(4, 1, 8, 8), torch.randn(4, 1, 8, 8)
    mask = torch.tensor([True, False, True, True]) if masked else None
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    want, want_g = _logits_and_grads(model, images, templates=partners, template_mask=mask)
    got, got_g = _logits_and_grads(compiled, images, templates=partners, template_mask=mask)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(got_g, want_g):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("compile_model", [False, True])
def test_otvit_trains_under_bf16_autocast_on_gpu(compile_model):
    """An OT-ViT training step on CUDA (the OT layer on auto = triton) under bf16 autocast, eager and
    compiled (inductor, fullgraph): finite logits, and the logits and every parameter gradient within
    FlashAttention's rule of the float64 model."""
    import os
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1: the Triton kernels take CPU tensors only")
    torch.manual_seed(0)
    model = OTViT(img_size=28, patch_size=4, in_chans=1, num_classes=10, embed_dim=64, depth=2, num_heads=4,
                  dropout=0.0).cuda()
    images, partners = torch.randn(8, 1, 28, 28, device="cuda"), torch.randn(8, 1, 28, 28, device="cuda")
    labels, mask = torch.randint(0, 10, (8,), device="cuda"), torch.rand(8, device="cuda") < 0.5
    run = torch.compile(model, fullgraph=True) if compile_model else model
    # the logits and every parameter gradient by FlashAttention's rule against the float64 model, with
    # the model on the reference backend under the same autocast as the bar (tests/flash_rule.py)
    triples = autocast_triples(model, (images,), dict(templates=partners, template_mask=mask), device="cuda",
                               tested=run, loss=lambda out: F.cross_entropy(out.double(), labels))
    assert torch.isfinite(triples[0][1]).all()
    assert_flash_rule("OT-ViT under bf16 autocast", torch.bfloat16, 1.0, triples)
