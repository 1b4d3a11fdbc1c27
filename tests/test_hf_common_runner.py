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


# --sdist: the tree built from a transformers sdist and attnzoo's testers (benchmarks/hf_common)

# what the real test_modeling_common imports beside itself, and the names the testers import from it
STUB_COMMON = '''
from .exporters.test_export import ExportTesterMixin
from .generation.test_utils import GenerationTesterMixin

torch_device = "cpu"


def ids_tensor(shape, vocab_size):
    import torch
    return torch.randint(vocab_size, shape)


def require_torch(cls):
    return cls


class ModelTesterMixin:
    def test_tester_builds_a_tiny_model(self):
        config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        for model_class in self.all_model_classes:
            out = model_class(config)(**inputs)
            assert out[0].shape[0] == self.model_tester.batch_size
'''


def _fake_sdist(tmp_path, version="0.0.1", files=("test_modeling_common.py", "test_training_mixin.py")):
    import io
    import tarfile
    sdist = tmp_path / f"transformers-{version}.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        for name in files:
            data = (STUB_COMMON if name == "test_modeling_common.py" else "# stub\n").encode()
            info = tarfile.TarInfo(f"transformers-{version}/tests/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return sdist


def test_sdist_tree_puts_the_testers_where_test_modeling_common_imports_them(tmp_path):
    """The tree's model test files import, and run (in their own process, where `tests` is the tree's),
    against the sdist's test_modeling_common: its mixin's test builds each architecture's tiny models."""
    import subprocess
    import sys
    runner = benchmark_scripts.load("hf_common_tests")
    tree = runner.sdist_tree(_fake_sdist(tmp_path), "0.0.1", tmp_path / "tree")
    files = runner.model_test_files(str(tree), ["qwen2", "gemma2"])
    assert f'WINDOW = "{runner.WINDOW}"' in (tree / "tests" / "causal_lm_tester.py").read_text()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "tiny", *files],
                          cwd=tree, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 passed" in done.stdout, done.stdout


def test_sdist_without_the_shared_tests_is_named(tmp_path):
    runner = benchmark_scripts.load("hf_common_tests")
    sdist = _fake_sdist(tmp_path, files=("test_modeling_common.py",))
    with pytest.raises(SystemExit, match="transformers-0.0.1/tests/test_training_mixin.py"):
        runner.sdist_tree(sdist, "0.0.1", tmp_path / "tree")
    # the sdist of another version than the installed one
    with pytest.raises(SystemExit, match=r"no transformers-0\.0\.1/tests/test_modeling_common.py.*installed "
                                         r"transformers 0\.0\.1 \(it holds \['transformers-0\.0\.2'\]\)"):
        runner.sdist_tree(_fake_sdist(tmp_path, "0.0.2"), "0.0.1", tmp_path / "tree")


def test_absent_sdist_path_is_named(tmp_path):
    runner = benchmark_scripts.load("hf_common_tests")
    with pytest.raises(SystemExit, match="--sdist .*nowhere.tar.gz.*no such file"):
        runner.sdist_tree(tmp_path / "nowhere.tar.gz", "0.0.1", tmp_path / "tree")


def test_offline_download_names_the_command(tmp_path, monkeypatch):
    """pip with no index to reach (as offline): the error gives the command that failed and pip's reason."""
    runner = benchmark_scripts.load("hf_common_tests")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    with pytest.raises(SystemExit, match=r"pip download --no-deps --no-binary :all: transformers==0\.0\.1") as e:
        runner.fetch_sdist("0.0.1", tmp_path / "cache")
    assert "--sdist PATH" in str(e.value)


def test_cached_sdist_is_not_downloaded_again(tmp_path, monkeypatch):
    runner = benchmark_scripts.load("hf_common_tests")
    sdist = _fake_sdist(tmp_path)
    monkeypatch.setattr(runner.subprocess, "run", lambda *a, **k: pytest.fail("downloaded again"))
    assert runner.fetch_sdist("0.0.1", tmp_path) == sdist


def test_missing_parameterized_is_named(monkeypatch):
    import importlib.util
    runner = benchmark_scripts.load("hf_common_tests")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "parameterized" else real(name, *a))
    with pytest.raises(SystemExit, match="needs `parameterized`: .* -m pip install parameterized"):
        runner.main(["--sdist", "unused.tar.gz"])
