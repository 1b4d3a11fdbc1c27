"""The training loop: ``train(cfg, resume=None)``. Runs alone or under torchrun (DDP)."""
from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from tqdm.auto import tqdm

from ..models import build_model, count_parameters
from ..models.amp import bf16_autocast
from . import distributed as D
from .checkpoint import (CheckpointError, check_resumable, load_checkpoint, newest_pointer, remove_stale_temporaries,
                         resolve, restore, save_checkpoint)
from .config import TrainConfig, check, effective_lr, model_kwargs
from .data import build_loaders, pipeline, uses_partners
from .datasets import dataset_info
from .graph_step import GraphedEval, GraphedTrainStep, graph_choice
from .metrics import plot_curves, write_metrics
from .optim import build_optimizer, build_scheduler, current_lr, match_lr_kind


PLOT_INTERVAL_S = 30.0  # curves.png is redrawn at most this often (matplotlib costs ~0.3 s), and after the last epoch


def epoch_seed(seed: int, epoch: int, rank: int) -> int:
    """Dropout RNG is reseeded from (seed, epoch, rank) at every epoch start, so an epoch's randomness
    never depends on how the run got there (resumed or not)."""
    return (seed * 1_000_003 + epoch * 1009 + rank) % (2 ** 63)


def model_from_config(cfg: TrainConfig, info) -> torch.nn.Module:
    model = build_model(cfg.model.name, **model_kwargs(cfg.model, info))
    if hasattr(model, "partner_prob"):  # sizes OT-ViT's shape-static forward (compiled or graphed)
        model.partner_prob = cfg.data.partner_prob if uses_partners(cfg) else None
    return model


class Graphs:
    """The graphed training step and evaluation of a run (``train.graph``), or None for each."""

    def __init__(self, model, optimizer, loaders, cfg: TrainConfig, device: torch.device, world: int) -> None:
        self.on = graph_choice(cfg, device, world, pipeline(cfg))
        required = cfg.train.graph is True
        self.train = GraphedTrainStep(model, optimizer, loaders.train, cfg, device, required) if self.on else None
        self.eval = GraphedEval(model, loaders.test, cfg, device, required) if self.on else None

    def status(self) -> str:
        if not self.on:
            return "off"
        return f"training step {self.train.status}; evaluation {self.eval.status}"


def optimizer_for(model, cfg: TrainConfig, device: torch.device, world: int = 1):
    """AdamW at ``config.effective_lr``: fused on CUDA, capturable (device-side learning rate and
    step count) when the step is graphed."""
    capturable = graph_choice(cfg, device, world, pipeline(cfg))
    return build_optimizer(model, cfg.optim, fused=device.type == "cuda", lr=effective_lr(cfg), capturable=capturable)


def memory_format(cfg: TrainConfig, device: torch.device) -> torch.memory_format:
    """Channels-last on CUDA when configured: cuDNN's fastest layout for the patch embedding's conv."""
    return torch.channels_last if cfg.train.channels_last and device.type == "cuda" else torch.contiguous_format


def compile_choice(cfg: TrainConfig, device: torch.device):
    """What ``train.compile`` means on this device: False, "model" or "blocks"."""
    how = cfg.train.compile
    if how == "auto":
        return "model" if device.type == "cuda" else False
    return "model" if how is True else how


def compile_model(model: torch.nn.Module, cfg: TrainConfig, device: torch.device) -> torch.nn.Module:
    """``train.compile``: ``model`` (or true) compiles the whole forward in place, one graph per
    batch shape (OT-ViT then runs its shape-static forward: every partner through the trunk);
    ``blocks`` compiles each transformer block alone with dynamic batch sizes (OT-ViT keeps its
    eager gather of the rows that borrow templates); ``auto``: ``model`` on CUDA, nothing on CPU.
    In place: parameter names stay the same, so checkpoints do not depend on the choice."""
    how = compile_choice(cfg, device)
    if not how:
        return model
    kw = {k: v for k, v in (("mode", cfg.train.compile_mode), ("backend", cfg.train.compile_backend)) if v is not None}
    if how == "model":
        model.compile(dynamic=False, **kw)
    else:
        for block in model.blocks:
            block.compile(**kw)
    return model


def _forward(model, batch, device, fmt=torch.contiguous_format):
    """(logits, labels) for a (images, labels[, partners, has_partner]) batch."""
    images = batch[0].to(device, non_blocking=True).contiguous(memory_format=fmt)
    labels = batch[1].to(device, non_blocking=True)
    if len(batch) == 4:
        partners = batch[2].to(device, non_blocking=True).contiguous(memory_format=fmt)
        has = batch[3].to(device, non_blocking=True)
        return model(images, templates=partners, template_mask=has), labels
    return model(images), labels


class TrainStep:
    """One optimisation step on a batch without waiting for the device: returns (loss, number of
    correct predictions) as device tensors and the batch size. The training loop and the
    throughput benchmark (``throughput.py``) both run this."""

    def __init__(self, net, optimizer, scheduler, cfg: TrainConfig, device: torch.device) -> None:
        self.net, self.optimizer, self.scheduler, self.cfg, self.device = net, optimizer, scheduler, cfg, device
        self.fmt = memory_format(cfg, device)
        self.params = [p for p in net.parameters() if p.requires_grad]

    def __call__(self, batch):
        cfg = self.cfg
        with bf16_autocast(self.device, cfg.train.amp):
            logits, labels = _forward(self.net, batch, self.device, self.fmt)
            loss = F.cross_entropy(logits.float(), labels, label_smoothing=cfg.optim.label_smoothing)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.optim.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.params, cfg.optim.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        return loss.detach(), (logits.detach().argmax(-1) == labels).sum(), labels.shape[0]


def evaluate(model, loader, cfg: TrainConfig, info: D.DistInfo, graph: Optional[GraphedEval] = None) -> tuple[float, float]:
    """(mean loss, accuracy) over the evaluation split; sums stay on the device until the end.
    ``graph``: the graphed evaluation (``train.graph``) instead of the batch loop."""
    if graph is not None:
        loss_sum, correct, count = graph.evaluate()
        loss_sum, correct, count = D.all_sum([loss_sum.item(), float(correct.item()), count], info)
        return loss_sum / max(count, 1), correct / max(count, 1)
    model.eval()
    fmt = memory_format(cfg, info.device)
    loss_sum = torch.zeros((), dtype=torch.float64, device=info.device)
    correct = torch.zeros((), dtype=torch.int64, device=info.device)
    count = 0
    with torch.no_grad(), bf16_autocast(info.device, cfg.train.amp):
        for batch in loader:
            logits, labels = _forward(model, batch[:2], info.device, fmt)
            loss_sum += F.cross_entropy(logits.float(), labels, reduction="sum")
            correct += (logits.argmax(-1) == labels).sum()
            count += labels.shape[0]
    loss_sum, correct, count = D.all_sum([loss_sum.item(), float(correct.item()), count], info)
    return loss_sum / max(count, 1), correct / max(count, 1)


def train_one_epoch(model, loader, optimizer, scheduler, cfg: TrainConfig, info: D.DistInfo, epoch: int,
                    graph: Optional[GraphedTrainStep] = None):
    """One epoch. The loss and accuracy sums stay on the device; every ``train.log_every`` steps
    (and at the end) they are read once: the progress bar, and a check that the loss is finite.
    ``graph``: the graphed step (``train.graph``) replayed instead of the batch loop."""
    model.train()
    t0 = time.perf_counter()
    steps = len(loader) if cfg.train.max_steps_per_epoch is None else min(len(loader), cfg.train.max_steps_per_epoch)
    if graph is None:
        step_fn = TrainStep(model, optimizer, scheduler, cfg, info.device)
        loss_sum = torch.zeros((), dtype=torch.float64, device=info.device)
        correct = torch.zeros((), dtype=torch.int64, device=info.device)
    else:
        graph.start_epoch(epoch)
        loss_sum, correct = graph.loss_sum, graph.correct
    count = 0
    bar = tqdm(total=steps, desc=f"epoch {epoch + 1}/{cfg.train.epochs}", leave=False, dynamic_ncols=True,
               disable=not (cfg.train.progress and info.is_main),
               mininterval=1.0 if sys.stderr.isatty() else 60.0)  # keep nohup logs short
    checked = 0

    def check_and_show(done: int) -> None:
        nonlocal checked
        total, right = loss_sum.item(), int(correct.item())  # the one wait for the device
        if not math.isfinite(total):
            raise FloatingPointError(f"non-finite training loss in epoch {epoch + 1}, steps {checked + 1}-{done}; "
                                     f"try a lower optim.lr or optim.grad_clip")
        elapsed = time.perf_counter() - t0
        bar.set_postfix(loss=f"{total / max(count, 1):.4f}", acc=f"{right / max(count, 1):.4f}",
                        img_s=f"{count * info.world / elapsed:.0f}", lr=f"{current_lr(optimizer):.2e}",
                        refresh=False)  # the bar redraws on update(), at most every mininterval
        bar.update(done - checked)
        checked = done

    done = 0
    if graph is None:
        for batch in loader:
            if done >= steps:
                break
            loss, right, n = step_fn(batch)
            loss_sum += loss.double() * n
            correct += right
            count += n
            done += 1
            if done % cfg.train.log_every == 0:
                check_and_show(done)
    else:
        for k in range(steps):
            graph.run()
            scheduler.step()  # the next step's learning rate, written into the optimizer's tensor
            count += graph.rows(k)
            done += 1
            if done % cfg.train.log_every == 0:
                check_and_show(done)
    if checked < done:
        check_and_show(done)
    bar.close()
    loss_total, right_total, count = D.all_sum([loss_sum.item(), float(correct.item()), count], info)
    elapsed = time.perf_counter() - t0
    return {"train_loss": loss_total / max(count, 1), "train_acc": right_total / max(count, 1),
            "train_time_s": elapsed, "images_per_s": count / max(elapsed, 1e-9)}


def _rng_state(device: torch.device) -> dict:
    state = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def _print(*args, **kw):
    print(*args, **kw, flush=True)  # epoch lines show up promptly in nohup logs


def train(cfg: TrainConfig, resume: Optional[str] = None, log=_print,
          on_epoch: Optional[Callable[[dict], None]] = None, allow_config_change: bool = False,
          deadline: Optional[float] = None) -> dict:
    """Train as configured; ``resume``: a run dir / checkpoint to continue from (a checkpoint trained
    with other settings is refused unless ``allow_config_change``; the changes are then recorded).
    ``on_epoch(row)`` is called on the main process after each epoch with that epoch's metrics.
    ``deadline`` (a ``time.time()`` value): stop after the last epoch expected to end before it (the
    checkpoint is written; ``--resume`` continues). Returns the summary (``"stopped_early": True``
    when the deadline stopped it, ``"nothing_to_train": True`` when the checkpoint already holds
    ``train.epochs`` epochs)."""
    info = D.setup(cfg.train.device)
    try:
        return _train(cfg, resume, info, log if info.is_main else (lambda *a, **k: None),
                      on_epoch if info.is_main else None, allow_config_change, deadline)
    finally:
        D.cleanup(info)


def _summary(cfg: TrainConfig, history: list, best_acc: float, n_params: int, world: int, evaluates_on: str,
             changes: list) -> dict:
    last = history[-1]
    return {"model": cfg.model.name, "attention": cfg.model.attention, "dataset": cfg.data.dataset,
            "parameters": n_params, "world_size": world, "best_test_acc": best_acc,
            "final_test_acc": last["test_acc"], "epochs_done": last["epoch"], "evaluated_on": evaluates_on,
            "config": cfg.to_dict(), **({"config_changes": changes} if changes else {})}


def _resume_state(cfg: TrainConfig, resume, info: D.DistInfo, allow_change: bool, log):
    """The verified checkpoint (weights, state) and the settings this resume changes, recorded with
    the ones earlier resumes changed: [{"after_epoch": E, "changes": [...]}, ...]."""
    weights, state = load_checkpoint(resume)
    changes = check_resumable(state, cfg.to_dict(), resume, allow_change, info.device.type,
                              defaults=TrainConfig().to_dict())
    recorded = list(state.get("config_changes", []))
    if changes:
        log(f"resuming {resume} with changed settings (--allow-config-change): {'; '.join(changes)}")
        recorded.append({"after_epoch": state["epoch"], "changes": changes})
    return weights, state, recorded


def _refuse_to_replace(out_dir: Path, resume) -> None:
    """A run that does not continue the checkpoint already in ``out_dir`` (no ``resume``, or a resume
    from another folder) would replace it: its first save repoints last.json and deletes the files
    no pointer names. Refused before anything is written, so nothing is lost."""
    ckpt_dir = out_dir / "checkpoints"
    pointer = newest_pointer(ckpt_dir)
    if pointer is None:
        return
    if resume is not None and resolve(resume)[0].parent.resolve() == ckpt_dir.resolve():
        return
    what = "without --resume" if resume is None else f"from another checkpoint ({resume})"
    raise CheckpointError(f"train.out_dir {out_dir} already holds a run ({pointer}); training into it "
                          f"{what} would replace that run's checkpoints and metrics: pass --resume to continue "
                          f"it, choose another --out-dir (train.out_dir), or delete {ckpt_dir} to start again")


def epoch_fits(deadline: Optional[float], durations: list[float], now: Optional[float] = None) -> bool:
    """Whether another epoch is expected to end before ``deadline`` (a ``time.time()`` value): the
    slowest of the last three epochs (the first one includes compilation, so it errs on the safe
    side) plus 10%; with no epoch timed yet, whether any time is left."""
    if deadline is None:
        return True
    now = time.time() if now is None else now
    if not durations:
        return now < deadline
    return now + 1.1 * max(durations[-3:]) < deadline


def _train(cfg: TrainConfig, resume, info: D.DistInfo, log, on_epoch=None, allow_config_change: bool = False,
           deadline: Optional[float] = None) -> dict:
    check(cfg)  # every value, before any data is read or file written
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    out_dir = Path(cfg.train.out_dir)
    _refuse_to_replace(out_dir, resume)
    resumed = _resume_state(cfg, resume, info, allow_config_change, log) if resume else None
    if resumed is not None and resumed[1]["epoch"] >= cfg.train.epochs:
        state = resumed[1]
        log(f"nothing left to train: the checkpoint {resume} already holds epoch {state['epoch']} and train.epochs "
            f"is {cfg.train.epochs} (its metrics are in its run folder's metrics.json; to train longer, raise "
            f"train.epochs and pass --allow-config-change)")
        history = list(state["history"])
        return {"nothing_to_train": True, "epochs_done": state["epoch"], "best_test_acc": state["best_acc"],
                "final_test_acc": history[-1]["test_acc"] if history else None, "config": cfg.to_dict()}
    torch.manual_seed(cfg.train.seed)
    # the model first: the loaders leave the global RNG untouched, so the order changes no number
    model = model_from_config(cfg, dataset_info(cfg.data.dataset)).to(info.device,
                                                                       memory_format=memory_format(cfg, info.device))
    loaders = build_loaders(cfg, info.rank, info.world, device=info.device)
    optimizer = optimizer_for(model, cfg, info.device, info.world)
    steps = len(loaders.train)
    if cfg.train.max_steps_per_epoch is not None:
        steps = min(steps, cfg.train.max_steps_per_epoch)
    scheduler = build_scheduler(optimizer, cfg.optim, steps, cfg.train.epochs)
    match_lr_kind(optimizer, scheduler)
    start_epoch, history, best_acc, changes = 0, [], -math.inf, []
    if resumed is not None:
        weights, state, changes = resumed
        restore(model, optimizer, scheduler, weights, state, resume)
        match_lr_kind(optimizer, scheduler)
        try:
            _set_rng_state(state["rng"], info.device)
        except (KeyError, TypeError, RuntimeError) as e:
            raise CheckpointError(f"checkpoint {resume}: its RNG state is unusable ({type(e).__name__}: {e})") from None
        start_epoch, history, best_acc = state["epoch"], list(state["history"]), state["best_acc"]
        log(f"resumed from {resume} after epoch {start_epoch}")
    n_params = count_parameters(model)
    log(f"{cfg.model.name} ({cfg.model.attention}) {n_params / 1e6:.2f}M parameters on {info.device}"
        f"{f' x{info.world} processes' if info.world > 1 else ''}; {loaders.train.n_images} train / "
        f"{loaders.test.n_images} {loaders.evaluates_on} images of {cfg.data.dataset}"
        f"{' (synthetic)' if cfg.data.synthetic else ''}; {pipeline(cfg)} pipeline"
        f"{f', compiled ({compile_choice(cfg, info.device)})' if compile_choice(cfg, info.device) else ''}")
    if info.is_main:  # temporaries of a process killed while writing this run directory
        for folder in (out_dir, out_dir / "checkpoints"):
            remove_stale_temporaries(folder)
    compile_model(model, cfg, info.device)
    net = DistributedDataParallel(model, device_ids=[info.device.index] if info.device.type == "cuda" else None) \
        if info.world > 1 else model
    graphs = Graphs(model, optimizer, loaders, cfg, info.device, info.world)
    summary, plotted, durations = {}, -math.inf, []
    for epoch in range(start_epoch, cfg.train.epochs):
        fits = epoch_fits(deadline, durations)
        if info.world > 1:  # every process stops at the same epoch
            fits = D.all_sum([0.0 if fits else 1.0], info)[0] == 0
        if not fits:
            log(f"stopped at the time budget after epoch {epoch} of {cfg.train.epochs}; the checkpoint is in "
                f"{out_dir}/checkpoints/ (--resume continues)")
            summary["stopped_early"] = True
            break
        t_epoch = time.perf_counter()
        loaders.train.set_epoch(epoch)
        torch.manual_seed(epoch_seed(cfg.train.seed, epoch, info.rank))
        row = {"epoch": epoch + 1, **train_one_epoch(net, loaders.train, optimizer, scheduler, cfg, info, epoch,
                                                      graphs.train)}
        row["test_loss"], row["test_acc"] = evaluate(model, loaders.test, cfg, info, graphs.eval)
        row["lr"] = current_lr(optimizer)
        history.append(row)
        is_best = row["test_acc"] > best_acc
        best_acc = max(best_acc, row["test_acc"])
        log(f"epoch {epoch + 1}/{cfg.train.epochs}: train loss {row['train_loss']:.4f} acc {row['train_acc']:.4f} | "
            f"{loaders.evaluates_on} loss {row['test_loss']:.4f} acc {row['test_acc']:.4f} | "
            f"{row['images_per_s']:.0f} img/s")
        summary = _summary(cfg, history, best_acc, n_params, info.world, loaders.evaluates_on, changes)
        summary["graph"] = graphs.status()
        overflow = getattr(model, "partner_overflow", None)
        if overflow is not None:  # OT-ViT's static forward: rows that went without their partner (expected 0)
            summary["partner_overflow_rows"] = int(overflow)
        if graphs.on and epoch == start_epoch:
            log(f"CUDA graphs: {graphs.status()}")
        if info.is_main:
            state = {"epoch": epoch + 1, "step": scheduler.last_epoch, "best_acc": best_acc,
                     "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                     "rng": _rng_state(info.device), "history": history, "config": cfg.to_dict(),
                     "device_type": info.device.type, "config_changes": changes}
            save_checkpoint(out_dir / "checkpoints", epoch + 1, model.state_dict(), state, is_best=is_best)
            write_metrics(out_dir, history, summary)
            last = epoch + 1 == cfg.train.epochs
            if cfg.train.plot and (last or time.monotonic() - plotted >= PLOT_INTERVAL_S):
                plot_curves(history, out_dir / "curves.png",
                            title=f"{cfg.model.name} ({cfg.model.attention}) on {cfg.data.dataset}")
                plotted = time.monotonic()
            if on_epoch is not None:
                on_epoch(row)
        D.barrier(info)
        durations.append(time.perf_counter() - t_epoch)
    if info.is_main and summary and not summary.get("stopped_early"):
        log(f"best test accuracy {best_acc:.4f}; metrics in {out_dir}/metrics.json and metrics.csv, curves in "
            f"{out_dir}/curves.png, checkpoints in {out_dir}/checkpoints/ (last.json, best.json)")
    return summary
