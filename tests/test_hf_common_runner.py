"""benchmarks/hf_common_tests.py's plugin: in the attnzoo run, a model built with transformers' default
implementation runs attnzoo's softmax (counted), Gemma 2 included (it turns SDPA off for softcapping),
and gives what transformers' eager attention gives; everything it changed in transformers is put back
when the session ends. Tiny float32 models from their config classes (no download): in float64 HF's eager
attention turns a padded query's row to NaN (its finfo(float64).min logits become -inf in its float32 softmax)."""
from __future__ import annotations

import pytest
import torch

from . import benchmark_scripts

transformers = pytest.importorskip("transformers", minversion="5.0")
from transformers import Gemma2Config, Gemma2Model, Qwen2Config, Qwen2Model  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface  # noqa: E402
from transformers.modeling_utils import AttentionInterface  # noqa: E402

SMALL = dict(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=64, attention_dropout=0.0, pad_token_id=0)
IDS = torch.tensor([[3, 8, 11, 5, 2, 9, 14], [7, 1, 4, 12, 8, 2, 6]])
LEFT_PAD = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]])


def _configs():
    return {"qwen2": (Qwen2Model, Qwen2Config(**SMALL)),
            # a cap of 0.5 on logits drawn of size ~1: a kernel without it would be far off
            "gemma2": (Gemma2Model, Gemma2Config(**SMALL, attn_logit_softcapping=0.5, query_pre_attn_scalar=8))}


def _hidden(model_class, config, implementation=None):
    torch.manual_seed(0)
    model = model_class._from_config(config, attn_implementation=implementation, dtype=torch.float32).eval()
    with torch.no_grad():   # weights larger than HF's init, whose logits of ~1e-3 would hide the cap
        for p in model.parameters():
            p.normal_(0, 0.3)
    with torch.no_grad():
        return model, model(IDS, attention_mask=LEFT_PAD).last_hidden_state


@pytest.fixture
def route():
    runner = benchmark_scripts.load("hf_common_tests")
    attention, mask = AttentionInterface._global_mapping["sdpa"], AttentionMaskInterface._global_mapping["sdpa"]
    plugin = runner.AttentionRoute("attnzoo", ["qwen2", "gemma2"])
    plugin.pytest_configure(None)
    yield plugin
    plugin.pytest_unconfigure(None)
    assert AttentionInterface._global_mapping["sdpa"] is attention
    assert AttentionMaskInterface._global_mapping["sdpa"] is mask
    assert Gemma2Model._supports_sdpa is False


@pytest.mark.parametrize("family", ["qwen2", "gemma2"])
def test_default_implementation_runs_attnzoo_as_eager_does(route, family):
    model_class, config = _configs()[family]
    model, got = _hidden(model_class, config)
    assert model.config._attn_implementation == "sdpa"
    assert route.calls == config.num_hidden_layers   # one attnzoo call per layer
    _, want = _hidden(model_class, config, "eager")
    assert route.calls == config.num_hidden_layers   # eager never reaches it
    valid = LEFT_PAD.bool()   # padded queries' rows are not compared (HF's eager and SDPA differ there)
    torch.testing.assert_close(got[valid], want[valid], rtol=0, atol=2e-5)


def test_tree_without_model_tests_is_named(tmp_path):
    runner = benchmark_scripts.load("hf_common_tests")
    with pytest.raises(SystemExit, match="tests/models/qwen2/test_modeling_qwen2.py"):
        runner.model_test_files(str(tmp_path), ["qwen2"])
