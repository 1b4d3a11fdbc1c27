"""``train.graph``: the whole training step, and the whole evaluation batch, as one CUDA graph.

A small model (the paper's ViT: 3.2M parameters) leaves an H100 waiting for the host: every step
launches hundreds of kernels. Here a step is one function of fixed-address tensors, captured once
and replayed: the batch is assembled from the device-resident split (its indices read from the
epoch's order through a step counter kept on the device, crops, flips, OT-ViT's partners and the
normalisation as gathers), then the forward under bf16 autocast, the loss, the backward, gradient
clipping and a capturable AdamW step (learning rate and step count in device tensors). The host
only replays the graph and lets the scheduler write the next learning rate into its tensor.

What capture needs, and how each holds (the tests check the conditions on the CPU, where the same
functions run without capture):
- fixed shapes: every batch has ``train.batch_size`` rows; the epoch's last, short batch is padded
  with rows of weight 0, and the loss is the weighted mean (the mean over the real rows, as an
  unpadded step computes it); OT-ViT runs its shape-static forward (``OTViT.static_shapes``);
- no host reads: the loss and accuracy sums stay on the device (read every ``train.log_every``
  steps, outside the graph), the optimizer reads no step count on the host (``capturable``);
- no data-dependent Python branches: none in the step; the epoch's draws (crops, flips, partners)
  are written into the same tensors every epoch (``DeviceTrainData.fixed_buffers``).

The first ``WARMUP_STEPS`` steps run uncaptured on a side stream (they are real training steps:
kernels get compiled, autotuned and loaded there), then the step is captured and replayed. With
``train.graph: auto`` a capture that fails (an operation a graph cannot hold) is reported and the
step goes on uncaptured; with ``true`` it is an error. On the CPU nothing is captured: the same
static step runs as it is (what the CPU tests compare against the plain loop)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..models.amp import bf16_autocast

WARMUP_STEPS = 3


def graph_choice(cfg, device: torch.device, world: int, pipeline: str) -> bool:
    """Whether ``train.graph`` asks for the static (graphed) step here: ``auto`` on one CUDA device
    with the device-resident data, unless torch.compile captures graphs itself (``compile_mode``
    reduce-overhead / max-autotune) or compiles block by block; ``true`` anywhere it can run (CPU:
    uncaptured, for tests)."""
    from .config import CUDAGRAPH_MODES
    how = cfg.train.graph
    if how is False:
        return False
    if how == "auto" and (cfg.train.compile == "blocks" or cfg.train.compile_mode in CUDAGRAPH_MODES):
        return False
    possible = world == 1 and pipeline == "device"
    if how == "auto":
        return possible and device.type == "cuda"
    if not possible:
        raise ValueError(f"train.graph=true needs one process and data.pipeline=device (got {world} processes, "
                         f"{pipeline} pipeline); use train.graph=auto to fall back")
    return True


class _Captured:
    """Runs ``body`` uncaptured for the first ``warmup`` calls (on a side stream on CUDA), then
    captures it in a CUDA graph and replays that (the capture itself runs nothing, so the call that
    captures replays once). ``required``: a failed capture raises;
    otherwise it is reported in ``status`` and the body runs uncaptured from then on."""

    def __init__(self, body, device: torch.device, name: str, required: bool, warmup: int = WARMUP_STEPS) -> None:
        self.body, self.device, self.name, self.required, self.warmup = body, device, name, required, warmup
        self.capture = device.type == "cuda"
        self.calls, self.graph = 0, None
        self.status = "uncaptured (CPU)" if not self.capture else "warming up"

    def __call__(self) -> None:
        if not self.capture:
            self.body()
            return
        if self.graph is not None:
            self.graph.replay()
            return
        if self.calls < self.warmup:
            self.calls += 1
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self.body()
            torch.cuda.current_stream(self.device).wait_stream(side)
            return
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.body()
        except Exception as e:  # noqa: BLE001 - any capture failure: report, then run uncaptured
            try:
                torch.cuda.synchronize(self.device)
            except RuntimeError:  # a stream left in the failed capture's error state: the body below says more
                pass
            if self.required:
                raise RuntimeError(f"train.graph=true: the {self.name} could not be captured in a CUDA graph "
                                   f"({type(e).__name__}: {e}); use train.graph=auto to fall back") from e
            self.capture = False
            self.status = f"uncaptured (capture failed: {type(e).__name__}: {str(e).splitlines()[0][:200]})"
            self.body()
            return
        self.graph, self.status = graph, "captured"
        graph.replay()


class GraphedTrainStep:
    """The static training step over a ``DeviceTrainData``: ``start_epoch(epoch)``, then one
    ``run()`` per step (the k-th call of the epoch trains batch k). ``loss_sum`` (float64, weighted
    by rows) and ``correct`` (int64) accumulate on the device over the epoch; ``rows(k)`` is how
    many real images step k holds."""

    def __init__(self, model, optimizer, data, cfg, device: torch.device, required: bool) -> None:
        self.model, self.optimizer, self.data, self.cfg, self.device = model, optimizer, data, cfg, device
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.amp = bool(cfg.train.amp and device.type == "cuda")
        B = data.batch_size
        total = len(data) * B                         # every step's rows, the last batch padded
        self.batch = B
        self.offsets = torch.arange(B, device=device)
        self.step_index = torch.zeros((), dtype=torch.int64, device=device)
        self.order = torch.zeros(total, dtype=torch.int64, device=device)
        self.weight = torch.zeros(total, dtype=torch.float32, device=device)
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.correct = torch.zeros((), dtype=torch.int64, device=device)
        self.n_real = 0
        data.fixed_buffers = True
        if hasattr(model, "static_shapes"):
            model.static_shapes = True
        self.run = _Captured(self._body, device, "training step", required)

    @property
    def status(self) -> str:
        return self.run.status

    def start_epoch(self, epoch: int) -> None:
        """The epoch's order and draws into the step's fixed tensors; the sums and the step counter to 0."""
        order = self.data.order(epoch)
        n = order.numel()
        self.n_real = n
        self.order[:n].copy_(order)
        self.order[n:].zero_()                   # padding rows read image 0 and weigh nothing
        self.weight[:n].fill_(1.0)
        self.weight[n:].zero_()
        self.data.draws(epoch)
        self.epoch = epoch
        self.step_index.zero_()
        self.loss_sum.zero_()
        self.correct.zero_()

    def rows(self, k: int) -> int:
        return max(0, min(self.batch, self.n_real - k * self.batch))

    def forward_loss(self):
        """Batch ``step_index`` of the epoch through the model: (weighted mean loss, logits, labels,
        real-row mask, number of real rows as a tensor). Fixed shapes, no host reads: this part
        traces into one graph with its backward (``torch.compile(fullgraph=True)``, tested)."""
        at = self.step_index * self.batch + self.offsets
        index, weight = self.order[at], self.weight[at]
        real = weight > 0
        batch = self.data.batch(index, self.epoch)
        images, labels = batch[0], batch[1]
        with bf16_autocast(self.device, self.amp, cache=False):  # a graph replays: no cast cache
            if len(batch) == 4:
                logits = self.model(images, templates=batch[2], template_mask=batch[3] & real)
            else:
                logits = self.model(images)
            per_row = F.cross_entropy(logits.float(), labels, reduction="none",
                                      label_smoothing=self.cfg.optim.label_smoothing)
            count = weight.sum()
            loss = (per_row * weight).sum() / count
        return loss, logits, labels, real, count

    def _body(self) -> None:
        # gradients set to None, so the backward writes them afresh: during capture this allocates them
        # in the graph's memory, where every replay writes them again (no kernel is recorded for it)
        self.optimizer.zero_grad(set_to_none=True)
        loss, logits, labels, real, count = self.forward_loss()
        loss.backward()
        if self.cfg.optim.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.params, self.cfg.optim.grad_clip, foreach=True)
        self.optimizer.step()  # fused AdamW: lr and step count read on the device
        with torch.no_grad():
            self.loss_sum += loss.detach().double() * count.double()
            self.correct += ((logits.argmax(-1) == labels) & real).sum()
            self.step_index += 1


class GraphedEval:
    """The static evaluation batch over a ``DeviceEvalData``: ``evaluate()`` runs every batch (the
    last one padded with rows of weight 0) and returns the device sums (loss, correct)."""

    def __init__(self, model, data, cfg, device: torch.device, required: bool) -> None:
        self.model, self.data, self.device = model, data, device
        self.amp = bool(cfg.train.amp and device.type == "cuda")
        n, B = data.labels.shape[0], data.batch_size
        self.steps = math.ceil(n / B)
        total = self.steps * B
        self.batch = B
        self.offsets = torch.arange(B, device=device)
        self.step_index = torch.zeros((), dtype=torch.int64, device=device)
        self.order = torch.zeros(total, dtype=torch.int64, device=device)
        self.order[:n] = torch.arange(n, device=device)
        self.weight = torch.zeros(total, dtype=torch.float32, device=device)
        self.weight[:n] = 1.0
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.correct = torch.zeros((), dtype=torch.int64, device=device)
        # the first evaluation pass is the warm-up: its batches compile and load every kernel
        self.run = _Captured(self._body, device, "evaluation batch", required, warmup=self.steps)

    @property
    def status(self) -> str:
        return self.run.status

    def _body(self) -> None:
        at = self.step_index * self.batch + self.offsets
        index, weight = self.order[at], self.weight[at]
        with torch.no_grad(), bf16_autocast(self.device, self.amp, cache=False):
            logits = self.model(self.data.pixels(index))
            labels = self.data.labels[index]
            self.loss_sum += (F.cross_entropy(logits.float(), labels, reduction="none").double() * weight).sum()
            self.correct += ((logits.argmax(-1) == labels) & (weight > 0)).sum()
            self.step_index += 1

    def evaluate(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(loss sum, correct, images) over this process's share of the evaluation split."""
        self.model.eval()
        self.step_index.zero_()
        self.loss_sum.zero_()
        self.correct.zero_()
        for _ in range(self.steps):
            self.run()
        return self.loss_sum, self.correct, self.data.labels.shape[0]
