"""Cached decoding and the packed route (issue 30: "cached decoding is unchanged").

A cached decoding step never takes the packed route, after an ordinary prefill (``generate``) or after
a packed one. Sinkhorn and Fenchel's context preference, which read more than the cache about the
earlier positions, refuse a cached step after a packed prefill, naming it. After a packed prefill the cache holds every sequence's keys back to back and the new
token attends to all of them: what transformers' flash path does (a one-position step is never read as
packed; ``modeling_flash_attention_utils._is_packed_sequence``), checked against transformers' own
SDPA attention on a one-layer Llama, whose cache does not depend on the prefill's attention (the
prefill's logits differ there: with a cache object HF's SDPA lets the packed sequences see each
other). float64."""
from __future__ import annotations

import pytest
import torch

import attnzoo

transformers = pytest.importorskip("transformers", minversion="5.0")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from attnzoo.adapters import hf_packed  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, LENGTHS = 40, [3, 1, 5]


def llama(layers, implementation="sdpa"):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         attention_dropout=0.0, attn_implementation=implementation)
    return LlamaForCausalLM(config).double().eval()


@pytest.fixture
def packed_runs(monkeypatch):
    """The packed route's calls (one per layer per forward that takes it)."""
    runs = []
    real = hf_packed.run
    monkeypatch.setattr(hf_packed, "run", lambda *a, **kw: runs.append(1) or real(*a, **kw))
    return runs


def test_generate_after_an_ordinary_prefill_never_takes_the_packed_route(packed_runs):
    model = attnzoo.swap(llama(2), "softmax")
    prompt = torch.tensor([[3, 8, 11, 5, 2]])
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=4, do_sample=False, use_cache=True)
    assert out.shape == (1, 9) and not packed_runs


def test_a_cached_step_after_a_packed_prefill_attends_to_every_cached_token(packed_runs):
    ids = torch.tensor([[3, 8, 11, 7, 1, 4, 12, 6, 9]])
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    step, step_position = torch.tensor([[5]]), torch.tensor([[LENGTHS[-1]]])
    hf = llama(1)
    ours = attnzoo.swap(llama(1), "softmax")
    logits = {}
    with torch.no_grad():
        for name, model in (("hf", hf), ("attnzoo", ours)):
            prefill = model(ids, position_ids=positions, use_cache=True)
            runs_before_step = len(packed_runs)
            logits[name] = model(step, position_ids=step_position, cache=prefill.past_key_values,
                                 use_cache=True).logits[0, -1]
            assert len(packed_runs) == runs_before_step, "the cached step took the packed route"
    assert len(packed_runs) == 1                     # attnzoo's packed prefill, one layer
    torch.testing.assert_close(logits["attnzoo"], logits["hf"], atol=1e-10, rtol=1e-10)
    # the step does see the earlier sequences: the first one's tokens move its logits
    other = ids.clone()
    other[0, 0] = 30
    with torch.no_grad():
        moved = ours(step, position_ids=step_position, use_cache=True,
                     cache=ours(other, position_ids=positions, use_cache=True).past_key_values).logits[0, -1]
    assert (moved - logits["attnzoo"]).abs().max() > 1e-6


@pytest.mark.parametrize("spec", ["sinkhorn", "fenchel(preference='context')"])
def test_a_cached_step_after_a_packed_prefill_is_refused_where_the_kernel_needs_more_than_the_cache(spec):
    """Sinkhorn reads the earlier positions' queries, Fenchel's context their tokens: a packed prefill
    keeps neither per sequence, so the step says so instead of answering otherwise."""
    model = attnzoo.swap(llama(1), spec)
    ids = torch.tensor([[3, 8, 11, 7, 1, 4, 12, 6, 9]])
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    with torch.no_grad():
        prefill = model(ids, position_ids=positions, use_cache=True)
        with pytest.raises(ValueError, match="packed row of several sequences"):
            model(torch.tensor([[5]]), position_ids=torch.tensor([[LENGTHS[-1]]]), cache=prefill.past_key_values,
                  use_cache=True)
