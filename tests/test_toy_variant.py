"""A variant declared from outside the package works everywhere a built-in one does.

Cosine-similarity attention, out_i = sum_j softmax_j(tau cos(q_i, k_j) + mask_ij) v_j, is declared in
this file only: a reference function, an argument check and a FLOP formula in one ``attnzoo.Variant``
record, registered with ``attnzoo.register_variant`` for this module and unregistered after it. The
tests then use it through the public API alone (functional, create and spec strings, explain, the
masked/multihead wrappers, swap into timm / torch.nn / Hugging Face, ``attnzoo bench`` and training),
each checked against float64 math written here independently of the reference: a per-row loop over
the keys that take part.
"""
from __future__ import annotations

import copy
import json
import math
import re
from fractions import Fraction

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import attnzoo
from attnzoo.cli import main as cli_main

from .flash_rule import assert_flash_rule, flash_rule_failures, rounded, scale_grad
from .train_helpers import no_system_datasets, tiny_config  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

NAME = "cosine"


# -- the variant, as a user outside the package would declare it -------------------------------------

def cosine_attention(q, k, v, *, attn_mask=None, is_causal=False, scale, dropout_p=0.0, tau=10.0):
    """Cosine-similarity attention: softmax_j(tau cos(q_i, k_j) + mask_ij) v_j. ``scale`` is not used:
    the logits are bounded by tau instead. A query row with no key taking part returns zeros."""
    out_dtype = q.dtype
    if out_dtype in (torch.float16, torch.bfloat16):  # exp and the row sums in float32
        q, k, v = q.float(), k.float(), v.float()
    nq, nk = q.shape[-2], k.shape[-2]
    logits = tau * (F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-1, -2))
    keep = None
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            keep = attn_mask
        else:  # -inf removes the key; finite values are added, and no -inf enters the arithmetic
            keep = attn_mask > -math.inf
            logits = logits + torch.where(keep, attn_mask, torch.zeros((), dtype=attn_mask.dtype)).to(logits.dtype)
    if is_causal:  # bottom-right aligned, as SDPA's causal_lower_right
        rows = torch.arange(nq, device=q.device)[:, None]
        cols = torch.arange(nk, device=q.device)[None, :]
        causal = cols <= rows + (nk - nq)
        keep = causal if keep is None else keep & causal
    if keep is not None:
        logits = logits.masked_fill(~keep, -math.inf)
    row_max = logits.amax(-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max)).detach()
    e = torch.exp(logits - row_max)
    total = e.sum(-1, keepdim=True)
    weights = e / torch.where(total > 0, total, torch.ones_like(total))  # an empty row stays all zeros
    if dropout_p > 0:
        weights = F.dropout(weights, dropout_p, training=True)
    return (weights @ v).to(out_dtype)


def check_cosine(q, k, v, *, scale, tau):
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not math.isfinite(tau) or tau <= 0:
        raise ValueError(f"tau must be a positive finite number, got {tau!r}")
    return {"tau": float(tau)}


def cosine_flops(s, causal, **_):
    """QK^T and PV (2 B H Nq Nk (D + Dv), halved when causal) plus the q and k norms (2 B H (Nq + Nk) D)."""
    products = Fraction(2 * s.bh * s.seq_q * s.nk * (s.head_dim + s.dv))
    return (products / 2 if causal else products) + 2 * s.bh * (s.seq_q + s.nk) * s.head_dim


FLOP_FORMULA = "2 B H Nq Nk (D + Dv) (x 1/2 causal) + 2 B H (Nq + Nk) D for the norms"

RECORD = attnzoo.Variant(
    name=NAME, reference=cosine_attention, check=check_cosine, class_name="CosineAttention",
    doc="softmax(tau cos(q, k)) v: cosine-similarity attention with temperature tau.",
    complexity="O(Nq Nk D)", parameters="none beyond qkv/proj", paper="toy: cosine-similarity attention",
    flops=cosine_flops, flop_formula=FLOP_FORMULA)


@pytest.fixture(scope="module", autouse=True)
def cosine_variant():
    """Declared for this module only: the other test modules never see it."""
    cls = attnzoo.register_variant(RECORD)
    try:
        yield cls
    finally:
        attnzoo.unregister(NAME)


# -- the float64 ground truth, written independently of the reference ------------------------------

def dense_keep_bias(attn_mask, is_causal, shape):
    """SDPA's mask convention spelled out on a dense (B, H, Nq, Nk) grid: (keep, bias), float64."""
    B, H, nq, nk = shape
    keep = torch.ones(shape, dtype=torch.bool)
    bias = torch.zeros(shape, dtype=torch.float64)
    if attn_mask is not None:
        m = attn_mask.expand(shape)
        if m.dtype == torch.bool:
            keep &= m
        else:
            keep &= m != -math.inf
            bias = torch.where(keep, m.double(), bias)
    if is_causal:
        for i in range(nq):
            for j in range(nk):
                if j > i + nk - nq:
                    keep[..., i, j] = False
    return keep, bias


def expected_cosine(q, k, v, tau, attn_mask=None, is_causal=False):
    """out_i = sum_j softmax_j(tau q_i.k_j / (|q_i| |k_j|) + bias_ij) v_j over the kept keys, one row at a time."""
    q, k, v = q.double(), k.double(), v.double()
    B, H, nq, _ = q.shape
    nk = k.shape[-2]
    keep, bias = dense_keep_bias(attn_mask, is_causal, (B, H, nq, nk))
    out = torch.zeros(B, H, nq, v.shape[-1], dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            for i in range(nq):
                js = keep[b, h, i].nonzero().flatten()
                if len(js) == 0:
                    continue  # no key: a zero row
                cos = torch.stack([q[b, h, i] @ k[b, h, j] / (q[b, h, i].norm() * k[b, h, j].norm()) for j in js])
                logits = tau * cos + bias[b, h, i, js]
                w = torch.exp(logits - logits.max())
                out[b, h, i] = (w / w.sum()) @ v[b, h, js]
    return out


def rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def split_heads(t, heads):
    B, N, E = t.shape
    return t.view(B, N, heads, E // heads).transpose(1, 2)


def merge_heads(t):
    B, H, N, D = t.shape
    return t.transpose(1, 2).reshape(B, N, H * D)


def layer_reference(x, qkv_weight, qkv_bias, proj_weight, proj_bias, heads, tau, is_causal=False):
    """timm's Attention layout in float64: fused qkv projection, the formula per head, output projection."""
    x = x.double()
    qkv = x @ qkv_weight.double().T + (0 if qkv_bias is None else qkv_bias.double())
    q, k, v = (split_heads(t, heads) for t in qkv.chunk(3, dim=-1))
    out = merge_heads(expected_cosine(q, k, v, tau, is_causal=is_causal))
    return out @ proj_weight.double().T + (0 if proj_bias is None else proj_bias.double())


def max_diff(a, b):
    return (a.double() - b.double()).abs().max().item()


# -- 1. the functional -------------------------------------------------------------------------------

B, H, NQ, NK, D = 2, 2, 5, 7, 4
ROW_MASK = torch.tensor([True, False, True, True, False])[:, None]  # (Nq, 1): rows 1 and 4 see no key
KEY_MASK = torch.tensor([True, True, False, True, False, True, True])  # (Nk,)
BOOL_FULL = rand(B, H, NQ, NK, seed=11) > 0
BOOL_FULL[0, 1, 2] = False  # one fully masked row
FLOAT_MASK = rand(NQ, NK, seed=12).masked_fill(rand(NQ, NK, seed=13) > 0.8, -math.inf)
FLOAT_ROWS = torch.zeros(NQ, 1).masked_fill(~ROW_MASK, -math.inf)

MASKS = {
    "none": (None, False),
    "bool_full": (BOOL_FULL, False),
    "float": (FLOAT_MASK, False),
    "bool_rows": (ROW_MASK, False),
    "float_rows": (FLOAT_ROWS, False),
    "bool_keys": (KEY_MASK, False),
    "causal": (None, True),
    "causal_and_keys": (KEY_MASK, True),
}


# cross-attention (Nq = 5 < Nk = 7) for every mask; self-attention (Nq = Nk) for the masks that fit it
CASES = [(case, NQ) for case in MASKS] + [(case, NK) for case, (m, _) in MASKS.items() if m is None or m.dim() == 1]


@pytest.mark.parametrize("case,nq", CASES)
def test_functional_matches_the_formula(case, nq):
    attn_mask, is_causal = MASKS[case]
    q, k, v = rand(B, H, nq, D, seed=1), rand(B, H, NK, D, seed=2), rand(B, H, NK, 3, seed=3)
    fn = attnzoo.functional.VARIANT_FUNCTIONS[NAME]
    out = fn(q, k, v, attn_mask=attn_mask, is_causal=is_causal, tau=3.0)
    assert out.shape == (B, H, nq, 3) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected_cosine(q, k, v, 3.0, attn_mask, is_causal),
                               rtol=1e-5, atol=1e-6)
    keep, _ = dense_keep_bias(attn_mask, is_causal, (B, H, nq, NK))
    empty = ~keep.any(-1)
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))  # zeros, not NaN


def test_functional_option_default_and_errors():
    q, k, v = rand(1, 2, NQ, D, seed=1), rand(1, 2, NK, D, seed=2), rand(1, 2, NK, D, seed=3)
    fn = attnzoo.functional.VARIANT_FUNCTIONS[NAME]
    assert NAME in attnzoo.functional.VARIANT_FUNCTIONS
    default = fn(q, k, v)
    torch.testing.assert_close(default.double(), expected_cosine(q, k, v, 10.0), rtol=1e-5, atol=1e-6)
    assert max_diff(default, fn(q, k, v, tau=1.0)) > 1e-2  # tau reaches the kernel
    torch.testing.assert_close(fn(q, k, v, scale=0.01), default)  # the logit scale does not apply
    with pytest.raises(ValueError, match="tau"):
        fn(q, k, v, tau=-1.0)
    with pytest.raises(TypeError, match="temperature"):
        fn(q, k, v, temperature=2.0)
    with pytest.raises(ValueError, match="attn_mask"):
        fn(q, k, v, attn_mask=torch.full((NQ, NK), math.nan))


def _bf16_triples(perturb=None):
    """(name, the variant on bf16 inputs, the float64 result stored in bf16, the float64 formula on the
    same inputs) for the output and dq, dk, dv. The variant's only backend is its reference, so the bar
    is the rounding of the exact result (FlashAttention's rule with the reference as the tested path)."""
    q, k, v = (t.bfloat16() for t in (rand(1, 2, NQ, D, seed=1), rand(1, 2, NK, D, seed=2), rand(1, 2, NK, D, seed=3)))
    cot = rand(1, 2, NQ, D, seed=4).double()
    fn = attnzoo.functional.VARIANT_FUNCTIONS[NAME]

    def run(call, dtype, tested=False):
        leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        out = call(*(perturb(*leaves) if tested and perturb else leaves))
        return [out] + list(torch.autograd.grad((out.double() * cot).sum(), leaves))

    want = run(lambda q, k, v: expected_cosine(q, k, v, 2.0, KEY_MASK), torch.float64)
    got = run(lambda q, k, v: fn(q, k, v, attn_mask=KEY_MASK, tau=2.0), torch.bfloat16, tested=True)
    return list(zip(("out", "dq", "dk", "dv"), got, [rounded(w, torch.bfloat16) for w in want], want))


def test_functional_bf16_meets_the_flash_rule():
    triples = _bf16_triples()
    assert triples[0][1].dtype == torch.bfloat16
    assert_flash_rule(NAME, torch.bfloat16, 2.0, triples)
    # and the check sees a gradient 5% off
    wrong = _bf16_triples(lambda q, k, v: (q, scale_grad(k, 0.95), v))
    assert any("dk error" in f for f in flash_rule_failures(NAME, torch.bfloat16, 2.0, wrong))


def test_functional_gradients():
    q = rand(1, 1, 3, 3, seed=4).double().requires_grad_()
    k = rand(1, 1, 4, 3, seed=5).double().requires_grad_()
    v = rand(1, 1, 4, 2, seed=6).double().requires_grad_()
    mask = torch.tensor([[True, False, True, True], [False] * 4, [True, True, False, True]])  # row 1 empty
    fn = attnzoo.functional.VARIANT_FUNCTIONS[NAME]
    assert torch.autograd.gradcheck(lambda q, k, v: fn(q, k, v, attn_mask=mask, tau=2.5), (q, k, v))
    assert torch.autograd.gradcheck(lambda q, k, v: fn(q, k, v, is_causal=True, tau=2.5), (q, k, v))


# -- 2. create, spec strings, describe ---------------------------------------------------------------

DIM, HEADS, N = 16, 2, 6


def test_create_and_layer_from_spec_strings(cosine_variant):
    layer = attnzoo.create("cosine(tau=5.0)", DIM, HEADS, qkv_bias=True).eval()
    assert type(layer) is cosine_variant and type(layer).__name__ == "CosineAttention"
    assert isinstance(layer, attnzoo.AttentionLayer) and layer.tau == 5.0 and "tau=5.0" in repr(layer)
    x = rand(2, N, DIM, seed=7)
    with torch.no_grad():
        out = layer(x)
    ref = layer_reference(x, layer.qkv.weight, layer.qkv.bias, layer.proj.weight, layer.proj.bias, HEADS, 5.0)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        assert max_diff(attnzoo.create("cosine", DIM, HEADS)(x), out) > 1e-3  # default tau 10 is another layer

    bound = attnzoo.layer("cosine(tau=5.0)")
    assert issubclass(bound, cosine_variant) and bound(DIM, num_heads=HEADS).tau == 5.0
    copied = copy.deepcopy(bound(DIM, num_heads=HEADS))  # pickles by spec: the class is made at run time
    assert type(copied).spec == "cosine(tau=5.0)" and copied.tau == 5.0
    assert bound(DIM, num_heads=HEADS, tau=2.0).tau == 2.0  # keyword arguments override the spec
    with pytest.raises(ValueError, match="temperature"):
        attnzoo.create("cosine(temperature=2.0)", DIM, HEADS)
    with pytest.raises(ValueError, match="temperature"):
        attnzoo.layer("cosine(temperature=2.0)")
    with pytest.raises(ValueError, match="tau"):  # when the layer is built: the default hook runs the check
        attnzoo.create("cosine(tau=0.0)", DIM, HEADS)
    with pytest.raises(ValueError, match="did you mean 'cosine'"):
        attnzoo.create("cosin", DIM, HEADS)


def test_describe_available_and_list(capsys):
    assert NAME in attnzoo.available()
    d = attnzoo.describe("cosine(tau=2.0)")
    assert d["name"] == NAME and d["class"] == "CosineAttention" and d["causal"] and d["cross"] and d["masks"]
    assert d["paper"] == "toy: cosine-similarity attention" and d["complexity"] == "O(Nq Nk D)"
    assert cli_main(["list", NAME]) == 0
    out = " ".join(capsys.readouterr().out.split())  # attnzoo list NAME: the variant in full
    assert out.startswith("cosine ") and "tau=10.0" in out and "CosineAttention" in out
    assert "cosine-similarity attention with temperature tau" in out and "reference" in out  # doc, backends
    assert cli_main(["list"]) == 0
    assert re.search(r"(│ cosine +│|^cosine$)", capsys.readouterr().out, re.M)  # its row or block in the list


def test_layer_trains_and_reloads(cosine_variant):
    layer = attnzoo.create("cosine(tau=4.0)", DIM, HEADS)
    x, target = rand(2, N, DIM, seed=8), rand(2, N, DIM, seed=9)
    opt = torch.optim.Adam(layer.parameters(), lr=1e-2)
    losses = []
    for _ in range(5):
        opt.zero_grad()
        loss = (layer(x) - target).pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses
    fresh = attnzoo.create("cosine(tau=4.0)", DIM, HEADS)
    fresh.load_state_dict(layer.state_dict(), strict=True)
    with torch.no_grad():
        assert max_diff(fresh(x), layer(x)) == 0


def test_a_variant_declared_after_transformers_loaded_is_an_attention_implementation():
    pytest.importorskip("transformers", minversion="5.0")
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    late = attnzoo.Variant(name="cosine_late", reference=cosine_attention, check=check_cosine)
    assert "attnzoo_cosine_late" not in ALL_ATTENTION_FUNCTIONS
    attnzoo.register_variant(late)
    try:
        assert "attnzoo_cosine_late" in ALL_ATTENTION_FUNCTIONS  # nothing else ran register_hf_attention
    finally:
        attnzoo.unregister("cosine_late")


def test_unregister_removes_a_variant_everywhere():
    other = attnzoo.Variant(name="cosine_once", reference=cosine_attention, check=check_cosine)
    attnzoo.register_variant(other)
    assert "cosine_once" in attnzoo.functional.VARIANT_FUNCTIONS
    attnzoo.create("cosine_once", DIM, HEADS)
    attnzoo.unregister("cosine_once")
    assert "cosine_once" not in attnzoo.available()
    assert "cosine_once" not in attnzoo.functional.VARIANT_FUNCTIONS
    with pytest.raises(ValueError, match="unknown attention variant"):
        attnzoo.create("cosine_once", DIM, HEADS)
    with pytest.raises(ValueError, match="variant"):
        attnzoo.explain("cosine_once", *(rand(1, 1, 2, 2, seed=s) for s in range(3)))
    attnzoo.register_variant(other)  # declarable again once removed
    attnzoo.unregister("cosine_once")


# -- 3. explain --------------------------------------------------------------------------------------

def test_explain_names_the_reference_backend():
    q, k, v = rand(1, 2, NQ, D, seed=1), rand(1, 2, NK, D, seed=2), rand(1, 2, NK, D, seed=3)
    choice = attnzoo.explain(NAME, q, k, v, tau=2.0)
    assert choice.variant == NAME and choice.backend.name == "reference" and "'reference'" in str(choice)
    assert attnzoo.functional.explain(NAME, q, k, v, backend="reference").backend.name == "reference"
    with pytest.raises(ValueError, match="tau"):
        attnzoo.explain(NAME, q, k, v, tau=math.inf)
    with pytest.raises(ValueError, match="triton"):
        attnzoo.functional.VARIANT_FUNCTIONS[NAME](q, k, v, backend="triton")  # none declared: a clear error


# -- 4. the wrappers ---------------------------------------------------------------------------------

def test_masked_wrapper_is_causal():
    layer = attnzoo.create("masked(kind='cosine', tau=3.0)", DIM, HEADS).eval()
    assert layer.kind == NAME and layer.tau == 3.0
    x = rand(2, N, DIM, seed=7)
    with torch.no_grad():
        out = layer(x)
        later = x.clone()
        later[:, 3:] = rand(2, N - 3, DIM, seed=10)
        assert max_diff(layer(later)[:, :3], out[:, :3]) == 0 and max_diff(layer(later)[:, 3:], out[:, 3:]) > 1e-3
    ref = layer_reference(x, layer.qkv.weight, None, layer.proj.weight, layer.proj.bias, HEADS, 3.0, is_causal=True)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)
    q, k, v = rand(1, 2, NQ, D, seed=1), rand(1, 2, NK, D, seed=2), rand(1, 2, NK, D, seed=3)
    torch.testing.assert_close(attnzoo.functional.masked(q, k, v, kind=NAME, tau=3.0).double(),
                               expected_cosine(q, k, v, 3.0, is_causal=True), rtol=1e-5, atol=1e-6)


def test_multihead_wrapper_runs_the_kind():
    mha = attnzoo.create("multihead(kind='cosine', tau=3.0)", DIM, HEADS, batch_first=True).eval()
    x = rand(2, N, DIM, seed=7)
    pad = torch.tensor([[False] * N, [False] * 4 + [True] * 2])  # torch convention: True = padding
    with torch.no_grad():
        out, weights = mha(x, x, x, key_padding_mask=pad, average_attn_weights=False)
    W, b = mha.in_proj_weight.double(), mha.in_proj_bias.double()
    q, k, v = (split_heads(x.double() @ w.T + bb, HEADS) for w, bb in zip(W.chunk(3), b.chunk(3)))
    ctx = expected_cosine(q, k, v, 3.0, attn_mask=~pad.view(2, 1, 1, N))
    ref = merge_heads(ctx) @ mha.out_proj.weight.double().T + mha.out_proj.bias.double()
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)
    assert weights.shape == (2, HEADS, N, N) and torch.allclose(weights.sum(-1), torch.ones(2, HEADS, N))
    assert weights[1, ..., 4:].abs().max() == 0  # padded keys take no weight


# -- 5. swap into timm, torch.nn and Hugging Face ----------------------------------------------------

def _grads_flow(model, loss, attention):
    """Every gradient finite; the attention module's projections (those feeding q and k too) get one."""
    model.zero_grad()
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    for p in attention.parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0


def _captured(module):
    """A forward hook that keeps the module's first input and its output."""
    seen = {}

    def hook(mod, args, kwargs, output):
        seen["x"] = args[0] if args else kwargs["hidden_states"]
        seen["out"] = output
    return seen, module.register_forward_hook(hook, with_kwargs=True)


def test_swap_into_timm_vit(cosine_variant):
    timm = pytest.importorskip("timm")
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2,
                              embed_dim=32, num_heads=2, num_classes=3).eval()
    x = rand(2, 3, 32, 32, seed=1)
    with torch.no_grad():
        before = model(x)
    attnzoo.swap(model, "cosine(tau=4.0)", strict=True)
    assert [type(b.attn) for b in model.blocks] == [cosine_variant] * 2 and model.blocks[0].attn.tau == 4.0
    assert model.attnzoo_swap_report.swapped == ["blocks.0.attn", "blocks.1.attn"]
    attn = model.blocks[1].attn
    seen, handle = _captured(attn)
    with torch.no_grad():
        after = model(x)
    handle.remove()
    assert torch.isfinite(after).all() and max_diff(after, before) > 1e-3
    ref = layer_reference(seen["x"], attn.qkv.weight, attn.qkv.bias, attn.proj.weight, attn.proj.bias, 2, 4.0)
    torch.testing.assert_close(seen["out"].double(), ref, rtol=1e-5, atol=1e-5)
    _grads_flow(model, model.train()(x).logsumexp(-1).mean(), model.blocks[0].attn)
    attnzoo.unswap(model)
    with torch.no_grad():
        assert max_diff(model.eval()(x), before) <= 1e-6  # the moved weights came back unchanged


E = 16


def _encoder_layer_reference(layer, x, pad, tau):
    """float64 post-norm nn.TransformerEncoderLayer with cosine attention over the unpadded keys."""
    d = {k: v.double() for k, v in layer.state_dict().items()}
    x = x.double()
    q, k, v = (x @ d["self_attn.in_proj_weight"].T + d["self_attn.in_proj_bias"]).split(E, dim=-1)
    ctx = expected_cosine(*(split_heads(t, HEADS) for t in (q, k, v)), tau, attn_mask=~pad.view(2, 1, 1, -1))
    a = merge_heads(ctx) @ d["self_attn.out_proj.weight"].T + d["self_attn.out_proj.bias"]

    def ln(t, name):
        return F.layer_norm(t, (E,), d[name + ".weight"], d[name + ".bias"], layer.norm1.eps)
    h = ln(x + a, "norm1")
    ff = torch.relu(h @ d["linear1.weight"].T + d["linear1.bias"]) @ d["linear2.weight"].T + d["linear2.bias"]
    return ln(h + ff, "norm2")


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")  # torch's own fast path, before the swap
def test_swap_into_torch_transformer_encoder():
    layer = nn.TransformerEncoderLayer(E, HEADS, 32, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True).eval()
    x = rand(2, N, E, seed=1)
    pad = torch.tensor([[False] * N, [False] * 4 + [True] * 2])
    with torch.no_grad():
        before = model(x, src_key_padding_mask=pad)
        attnzoo.swap(model, "cosine(tau=4.0)", strict=True)
        after = model(x, src_key_padding_mask=pad)
    assert all(m.self_attn.kind == NAME for m in model.layers) and model.use_nested_tensor is False
    keep = ~pad
    assert torch.isfinite(after).all() and max_diff(after[keep], before[keep]) > 1e-3
    first = model.layers[0]
    with torch.no_grad():
        one = first(x, src_key_padding_mask=pad)
    torch.testing.assert_close(one[keep].double(), _encoder_layer_reference(first, x, pad, 4.0)[keep],
                               rtol=1e-5, atol=1e-5)
    _grads_flow(model, model.train()(x, src_key_padding_mask=pad)[keep].pow(2).mean(), first.self_attn)


HF_IDS = torch.tensor([[5, 9, 12, 3, 0, 0], [7, 1, 4, 4, 8, 2]])
HF_PADDING = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])  # 1 = real token
HF_REAL = HF_PADDING.bool()


def _bert(**kw):
    transformers = pytest.importorskip("transformers", minversion="5.0")
    config = transformers.BertConfig(vocab_size=20, hidden_size=E, num_hidden_layers=2, num_attention_heads=HEADS,
                                     intermediate_size=32, max_position_embeddings=16, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0, **kw)
    return transformers.BertModel(config).eval(), config


def test_swap_into_hugging_face_bert():
    model, _ = _bert()
    with torch.no_grad():
        before = model(HF_IDS, attention_mask=HF_PADDING).last_hidden_state
    attnzoo.swap(model, "cosine(tau=4.0)", strict=True)
    module = model.encoder.layer[0].attention.self
    assert module.attnzoo_kernel.kind == NAME and module.attnzoo_kernel.tau == 4.0
    h = rand(1, N, E, seed=4)
    with torch.no_grad():
        out = module(h)[0]
        q, k, v = (split_heads(h.double() @ lin.weight.double().T + lin.bias.double(), HEADS)
                   for lin in (module.query, module.key, module.value))
        torch.testing.assert_close(out.double(), merge_heads(expected_cosine(q, k, v, 4.0)), rtol=1e-5, atol=1e-6)
        after = model(HF_IDS, attention_mask=HF_PADDING).last_hidden_state
        other = HF_IDS.clone()
        other[~HF_REAL] = 17  # the padded tokens do not reach the real ones
        moved = model(other, attention_mask=HF_PADDING).last_hidden_state
    assert torch.isfinite(after).all() and max_diff(after[HF_REAL], before[HF_REAL]) > 1e-3
    assert max_diff(after[HF_REAL], moved[HF_REAL]) <= 1e-5
    loss = model.train()(HF_IDS, attention_mask=HF_PADDING).last_hidden_state[HF_REAL].pow(2).mean()
    _grads_flow(model, loss, model.encoder.layer[0].attention.self)


def test_hugging_face_causal_model_and_attention_implementation():
    decoder, _ = _bert(is_decoder=True)
    attnzoo.swap(decoder, NAME, strict=True)
    ids = HF_IDS[1:]
    later = ids.clone()
    later[0, 3:] = 19
    with torch.no_grad():
        a, b = decoder(ids).last_hidden_state, decoder(later).last_hidden_state
    assert max_diff(a[:, :3], b[:, :3]) <= 1e-5 and max_diff(a[:, 3:], b[:, 3:]) > 1e-4

    # a variant without parameters is also a transformers attention implementation, "attnzoo_cosine",
    # registered with transformers when it is declared (or, when transformers is imported after it, then)
    transformers = pytest.importorskip("transformers", minversion="5.0")
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    assert f"attnzoo_{NAME}" in ALL_ATTENTION_FUNCTIONS
    assert f"attnzoo_{NAME}" in attnzoo.register_hf_attention()
    swapped, config = _bert()
    attnzoo.swap(swapped, NAME)
    by_name = transformers.AutoModel.from_config(config, attn_implementation=f"attnzoo_{NAME}").eval()
    by_name.load_state_dict(swapped.state_dict(), strict=True)  # the swap added no parameters
    with torch.no_grad():
        want = swapped(HF_IDS, attention_mask=HF_PADDING).last_hidden_state
        got = by_name(HF_IDS, attention_mask=HF_PADDING).last_hidden_state
    assert max_diff(got[HF_REAL], want[HF_REAL]) <= 1e-5


# -- 6. attnzoo bench --------------------------------------------------------------------------------

def test_bench_command_times_the_variant(tmp_path):
    args = ["bench", "--variants", NAME, "masked(kind='cosine', tau=2.0)", "--backends", "reference", "auto",
            "--seq-lens", "8", "--batch-tokens", "16", "--head-dim", "4", "--heads", "2", "--mode", "fwd",
            "fwd+bwd", "--min-repeats", "1", "--repeats", "1", "--target-seconds", "0", "--no-memory", "--quiet",
            "--out", str(tmp_path)]
    assert cli_main(args) == 0
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["flop_conventions"]["forward"][NAME] == FLOP_FORMULA
    shape = attnzoo.ops.sizes.Shape(batch=2, heads=2, seq_q=8, head_dim=4)
    for variant, causal in ((NAME, False), ("masked(kind='cosine', tau=2.0)", True)):
        rows = {(r["backend"], r["mode"]): r for r in result["results"] if r["variant"] == variant}
        assert set(rows) == {(b, m) for b in ("reference", "auto") for m in ("fwd", "fwd+bwd")}
        forward = cosine_flops(shape, causal)
        for (backend, mode), row in rows.items():
            assert row["status"] == "ok", row["reason"]
            assert row["time_s"]["median"] > 0 and row["batch"] == 2 and row["seq_len"] == 8
            assert row["flops"] == round(forward * (1 if mode == "fwd" else 1 + RECORD.backward_factor))
            if backend == "auto":
                assert row["resolved_backend"] == "reference"
    assert "cosine" in (tmp_path / "bench.md").read_text()


# -- 7. training -------------------------------------------------------------------------------------

@pytest.mark.usefixtures("no_system_datasets")
def test_vit_trains_with_the_variant(tmp_path, cosine_variant):
    from attnzoo.train import train
    from attnzoo.train.datasets import dataset_info
    from attnzoo.train.loop import model_from_config
    cfg = tiny_config(tmp_path, overrides=['model.attention="cosine(tau=5.0)"'])
    model = model_from_config(cfg, dataset_info("fashion_mnist"))
    assert all(isinstance(b.attn, cosine_variant) and b.attn.tau == 5.0 for b in model.blocks)
    images = rand(8, 1, 28, 28, seed=3)
    with torch.no_grad():  # a model of run-time classes survives pickling (checkpoints, deepcopy)
        assert max_diff(copy.deepcopy(model).eval()(images), model.eval()(images)) == 0

    # a fixed batch: a few Adam steps bring its loss down through the cosine layers
    labels = torch.arange(8) % 10
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(6):
        opt.zero_grad()
        loss = F.cross_entropy(model(images), labels)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses

    # the training loop on generated data, through the config as `attnzoo train` reads it
    torch.manual_seed(0)
    start = {k: v.clone() for k, v in model_from_config(cfg, dataset_info("fashion_mnist")).state_dict().items()}
    summary = train(cfg, log=lambda *a: None)
    assert summary["attention"] == "cosine(tau=5.0)"
    epoch = json.loads((tmp_path / "metrics.json").read_text())["epochs"][0]
    assert math.isfinite(epoch["train_loss"]) and 0 <= epoch["test_acc"] <= 1
    from safetensors.torch import load_file
    end = load_file(str(tmp_path / "checkpoints" / "epoch0001.safetensors"))
    assert end.keys() == start.keys() and all(torch.isfinite(v).all() for v in end.values())
    assert any(not torch.equal(start[k], end[k]) for k in start)  # the optimizer stepped
