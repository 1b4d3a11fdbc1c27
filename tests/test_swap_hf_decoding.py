"""Cached decoding after attnzoo.swap gives what recomputing every position gives.

A KV cache holds the earlier positions' keys and values; Sinkhorn (a variant that couples queries)
also needs their queries, and Fenchel's context preference their tokens (adapters/decode_state.py).
Each test generates with ``use_cache=True`` and with ``use_cache=False`` (every step a full forward
over the sequence so far, which needs no cache at all) in float64, and asks for the same tokens and
logits to rounding: tiny Llama (grouped-query attention: 2 key/value heads for 4 query heads), GPT-2
and BART built from configs, offline."""
from __future__ import annotations

import copy

import pytest
import torch

import attnzoo

from .swap_helpers import VARIANTS, max_diff, reference_kernels  # noqa: F401

transformers = pytest.importorskip("transformers", minversion="5.0")
from transformers import (BartConfig, BartForConditionalGeneration, DynamicCache, GPT2Config,  # noqa: E402
                          GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM)

E, HEADS, VOCAB = 32, 4, 40
EXACT = 1e-10  # float64: the cached and recomputed logits agree to rounding (a missed query moves them ~1e-3)
IDS = torch.tensor([[3, 8, 11, 5, 2, 9, 14], [7, 1, 4, 12, 8, 2, 6]])
LEFT_PAD = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]])  # HF: 1 = real token


def llama():
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=E, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=64,
                                        attention_dropout=0.0, pad_token_id=0, bos_token_id=None, eos_token_id=None))


def gpt2():
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=E, n_layer=2, n_head=HEADS, n_positions=64,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=0,
                                      bos_token_id=None, eos_token_id=None))


def bart():
    return BartForConditionalGeneration(BartConfig(
        vocab_size=VOCAB, d_model=E, encoder_layers=1, decoder_layers=2, encoder_attention_heads=HEADS,
        decoder_attention_heads=HEADS, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=0, bos_token_id=1,
        eos_token_id=None, forced_eos_token_id=None, decoder_start_token_id=1))


DECODERS = {"llama": llama, "gpt2": gpt2}


def swapped(make, spec):
    """``make()`` swapped to ``spec`` in float64, eval mode; parameters a variant adds at zero (Fenchel's
    context net starts uniform, which would hide the tokens it reads) drawn at random."""
    torch.manual_seed(0)
    model = attnzoo.swap(make(), spec).double().eval()
    g = torch.Generator().manual_seed(1)
    for name, p in model.named_parameters():
        if "attnzoo_kernel" in name and not p.detach().any():
            p.data.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def generate_both(model, **kw):
    out = {}
    with torch.no_grad():
        for use_cache in (True, False):
            out[use_cache] = model.generate(**kw, do_sample=False, use_cache=use_cache, output_logits=True,
                                            return_dict_in_generate=True)
    return out[True], out[False]


def assert_same(cached, recomputed):
    assert torch.equal(cached.sequences, recomputed.sequences)
    assert len(cached.logits) == len(recomputed.logits)
    diff = max(max_diff(a, b) for a, b in zip(cached.logits, recomputed.logits))
    assert diff <= EXACT, f"cached decoding moved the logits by {diff:.2e}"


SPECS = VARIANTS + ["sinkhorn(n_iters=5, eps=0.5)", "fenchel(preference='context')"]


@pytest.mark.parametrize("padding", [False, True], ids=["no-mask", "left-padding"])
@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("family", list(DECODERS))
def test_greedy_generate_is_the_same_with_the_cache(family, spec, padding):
    model = swapped(DECODERS[family], spec)
    kw = {"attention_mask": LEFT_PAD} if padding else {}
    assert_same(*generate_both(model, input_ids=IDS, max_new_tokens=5, **kw))


@pytest.mark.parametrize("family", list(DECODERS))
def test_beam_search_follows_the_reordered_cache(family):
    """Beam search reorders the cache's batch rows every step (reorder_cache): the kept queries follow."""
    model = swapped(DECODERS[family], "sinkhorn")
    cached, recomputed = generate_both(model, input_ids=IDS, attention_mask=LEFT_PAD, max_new_tokens=5,
                                       num_beams=3, num_return_sequences=3, output_scores=True)
    assert_same(cached, recomputed)
    assert max_diff(cached.sequences_scores, recomputed.sequences_scores) <= EXACT


def test_prompt_lookup_crops_the_cache_and_checks_several_tokens_at_once(monkeypatch):
    """Prompt-lookup decoding proposes several tokens, runs them in one cached call and crops the cache
    back past the rejected ones: the same tokens as plain greedy decoding without a cache."""
    crops = []
    real_crop = DynamicCache.crop
    monkeypatch.setattr(DynamicCache, "crop", lambda self, n: (crops.append(n), real_crop(self, n))[1])
    model = swapped(llama, "sinkhorn")
    ids = torch.tensor([[3, 8, 11, 5, 3, 8, 11, 6, 3, 8]])
    with torch.no_grad():
        lookup = model.generate(ids, max_new_tokens=8, do_sample=False, prompt_lookup_num_tokens=3,
                                output_logits=True, return_dict_in_generate=True)
    assert any(n < 0 for n in crops), "no candidate was rejected: the crop path did not run"
    assert_same(lookup, generate_both(model, input_ids=ids, max_new_tokens=8)[1])


def test_a_reused_prompt_cache_continues_each_sequence():
    """A cache filled with a shared prompt, copied for two continuations (transformers' prompt reuse)."""
    model = swapped(llama, "sinkhorn")
    prompt = IDS[:1, :4]
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(prompt, cache=cache)
    for tail in ([9, 14], [7, 2, 2]):
        ids = torch.cat([prompt, torch.tensor([tail])], 1)
        with torch.no_grad():
            cached = model.generate(ids, cache=copy.deepcopy(cache), max_new_tokens=4, do_sample=False,
                                    output_logits=True, return_dict_in_generate=True)
        recomputed = generate_both(model, input_ids=ids, max_new_tokens=4)[1]
        assert_same(cached, recomputed)


def test_a_cache_of_another_sequence_is_refused():
    model = swapped(llama, "sinkhorn")
    first, other = DynamicCache(config=model.config), DynamicCache(config=model.config)
    with torch.no_grad():
        model(IDS[:1], cache=first)
        model(IDS[1:], cache=other)  # the layers now keep the queries of the other sequence
        with pytest.raises(ValueError, match=r"(?s)'sinkhorn'.*7 earlier position.*not those.*use_cache=False"):
            model(torch.tensor([[5]]), cache=first)
        # the sequence the layers keep goes on
        step = model(torch.tensor([[5]]), cache=other).logits[:, -1]
        full = model(torch.cat([IDS[1:], torch.tensor([[5]])], 1)).logits[:, -1]
    assert max_diff(step, full) <= EXACT


def test_caches_attnzoo_cannot_follow_are_refused():
    model = swapped(llama, "sinkhorn")
    with pytest.raises(ValueError, match=r"(?s)causality plus padding.*static cache.*use_cache=False"):
        model.generate(IDS, max_new_tokens=2, do_sample=False, cache_implementation="static")
    model.train()  # a training step with gradients on keeps nothing (it would hold the step's activations)
    cache = DynamicCache(config=model.config)
    model(IDS, cache=cache)
    with torch.no_grad(), pytest.raises(ValueError, match="nothing is kept"):
        model(torch.tensor([[5], [6]]), cache=cache)


@pytest.mark.parametrize("spec,beams", [("sinkhorn", 1), ("sinkhorn", 3), ("fenchel(preference='context')", 1)])
def test_encoder_decoder_cross_attention(spec, beams):
    """BART: the decoder's cross-attention solves each decoder prefix (Sinkhorn couples the decoder's
    queries there too), so a cached step needs the earlier decoder queries of that layer as well.
    Fenchel's context preference reads the encoder's tokens there (the keys' tokens)."""
    model = swapped(bart, spec)
    assert_same(*generate_both(model, input_ids=IDS[:, :5], max_new_tokens=5, num_beams=beams))


def test_registered_implementation_without_swap():
    """attn_implementation="attnzoo_sinkhorn" (no swap, no attnzoo_kernel child): same answer."""
    attnzoo.register_hf_attention()
    torch.manual_seed(0)
    model = llama().double().eval()
    model.set_attn_implementation("attnzoo_sinkhorn")
    assert_same(*generate_both(model, input_ids=IDS, attention_mask=LEFT_PAD, max_new_tokens=5))


def test_default_backends_float32():
    """The dispatcher's own choice (not the reference) in float32: the cached step runs one
    non-causal problem per new row, the recomputation the causal kernel; they agree to float32 rounding."""
    with attnzoo.use_backend("auto"):
        torch.manual_seed(0)
        model = attnzoo.swap(llama(), "sinkhorn").eval()
        cached, recomputed = generate_both(model, input_ids=IDS, attention_mask=LEFT_PAD, max_new_tokens=5)
    assert torch.equal(cached.sequences, recomputed.sequences)
    assert max(max_diff(a, b) for a, b in zip(cached.logits, recomputed.logits)) <= 1e-5


def test_the_functional_decode_step_the_docs_give():
    """docs/kernels_sinkhorn.md: the last row of the causal forward over N positions is the non-causal
    problem over all N queries; the last query alone (Nq = 1 < Nk) is a 1-row problem, the plain mean
    of the values. Checked against float64 Sinkhorn on the prefix written here."""
    import attnzoo.functional as AF
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 6, 4, generator=g, dtype=torch.float64) for _ in range(3))
    logits = -torch.cdist(q, k) ** 2 / (2 * 4 ** 0.5)  # cost="l2", eps = 1, scale = 1/sqrt(D)
    g_pot = torch.zeros(1, 2, 1, 6, dtype=torch.float64)
    for _ in range(3):  # n_iters = 3 (row, column) rounds, then the final row normalisation
        f = -torch.logsumexp(logits + g_pot, -1, keepdim=True)
        g_pot = -torch.logsumexp(logits + f, -2, keepdim=True)
    want = torch.softmax(logits + g_pot, -1)[..., -1:, :] @ v
    for backend in ("reference", "auto"):
        with attnzoo.use_backend(backend):
            causal_last = AF.sinkhorn(q, k, v, is_causal=True)[..., -1:, :]
            recipe = AF.sinkhorn(q, k, v)[..., -1:, :]
            alone = AF.sinkhorn(q[..., -1:, :], k, v, is_causal=True)
        torch.testing.assert_close(causal_last, want, rtol=0, atol=1e-12)
        torch.testing.assert_close(recipe, want, rtol=0, atol=1e-12)
        torch.testing.assert_close(alone, v.mean(-2, keepdim=True), rtol=0, atol=1e-12)
