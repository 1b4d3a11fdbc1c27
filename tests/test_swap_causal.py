"""No future leak after attnzoo.swap, for every variant in every adapter: change only the last token
and no earlier output may move. Causality reaches every kernel as ``is_causal=True`` (plus the
padding mask): for Sinkhorn an explicit lower-triangular mask is not the same thing (its column
normalisation couples the rows), so a leak here means an adapter handed causality over as a mask.

Hugging Face: LlamaForCausalLM and GPT2LMHeadModel (decoder-only) and BART (encoder-decoder) from
tiny random configs, offline; torch.nn: TransformerEncoder / TransformerDecoder with causal masks;
timm: its Attention called with is_causal=True."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import attnzoo
from attnzoo.adapters.kernel import causal_and_rest

from .swap_helpers import VARIANTS, max_diff, reference_kernels  # noqa: F401

E, HEADS, N, VOCAB = 32, 4, 7, 40
CAUSAL_VARIANTS = [v for v in VARIANTS if v != "ot"]  # OT attention has no causal form (its own test below)
LEAK = 1e-6   # earlier outputs must not move beyond rounding (they are bitwise equal in practice)
MOVES = 1e-4  # ... while the last one must (else the test could not fail)

IDS = torch.tensor([[3, 8, 11, 5, 2, 9, 14], [7, 1, 4, 12, 8, 2, 6]])
LEFT_PAD = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]])  # HF: 1 = real token


def _last_changed(ids):
    other = ids.clone()
    other[:, -1] = (other[:, -1] + 17) % VOCAB
    return other


def _assert_no_leak(a, b, where=slice(None)):
    """a, b: (B, N, ...) outputs for inputs that differ in the last token only."""
    assert max_diff(a[where][:, :-1], b[where][:, :-1]) <= LEAK, "a later token moved an earlier output"
    assert max_diff(a[where][:, -1], b[where][:, -1]) > MOVES, "the last token changed nothing: no test"


# ---- Hugging Face ------------------------------------------------------------------------------
transformers = pytest.importorskip("transformers", minversion="5.0")


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=E, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=HEADS, num_key_value_heads=2,
                                        max_position_embeddings=32, attention_dropout=0.0))


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=E, n_layer=2, n_head=HEADS, n_positions=32,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def bart():
    from transformers import BartConfig, BartForConditionalGeneration
    return BartForConditionalGeneration(BartConfig(
        vocab_size=VOCAB, d_model=E, encoder_layers=1, decoder_layers=2, encoder_attention_heads=HEADS,
        decoder_attention_heads=HEADS, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, decoder_start_token_id=1))


DECODERS = {"llama": llama, "gpt2": gpt2}


@pytest.mark.parametrize("padding", [False, True], ids=["no-mask", "left-padding"])
@pytest.mark.parametrize("variant", CAUSAL_VARIANTS)
@pytest.mark.parametrize("family", list(DECODERS))
def test_hf_decoder_only_has_no_future_leak(family, variant, padding):
    torch.manual_seed(0)
    model = attnzoo.swap(DECODERS[family](), variant).eval()
    kw = {"attention_mask": LEFT_PAD} if padding else {}
    with torch.no_grad():
        a = model(IDS, **kw).logits
        b = model(_last_changed(IDS), **kw).logits
    real = slice(1, 2) if padding else slice(None)  # row 0's padded positions carry no meaning
    _assert_no_leak(a, b, real)
    if padding:  # row 0: its real tokens (2..N-1) and the last one
        assert max_diff(a[0, 2:-1], b[0, 2:-1]) <= LEAK


@pytest.mark.parametrize("impl", ["attnzoo_sinkhorn", "attnzoo_sigmoid"])
def test_hf_registered_implementations_have_no_future_leak(impl):
    """The same through attn_implementation="attnzoo_<variant>" (no swap)."""
    attnzoo.register_hf_attention()
    torch.manual_seed(0)
    model = llama().eval()
    model.set_attn_implementation(impl)
    with torch.no_grad():
        _assert_no_leak(model(IDS, attention_mask=LEFT_PAD).logits[1:],
                        model(_last_changed(IDS), attention_mask=LEFT_PAD).logits[1:])


@pytest.mark.parametrize("variant", CAUSAL_VARIANTS)
def test_hf_encoder_decoder_has_no_future_leak(variant):
    """BART: the last decoder token must reach no earlier decoder position, neither through the
    decoder's causal self-attention nor through its cross-attention (for Sinkhorn, the column
    normalisation over the decoder's queries would carry it there)."""
    torch.manual_seed(0)
    model = attnzoo.swap(bart(), variant).eval()
    src = IDS[:, :5]
    with torch.no_grad():
        a = model(input_ids=src, decoder_input_ids=IDS).logits
        b = model(input_ids=src, decoder_input_ids=_last_changed(IDS)).logits
        _assert_no_leak(a, b)
        other_src = src.clone()
        other_src[:, 1] = 30
        c = model(input_ids=other_src, decoder_input_ids=IDS).logits
    assert max_diff(a, c) > LEAK  # the encoder's tokens do reach the decoder (through the cross-attention)


def test_hf_sinkhorn_gets_is_causal_not_a_triangle(monkeypatch):
    """What the kernel receives: is_causal=True and a per-key padding mask, never the causal square."""
    from attnzoo.adapters import hf
    seen = []
    real = hf.run_kernel

    def spy(kernel, q, k, v, *, attn_mask=None, is_causal=False, **kw):
        seen.append((None if attn_mask is None else tuple(attn_mask.shape), is_causal))
        return real(kernel, q, k, v, attn_mask=attn_mask, is_causal=is_causal, **kw)

    monkeypatch.setattr(hf, "run_kernel", spy)
    model = attnzoo.swap(llama(), "sinkhorn").eval()
    with torch.no_grad():
        model(IDS, attention_mask=LEFT_PAD)
        model(IDS)
    assert seen == [((2, 1, 1, N), True)] * 2 + [(None, True)] * 2


MASK_SPLITS = {  # name -> (mask, expected kernel mask, expected is_causal)
    "causal": (torch.ones(5, 5, dtype=torch.bool).tril(), None, True),
    "causal & padding": (torch.ones(5, 5, dtype=torch.bool).tril() & torch.tensor([0, 1, 1, 1, 1]).bool(),
                         torch.tensor([[0, 1, 1, 1, 1]]).bool(), True),
    "causal & window": (torch.ones(5, 5, dtype=torch.bool).tril() & torch.ones(5, 5, dtype=torch.bool).triu(-1),
                        "same", True),
    "bidirectional prefix": (torch.ones(5, 5, dtype=torch.bool).tril() | (torch.arange(5)[None] < 2), "same", False),
    "cache (3 queries, 5 keys)": (torch.ones(3, 5, dtype=torch.bool).tril(2), None, True),
}


def _assert_kernel_mask(got, want, mask):
    """``want``: None (no mask left), "same" (the mask itself, untouched) or the expected tensor."""
    if want is None:
        assert got is None
    elif isinstance(want, str):
        assert got is mask
    else:
        assert torch.equal(got, want)


@pytest.mark.parametrize("name", list(MASK_SPLITS))
def test_causal_and_rest(name):
    mask, want, causal = MASK_SPLITS[name]
    got, is_causal = causal_and_rest(mask, *mask.shape)
    assert is_causal == causal
    _assert_kernel_mask(got, want, mask)
    as_float = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
    got_f, is_causal_f = causal_and_rest(as_float, *mask.shape)
    assert is_causal_f == causal and (got_f is None) == (got is None)


def _band(n, width):
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    return (j <= i) & (j > i - width)


PAD = torch.tensor([0, 1, 1, 1, 1, 1]).bool()
WINDOW_SPLITS = {  # name -> (mask, the kernel's window_size, expected kernel mask ("same": the mask itself))
    "causal & band & padding": (_band(6, 3) & PAD, (2, 0), PAD[None]),
    "causal & band": (_band(6, 3), (2, 0), None),
    # the kernel applies its band itself: outside it the mask is not read
    "causal & padding, the band left to the kernel": (_band(6, 6) & PAD, (2, 0), PAD[None]),
    "a narrower band than the kernel's": (_band(6, 2) & PAD, (2, 0), "same"),
    "a key masked for one query only": (_band(6, 3) & ~((torch.arange(6)[:, None] == 3) & (torch.arange(6) == 2)),
                                        (2, 0), "same"),
    "bidirectional": (_band(6, 3) | _band(6, 3).T, (2, 0), "same"),
}


@pytest.mark.parametrize("name", list(WINDOW_SPLITS))
def test_causal_and_rest_with_the_kernels_window(name):
    """HF's sliding layers: the kernel gets window_size too, so a mask that is exactly causal AND the band
    AND per-key padding reaches it as the padding row (or None); anything else stays the mask itself."""
    mask, window, want = WINDOW_SPLITS[name]
    got, is_causal = causal_and_rest(mask, 6, 6, window)
    assert is_causal == (name != "bidirectional")
    _assert_kernel_mask(got, want, mask)
    as_float = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
    got_f, _ = causal_and_rest(as_float, 6, 6, window)
    if isinstance(want, torch.Tensor):
        assert got_f.dtype == as_float.dtype and torch.equal(got_f > float("-inf"), want)
    else:
        assert (got_f is None) == (want is None)
    if isinstance(want, torch.Tensor):  # a float bias inside the band is not padding
        biased = as_float.clone()
        biased[5, 4] = 0.5
        assert causal_and_rest(biased, 6, 6, window)[0] is biased


def test_sinkhorn_kernel_keeps_a_per_key_causal_mask_and_zeroes_the_padded_rows():
    """run_kernel hands a causal Sinkhorn call its per-key padding row as it is (a causal window can then
    be batched) and zeroes the padded tokens' rows after the call: the same outputs as the dense mask
    with those query rows masked (drop_padded_queries), right padding included, where the rule alone
    would give a padded query a non-zero row of its own."""
    from attnzoo.adapters.kernel import kernel_layer, run_kernel
    from attnzoo.adapters.spec import resolve
    layer = kernel_layer(resolve("sinkhorn(n_iters=2)", {}), 8, 2, 4).double()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 6, 4, generator=g, dtype=torch.float64) for _ in range(3))
    keys = torch.tensor([[1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1]]).bool()[:, None, None, :]
    dense = (keys & torch.ones(6, 6, dtype=torch.bool).tril()).contiguous()
    for window in (None, (2, 0)):
        extras = None if window is None else {"window_size": window}
        with attnzoo.use_backend("reference"):
            got = run_kernel(layer, q, k, v, attn_mask=keys, is_causal=True, self_attention=True, extras=extras)
            want = run_kernel(layer, q, k, v, attn_mask=dense, is_causal=True, self_attention=True, extras=extras)
            rule = layer.attend(q, k, v, attn_mask=keys, is_causal=True, x=q, **(extras or {}))
        assert max_diff(got, want) <= 1e-12
        assert got[0, :, 4:].abs().max() == 0 and got[1, :, 0].abs().max() == 0
        assert rule[0, :, 4:].abs().min() > 0   # what the zeroing changes: the padded rows alone
        assert max_diff(rule[0, :, :4], got[0, :, :4]) <= 1e-12


# ---- torch.nn ----------------------------------------------------------------------------------
def _tokens(n=N, seed=1):
    return torch.randn(2, n, E, generator=torch.Generator().manual_seed(seed))


def _last_moved(x):
    y = x.clone()
    y[:, -1] += 1.0
    return y


@pytest.mark.parametrize("how", ["mask", "mask+is_causal"])
@pytest.mark.parametrize("variant", CAUSAL_VARIANTS)
def test_torch_encoder_has_no_future_leak(variant, how):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(E, HEADS, 64, dropout=0.0, batch_first=True)
    model = attnzoo.swap(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), variant).eval()
    causal = nn.Transformer.generate_square_subsequent_mask(N)
    kw = {"is_causal": True} if how == "mask+is_causal" else {}
    x = _tokens()
    with torch.no_grad():
        _assert_no_leak(model(x, mask=causal, **kw), model(_last_moved(x), mask=causal, **kw))


@pytest.mark.parametrize("variant", CAUSAL_VARIANTS)
def test_torch_decoder_has_no_future_leak(variant):
    torch.manual_seed(0)
    layer = nn.TransformerDecoderLayer(E, HEADS, 64, dropout=0.0, batch_first=True)
    model = attnzoo.swap(nn.TransformerDecoder(layer, 2), variant).eval()
    causal = nn.Transformer.generate_square_subsequent_mask(N)
    x, memory = _tokens(), _tokens(5, seed=2)
    pad = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    with torch.no_grad():
        a = model(x, memory, tgt_mask=causal, tgt_is_causal=True, memory_key_padding_mask=pad)
        b = model(_last_moved(x), memory, tgt_mask=causal, tgt_is_causal=True, memory_key_padding_mask=pad)
    _assert_no_leak(a, b)
    attnzoo.unswap(model)
    assert all(not layer._forward_pre_hooks for layer in model.layers)  # the cross-attention hook goes too


# ---- timm --------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", CAUSAL_VARIANTS)
def test_timm_attention_has_no_future_leak(variant):
    timm_layers = pytest.importorskip("timm.layers")
    torch.manual_seed(0)
    holder = attnzoo.swap(nn.ModuleDict({"attn": timm_layers.Attention(E, num_heads=HEADS, qkv_bias=True)}),
                          variant).eval()
    attn = holder["attn"]
    assert type(attn).__module__.startswith("attnzoo")
    x = _tokens()
    with torch.no_grad():
        _assert_no_leak(attn(x, is_causal=True), attn(_last_moved(x), is_causal=True))


def test_ot_refuses_causal_rather_than_leaking():
    """OT attention has no causal form: asked for one it raises instead of mixing in later tokens."""
    model = attnzoo.swap(nn.TransformerEncoder(nn.TransformerEncoderLayer(E, HEADS, 64, dropout=0.0,
                                                                          batch_first=True), 1,
                                               enable_nested_tensor=False), "ot").eval()
    x = _tokens()
    try:
        a = model(x, mask=nn.Transformer.generate_square_subsequent_mask(N), is_causal=True)
    except (ValueError, NotImplementedError) as e:
        assert "causal" in str(e)
        return
    b = model(_last_moved(x), mask=nn.Transformer.generate_square_subsequent_mask(N), is_causal=True)
    _assert_no_leak(a, b)
