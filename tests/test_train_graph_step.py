"""train.graph: the whole step (batch assembly, forward, loss, backward, clipping, AdamW) as one
static-shape function for a CUDA graph. On the CPU nothing is captured, but the conditions a
capture needs are checked there: the static step trains as the plain loop does, it never reads a
device value on the host (no .item(), bool(tensor), .tolist(), nonzero: a dispatch-level probe),
and its forward and backward trace into one graph (torch.compile(fullgraph=True))."""
from __future__ import annotations

import collections
import json
import math

import pytest
import torch
from safetensors.torch import load_file
from torch.utils._python_dispatch import TorchDispatchMode

from attnzoo.ops import validate
from attnzoo.train import loop, train
from attnzoo.train.data import build_loaders
from attnzoo.train.datasets import dataset_info
from attnzoo.train.graph_step import GraphedEval, GraphedTrainStep, graph_choice
from attnzoo.train.optim import build_scheduler, match_lr_kind

from tests.common import needs_cuda

from .train_helpers import tiny_config, no_system_datasets  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("one_thread", "no_system_datasets")
QUIET = dict(log=lambda *a, **k: None)
# 36 images at batch 8: the last batch holds 4, padded to 8 by the static step
COMMON = ["data.augment=true", "model.dropout=0.0", "train.epochs=2", "data.synthetic_train_size=36",
          "data.synthetic_test_size=20", "train.eval_batch_size=8"]
# the aten ops that read a device value on the host (or make a shape only the data knows)
SYNCING = {"aten._local_scalar_dense.default", "aten.item.default", "aten.nonzero.default",
           "aten.masked_select.default", "aten._unique2.default", "aten.unique_dim.default",
           "aten.unique_consecutive.default", "aten.repeat_interleave.Tensor"}


def _weights(out):
    return load_file(str(out / "checkpoints" / "epoch0002.safetensors"))


@pytest.mark.parametrize("model", ["vit", "otvit"])
def test_the_static_step_trains_as_the_plain_loop(tmp_path, model):
    """Padded last batch, weighted loss, fused AdamW with a tensor learning rate, OT-ViT's static
    forward: the same weights and metrics as the plain loop, to float32 rounding."""
    plain = train(tiny_config(tmp_path / "plain", model=model, overrides=COMMON), **QUIET)
    static = train(tiny_config(tmp_path / "static", model=model, overrides=COMMON + ["train.graph=true"]), **QUIET)
    assert static["graph"] == "training step uncaptured (CPU); evaluation uncaptured (CPU)"
    a, b = _weights(tmp_path / "plain"), _weights(tmp_path / "static")
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5)
    ha, hb = (json.loads((tmp_path / d / "metrics.json").read_text())["epochs"] for d in ("plain", "static"))
    for ra, rb in zip(ha, hb):
        assert rb["train_loss"] == pytest.approx(ra["train_loss"], rel=1e-5)
        assert rb["test_loss"] == pytest.approx(ra["test_loss"], rel=1e-5)
        assert rb["lr"] == pytest.approx(ra["lr"], rel=1e-6)
        assert rb["train_acc"] == ra["train_acc"] and rb["test_acc"] == ra["test_acc"]
    if model == "otvit":
        assert static["partner_overflow_rows"] == 0


def _static_parts(tmp_path, model, overrides=()):
    cfg = tiny_config(tmp_path, model=model, overrides=COMMON + ["train.graph=true", *overrides])
    dev = torch.device("cpu")
    torch.manual_seed(0)
    net = loop.model_from_config(cfg, dataset_info(cfg.data.dataset))
    loaders = build_loaders(cfg, device=dev)
    opt = loop.optimizer_for(net, cfg, dev)
    sched = build_scheduler(opt, cfg.optim, len(loaders.train), cfg.train.epochs)
    match_lr_kind(opt, sched)
    return cfg, net, loaders, opt, sched, GraphedTrainStep(net, opt, loaders.train, cfg, dev, required=True), \
        GraphedEval(net, loaders.test, cfg, dev, required=True)


class Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("model", ["vit", "otvit"])
def test_a_static_step_never_waits_for_the_device(tmp_path, model):
    """Tensor.item / __bool__ / tolist / __int__ / __float__ / __index__ raise, and a dispatch-level
    recorder sees no op that reads a device value on the host, over a whole epoch of static steps
    (the padded last batch included) and a whole graphed evaluation."""
    cfg, net, loaders, opt, sched, step, evaluation = _static_parts(tmp_path, model)
    step.start_epoch(0)
    net.train()
    step.run()                       # the optimizer's first step creates its state
    sched.step()
    with pytest.MonkeyPatch.context() as mp:
        for name in ("item", "__bool__", "tolist", "__int__", "__float__", "__index__"):
            mp.setattr(torch.Tensor, name, _refuse)
        # attnzoo reads values on the host only on VALUE_CHECK_DEVICES (CPU, where it costs no sync;
        # e.g. whether a query holds NaN): emulate a GPU, where it reads none
        mp.setattr(validate, "VALUE_CHECK_DEVICES", set())
        with Recorder() as rec:
            for _ in range(len(loaders.train) - 1):   # the rest of the epoch, its padded last batch included
                step.run()
            evaluation.evaluate()
    assert not SYNCING & set(rec.ops), {k: v for k, v in rec.ops.items() if k in SYNCING}
    # the update (one fused kernel per parameter group) reads the learning rate on the device
    assert rec.ops["aten._fused_adamw_.tensor_lr"] == len(opt.param_groups) * (len(loaders.train) - 1)
    assert int(step.step_index) == len(loaders.train) and float(step.loss_sum) > 0


def _refuse(self, *a, **k):
    raise AssertionError("a host read of a tensor inside the step")


def test_the_plain_step_does_wait_so_the_probe_can_see_it(tmp_path):
    """The probe's control: the eager OT-ViT forward gathers the borrowing rows (nonzero) and the
    plain CPU AdamW reads its step count on the host; the probe records both."""
    cfg = tiny_config(tmp_path, model="otvit", overrides=COMMON)
    dev = torch.device("cpu")
    net = loop.model_from_config(cfg, dataset_info(cfg.data.dataset))
    loaders = build_loaders(cfg, device=dev)
    opt = loop.optimizer_for(net, cfg, dev)
    sched = build_scheduler(opt, cfg.optim, len(loaders.train), cfg.train.epochs)
    step = loop.TrainStep(net, opt, sched, cfg, dev)
    batches = iter(loaders.train)
    step(next(batches))
    with Recorder() as rec:
        step(next(batches))
    assert rec.ops["aten.nonzero.default"] >= 1 and rec.ops["aten._local_scalar_dense.default"] >= 1


@pytest.mark.parametrize("model", ["vit", "otvit"])
def test_the_static_forward_and_backward_trace_as_one_graph(tmp_path, model):
    """Batch assembly from the device-side step counter, the model (OT-ViT: partners, static
    forward) and the weighted loss compile with fullgraph=True; AOT autograd traces the backward
    with fake tensors, so a host read there would fail too. The compiled step's gradients equal the
    eager ones. (torch marks its fused optimizer as not traceable: it is one kernel already; the
    probe above checks it.)"""
    cfg, net, loaders, opt, sched, step, _ = _static_parts(tmp_path, model, ["train.graph=true"])
    step.start_epoch(1)
    step.step_index.fill_(len(loaders.train) - 1)   # the padded last batch
    net.train()
    params = [p for p in net.parameters() if p.requires_grad]

    def grads(fn):
        loss = fn()[0]
        return loss.detach(), torch.autograd.grad(loss, params)

    want_loss, want = grads(step.forward_loss)
    torch._dynamo.reset()
    compiled = torch.compile(step.forward_loss, fullgraph=True, backend="aot_eager")
    got_loss, got = grads(compiled)
    torch._dynamo.reset()
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-6, atol=1e-7)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_graph_choice_and_its_errors(tmp_path):
    cfg = tiny_config(tmp_path, overrides=["train.graph=auto"])
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert not graph_choice(cfg, cpu, 1, "device") and graph_choice(cfg, cuda, 1, "device")
    assert not graph_choice(cfg, cuda, 2, "device") and not graph_choice(cfg, cuda, 1, "loader")
    on = tiny_config(tmp_path, overrides=["train.graph=true"])
    assert graph_choice(on, cpu, 1, "device")
    with pytest.raises(ValueError, match="train.graph=true needs one process and data.pipeline=device"):
        graph_choice(on, cpu, 1, "loader")
    with pytest.raises(ValueError, match="train.graph"):
        tiny_config(tmp_path, overrides=["train.graph=yes please"])
    with pytest.raises(ValueError, match="train.compile=blocks"):
        tiny_config(tmp_path, overrides=["train.graph=true", "train.compile=blocks"])
    with pytest.raises(ValueError, match="captures its own CUDA graphs"):
        tiny_config(tmp_path, overrides=["train.graph=true", "train.compile_mode=reduce-overhead"])
    for other in (["train.compile=blocks"], ["train.compile=true", "train.compile_mode=reduce-overhead"]):
        assert not graph_choice(tiny_config(tmp_path, overrides=["train.graph=auto", *other]), cuda, 1, "device")


def test_the_learning_rate_scales_by_the_stated_rule(tmp_path):
    from attnzoo.train.config import effective_lr
    base = ["optim.lr=3e-4", "optim.lr_reference_batch=128", "train.batch_size=512"]
    assert effective_lr(tiny_config(tmp_path, overrides=base)) == pytest.approx(3e-4)  # none: as given
    assert effective_lr(tiny_config(tmp_path, overrides=base + ["optim.lr_scaling=sqrt"])) == pytest.approx(6e-4)
    assert effective_lr(tiny_config(tmp_path, overrides=base + ["optim.lr_scaling=linear"])) == pytest.approx(1.2e-3)
    cfg = tiny_config(tmp_path, overrides=["optim.lr=1e-3", "optim.lr_reference_batch=2", "optim.lr_scaling=sqrt",
                                           "optim.warmup_epochs=0"])   # batch 8 = 4x the reference
    net = loop.model_from_config(cfg, dataset_info(cfg.data.dataset))
    assert loop.optimizer_for(net, cfg, torch.device("cpu")).param_groups[0]["lr"] == pytest.approx(2e-3)
    summary = train(cfg, **QUIET)
    assert summary["epochs_done"] == 1 and math.isfinite(summary["final_test_acc"])
    with pytest.raises(ValueError, match="optim.lr_scaling"):
        tiny_config(tmp_path, overrides=["optim.lr_scaling=cubic"])


# ---- GPU ------------------------------------------------------------------------------------
@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("model", ["vit", "otvit"])
def test_cuda_graph_capture_trains_as_the_uncaptured_static_step(tmp_path, model):
    """On CUDA the step and the evaluation are captured (status "captured") and replaying them
    trains as running the same static step uncaptured (float32, no autocast: rounding only)."""
    gpu = COMMON + ["train.device=cuda", "train.amp=false", "train.compile=false"]
    captured = train(tiny_config(tmp_path / "g", model=model, overrides=gpu + ["train.graph=true",
                                                                               "train.epochs=3"]), **QUIET)
    assert captured["graph"] == "training step captured; evaluation captured"
    from attnzoo.train import graph_step
    real = graph_step._Captured.__init__

    def never_capture(self, *a, **k):
        real(self, *a, **k)
        self.warmup = 10 ** 9
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(graph_step._Captured, "__init__", never_capture)
        train(tiny_config(tmp_path / "u", model=model, overrides=gpu + ["train.graph=true", "train.epochs=3"]),
              **QUIET)
    a = load_file(str(tmp_path / "g" / "checkpoints" / "epoch0003.safetensors"))
    b = load_file(str(tmp_path / "u" / "checkpoints" / "epoch0003.safetensors"))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)
