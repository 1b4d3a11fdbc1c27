"""Grouped-query attention after attnzoo.swap: a Llama with 2 key/value heads for 4 query heads hands
the kernel its keys and values as they are (enable_gqa=True, no copies), and computes what the same
Llama with every key/value head written out per query head computes (Hugging Face's repeat_kv
convention: key/value head j serves query heads j*g .. j*g+g-1), for every variant. float64."""
from __future__ import annotations

import pytest
import torch

import attnzoo

from .swap_helpers import VARIANTS, max_diff, reference_kernels  # noqa: F401

transformers = pytest.importorskip("transformers", minversion="5.0")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

HEADS, KV_HEADS, E = 4, 2, 32
IDS = torch.tensor([[3, 8, 11, 5, 2, 9, 14], [7, 1, 4, 12, 8, 2, 6]])
LEFT_PAD = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]])


def llama(kv_heads):
    return LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=E, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=HEADS, num_key_value_heads=kv_heads,
                                        max_position_embeddings=32, attention_dropout=0.0)).double().eval()


def written_out(grouped):
    """The same model with num_key_value_heads = num_attention_heads: each k/v projection's head
    repeated for the query heads it serves."""
    full = llama(HEADS)
    state = grouped.state_dict()
    head_dim, group = E // HEADS, HEADS // KV_HEADS
    for name, w in list(state.items()):
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            state[name] = w.view(KV_HEADS, head_dim, E).repeat_interleave(group, 0).reshape(HEADS * head_dim, E)
    full.load_state_dict(state)
    return full


def test_the_kernel_gets_the_grouped_heads(monkeypatch):
    from attnzoo.adapters import hf
    seen = []
    real = hf.run_kernel

    def spy(kernel, q, k, v, **kw):
        seen.append((q.shape[1], k.shape[1], v.shape[1], kw.get("enable_gqa")))
        return real(kernel, q, k, v, **kw)

    monkeypatch.setattr(hf, "run_kernel", spy)
    torch.manual_seed(0)
    model = attnzoo.swap(llama(KV_HEADS), "sigmoid")
    with torch.no_grad():
        model(IDS)
    assert seen == [(HEADS, KV_HEADS, KV_HEADS, True)] * 2


@pytest.mark.parametrize("spec", VARIANTS + ["l2(tie_qk=True)", "fenchel(preference='context')"])
def test_grouped_heads_compute_the_written_out_model(spec):
    torch.manual_seed(0)
    grouped = llama(KV_HEADS)
    full = written_out(grouped)
    with torch.no_grad():
        unswapped = grouped(IDS, attention_mask=LEFT_PAD).logits
        assert max_diff(full(IDS, attention_mask=LEFT_PAD).logits, unswapped) <= 1e-12  # the construction
        attnzoo.swap(grouped, spec)
        attnzoo.swap(full, spec)
        g = torch.Generator().manual_seed(1)  # parameters a variant adds start at zero: draw them, alike
        for (name, p), (_, q) in zip(grouped.named_parameters(), full.named_parameters()):
            if "attnzoo_kernel" in name:
                q.copy_(p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype)))
        got = grouped(IDS, attention_mask=LEFT_PAD).logits
        want = full(IDS, attention_mask=LEFT_PAD).logits
    real = LEFT_PAD.bool()
    assert max_diff(got[real], want[real]) <= 1e-10
    if spec in ("softmax", "masked", "multihead"):  # the same attention as Hugging Face's own
        assert max_diff(got[real], unswapped[real]) <= 1e-10
