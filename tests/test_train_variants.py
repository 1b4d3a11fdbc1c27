"""One epoch of training runs for ViT and OT-ViT with every attention variant, and for the shipped
configs (CIFAR ones on generated CIFAR-shaped data); config and command-line handling."""
from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

import attnzoo
from attnzoo.cli import main
from attnzoo.train import load_config, train
from attnzoo.train.loop import model_from_config
from attnzoo.train.datasets import dataset_info

from .train_helpers import tiny_config, no_system_datasets  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("one_thread", "no_system_datasets")

VARIANTS = attnzoo.available()  # all ten registry names (masked = causal: odd for a ViT, but it runs)
RUNS = [("vit", v) for v in VARIANTS] + [("otvit", v) for v in VARIANTS]


@pytest.mark.parametrize("model,attention", RUNS)
def test_one_epoch_trains(tmp_path, model, attention):
    cfg = tiny_config(tmp_path, model=model, overrides=[f"model.attention={attention}"])
    torch.manual_seed(0)
    before = {k: v.clone() for k, v in model_from_config(cfg, dataset_info("fashion_mnist")).state_dict().items()}
    summary = train(cfg, log=lambda *a: None)
    hist = json.loads((tmp_path / "metrics.json").read_text())["epochs"]
    assert len(hist) == 1 and math.isfinite(hist[0]["train_loss"]) and 0 <= hist[0]["test_acc"] <= 1
    assert summary["attention"] == attention and summary["model"] == model
    after = load_file(str(tmp_path / "checkpoints" / "epoch0001.safetensors"))
    assert after.keys() == before.keys()
    assert all(torch.isfinite(v).all() for v in after.values())
    assert any(not torch.equal(before[k], after[k]) for k in before)  # the optimizer stepped


CONFIGS = ["vit_cifar10", "otvit_cifar10", "vit_cifar100", "otvit_cifar100", "vit_fashion_mnist",
           "otvit_fashion_mnist", "demo", "demo_fashion_mnist"]
SHRINK = ["model.embed_dim=16", "model.depth=2", "model.num_heads=2", "data.synthetic=true",
          "data.synthetic_train_size=16", "data.synthetic_test_size=8", "train.epochs=1", "train.batch_size=8",
          "train.progress=false", "train.device=cpu"]


@pytest.mark.parametrize("name", CONFIGS)
def test_shipped_configs_train_on_generated_data(tmp_path, name):
    cfg = load_config(f"configs/{name}.yaml", SHRINK + [f"train.out_dir={tmp_path}", "train.plot=false"])
    summary = train(cfg, log=lambda *a: None)
    assert summary["epochs_done"] == 1 and summary["dataset"] == cfg.data.dataset
    assert (tmp_path / "metrics.csv").read_text().count("\n") == 2  # header + one epoch


def test_cli_set_overrides_and_outputs(tmp_path, capsys):
    rc = main(["train", "configs/otvit_cifar10.yaml", *[a for s in SHRINK for a in ("--set", s)],
               "--set", 'model.attention="sinkhorn(n_iters=2)"', "--set", "train.epochs=2",
               "--out-dir", str(tmp_path)])
    assert rc == 0
    data = json.loads((tmp_path / "metrics.json").read_text())
    assert data["config"]["model"]["attention"] == "sinkhorn(n_iters=2)" and data["epochs_done"] == 2
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pointer = json.loads((tmp_path / "checkpoints" / "last.json").read_text())
    assert pointer["epoch"] == 2
    assert "test acc" in capsys.readouterr().out


def test_sigmoid_override_builds_sigmoid_layers():
    cfg = load_config("configs/vit_fashion_mnist.yaml", ['model.attention="sigmoid"', "model.embed_dim=16",
                                                          "model.num_heads=2"])
    model = model_from_config(cfg, dataset_info("fashion_mnist"))
    assert all(isinstance(b.attn, attnzoo.SigmoidAttention) for b in model.blocks)


BAD_CONFIG = [
    (["model.widht=3"], "model.widht"),
    (["train.epochs=two"], "train.epochs"),
    (["optim.lr=fast"], "optim.lr"),
    (["data.synthetic=maybe"], "data.synthetic"),
    (["nosection"], "key=value"),
    (["train.epochs=0"], "train.epochs"),
    (["train.batch_size=-8"], "train.batch_size"),
    (["optim.lr=0"], "optim.lr"),
    (["optim.betas=[0.9]"], "optim.betas"),
    (["optim.label_smoothing=1.5"], "optim.label_smoothing"),
    (["data.dataset=mnist"], "data.dataset"),
    (["data.partner_prob=2"], "data.partner_prob"),
    (["data.train_subset=0"], "data.train_subset"),
    (["train.device=gpu"], "train.device"),
    (["model.depth=-1"], "depth"),
    (["model.attention=softmaxx"], "softmaxx"),
    (["model.patch_size=3"], "patch_size"),
    (["model.name=resnet"], "model name"),
    (["data.pipeline=gpu"], "data.pipeline"),
    (["data.crop_padding=-1"], "data.crop_padding"),
    (["data.validation_size=0"], "data.validation_size"),
    (["train.compile=fast"], "train.compile"),
    (["train.compile=1"], "train.compile"),
    (["train.log_every=0"], "train.log_every"),
]


@pytest.mark.parametrize("overrides,match", BAD_CONFIG)
def test_bad_config_values_are_named(overrides, match):
    with pytest.raises(ValueError, match=match):
        load_config("configs/demo.yaml", overrides)


@pytest.mark.parametrize("config", ["configs/demo.yaml", "configs/vit_fashion_mnist.yaml", "configs/otvit_cifar10.yaml"])
def test_cli_reports_errors_without_a_traceback(tmp_path, capsys, config):
    """Config errors come before any data is read: the same message whether or not the dataset is
    installed (the fixture hides Fashion-MNIST and the network), and nothing is written."""
    assert main(["train", str(tmp_path / "missing.yaml")]) == 2
    assert "not found" in capsys.readouterr().err
    assert main(["train", config, "--set", "model.depth=-1", "--out-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "depth" in err and err.count("\n") == 1 and err.startswith("attnzoo train: error:")
    assert not (tmp_path / "run").exists()


def test_missing_dataset_is_one_error_line(tmp_path, capsys):
    rc = main(["train", "configs/vit_fashion_mnist.yaml", "--set", "data.download=false", "--out-dir", str(tmp_path)])
    assert rc == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "apt-get install dataset-fashion-mnist" in err
