"""The model benchmark (`attnzoo bench --models`) on tiny configurations of its four models, on the CPU:
the swap really happens and changes nothing else, every case gives a row with consistent figures,
the step profile counts what ran, deadlines turn a slow case into a skipped row, the command line and
the rendered pages. Not speed: nothing here compares two timings."""
from __future__ import annotations

import json
import time

import pytest
import torch

from attnzoo import cli
from attnzoo.bench import model_bench
from attnzoo.bench.model_bench import ModelBenchConfig
from attnzoo.bench.model_zoo import MODELS, OWN, model_spec
from attnzoo.bench.packed_batch import mixed_lengths
from attnzoo.bench.schema import validate_models
from attnzoo.bench.timing import host_seconds, profile_steps, time_steps
from attnzoo.layers.base import AttentionLayer
from tests import benchmark_scripts

pytestmark = pytest.mark.usefixtures("one_thread")

FAST = dict(warmup=1, steps=1, blocks=2, host_steps=1, profile_steps=1)


@pytest.fixture(scope="module")
def result():
    config = ModelBenchConfig(models=list(MODELS), variants=["l2"], modes=["eager", "cudagraphs"], device="cpu",
                              **FAST)
    return model_bench.run(config, progress=False)


def test_every_case_has_a_row_with_consistent_figures(result):
    validate_models(json.loads(json.dumps(result)))
    rows = result["results"]
    assert [(r["model"], r["attention"], r["mode"]) for r in rows] == [
        (m, a, mode) for m in MODELS for mode in ("eager", "cudagraphs") for a in (OWN, "l2")]
    own = {r["model"]: r for r in rows if r["attention"] == OWN and r["mode"] == "eager"}
    for r in rows:
        if r["mode"] == "cudagraphs":  # on a CPU that mode only compiles: said, not measured
            assert r["status"] == "skipped" and "CUDA" in r["reason"] and r["items_per_s"] is None
            continue
        assert r["status"] == "ok", r["reason"]
        shapes = model_spec(r["model"]).tiny
        per_step = shapes.batch if r["unit"] == "images/s" else shapes.batch * shapes.seq
        if model_spec(r["model"]).real_tokens is not None:  # mixed lengths: the real tokens, half of them
            per_step = sum(mixed_lengths(shapes.batch, shapes.seq))
            assert per_step == shapes.batch * shapes.seq // 2
        assert r["items_per_step"] == per_step
        assert r["items_per_s"] == pytest.approx(per_step / r["step_s"]["median"])
        assert r["ratio_vs_own"] == pytest.approx(r["items_per_s"] / own[r["model"]]["items_per_s"])
        assert r["aten_ops_per_step"] > 0 and r["host_ms_per_step"] > 0 and torch.isfinite(torch.tensor(r["loss"]))
        assert r["launches_per_step"] is None  # no kernel launches to count on a CPU


def _attention_layers(model):
    return [m for m in model.modules() if isinstance(m, AttentionLayer)]


@pytest.mark.parametrize("name", list(MODELS))
def test_the_variant_is_swapped_in_and_softmax_changes_nothing(name):
    """The benchmark compares like with like: built with the same seed, the model with attnzoo's softmax
    gives its own attention's loss (timm's Attention, HF's sdpa), and an l2 swap puts l2 everywhere."""
    spec = model_spec(name)
    losses = {}
    for attention in (None, "softmax"):
        torch.manual_seed(0)
        model = spec.build("tiny", attention)
        batch = spec.batch_of(model, spec.tiny, torch.device("cpu"), torch.Generator().manual_seed(1))
        losses[attention] = float(spec.loss(model, batch).detach())
        if attention is None:
            assert not _attention_layers(model)
    assert losses["softmax"] == pytest.approx(losses[None], rel=1e-5, abs=1e-6)
    swapped = spec.build("tiny", "l2")
    layers = _attention_layers(swapped)
    assert layers and all(layer.variant == "l2" for layer in layers)


def test_the_full_configs_are_the_named_models():
    """Checked against transformers' own defaults (GPT2Config() is GPT-2-small, BertConfig() BERT-base)
    and the issue's Llama-style model (12 query heads sharing 4 key/value heads), without building them."""
    from transformers import BertConfig, GPT2Config
    gpt2, bert, llama = (model_spec(n).build.config("full") for n in ("gpt2", "bert", "llama"))
    base = GPT2Config()
    assert (gpt2.n_embd, gpt2.n_layer, gpt2.n_head, gpt2.n_positions) == (base.n_embd, base.n_layer, base.n_head, 1024)
    base = BertConfig()
    assert (bert.hidden_size, bert.num_hidden_layers, bert.num_attention_heads) == (
        base.hidden_size, base.num_hidden_layers, base.num_attention_heads) == (768, 12, 12)
    assert (llama.num_attention_heads, llama.num_key_value_heads, llama.hidden_size) == (12, 4, 768)
    tiny = model_spec("llama").build.config("tiny")
    assert tiny.num_attention_heads == 3 * tiny.num_key_value_heads  # grouped as in the full model
    assert (model_spec("gpt2").full.seq, model_spec("llama").full.seq, model_spec("bert").full.seq) == (1024, 1024, 128)
    assert (model_spec("vit_s").full.batch, model_spec("vit_s").full.seq) == (128, 197)  # 14 x 14 patches + class


def test_compile_mode_runs_and_is_measured_against_own_compiled():
    config = ModelBenchConfig(models=["vit_s"], variants=["softmax"], modes=["compile"], device="cpu",
                              compile_backend="aot_eager", **FAST)
    rows = model_bench.run(config, progress=False)["results"]
    assert [(r["attention"], r["mode"], r["status"]) for r in rows] == [(OWN, "compile", "ok"),
                                                                       ("softmax", "compile", "ok")]
    assert rows[1]["ratio_vs_own"] == pytest.approx(rows[1]["items_per_s"] / rows[0]["items_per_s"])


def test_a_case_past_its_deadline_is_skipped_and_the_run_goes_on():
    config = ModelBenchConfig(models=["vit_s", "gpt2"], variants=["l2"], modes=["eager"], device="cpu",
                              case_seconds=1e-4, **FAST)
    rows = model_bench.run(config, progress=False)["results"]
    assert len(rows) == 4
    assert all(r["status"] == "skipped" and "case_seconds" in r["reason"] for r in rows), rows
    config = ModelBenchConfig(models=["vit_s"], variants=["l2"], modes=["eager"], device="cpu", budget_seconds=1e-4,
                              **FAST)
    rows = model_bench.run(config, progress=False)["results"]
    assert all(r["status"] == "skipped" and "budget" in r["reason"] for r in rows), rows


def test_profile_counts_the_aten_ops_a_step_runs():
    a, b = torch.randn(4), torch.randn(4)

    def step():
        for _ in range(5):
            torch.add(a, b)
        torch.mul(a, b)

    profiled = profile_steps(step, "cpu", 3)
    assert profiled["aten_ops_per_step"] == 6 and profiled["profiled_steps"] == 3


def test_step_timings_measure_the_step():
    stats = time_steps(lambda: time.sleep(0.004), "cpu", steps=2, blocks=3)
    assert stats.n == 3 and 0.004 <= stats.median < 0.1
    assert host_seconds(lambda: time.sleep(0.002), "cpu", 2).median >= 0.002


@pytest.mark.parametrize("kw,word", [({"models": ["resnet"]}, "model must be one of"),
                                     ({"modes": ["warp"]}, "model mode"), ({"size": "huge"}, "size"),
                                     ({"steps": 0}, "steps"), ({"variants": ["l2(foo=1)"]}, "foo"),
                                     ({"case_seconds": -1}, "case_seconds")])
def test_bad_configs_are_refused(kw, word):
    with pytest.raises(ValueError, match=word):
        ModelBenchConfig(**kw).validate()


def test_command_line_writes_json_markdown_and_a_row_log(tmp_path, capsys):
    out = tmp_path / "run"
    assert cli.main(["bench", "--models", "gpt2", "--variants", "relu", "--model-modes", "eager", "cudagraphs",
                     "--model-warmup", "1", "--model-steps", "1", "--model-blocks", "1", "--quiet",
                     "--out", str(out)]) == 0
    result = json.loads((out / "models.json").read_text())
    assert [(r["attention"], r["mode"]) for r in result["results"]] == [
        (OWN, "eager"), ("relu", "eager"), (OWN, "cudagraphs"), ("relu", "cudagraphs")]
    assert "## Throughput" in (out / "models.md").read_text()
    logged = (out / "models.jsonl").read_text().splitlines()
    assert len(logged) == 5  # the header, then each case as it finished
    capsys.readouterr()
    assert cli.main(["bench", "--from-jsonl", str(out / "models.jsonl"), "--out", str(tmp_path / "again")]) == 0
    rebuilt = json.loads((tmp_path / "again" / "models.json").read_text())
    assert rebuilt["results"] == result["results"] and rebuilt["settings"]["complete"] is True


@pytest.mark.parametrize("argv,words", [
    (["--models", "resnet"], ["resnet", "model must be one of"]),
    (["--models", "vit_s", "--variants", "sinkhorn(n_iters=-1)"], ["n_iters must be an int >= 0"]),
    (["--models", "vit_s", "--overhead"], ["--models and --overhead"]),
])
def test_command_line_refuses_bad_model_arguments_in_one_line(tmp_path, capsys, argv, words):
    assert cli.main(["bench", *argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("attnzoo bench: error: ") and err.count("\n") == 1 and "Traceback" not in err
    assert all(w in err for w in words), err
    assert not (tmp_path / "out").exists()


def test_models_without_a_visible_gpu_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["bench", "--models", "vit_s", "--device", "cuda", "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.startswith("attnzoo bench: error: no CUDA device is visible")


def test_pages_show_a_gpu_model_result_beside_the_kernel_table(result, tmp_path):
    pages = benchmark_scripts.load("readme_pages")
    front_page, gpu_section, render = pages.front_page, pages.gpu_section, pages.render
    from attnzoo.bench.output import write_models_outputs
    gpu_dir = tmp_path / "benchmarks" / "results" / "gpu"
    fake = json.loads(json.dumps(result))
    fake["environment"]["device_name"] = "Fake GPU 80GB"
    write_models_outputs(fake, gpu_dir / "fake-gpu", "models")
    gpu = gpu_section(gpu_dir)
    assert gpu is not None and gpu.models is not None and not gpu.summary  # models only, no kernel table
    readme = tmp_path / "README.md"
    text = front_page(None, gpu, readme, tmp_path / "docs" / "benchmarks.md")
    assert "Whole models (Fake GPU 80GB)" in text and "| attention | vit_s eager |" in text
    l2 = next(r for r in result["results"] if r["model"] == "vit_s" and r["attention"] == "l2" and r["mode"] == "eager")
    assert f"({l2['ratio_vs_own']:.2f}x)" in text  # the ratio to the model's own attention, from the result
    assert "(benchmarks/results/gpu/fake-gpu/models.md)" in text
    page = render(None, gpu, tmp_path / "docs" / "benchmarks.md")
    assert "Whole models (Fake GPU 80GB)" in page and "not measured on a GPU yet" not in page


@pytest.mark.parametrize("attention", [None, "sigmoid", "sinkhorn(n_iters=3)"])
def test_the_packed_row_trains_what_the_padded_row_trains(attention):
    """llama_packed and llama_padded: the same model (same seed) on the same sequences gives the same loss
    (the same tokens predicted from the same prefixes), so their tokens/s compare like with like; a
    packed row whose sequences saw each other, or whose per-sequence normalisation (sigmoid's -log n,
    Sinkhorn's marginals) were the row's, would move it."""
    losses = []
    for name in ("llama_padded", "llama_packed"):
        spec = model_spec(name)
        torch.manual_seed(0)
        model = spec.build("tiny", attention)
        batch = spec.batch_of(model, spec.tiny, torch.device("cpu"), torch.Generator().manual_seed(1))
        losses.append(float(spec.loss(model, batch).detach()))
    assert losses[0] == pytest.approx(losses[1], rel=1e-5, abs=1e-6)
    padded, packed = (model_spec(n).batch_of(model, model_spec(n).tiny, torch.device("cpu"),
                                            torch.Generator().manual_seed(1))[0] for n in ("llama_padded", "llama_packed"))
    assert padded["input_ids"].shape == (8, 16) and packed["input_ids"].shape == (1, 64)
    assert (padded["attention_mask"] == 0).sum() == 64   # half the padded tokens are padding


def test_the_packed_rows_default_lengths():
    """The full size's batch is benchmarks/packed_llama.py's: 8 sequences of 96-512 tokens."""
    spec = model_spec("llama_packed")
    assert mixed_lengths(spec.full.batch, spec.full.seq) == [512, 384, 320, 256, 192, 160, 128, 96]
