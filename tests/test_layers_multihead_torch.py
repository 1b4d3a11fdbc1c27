"""attnzoo.MultiheadAttention against torch.nn.MultiheadAttention with the same weights: unbatched
(L, E) inputs under either batch_first, ``is_causal`` as torch's hint next to an explicit mask
(self and cross attention, L != S), add_bias_kv / add_zero_attn, torch's attributes, the weights
returned under dropout. float64, so the comparison is to rounding."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import attnzoo
import attnzoo.functional as AF
from attnzoo.layers.multihead import is_causal_mask

E, HEADS, L, S = 12, 3, 9, 6
TOL = dict(rtol=1e-9, atol=1e-10)


def _pair(batch_first, kdim=None, vdim=None, kind="softmax", **torch_kw):
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(E, HEADS, batch_first=batch_first, kdim=kdim, vdim=vdim, dtype=torch.float64,
                                **torch_kw)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.3)  # non-zero biases too
    ours = attnzoo.MultiheadAttention(E, HEADS, batch_first=batch_first, kdim=kdim, vdim=vdim, kind=kind,
                                      dtype=torch.float64, **torch_kw)
    ours.load_state_dict(ref.state_dict())
    return ref.eval(), ours.eval()


def _inputs(batched, batch_first, cross, kdim=None, vdim=None, B=2):
    g = torch.Generator().manual_seed(1)
    n_k = S if cross else L

    def make(n, width):
        shape = (n, width) if not batched else ((B, n, width) if batch_first else (n, B, width))
        return torch.randn(shape, generator=g, dtype=torch.float64)
    q = make(L, E)
    return q, (make(n_k, kdim or E) if cross else q), (make(n_k, vdim or E) if cross else q)


def _compare(ref, ours, args, **kw):
    for need_weights in (True, False):
        for average in (True, False):
            a = ref(*args, need_weights=need_weights, average_attn_weights=average, **kw)
            b = ours(*args, need_weights=need_weights, average_attn_weights=average, **kw)
            torch.testing.assert_close(b[0], a[0], **TOL)
            if need_weights:
                torch.testing.assert_close(b[1], a[1], **TOL)


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("cross", [False, True])
def test_unbatched_input_matches_torch(batch_first, cross):
    kdim, vdim = (5, 7) if cross else (None, None)
    ref, ours = _pair(batch_first, kdim, vdim)
    q, k, v = _inputs(False, batch_first, cross, kdim, vdim)
    _compare(ref, ours, (q, k, v))
    out = ours(q, k, v)[0]
    assert out.shape == (L, E)
    # the same tokens as a batch of one give the same outputs: L stays the sequence axis
    batched = ours(*(t.unsqueeze(0 if batch_first else 1) for t in (q, k, v)))[0]
    torch.testing.assert_close(batched.squeeze(0 if batch_first else 1), out, **TOL)


@pytest.mark.parametrize("batch_first", [True, False])
def test_unbatched_key_padding_mask_matches_torch(batch_first):
    ref, ours = _pair(batch_first)
    q, k, v = _inputs(False, batch_first, cross=True)
    kpm = torch.tensor([False, True, False, False, True, False])
    _compare(ref, ours, (q, k, v), key_padding_mask=kpm)


def _top_left_causal(n_q, n_k):
    return torch.ones(n_q, n_k, dtype=torch.bool).triu(1)  # True = masked, torch's convention


MASKS = {
    "square causal (bool)": lambda: _top_left_causal(L, L),
    "square causal (float)": lambda: nn.Transformer.generate_square_subsequent_mask(L, dtype=torch.float64),
    "cross, top-left causal": lambda: _top_left_causal(L, S),
    "cross, any mask": lambda: torch.rand(L, S, generator=torch.Generator().manual_seed(3)) < 0.4,
}


@pytest.mark.parametrize("name", list(MASKS))
@pytest.mark.parametrize("batch_first", [True, False])
def test_is_causal_with_an_explicit_mask_applies_the_mask_as_torch_does(name, batch_first):
    """torch treats is_causal as a hint: the mask it is given is what it applies (need_weights=True
    path; for the cross masks that are not causal in attnzoo's bottom-right sense)."""
    cross = name.startswith("cross")
    mask = MASKS[name]()
    if mask.dtype == torch.bool:
        mask[:, 0] = False  # every query keeps a key (torch gives NaN rows otherwise)
    ref, ours = _pair(batch_first)
    q, k, v = _inputs(True, batch_first, cross)
    want = ref(q, k, v, attn_mask=mask, is_causal=True, need_weights=True)
    for need_weights in (True, False):
        got = ours(q, k, v, attn_mask=mask, is_causal=True, need_weights=need_weights)
        torch.testing.assert_close(got[0], want[0], **TOL)
        if need_weights:
            torch.testing.assert_close(got[1], want[1], **TOL)
    # and the same as the mask alone
    torch.testing.assert_close(ours(q, k, v, attn_mask=mask)[0], want[0], **TOL)


def test_is_causal_mask_recognises_exactly_the_causal_pattern():
    assert is_causal_mask(_top_left_causal(5, 5), 5, 5)
    assert is_causal_mask(nn.Transformer.generate_square_subsequent_mask(5), 5, 5)
    assert is_causal_mask(_top_left_causal(5, 5).expand(6, 5, 5), 5, 5)
    bottom_right = ~attnzoo.ops.masking.causal_keep(3, 5)
    assert is_causal_mask(bottom_right, 3, 5) and not is_causal_mask(_top_left_causal(3, 5), 3, 5)
    off = _top_left_causal(5, 5)
    off[4, 0] = True
    assert not is_causal_mask(off, 5, 5)
    assert not is_causal_mask(nn.Transformer.generate_square_subsequent_mask(5) * 0.5 + 1.0, 5, 5)


def test_sinkhorn_with_a_causal_mask_and_the_hint_runs_prefix_sinkhorn():
    """The causal mask with is_causal=True reaches the kernel as is_causal alone: Sinkhorn's outputs
    for early tokens do not depend on later ones (they would through the column normalisation)."""
    torch.manual_seed(0)
    mha = attnzoo.MultiheadAttention(E, HEADS, batch_first=True, kind="sinkhorn", dtype=torch.float64).eval()
    x = torch.randn(2, L, E, dtype=torch.float64)
    mask = nn.Transformer.generate_square_subsequent_mask(L, dtype=torch.float64)
    out = mha(x, x, x, attn_mask=mask, is_causal=True, need_weights=False)[0]
    torch.testing.assert_close(out, mha(x, x, x, is_causal=True, need_weights=False)[0], **TOL)
    y = x.clone()
    y[:, -1] += 1.0
    moved = mha(y, y, y, attn_mask=mask, is_causal=True, need_weights=False)[0]
    torch.testing.assert_close(moved[:, :-1], out[:, :-1], **TOL)


@pytest.mark.parametrize("call,match", [
    (lambda m: m(torch.randn(2, L, E), torch.randn(S, E), torch.randn(S, E)), "batched"),
    (lambda m: m(torch.randn(2, L, E + 1), torch.randn(2, S, E), torch.randn(2, S, E)), "query must have 12"),
    (lambda m: m(torch.randn(2, L, E), torch.randn(2, S, E), torch.randn(2, S + 1, E)), "key and value"),
])
def test_bad_inputs_name_the_layer(call, match):
    with pytest.raises(ValueError, match=match):
        call(attnzoo.MultiheadAttention(E, HEADS, batch_first=True))


# ---- torch's attributes, add_bias_kv / add_zero_attn, dropout, nested tensors ----------------------

ATTRIBUTES = ("embed_dim", "kdim", "vdim", "_qkv_same_embed_dim", "num_heads", "dropout", "batch_first",
              "head_dim", "add_zero_attn")
CONFIGS = {
    "plain": {},
    "kdim/vdim": dict(kdim=5, vdim=7),
    "no bias": dict(bias=False),
    "bias_kv": dict(add_bias_kv=True),
    "zero_attn, batch_first": dict(add_zero_attn=True, batch_first=True, dropout=0.25),
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_torch_attributes_with_torch_meaning(config):
    kw = CONFIGS[config]
    ref, ours = nn.MultiheadAttention(E, HEADS, **kw), attnzoo.MultiheadAttention(E, HEADS, kind="relu", **kw)
    assert isinstance(ours, nn.MultiheadAttention)
    assert {a: getattr(ours, a) for a in ATTRIBUTES} == {a: getattr(ref, a) for a in ATTRIBUTES}
    for name in ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight", "in_proj_bias",
                 "bias_k", "bias_v"):
        a, b = getattr(ref, name), getattr(ours, name)
        assert (a is None) == (b is None) and (a is None or a.shape == b.shape), name
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in ref.state_dict().items()}
    assert type(ours.out_proj) is type(ref.out_proj)


EXTRA = {"bias_kv": dict(add_bias_kv=True), "zero_attn": dict(add_zero_attn=True),
         "both": dict(add_bias_kv=True, add_zero_attn=True)}
EXTRA_MASKS = {
    "none": lambda B: {},
    "key padding": lambda B: {"key_padding_mask": torch.tensor([[False] * (S - 2) + [True] * 2, [False] * S])},
    "bool mask": lambda B: {"attn_mask": torch.rand(L, S, generator=torch.Generator().manual_seed(4)) < 0.4},
    "float (B*H) mask": lambda B: {"attn_mask": torch.randn(B * HEADS, L, S, generator=torch.Generator().manual_seed(5),
                                                           dtype=torch.float64)},
}


@pytest.mark.parametrize("masks", list(EXTRA_MASKS))
@pytest.mark.parametrize("extra", list(EXTRA))
@pytest.mark.parametrize("batch_first", [True, False])
def test_bias_kv_and_zero_attn_match_torch(batch_first, extra, masks):
    """Cross-attention (L != S); a row whose every real key is masked still sees the extra keys."""
    ref, ours = _pair(batch_first, **EXTRA[extra])
    q, k, v = _inputs(True, batch_first, cross=True)
    kw = EXTRA_MASKS[masks](2)
    if "attn_mask" in kw and kw["attn_mask"].dtype == torch.bool:
        kw["attn_mask"][0] = True  # query 0: no real key left
    _compare(ref, ours, (q, k, v), **kw)


@pytest.mark.parametrize("extra", list(EXTRA))
def test_bias_kv_and_zero_attn_with_the_causal_hint_match_torch(extra):
    """Every query sees the extra keys, as in torch's need_weights=True path and its mask-only call.
    (torch's need_weights=False call with the is_causal hint and no padding mask hands SDPA a top-left
    causal flag over the extended keys, which hides them from all but the last query.)"""
    ref, ours = _pair(True, **EXTRA[extra])
    q, _, _ = _inputs(True, True, cross=False)
    mask = nn.Transformer.generate_square_subsequent_mask(L, dtype=torch.float64)
    want = ref(q, q, q, attn_mask=mask, is_causal=True, need_weights=True, average_attn_weights=False)
    torch.testing.assert_close(ref(q, q, q, attn_mask=mask, need_weights=False)[0], want[0], **TOL)
    for need_weights in (True, False):
        got = ours(q, q, q, attn_mask=mask, is_causal=True, need_weights=need_weights, average_attn_weights=False)
        torch.testing.assert_close(got[0], want[0], **TOL)
        if need_weights:
            torch.testing.assert_close(got[1], want[1], **TOL)


def _heads(module, x, which):
    """(B, H, N, hd) projection of batch-first x by the module's in_proj, written out here."""
    w, b = module.in_proj_weight.chunk(3)[which], module.in_proj_bias.chunk(3)[which]
    return (x @ w.T + b).view(x.shape[0], x.shape[1], HEADS, E // HEADS).transpose(1, 2)


@pytest.mark.parametrize("kind", attnzoo.ops.variant.names())
def test_bias_kv_and_zero_attn_for_every_kind(kind):
    """Every kind sees the extra keys as keys like any other: the module equals the kind's function on
    the projected keys with bias_k, bias_v and a zero key/value appended (torch's layout) and the key
    padding mask padded with 'take part'. Sinkhorn with is_causal: row i is Sinkhorn on queries 0..i
    and the extra keys plus keys 0..i (each prefix, by its definition)."""
    torch.manual_seed(0)
    mha = attnzoo.MultiheadAttention(E, HEADS, batch_first=True, kind=kind, add_bias_kv=True, add_zero_attn=True,
                                     dtype=torch.float64).eval()
    with torch.no_grad():
        for p in mha.parameters():
            p.normal_(0, 0.3)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(2, L, E, generator=g, dtype=torch.float64), torch.randn(2, S, E, generator=g, dtype=torch.float64)
    pad = torch.tensor([[False] * (S - 2) + [True] * 2, [False] * S])
    q, k, v = _heads(mha, x, 0), _heads(mha, y, 1), _heads(mha, y, 2)
    bias_k, bias_v = (t.view(1, HEADS, 1, E // HEADS).expand(2, -1, -1, -1) for t in (mha.bias_k, mha.bias_v))
    zero = torch.zeros(2, HEADS, 1, E // HEADS, dtype=torch.float64)
    k_all, v_all = torch.cat([k, bias_k, zero], 2), torch.cat([v, bias_v, zero], 2)
    keep = torch.cat([~pad, torch.ones(2, 2, dtype=torch.bool)], 1).view(2, 1, 1, S + 2)
    fn = AF.VARIANT_FUNCTIONS[kind]

    def merged(heads):
        return heads.transpose(1, 2).reshape(2, -1, E) @ mha.out_proj.weight.T + mha.out_proj.bias

    want = merged(fn(q, k_all, v_all, attn_mask=keep))
    got, weights = mha(x, y, y, key_padding_mask=pad, average_attn_weights=False)
    torch.testing.assert_close(got, want, **TOL)
    eye = torch.eye(S + 2, dtype=torch.float64).expand(2, HEADS, S + 2, S + 2)
    torch.testing.assert_close(weights, fn(q, k_all, eye, attn_mask=keep), **TOL)
    if kind == "sinkhorn":
        qs, ks, vs = _heads(mha, x, 0), _heads(mha, x, 1), _heads(mha, x, 2)
        rows = [fn(qs[:, :, :i + 1], torch.cat([ks[:, :, :i + 1], bias_k, zero], 2),
                   torch.cat([vs[:, :, :i + 1], bias_v, zero], 2))[:, :, -1:] for i in range(L)]
        got = mha(x, x, x, is_causal=True, need_weights=False)[0]
        torch.testing.assert_close(got, merged(torch.cat(rows, 2)), **TOL)


def _dropped_weights_and_output(module, x):
    """Per-head weights and output in training with dropout, and the output the weights imply."""
    out, w = module(x, x, x, average_attn_weights=False)
    vh = _heads(module, x, 2)
    implied = (w @ vh).transpose(1, 2).reshape(x.shape[0], -1, E) @ module.out_proj.weight.T + module.out_proj.bias
    return out, w, implied


@pytest.mark.parametrize("module", ["torch", "attnzoo"])
def test_weights_in_training_are_after_dropout_as_torch_returns_them(module):
    """torch returns the attention weights after dropout, and its output is those weights times v.
    attnzoo.MultiheadAttention does the same; checked on torch's module too, so the test states
    torch's meaning."""
    torch.manual_seed(0)
    cls = nn.MultiheadAttention if module == "torch" else attnzoo.MultiheadAttention
    mha = cls(E, HEADS, dropout=0.5, batch_first=True, dtype=torch.float64)
    x = torch.randn(2, L, E, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    clean = mha.eval()(x, x, x, average_attn_weights=False)[1]
    out, w, implied = _dropped_weights_and_output(mha.train(), x)
    dropped = w == 0
    assert 0.3 < dropped.double().mean() < 0.7, "about half the weights dropped"
    torch.testing.assert_close(w[~dropped], (clean / 0.5)[~dropped], **TOL)  # kept ones scaled by 1/(1-p)
    torch.testing.assert_close(out, implied, **TOL)


def test_nested_tensors_are_refused_by_name():
    mha = attnzoo.MultiheadAttention(E, HEADS, batch_first=True)
    nested = torch.nested.nested_tensor([torch.randn(3, E), torch.randn(5, E)])
    with pytest.raises(NotImplementedError, match="nested tensors.*enable_nested_tensor=False"):
        mha(nested, nested, nested)
    # the way nested tensors arrive: an encoder built with torch's attention (its nested-tensor path is
    # decided then), given attnzoo's afterwards and run in inference with padding
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(E, 4, 32, dropout=0.0, batch_first=True), 1).eval()
    encoder.layers[0].self_attn = attnzoo.MultiheadAttention(E, 4, batch_first=True)
    with torch.no_grad(), pytest.raises(NotImplementedError, match="nested tensors"):
        encoder(torch.randn(2, 5, E), src_key_padding_mask=torch.tensor([[False] * 5, [False] * 3 + [True] * 2]))


def test_encoder_layer_inference_fast_path_does_not_bypass_the_kernel():
    """nn.TransformerEncoderLayer runs torch's fused softmax on nn.MultiheadAttention's weights in
    inference (no grad, eval) when _qkv_same_embed_dim is True, which it now is: the kernel must still
    run (the module's hook turns that path off). With gradients on torch never takes that path."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(E + 4, 4, 32, dropout=0.0, batch_first=True)
    layer.self_attn = attnzoo.MultiheadAttention(E + 4, 4, batch_first=True, kind="relu")
    layer.eval()
    x = torch.randn(2, 5, E + 4)
    with_grad = layer(x)
    with torch.no_grad():
        assert torch.equal(layer(x), with_grad)
        layer.self_attn.kind = "softmax"
        softmax = layer(x)
    assert (softmax - with_grad).abs().max() > 1e-3
