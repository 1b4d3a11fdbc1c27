"""attnzoo in Hugging Face architectures beyond the ones tests/test_swap_hf*.py build: Mistral, Qwen2
and Phi-3 with a sliding window shorter than the sequence, Gemma2 (sliding layers, logit softcapping),
GPT-NeoX, T5 (relative position bias), Whisper, CLIP, DistilBERT, RoBERTa, ModernBERT (local
attention), and Falcon, whose attention does not call transformers' AttentionInterface.

The reference is attention written from the formula in float64 (scores * scaling + T5's position
bias, Gemma's softcap, transformers' own mask), registered with transformers as one more
implementation: transformers' "eager" computes the softmax in float32 in several of these models, so
it is no float64 reference. Tiny random configs, no downloads."""
from __future__ import annotations

import warnings

import pytest
import torch

import attnzoo

from .swap_helpers import max_diff, reference_kernels  # noqa: F401

transformers = pytest.importorskip("transformers", minversion="5.0")
import transformers as T  # noqa: E402
from transformers import AttentionInterface  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask  # noqa: E402

E, HEADS, VOCAB, N = 32, 4, 60, 9
WINDOW = 4  # shorter than N: a window replaced by plain causal attention changes the outputs
EXACT = 1e-12
IDS = torch.randint(3, VOCAB, (2, N), generator=torch.Generator().manual_seed(3))
LEFT_PAD = torch.ones(2, N, dtype=torch.long)
LEFT_PAD[0, :3] = 0  # HF: 1 = real token
REAL = LEFT_PAD.bool()
DECODER_IDS = torch.randint(3, VOCAB, (2, 5), generator=torch.Generator().manual_seed(4))
AUDIO = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
PIXELS = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
REFERENCE = "attnzoo_audit_reference"


def _reference_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                         softcap=None, position_bias=None, **kwargs):
    """softmax(q k^T * scaling + position_bias, softcapped, masked) v in the inputs' dtype."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scores = query @ key.transpose(-1, -2) * (query.shape[-1] ** -0.5 if scaling is None else scaling)
    if position_bias is not None:
        scores = scores + position_bias
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None:
        scores = (scores.masked_fill(~attention_mask, float("-inf")) if attention_mask.dtype == torch.bool
                  else scores + attention_mask)
    weights = scores.softmax(-1).nan_to_num(0.0)  # a row with no key left: zeros, as attnzoo
    return (weights @ value).transpose(1, 2).contiguous(), None


def _reference_mask(*args, **kwargs):
    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


AttentionInterface.register(REFERENCE, _reference_attention)
AttentionMaskInterface.register(REFERENCE, _reference_mask)


def _decoder(**kw):
    return dict(vocab_size=VOCAB, hidden_size=E, intermediate_size=64, num_hidden_layers=2, num_attention_heads=HEADS,
                num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=None,
                eos_token_id=None, **kw)


def mistral(**kw):
    return T.MistralForCausalLM(T.MistralConfig(**_decoder(**{"sliding_window": WINDOW, **kw})))


def qwen2(**kw):
    return T.Qwen2ForCausalLM(T.Qwen2Config(**_decoder(**{"use_sliding_window": True, "sliding_window": WINDOW,
                                                           "max_window_layers": 0, **kw})))


def phi3(**kw):
    return T.Phi3ForCausalLM(T.Phi3Config(**_decoder(**{"sliding_window": WINDOW, **kw})))


def gemma2(**kw):  # layers alternate sliding and full attention
    return T.Gemma2ForCausalLM(T.Gemma2Config(**_decoder(**{"head_dim": 8, "sliding_window": WINDOW,
                                                             "attn_logit_softcapping": None, **kw})))


def gpt_neox(**kw):
    return T.GPTNeoXForCausalLM(T.GPTNeoXConfig(vocab_size=VOCAB, hidden_size=E, intermediate_size=64,
                                                num_hidden_layers=2, num_attention_heads=HEADS,
                                                max_position_embeddings=64, pad_token_id=0, **kw))


def t5(**kw):
    return T.T5ForConditionalGeneration(T.T5Config(
        vocab_size=VOCAB, d_model=E, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=HEADS,
        relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=None, **kw))


def whisper(**kw):
    return T.WhisperForConditionalGeneration(T.WhisperConfig(
        vocab_size=VOCAB, num_mel_bins=8, d_model=E, encoder_layers=1, decoder_layers=2, encoder_attention_heads=HEADS,
        decoder_attention_heads=HEADS, encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=8,
        max_target_positions=32, pad_token_id=0, bos_token_id=1, eos_token_id=None, decoder_start_token_id=1,
        begin_suppress_tokens=None, suppress_tokens=None, **kw))


def clip(**kw):
    return T.CLIPModel(T.CLIPConfig(
        text_config=dict(vocab_size=VOCAB, hidden_size=E, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=HEADS, max_position_embeddings=16, eos_token_id=2, pad_token_id=0,
                         bos_token_id=1),
        vision_config=dict(hidden_size=E, intermediate_size=64, num_hidden_layers=2, num_attention_heads=HEADS,
                           image_size=16, patch_size=4), projection_dim=16, **kw))


def distilbert(**kw):
    return T.DistilBertModel(T.DistilBertConfig(vocab_size=VOCAB, dim=E, n_layers=2, n_heads=HEADS, hidden_dim=64,
                                                max_position_embeddings=32, **kw))


def roberta(**kw):
    return T.RobertaModel(T.RobertaConfig(vocab_size=VOCAB, hidden_size=E, num_hidden_layers=2,
                                          num_attention_heads=HEADS, intermediate_size=64,
                                          max_position_embeddings=40, pad_token_id=1, **kw))


def modernbert(**kw):  # layer 0 global, layers 1 and 2 local (a bidirectional window)
    return T.ModernBertModel(T.ModernBertConfig(**{
        "vocab_size": VOCAB, "hidden_size": E, "num_hidden_layers": 3, "num_attention_heads": HEADS,
        "intermediate_size": 64, "max_position_embeddings": 64, "local_attention": WINDOW,
        "global_attn_every_n_layers": 3, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
        "cls_token_id": 1, "sep_token_id": 2, **kw}))


def _decoder_outputs(m):
    return [m(IDS, attention_mask=LEFT_PAD).logits[REAL], m(IDS).logits]


def _encoder_outputs(m):
    return [m(IDS, attention_mask=LEFT_PAD).last_hidden_state[REAL], m(IDS).last_hidden_state]


ARCHITECTURES = {  # name -> (constructor, outputs compared, config change that removes the window or None)
    "mistral": (mistral, _decoder_outputs, {"sliding_window": 64}),
    "qwen2": (qwen2, _decoder_outputs, {"sliding_window": 64}),
    "phi3": (phi3, _decoder_outputs, {"sliding_window": 64}),
    "gemma2": (gemma2, _decoder_outputs, {"sliding_window": 64}),
    "gpt_neox": (gpt_neox, _decoder_outputs, None),
    "t5": (t5, lambda m: [m(input_ids=IDS, attention_mask=LEFT_PAD, decoder_input_ids=DECODER_IDS).logits], None),
    "whisper": (whisper, lambda m: [m(input_features=AUDIO, decoder_input_ids=DECODER_IDS).logits], None),
    "clip": (clip, lambda m: [m.text_model(input_ids=IDS, attention_mask=LEFT_PAD.flip(-1)).last_hidden_state,
                              m.vision_model(pixel_values=PIXELS).last_hidden_state], None),
    "distilbert": (distilbert, _encoder_outputs, None),
    "roberta": (roberta, _encoder_outputs, None),
    "modernbert": (modernbert, _encoder_outputs, {"local_attention": 64}),
}


def build(make, implementation=None, **kw):
    torch.manual_seed(0)
    model = make(**kw)
    if implementation is not None:
        model.set_attn_implementation(implementation)
    return model.double().eval()


def outputs(name, model):
    with torch.no_grad():
        return ARCHITECTURES[name][1](model)


@pytest.mark.parametrize("route", ["swap", "attn_implementation"])
@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_softmax_gives_the_original_outputs(name, route):
    make, _, no_window = ARCHITECTURES[name]
    expected = outputs(name, build(make, REFERENCE))
    if route == "swap":
        model = attnzoo.swap(build(make), "softmax", strict=True)
    else:
        model = build(make, "attnzoo_softmax")
    got = outputs(name, model)
    assert max(max_diff(a, b) for a, b in zip(got, expected)) <= EXACT
    if no_window is not None:  # the window is kept, not replaced by plain causal / full attention
        unwindowed = outputs(name, build(make, "attnzoo_softmax", **no_window))
        assert max(max_diff(a, b) for a, b in zip(got, unwindowed)) > 1e-4


@pytest.mark.parametrize("route", ["swap", "attn_implementation"])
def test_gemma2_logit_softcapping_is_computed_not_ignored(route):
    """Gemma 2's attn_logit_softcapping reaches the kernel as softcap (ops/logit_extras.py): the float64
    formula. A cap small against this tiny model's logits, so that ignoring it would show."""
    cap = {"attn_logit_softcapping": 0.002}
    expected = outputs("gemma2", build(gemma2, REFERENCE, **cap))
    model = (attnzoo.swap(build(gemma2, **cap), "softmax", strict=True) if route == "swap"
             else build(gemma2, "attnzoo_softmax", **cap))
    got = outputs("gemma2", model)
    assert max(max_diff(a, b) for a, b in zip(got, expected)) <= EXACT
    uncapped = outputs("gemma2", build(gemma2, REFERENCE))
    assert max(max_diff(a, b) for a, b in zip(got, uncapped)) > 1e-6


def test_falcon_does_not_call_the_interface_and_is_reported_unsupported():
    """Not every transformers model calls the AttentionInterface (docs/swapping.md names some):
    attnzoo.swap says so by module name instead of leaving softmax in place silently."""
    model = T.FalconForCausalLM(T.FalconConfig(vocab_size=VOCAB, hidden_size=E, num_hidden_layers=2,
                                               num_attention_heads=HEADS))
    with pytest.warns(UserWarning, match="transformer.h.0.self_attention"):
        attnzoo.swap(model, "sigmoid")
    assert model.attnzoo_swap_report.unsupported == ["transformer.h.0.self_attention",
                                                      "transformer.h.1.self_attention"]
    with pytest.raises(ValueError, match="strict=True"):
        attnzoo.swap(model, "sigmoid", strict=True)


def _generate(model, use_cache, **kw):
    with torch.no_grad():
        return model.generate(**kw, do_sample=False, use_cache=use_cache, max_new_tokens=4, output_logits=True,
                              return_dict_in_generate=True)


def _assert_cache_changes_nothing(model, **kw):
    cached, recomputed = _generate(model, True, **kw), _generate(model, False, **kw)
    assert torch.equal(cached.sequences, recomputed.sequences)
    assert max(max_diff(a, b) for a, b in zip(cached.logits, recomputed.logits)) <= EXACT


def test_t5_position_bias_in_a_cached_sinkhorn_step_is_refused():
    """A cached step of a variant that couples queries re-solves the earlier positions' rows, and a
    one-row T5 position bias is the new query's bias only: it was taken for a per-key padding mask and
    applied to every earlier row, so generate(use_cache=True) gave other logits than use_cache=False
    (by ~1) without a word. Now it is refused."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = attnzoo.swap(build(t5), "sinkhorn")
    with pytest.raises(ValueError, match="position bias.*use_cache=False"):
        _generate(model, True, input_ids=IDS, attention_mask=LEFT_PAD)
    assert len(_generate(model, False, input_ids=IDS, attention_mask=LEFT_PAD).logits) == 4


@pytest.mark.parametrize("spec", ["sigmoid", "linear", "ot"])
def test_t5_row_wise_variants_decode_with_the_position_bias(spec):
    _assert_cache_changes_nothing(attnzoo.swap(build(t5), spec), input_ids=IDS, attention_mask=LEFT_PAD)


@pytest.mark.parametrize("spec", ["softmax", "sigmoid", "linear", "ot"])
def test_sliding_window_decoding_with_left_padding(spec):
    _assert_cache_changes_nothing(attnzoo.swap(build(mistral), spec), input_ids=IDS, attention_mask=LEFT_PAD)


def test_sliding_window_cached_sinkhorn_decodes_and_does_not_leak():
    """Row i of causal Sinkhorn under a window is solved over the tokens in its window (every pair of which
    the window keeps), so a cached step needs the window's earlier queries only: once refused, it now
    gives what use_cache=False gives (through attn_implementation, no swap, with left padding)."""
    model = build(mistral, "attnzoo_sinkhorn")
    changed = IDS.clone()
    changed[:, -1] = (changed[:, -1] + 17) % VOCAB
    with torch.no_grad():
        a, b = model(IDS, attention_mask=LEFT_PAD).logits, model(changed, attention_mask=LEFT_PAD).logits
    assert max_diff(a[:, :-1][REAL[:, :-1]], b[:, :-1][REAL[:, :-1]]) == 0.0
    assert max_diff(a[:, -1], b[:, -1]) > 1e-4
    _assert_cache_changes_nothing(model, input_ids=IDS, attention_mask=LEFT_PAD)


CROSS_ATTENTION = {"t5": (t5, "*EncDecAttention", dict(input_ids=IDS, attention_mask=LEFT_PAD)),
                   "whisper": (whisper, "*encoder_attn", dict(input_features=AUDIO))}


@pytest.mark.parametrize("name", list(CROSS_ATTENTION))
def test_relative_positions_are_refused_in_a_decoders_cross_attention(name):
    """fenchel(preference='t5') reads offsets j - i, bottom-right aligned on the call's Nq. In a
    decoder's cross-attention (decoder positions against encoder tokens) that made an earlier
    position's output move with the number of later decoder positions (T5: by ~1) and cached
    generation differ from use_cache=False, without a word. Refused there now; the self-attention
    modules alone take it, and then neither happens."""
    make, cross, inputs = CROSS_ATTENTION[name]
    spec = "fenchel(preference='t5', num_buckets=8, max_distance=16)"

    def swapped(**kw):
        model = attnzoo.swap(build(make), spec, **kw)
        g = torch.Generator().manual_seed(1)
        for n, p in model.named_parameters():  # the table starts at zero (uniform): it would hide the positions
            if "attnzoo_kernel.relative_bias" in n:
                p.data.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))
        return model
    with pytest.raises(ValueError, match="cross-attention"), torch.no_grad():
        swapped()(**inputs, decoder_input_ids=DECODER_IDS)
    model = swapped(exclude=cross)
    with torch.no_grad():
        full = model(**inputs, decoder_input_ids=DECODER_IDS).logits
        prefix = model(**inputs, decoder_input_ids=DECODER_IDS[:, :3]).logits
    assert max_diff(full[:, :3], prefix) <= EXACT
    _assert_cache_changes_nothing(model, **inputs)


def test_relative_positions_are_refused_in_a_torch_decoders_cross_attention():
    layer = torch.nn.TransformerDecoderLayer(E, HEADS, 64, dropout=0.0, batch_first=True)
    attnzoo.swap(layer, "fenchel(preference='t5')")
    tgt, memory = torch.randn(2, 5, E), torch.randn(2, 7, E)
    with pytest.raises(ValueError, match="cross-attention"), torch.no_grad():
        layer(tgt, memory, tgt_mask=torch.nn.Transformer.generate_square_subsequent_mask(5), tgt_is_causal=True)
