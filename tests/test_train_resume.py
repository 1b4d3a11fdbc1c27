"""Resume after an interruption = the uninterrupted run, bit for bit (CPU, same seed); DDP with two
gloo processes = one process within tolerance."""
from __future__ import annotations

import json
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from attnzoo.train import loop, train
from attnzoo.train.checkpoint import load_checkpoint

from .train_helpers import tiny_config, no_system_datasets  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("one_thread", "no_system_datasets")

TIMING = ("train_time_s", "images_per_s")
# dropout, CIFAR augmentation and OT-ViT's partners all draw random numbers: all must replay exactly
RESUME_CASES = [  # (model, dataset, where, data pipeline)
    ("otvit", "cifar10", "evaluate", "device"),     # interrupted after epoch 2's training, before its checkpoint
    ("vit", "fashion_mnist", "step", "device"),     # interrupted in the middle of epoch 2
    ("otvit", "cifar10", "step", "loader"),
]


def _final(out_dir):
    weights, state = load_checkpoint(out_dir)
    return weights, state


@pytest.mark.parametrize("model,dataset,where,pipeline", RESUME_CASES)
def test_resume_is_bit_identical(tmp_path, monkeypatch, model, dataset, where, pipeline):
    kw = dict(model=model, dataset=dataset, overrides=["train.epochs=3", "model.dropout=0.2", "data.augment=true",
                                                       "data.crop_padding=2", f"data.pipeline={pipeline}",
                                                       "train.log_every=2"])
    train(tiny_config(tmp_path / "straight", **kw), log=lambda *a: None)

    calls = {"n": 0}
    real = loop.evaluate if where == "evaluate" else loop.train_one_epoch

    def interrupted(*args, **kwargs):
        calls["n"] += 1
        if where == "step" and calls["n"] == 2:
            cfg = args[4]
            cfg.train.max_steps_per_epoch = 2  # take two steps of epoch 2, then die
            real(*args, **kwargs)
            raise KeyboardInterrupt
        out = real(*args, **kwargs)
        if where == "evaluate" and calls["n"] == 2:
            raise KeyboardInterrupt
        return out

    cfg_b = tiny_config(tmp_path / "resumed", **kw)
    monkeypatch.setattr(loop, "evaluate" if where == "evaluate" else "train_one_epoch", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train(cfg_b, log=lambda *a: None)
    monkeypatch.undo()
    assert load_checkpoint(tmp_path / "resumed")[1]["epoch"] == 1
    train(tiny_config(tmp_path / "resumed", **kw), resume=str(tmp_path / "resumed"), log=lambda *a: None)

    (wa, sa), (wb, sb) = _final(tmp_path / "straight"), _final(tmp_path / "resumed")
    assert sa["epoch"] == sb["epoch"] == 3
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    for pa, pb in zip(sa["optimizer"]["state"].values(), sb["optimizer"]["state"].values()):
        assert all(torch.equal(pa[k], pb[k]) for k in pa)
    strip = [{k: v for k, v in row.items() if k not in TIMING} for row in sa["history"]]
    assert strip == [{k: v for k, v in row.items() if k not in TIMING} for row in sb["history"]]
    metrics = json.loads((tmp_path / "resumed" / "metrics.json").read_text())
    assert [r["epoch"] for r in metrics["epochs"]] == [1, 2, 3]


# ---- DDP ------------------------------------------------------------------------------------
DDP_OVERRIDES = ["train.epochs=2", "model.dropout=0.0", "train.threads=1"]  # dropout differs per rank by design


def _ddp_worker(rank, world, port, out_dir, model, dataset):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    train(tiny_config(out_dir, model=model, dataset=dataset, overrides=DDP_OVERRIDES), log=lambda *a: None)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("model,dataset", [("otvit", "cifar10")])
def test_ddp_two_gloo_processes_match_one(tmp_path, model, dataset):
    train(tiny_config(tmp_path / "single", model=model, dataset=dataset, overrides=DDP_OVERRIDES), log=lambda *a: None)
    # fork: the workers inherit the imported modules instead of importing torch/timm again (~10x faster here)
    mp.start_processes(_ddp_worker, args=(2, _free_port(), str(tmp_path / "ddp"), model, dataset), nprocs=2,
                       join=True, start_method="fork")
    one, two = (load_file(str(tmp_path / d / "checkpoints" / "epoch0002.safetensors")) for d in ("single", "ddp"))
    assert one.keys() == two.keys()
    for k in one:
        # float32 all-reduce of half-batch gradients vs one full-batch gradient: rounding-level gaps
        torch.testing.assert_close(two[k], one[k], rtol=1e-4, atol=1e-5)
    hist = [json.loads((tmp_path / d / "metrics.json").read_text()) for d in ("single", "ddp")]
    assert hist[1]["world_size"] == 2 and hist[0]["world_size"] == 1
    for a, b in zip(hist[0]["epochs"], hist[1]["epochs"]):
        assert a["test_acc"] == b["test_acc"]
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-5)
        assert a["test_loss"] == pytest.approx(b["test_loss"], rel=1e-5)
