"""Saving a swapped Hugging Face model (issue 31 item 4): save_pretrained then attnzoo.from_pretrained gives
back the swapped model, its variants and learned parameters; a plain from_pretrained says what it dropped.
Tiny Llama models built from a config, saved to tmp_path (no download)."""
from __future__ import annotations

import json
import warnings

import pytest
import torch

import attnzoo

from .swap_helpers import reference_kernels  # noqa: F401

transformers = pytest.importorskip("transformers", minversion="5.0")
from transformers import AutoModel, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM  # noqa: E402

IDS = torch.tensor([[5, 9, 12, 3, 7, 1, 4], [7, 1, 4, 4, 8, 2, 6]])
SIGMOID = "sigmoid(learnable_bias=True)"


def llama():
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=20, max_position_embeddings=16)
    return LlamaForCausalLM(config).eval()


def swapped_and_trained():
    """Layer 0 learned sigmoid (a bias shift that is not its initial 0), layer 1 Sinkhorn with an argument."""
    model = llama()
    attnzoo.swap(model, SIGMOID, include="model.layers.0.*")
    attnzoo.swap(model, "sinkhorn(n_iters=3)", include="model.layers.1.*")
    with torch.no_grad():
        model.model.layers[0].self_attn.attnzoo_kernel.bias_shift.copy_(torch.tensor([1.5, -0.5, 2.0, 0.25]))
    return model


def logits(model, ids=IDS):
    with torch.no_grad():
        return model(ids).logits


def test_round_trip_restores_variants_and_parameters(tmp_path):
    model = swapped_and_trained()
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["attnzoo_swap"] == {"model.layers.0.self_attn": SIGMOID,
                                     "model.layers.1.self_attn": "sinkhorn(n_iters=3)"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # no dropped-kernel warning on this route
        loaded = attnzoo.from_pretrained(AutoModelForCausalLM, tmp_path)
    k0, k1 = (loaded.model.layers[i].self_attn.attnzoo_kernel for i in (0, 1))
    assert type(k0) is attnzoo.SigmoidAttention and type(k1) is attnzoo.SinkhornAttention and k1.n_iters == 3
    torch.testing.assert_close(k0.bias_shift, model.model.layers[0].self_attn.attnzoo_kernel.bias_shift,
                               rtol=0, atol=0)
    torch.testing.assert_close(logits(loaded), logits(model), rtol=0, atol=1e-6)
    # and the learned shift matters: the same model with the shift back at 0 differs
    with torch.no_grad():
        k0.bias_shift.zero_()
    assert (logits(loaded) - logits(model)).abs().max() > 1e-3


def test_loading_info_no_longer_lists_the_kernels_keys(tmp_path):
    swapped_and_trained().save_pretrained(tmp_path)
    _, info = attnzoo.from_pretrained(AutoModelForCausalLM, tmp_path, output_loading_info=True)
    assert not info["unexpected_keys"] and not info["missing_keys"]


def test_the_base_model_loads_from_a_head_models_folder(tmp_path):
    model = swapped_and_trained()
    model.save_pretrained(tmp_path)
    base = attnzoo.from_pretrained(AutoModel, tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(base(IDS).last_hidden_state, model.model(IDS).last_hidden_state,
                                   rtol=0, atol=1e-6)


def test_plain_from_pretrained_warns_naming_the_spec(tmp_path):
    swapped_and_trained().save_pretrained(tmp_path)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path)
    with pytest.warns(UserWarning, match=r"saved after attnzoo\.swap \('sigmoid\(learnable_bias=True\)', "
                                         r"'sinkhorn\(n_iters=3\)'\).*attnzoo\.from_pretrained"):
        logits(plain)
    assert not hasattr(plain.model.layers[0].self_attn, "attnzoo_kernel")


def test_a_swap_leaving_layers_out_does_not_warn(tmp_path):
    model = llama()
    attnzoo.swap(model, SIGMOID, include="model.layers.0.*")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        logits(model)             # layer 1 runs SDPA on purpose
    model.save_pretrained(tmp_path)
    loaded = attnzoo.from_pretrained(AutoModelForCausalLM, tmp_path)
    assert not hasattr(loaded.model.layers[1].self_attn, "attnzoo_kernel")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(logits(loaded), logits(model), rtol=0, atol=1e-6)


def test_unswapped_model_saves_plain_and_loader_refuses_it(tmp_path):
    model = swapped_and_trained()
    attnzoo.unswap(model)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert "attnzoo_swap" not in saved and "attn_implementation" not in saved
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        logits(AutoModelForCausalLM.from_pretrained(tmp_path))
    with pytest.raises(ValueError, match="records no attnzoo swap"):
        attnzoo.from_pretrained(AutoModelForCausalLM, tmp_path)
