"""Packed sequences (padding-free fine-tuning) in a swapped Hugging Face model: three sequences in one
row of a batch of one give, for every variant, the logits of the three sequences run on their own,
through each route the sequences arrive by: transformers' flash kwargs (cu_seq_lens_q/k, max_length_q/k,
with a cache object present as in a default forward), restarting position_ids (use_cache=False, as in
training) and a block-diagonal mask alone. A tiny Llama with grouped heads and GPT-2, float64."""
from __future__ import annotations

import pytest
import torch

import attnzoo

from .swap_helpers import VARIANTS, max_diff, reference_kernels  # noqa: F401

transformers = pytest.importorskip("transformers", minversion="5.0")
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM  # noqa: E402

from attnzoo.adapters import hf_packed  # noqa: E402

E, HEADS, VOCAB = 32, 4, 40
LENGTHS = [3, 1, 5]
EXACT = 1e-10            # float64; a sequence that saw another moves its logits by ~1e-2


def llama():
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=E, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=32,
                                        attention_dropout=0.0))


def gpt2():
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=E, n_layer=2, n_head=HEADS, n_positions=32,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None,
                                      eos_token_id=None))


MODELS = {"llama": llama, "gpt2": gpt2}


def swapped(make, spec):
    torch.manual_seed(0)
    model = attnzoo.swap(make().double().eval(), spec)
    g = torch.Generator().manual_seed(1)  # parameters a variant adds start at zero: draw them
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "attnzoo_kernel" in name:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def packed_batch():
    ids = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(10 + i)) for i, n in enumerate(LENGTHS)]
    cu = torch.tensor([0] + torch.tensor(LENGTHS).cumsum(0).tolist(), dtype=torch.int32)
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    return ids, torch.cat(ids)[None], positions, cu


def block_mask(cu):
    seq = torch.searchsorted(cu[1:].long(), torch.arange(int(cu[-1])), right=True)
    return ((seq[:, None] == seq[None, :]) & torch.ones(len(seq), len(seq), dtype=torch.bool).tril())[None, None]


ROUTES = ["kwargs", "position_ids", "block_mask"]


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("spec", VARIANTS)
@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_packed_row_equals_the_sequences_alone(model_name, spec, route, monkeypatch):
    model = swapped(MODELS[model_name], spec)
    ids, packed_ids, positions, cu = packed_batch()
    with torch.no_grad():
        alone = torch.cat([model(i[None], use_cache=False).logits[0] for i in ids])
        if route == "kwargs":
            got = model(packed_ids, position_ids=positions, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                        max_length_q=max(LENGTHS), max_length_k=max(LENGTHS)).logits[0]
        elif route == "position_ids":
            got = model(packed_ids, position_ids=positions, use_cache=False).logits[0]
        else:  # the mask alone separates the sequences: the position-id route is switched off
            monkeypatch.setattr(hf_packed, "_from_positions", lambda position_ids: None)
            got = model(packed_ids, attention_mask=block_mask(cu), position_ids=positions, use_cache=False).logits[0]
    assert max_diff(got, alone) <= EXACT


def test_packed_gradients_equal_the_sequences_alone():
    """Training is what packing is for: the gradients of the summed loss equal those of the sequences run
    one by one (Sinkhorn: the variant whose per-sequence marginals a shared row would change)."""
    ids, packed_ids, positions, cu = packed_batch()

    def grads(run):
        model = swapped(llama, "sinkhorn")
        run(model).backward()
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    alone = grads(lambda m: sum(m(i[None], labels=i[None], use_cache=False).logits.sum() for i in ids))
    packed = grads(lambda m: m(packed_ids, position_ids=positions, use_cache=False).logits.sum())
    assert max_diff(packed, alone) <= 1e-9


def test_padding_inside_a_packed_row_is_an_error():
    model = swapped(llama, "relu")
    _, packed_ids, positions, cu = packed_batch()
    padding = torch.ones_like(packed_ids)
    padding[0, -1] = 0
    with torch.no_grad(), pytest.raises(ValueError, match="also masks .* pairs inside a sequence"):
        model(packed_ids, attention_mask=padding, position_ids=positions, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
              max_length_q=max(LENGTHS), max_length_k=max(LENGTHS))


def test_half_the_flash_kwargs_is_an_error():
    model = swapped(llama, "softmax")
    _, packed_ids, positions, cu = packed_batch()
    with torch.no_grad(), pytest.raises(ValueError, match="need both cu_seq_lens_q and cu_seq_lens_k"):
        model(packed_ids, position_ids=positions, cu_seq_lens_q=cu)


def test_an_ordinary_batch_is_not_packed():
    """Continuing positions, a batch of two, a causal mask: nothing for the packed routes to find."""
    q = torch.zeros(1, HEADS, 4, 8)
    causal = torch.ones(4, 4, dtype=torch.bool).tril()[None, None]
    assert hf_packed.find(q, q, causal, True, False, {"position_ids": torch.arange(4)[None]}) is None
    assert hf_packed.find(q.expand(2, -1, -1, -1), q, None, True, False,
                          {"position_ids": torch.tensor([[0, 1, 0, 1]] * 2)}) is None


def mistral_sliding():
    from transformers import MistralConfig, MistralForCausalLM
    return MistralForCausalLM(MistralConfig(vocab_size=VOCAB, hidden_size=E, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=HEADS, num_key_value_heads=2, head_dim=8,
                                            max_position_embeddings=32, attention_dropout=0.0, sliding_window=2,
                                            bos_token_id=None, eos_token_id=None, pad_token_id=None))


def windowed_block_mask(cu, window):
    keep = block_mask(cu)
    token = torch.arange(keep.shape[-1])
    return keep & (token[None, :] > token[:, None] - window)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("spec", ["softmax", "sigmoid", "sinkhorn", "fenchel"])
def test_sliding_window_model_packed_equals_the_sequences_alone(spec, route, monkeypatch):
    """Mistral with sliding_window=2 (sequences of 3, 1 and 5 tokens: the window cuts two): each route's
    packed logits equal the sequences run alone, and the packed route is the one taken (the window goes
    to the kernel as window_size inside each sequence; it is not padding inside a sequence)."""
    model = swapped(mistral_sliding, spec)
    ids, packed_ids, positions, cu = packed_batch()
    taken = []
    real_run = hf_packed.run
    monkeypatch.setattr(hf_packed, "run", lambda *a, **kw: taken.append(kw["extras"]) or real_run(*a, **kw))
    with torch.no_grad():
        alone = torch.cat([model(i[None], use_cache=False).logits[0] for i in ids])
        assert not taken
        if route == "kwargs":
            got = model(packed_ids, position_ids=positions, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                        max_length_q=max(LENGTHS), max_length_k=max(LENGTHS)).logits[0]
        elif route == "position_ids":
            got = model(packed_ids, position_ids=positions, use_cache=False).logits[0]
        else:
            monkeypatch.setattr(hf_packed, "_from_positions", lambda position_ids: None)
            got = model(packed_ids, attention_mask=windowed_block_mask(cu, 2), position_ids=positions,
                        use_cache=False).logits[0]
    assert taken and all(e.get("window_size") == (1, 0) for e in taken)
    assert max_diff(got, alone) <= EXACT
