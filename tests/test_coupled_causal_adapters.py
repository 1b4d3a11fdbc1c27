"""Issue 31 items 1-3 through the adapters: a swapped Sinkhorn model given a causal mask with more
structure than the triangle (packed sequences, a sliding window) gives the float64 answers of the
sequences run alone and of the prefixes, and no later token moves an earlier output. The rule itself
(ops/masking.py's coupled_causal_rows) is checked against an independent reference in
tests/test_coupled_causal_masks.py; here the adapters must hand it the mask and is_causal=True."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import attnzoo

from .swap_helpers import max_diff, reference_kernels  # noqa: F401

E, HEADS, VOCAB = 16, 2, 40
EXACT = 1e-10
SPEC = "sinkhorn(n_iters=3)"
pytestmark = pytest.mark.usefixtures("one_thread")


# ---- Hugging Face ------------------------------------------------------------------------------
def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=E, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=HEADS, num_key_value_heads=1,
                                        max_position_embeddings=32))


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=E, n_layer=1, n_head=HEADS, n_positions=32,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def _mistral(window=4):
    from transformers import MistralConfig, MistralForCausalLM
    return MistralForCausalLM(MistralConfig(vocab_size=VOCAB, hidden_size=E, intermediate_size=32,
                                            num_hidden_layers=1, num_attention_heads=HEADS, num_key_value_heads=1,
                                            max_position_embeddings=32, sliding_window=window))


def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=VOCAB, hidden_size=E, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=HEADS, num_key_value_heads=1,
                                        max_position_embeddings=32))


def _gemma2(window=4):
    from transformers import Gemma2Config, Gemma2ForCausalLM
    # attnzoo refuses HF's softcap argument: a Gemma2 without it, both layer kinds (sliding, full)
    return Gemma2ForCausalLM(Gemma2Config(vocab_size=VOCAB, hidden_size=E, intermediate_size=32, num_hidden_layers=2,
                                          num_attention_heads=HEADS, num_key_value_heads=1, head_dim=8,
                                          max_position_embeddings=32, sliding_window=window,
                                          attn_logit_softcapping=None, final_logit_softcapping=None,
                                          layer_types=["sliding_attention", "full_attention"]))


def _swapped(make):
    pytest.importorskip("transformers", minversion="5.0")
    torch.manual_seed(0)
    model = make().double().eval()
    attnzoo.swap(model, SPEC)
    return model


SEQS = (torch.tensor([3, 8, 11]), torch.tensor([7, 1, 4, 12]))


@pytest.mark.parametrize("make", [_llama, _gpt2, _mistral, _qwen2, _gemma2],
                         ids=["llama", "gpt2", "mistral", "qwen2", "gemma2"])
def test_hf_packed_sequences_equal_each_sequence_alone(make):
    """DataCollatorWithFlattening's input: batch 1, restarting position_ids, no cache (item 1)."""
    model = _swapped(make)
    ids = torch.cat(SEQS)[None]
    positions = torch.cat([torch.arange(len(s)) for s in SEQS])[None]
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=positions, use_cache=False).logits[0]
        alone = torch.cat([model(input_ids=s[None], use_cache=False).logits[0] for s in SEQS])
    assert max_diff(packed, alone) <= EXACT


@pytest.mark.parametrize("make", [_mistral, _gemma2], ids=["mistral", "gemma2"])
def test_hf_sliding_window_outputs_do_not_depend_on_later_tokens(make):
    """Item 2: with sliding_window=4 the first 4 positions' logits are those of the 4-token input."""
    model = _swapped(make)
    ids = torch.tensor([[3, 8, 11, 5, 2, 9, 14, 7, 1, 4, 12, 6]])
    with torch.no_grad():
        long = model(input_ids=ids, use_cache=False).logits
        short = model(input_ids=ids[:, :4], use_cache=False).logits
        other = ids.clone()
        other[:, 6] = 30
        moved = model(input_ids=other, use_cache=False).logits
    assert max_diff(long[:, :4], short) <= EXACT
    assert max_diff(moved[:, :6], long[:, :6]) <= EXACT, "a later token moved an earlier output"
    assert max_diff(moved[:, 6], long[:, 6]) > 1e-4


def test_hf_sliding_window_cache_generates_as_without_the_cache():
    """Mistral with sliding_window=4 and a 3-token prompt: the second cached step finds a cache that
    dropped position 0 (transformers' sliding-window layer keeps the last 3 keys). Row i's problem is
    the window's tokens (the rule), which the kept queries and the cache still hold: cached generate
    equals uncached (it was refused, first naming the wrong cause, then the sliding-window cache)."""
    model = _swapped(_mistral)
    ids = torch.tensor([[3, 8, 11]])
    out = {use_cache: model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0, use_cache=use_cache,
                                     output_logits=True, return_dict_in_generate=True)
           for use_cache in (True, False)}
    assert torch.equal(out[True].sequences, out[False].sequences)
    assert max(max_diff(a, b) for a, b in zip(out[True].logits, out[False].logits)) <= 1e-10


# ---- torch.nn ----------------------------------------------------------------------------------
def _encoder():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(E, HEADS, dim_feedforward=32, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False).double().eval()
    attnzoo.swap(model, SPEC)
    return model


def _hidden(mask_keep):
    """torch's convention: True = masked out."""
    return ~mask_keep


def _block_causal(lengths):
    seq = torch.cat([torch.full((n,), s) for s, n in enumerate(lengths)])
    n = len(seq)
    return (seq[:, None] == seq[None, :]) & torch.ones(n, n, dtype=torch.bool).tril()


def _band(n, width):
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    return (j <= i) & (j > i - width)


@pytest.mark.parametrize("hint", [False, True], ids=["mask only", "with is_causal"])
def test_torch_nn_packed_block_mask_equals_each_sequence_alone(hint):
    """Item 3: a block-causal mask through a swapped nn.TransformerEncoder."""
    model = _encoder()
    x = torch.randn(1, 7, E, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    mask = _hidden(_block_causal([3, 4]))
    with torch.no_grad():
        packed = model(x, mask=mask, is_causal=hint)
        alone = [model(x[:, lo:hi], mask=nn.Transformer.generate_square_subsequent_mask(hi - lo, dtype=x.dtype),
                       is_causal=True) for lo, hi in ((0, 3), (3, 7))]
    assert max_diff(packed, torch.cat(alone, 1)) <= EXACT


@pytest.mark.parametrize("hint", [False, True], ids=["mask only", "with is_causal"])
def test_torch_nn_causal_band_leaks_nothing_and_ignores_later_tokens(hint):
    model = _encoder()
    x = torch.randn(2, 9, E, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        long = model(x, mask=_hidden(_band(9, 3)), is_causal=hint)
        short = model(x[:, :4], mask=_hidden(_band(4, 3)), is_causal=hint)
        y = x.clone()
        y[:, 5] += 1.0
        moved = model(y, mask=_hidden(_band(9, 3)), is_causal=hint)
    assert max_diff(long[:, :4], short) <= EXACT
    assert max_diff(moved[:, :5], long[:, :5]) <= EXACT, "a later token moved an earlier output"
    assert max_diff(moved[:, 5], long[:, 5]) > 1e-4


def test_multihead_attention_with_a_causal_mask_alone():
    """attnzoo.MultiheadAttention(kind='sinkhorn') called directly in self-attention with a causal band or
    packed blocks and no is_causal hint: the mask means causality, as in a swapped nn.TransformerEncoder
    and the timm-facing layer; before, it ran as one non-causal problem and token 5 moved outputs 0..4."""
    torch.manual_seed(0)
    mha = attnzoo.MultiheadAttention(E, HEADS, kind=SPEC, batch_first=True).double().eval()
    x = torch.randn(2, 9, E, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    moved = x.clone()
    moved[:, 5] += 1.0

    def run(t, keep, **kw):
        return mha(t, t, t, attn_mask=_hidden(keep), need_weights=False, **kw)[0]

    with torch.no_grad():
        long, later = run(x, _band(9, 3)), run(moved, _band(9, 3))
        hinted = run(x, _band(9, 3), is_causal=True)
        block = run(x[:, :7], _block_causal([3, 4]))
        alone = torch.cat([run(x[:, lo:hi], _band(hi - lo, hi - lo), is_causal=True) for lo, hi in ((0, 3), (3, 7))], 1)
    assert max_diff(long[:, :5], later[:, :5]) <= EXACT, "a later token moved an earlier output"
    assert max_diff(long, hinted) <= EXACT
    assert max_diff(block, alone) <= EXACT


# ---- timm --------------------------------------------------------------------------------------
def _swapped_timm_layer():
    """A timm Attention swapped to Sinkhorn (float64) and an input of 9 tokens."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    holder = nn.Sequential(timm.layers.Attention(E, num_heads=HEADS).double().eval())
    attnzoo.swap(holder, SPEC)
    return holder[0], torch.randn(2, 9, E, dtype=torch.float64, generator=torch.Generator().manual_seed(3))


def test_timm_attention_with_a_band_and_is_causal():
    """A timm Attention swapped to Sinkhorn, called with a causal band and is_causal=True (timm's
    Attention takes attn_mask; the attnzoo layer also takes is_causal): the prefix answer."""
    layer, x = _swapped_timm_layer()
    with torch.no_grad():
        long = layer(x, attn_mask=_band(9, 3), is_causal=True)
        short = layer(x[:, :4], attn_mask=_band(4, 3), is_causal=True)
        block = layer(x[:, :7], attn_mask=_block_causal([3, 4]), is_causal=True)
        alone = torch.cat([layer(x[:, lo:hi], is_causal=True) for lo, hi in ((0, 3), (3, 7))], 1)
    assert max_diff(long[:, :4], short) <= EXACT
    assert max_diff(block, alone) <= EXACT


def test_timm_attention_with_a_causal_mask_alone():
    """The same layer given only the causal mask (a band, packed blocks), without is_causal: the mask
    means causality, as in the torch.nn and HF adapters; before, it ran as a plain mask and token 5
    moved the outputs of tokens 0..4 through Sinkhorn's column normalisation."""
    layer, x = _swapped_timm_layer()
    moved = x.clone()
    moved[:, 5] += 1.0
    with torch.no_grad():
        long = layer(x, attn_mask=_band(9, 3))
        later = layer(moved, attn_mask=_band(9, 3))
        short = layer(x[:, :4], attn_mask=_band(4, 3), is_causal=True)
        block = layer(x[:, :7], attn_mask=_block_causal([3, 4]))
        alone = torch.cat([layer(x[:, lo:hi], is_causal=True) for lo, hi in ((0, 3), (3, 7))], 1)
    assert max_diff(long[:, :5], later[:, :5]) <= EXACT
    assert max_diff(long[:, :4], short) <= EXACT
    assert max_diff(block, alone) <= EXACT


# ---- T5 preference with a static cache -----------------------------------------------------------
@pytest.mark.parametrize("make", [_llama, _gpt2], ids=["llama", "gpt2"])
def test_t5_preference_refuses_a_static_cache(make):
    """The static cache hands every max_cache_len slot to the kernel, which would shift the T5 offsets
    j - i by the unused count (issue 31: other tokens, logits off by 0.56): refused, naming the way out.
    The default (dynamic) cache still generates."""
    pytest.importorskip("transformers", minversion="5.0")
    torch.manual_seed(0)
    model = make().double().eval()
    attnzoo.swap(model, "fenchel(preference='t5')")
    ids = torch.tensor([[3, 8, 11, 5]])
    with pytest.raises(ValueError, match=r"static cache.*dynamic cache"):
        model.generate(ids, max_new_tokens=2, do_sample=False, cache_implementation="static", pad_token_id=0)
    assert model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0).shape == (1, 6)


# ---- torch.compile (issue 31 rough edge 14) -----------------------------------------------------
def test_compiled_softmax_swap_has_no_graph_break():
    """The mask split reads the mask's values; a kernel whose queries do not couple does not need it, so
    compiling a swapped Llama with a padding mask traces one graph (before: 12 breaks at bool(...))."""
    pytest.importorskip("transformers", minversion="5.0")
    torch.manual_seed(0)
    model = _llama().eval()
    attnzoo.swap(model, "softmax")
    ids = torch.tensor([[3, 8, 11, 5], [7, 1, 4, 12]])
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    torch._dynamo.reset()
    try:
        explained = torch._dynamo.explain(model)(input_ids=ids, attention_mask=mask, use_cache=False)
    finally:
        torch._dynamo.reset()
    assert explained.graph_break_count == 0, [str(b.reason)[:120] for b in explained.break_reasons]
    with torch.no_grad():
        eager = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        attnzoo.unswap(model)
        sdpa = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    assert max_diff(eager[0, 1:], sdpa[0, 1:]) < 1e-5 and max_diff(eager[1], sdpa[1]) < 1e-5
