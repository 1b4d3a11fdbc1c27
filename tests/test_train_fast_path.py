"""The training loop's fast path on CPU: torch.compile plumbing (dynamo with the eager backend, so
no C++ compilation), loss checks every ``train.log_every`` steps, the validation hold-out, and
the throughput entry point; the same on a GPU with inductor and bf16 (tests marked gpu)."""
from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from attnzoo.train import loop, train
from attnzoo.train.data import load_splits
from attnzoo.train.throughput import images_per_second

from tests.common import needs_cuda

from .train_helpers import tiny_config, no_system_datasets  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("one_thread", "no_system_datasets")
QUIET = dict(log=lambda *a, **k: None)


def _weights(out_dir):
    return load_file(str(out_dir / "checkpoints" / "epoch0001.safetensors"))


@pytest.mark.parametrize("model,how", [("vit", "model"), ("otvit", "model"), ("otvit", "blocks")])
def test_compiled_training_matches_eager(tmp_path, model, how):
    """dynamo traces the model (OT-ViT: its shape-static forward under "model") and training gives
    the eager run's weights: identical for ViT, to rounding for OT-ViT's static forward."""
    common = ["data.augment=true", "model.dropout=0.0"]
    train(tiny_config(tmp_path / "eager", model=model, overrides=common), **QUIET)
    torch._dynamo.reset()
    cfg = tiny_config(tmp_path / "compiled", model=model,
                      overrides=common + [f"train.compile={how}", "train.compile_backend=eager"])
    from torch._dynamo.utils import counters
    counters.clear()
    train(cfg, **QUIET)
    assert counters["stats"]["unique_graphs"] >= (2 if how == "model" else 3)  # it did go through dynamo
    if how == "model":
        assert not counters["graph_break"]   # train and eval forwards as one graph each
    eager, compiled = _weights(tmp_path / "eager"), _weights(tmp_path / "compiled")
    for k in eager:
        if model == "vit":
            assert torch.equal(eager[k], compiled[k]), k
        else:
            torch.testing.assert_close(compiled[k], eager[k], rtol=1e-4, atol=1e-6)
    torch._dynamo.reset()


def test_compile_auto_is_off_on_cpu(tmp_path):
    cfg = tiny_config(tmp_path, overrides=["train.compile=auto"])
    assert loop.compile_choice(cfg, torch.device("cpu")) is False
    assert loop.compile_choice(cfg, torch.device("cuda")) == "model"
    assert loop.compile_choice(tiny_config(tmp_path, overrides=["train.compile=true"]), torch.device("cpu")) == "model"


@pytest.mark.parametrize("log_every", [1, 3, 1000])
def test_a_non_finite_loss_stops_training_at_the_next_check(tmp_path, monkeypatch, log_every):
    real = loop.model_from_config

    def poisoned(cfg, info):
        model = real(cfg, info)
        with torch.no_grad():
            model.head.bias.fill_(float("nan"))
        return model

    monkeypatch.setattr(loop, "model_from_config", poisoned)
    cfg = tiny_config(tmp_path, overrides=[f"train.log_every={log_every}"])  # 4 steps per epoch
    last = min(log_every, 4)
    with pytest.raises(FloatingPointError, match=f"epoch 1, steps 1-{last}"):
        train(cfg, **QUIET)
    assert not (tmp_path / "checkpoints" / "last.json").exists()


def test_validation_holds_out_training_images(tmp_path):
    cfg = tiny_config(tmp_path, overrides=["data.validation_size=8"])
    splits = load_splits(cfg)
    assert splits.evaluates_on == "validation" and splits.train[1].numel() == 24 and splits.test[1].numel() == 8
    full = load_splits(tiny_config(tmp_path))
    rows = {bytes(x.flatten().tolist()) for x in full.train[0]}
    held = [bytes(x.flatten().tolist()) for x in splits.test[0]]
    kept = [bytes(x.flatten().tolist()) for x in splits.train[0]]
    assert set(held) | set(kept) == rows and not set(held) & set(kept)   # a partition of the training split
    assert not {bytes(x.flatten().tolist()) for x in full.test[0]} & set(held)
    summary = train(cfg, **QUIET)
    assert summary["evaluated_on"] == "validation"
    with pytest.raises(ValueError, match="data.validation_size"):
        load_splits(tiny_config(tmp_path, overrides=["data.validation_size=32"]))


def test_throughput_runs_on_cpu(tmp_path):
    small = ["model.embed_dim=16", "model.depth=2", "model.num_heads=2", "train.batch_size=8",
             "train.eval_batch_size=8", "train.threads=1"]
    r = images_per_second("configs/otvit_cifar10.yaml", device="cpu", steps=2, warmup=1, overrides=small,
                          eval_batches=1)
    assert r["device"] == "cpu" and r["data"] == "synthetic" and r["model"] == "otvit" and r["augment"]
    assert r["compile"] == "off" and not r["amp_bf16"] and r["batch_size"] == 8 and r["steps"] == 2
    for key in ("train_images_per_s", "eval_images_per_s", "data_images_per_s", "epoch_images_per_s"):
        assert math.isfinite(r[key]) and r[key] > 0, key
    assert r["epoch_train_images"] == 50000 and r["epoch_eval_images"] == 10000
    assert r["epoch_seconds_estimate"] == pytest.approx(50000 / r["train_images_per_s"] + 10000 / r["eval_images_per_s"])
    assert r["epoch_images_per_s"] <= r["train_images_per_s"]
    json.dumps(r)  # the benchmark writes it as JSON
    with pytest.raises(ValueError, match="steps"):
        images_per_second("configs/vit_fashion_mnist.yaml", device="cpu", steps=0)


def test_throughput_profiles_extra_steps_on_request():
    small = ["model.embed_dim=16", "model.depth=1", "model.num_heads=2", "train.batch_size=8",
             "train.eval_batch_size=8", "train.threads=1"]
    r = images_per_second("configs/vit_fashion_mnist.yaml", device="cpu", steps=1, warmup=0, overrides=small,
                          eval_batches=1, profile_steps=2)
    p = r["profile"]
    assert p["steps"] == 2 and p["ms_per_step"] > 0
    assert p["launches_per_step"] == 0 and p["host_waits_per_step"] == 0  # no CUDA on this device
    # The model's matmuls ran. The table keeps the 15 busiest ops by self time and, at this tiny width,
    # the two matmul ops sit near its bottom (ranks 9 to 13 in runs here), so either one counts.
    assert any(op in p["host_table"] for op in ("aten::mm", "aten::addmm", "aten::linear")), p["host_table"]
    assert p["host_table"].count("aten::") >= 10  # a full table of operators, not an empty profile
    assert "device_table" not in p
    json.dumps(r)
    assert "profile" not in images_per_second("configs/vit_fashion_mnist.yaml", device="cpu", steps=1, warmup=0,
                                              overrides=small, eval_batches=1)
    with pytest.raises(ValueError, match="profile_steps"):
        images_per_second("configs/vit_fashion_mnist.yaml", device="cpu", profile_steps=-1)


# ---- GPU ------------------------------------------------------------------------------------
@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("model", ["vit", "otvit"])
def test_cuda_fast_path_trains(tmp_path, model):
    """bf16 autocast, fused AdamW, channels-last, inductor: a few epochs on generated data learn (as
    on CPU, where this reaches ~0.7; the generated classes are pixel patterns, which crops would
    scramble, so no augmentation here)."""
    cfg = tiny_config(tmp_path, model=model, overrides=[
        "train.device=cuda", "train.compile=model", "train.epochs=6", "data.synthetic_train_size=512",
        "data.synthetic_test_size=256", "train.batch_size=64", "train.eval_batch_size=128", "data.augment=false"])
    summary = train(cfg, **QUIET)
    hist = json.loads((tmp_path / "metrics.json").read_text())["epochs"]
    assert all(math.isfinite(h["train_loss"]) for h in hist)
    assert summary["final_test_acc"] > 0.4  # chance is 0.1


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("config", ["configs/vit_fashion_mnist.yaml", "configs/otvit_fashion_mnist.yaml"])
def test_cuda_throughput_of_the_paper_configs(config):
    r = images_per_second(config, device="cuda", steps=5, warmup=3)
    assert r["compile"] == "model" and r["amp_bf16"] and r["train_images_per_s"] > 0
    assert r["peak_memory_bytes"] > 0
