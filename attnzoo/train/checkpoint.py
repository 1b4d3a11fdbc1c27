"""Checkpoints: weights in safetensors, the rest (optimizer, scheduler, RNG, step, history, config) in
a torch file read back with ``weights_only=True``.

Integrity: every file is written to a temporary name, flushed and renamed (atomic on POSIX); a
temporary left by a killed process is removed by the next save (``remove_stale_temporaries``).
``last.json`` / ``best.json`` name the pair of files that belong together with their SHA-256
checksums. The pair also vouches for itself, so a checkpoint loaded by its ``.safetensors`` path
with no pointer beside it is verified too: the weights file's metadata holds the SHA-256 of its own
tensors (names, dtypes, shapes and bytes) and of the state file, and the state records the weights'
tensor checksum (the two files belong together). Every file read is checked; a checkpoint that
carries no checksum for a file it needs (one written by an older attnzoo, loaded without its
pointer) is refused rather than trusted. A save writes the state, then the weights, then
``best.json`` (when the epoch is the best), then ``last.json``: a crash at any moment leaves both
pointers naming complete, verified files (``best.json`` can only run ahead of ``last.json``, by
one epoch; in a run's first save ``last.json`` may not exist yet). A run folder resumes from the
newest of the two (``newest_pointer``), so no finished epoch is trained again."""
from __future__ import annotations

import hashlib
import io
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Union

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

STATE_FORMAT = "attnzoo-train-state/1"
STATE_KEYS = ("epoch", "step", "best_acc", "optimizer", "scheduler", "rng", "history", "config")
TMP_SUFFIX = ".tmp"
_UMASK = os.umask(0o022)
os.umask(_UMASK)


class CheckpointError(RuntimeError):
    """A checkpoint exists but cannot be used (corrupt, truncated, mismatched)."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No checkpoint where one was expected."""


def _atomic_write(path: Path, write: Callable[[str], Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TMP_SUFFIX, dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        # mkstemp makes 0600 files; give the usual permissions after the write, since a writer may
        # replace the file rather than write into it (safetensors' save_file does: its file was 0600)
        os.chmod(tmp, 0o666 & ~_UMASK)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def remove_stale_temporaries(folder: Union[str, Path]) -> list[Path]:
    """Delete ``.NAME.XXXX.tmp`` files that ``_atomic_write`` left when its process was killed. Only
    one process writes a run directory, so any temporary found before it writes is stale."""
    folder = Path(folder)
    removed = []
    if folder.is_dir():
        for f in folder.glob(f".*{TMP_SUFFIX}"):
            f.unlink(missing_ok=True)
            removed.append(f)
    return removed


def sha256(path: Union[str, Path]) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def tensors_sha256(tensors: dict) -> str:
    """SHA-256 of a state dict's content: every tensor's name, dtype, shape and bytes, in name order.
    It does not depend on how a file lays the tensors out, so it travels inside the file itself."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def save_checkpoint(ckpt_dir: Union[str, Path], epoch: int, weights: dict, state: dict,
                    is_best: bool = False) -> Path:
    """Write epochNNNN.{state.pt,safetensors}, point best.json (when best) then last.json at them with
    their checksums, drop the files no pointer names any more."""
    ckpt_dir = Path(ckpt_dir)
    remove_stale_temporaries(ckpt_dir)
    stem = f"epoch{epoch:04d}"
    weights = {k: v.detach().cpu().contiguous() for k, v in weights.items()}
    weights_file, state_file = ckpt_dir / f"{stem}.safetensors", ckpt_dir / f"{stem}.state.pt"
    content = tensors_sha256(weights)
    buffer = io.BytesIO()
    recorded = {k: v for k, v in state.items() if k not in ("format", "weights_sha256", "weights_tensors_sha256")}
    torch.save({"format": STATE_FORMAT, **recorded, "weights_tensors_sha256": content}, buffer)
    state_bytes = buffer.getvalue()
    state_sum = hashlib.sha256(state_bytes).hexdigest()
    _atomic_write(state_file, lambda p: Path(p).write_bytes(state_bytes))
    _atomic_write(weights_file, lambda p: save_file(weights, p, metadata={
        "epoch": str(epoch), "format": STATE_FORMAT, "tensors_sha256": content, "state_sha256": state_sum}))
    pointer = json.dumps({"epoch": epoch, "weights": weights_file.name, "weights_sha256": sha256(weights_file),
                          "state": state_file.name, "state_sha256": state_sum})
    for name in (["best", "last"] if is_best else ["last"]):
        _atomic_write(ckpt_dir / f"{name}.json", lambda p: Path(p).write_text(pointer))
    _remove_unreferenced(ckpt_dir)
    return weights_file


def _read_pointer(p: Path) -> dict:
    """A pointer's content, checked: plain file names in its own folder (never a path elsewhere)."""
    try:
        ref = json.loads(p.read_text())
        names = (ref["weights"], ref["state"])
        if not all(isinstance(n, str) for n in names):
            raise TypeError("file names must be strings")
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"checkpoint pointer {p} is corrupt ({e}); delete it or pass the "
                              f".safetensors file directly") from None
    for n in names:
        if not n or Path(n).name != n or n in (".", ".."):
            raise CheckpointError(f"checkpoint pointer {p} names {n!r}, which is not a file in {p.parent}; "
                                  f"a pointer may only name files beside it")
    return ref


def _remove_unreferenced(ckpt_dir: Path) -> None:
    keep = set()
    for name in ("last", "best"):
        p = ckpt_dir / f"{name}.json"
        if p.is_file():
            ref = _read_pointer(p)
            keep |= {ref["weights"], ref["state"]}
    for f in ckpt_dir.glob("epoch*"):
        if f.name not in keep:
            f.unlink(missing_ok=True)


def newest_pointer(folder: Union[str, Path]) -> Union[Path, None]:
    """The pointer (``last.json`` or ``best.json``) of a run dir or its checkpoints/ dir that names the
    latest epoch, or None when there is none. ``best.json`` runs ahead of ``last.json`` when a save
    was killed between the two (in a run's first save, ``last.json`` is then absent)."""
    folder = Path(folder)
    if (folder / "checkpoints").is_dir():
        folder = folder / "checkpoints"
    pointers = [folder / f"{name}.json" for name in ("last", "best") if (folder / f"{name}.json").is_file()]
    if len(pointers) < 2:
        return pointers[0] if pointers else None
    return max(pointers, key=_pointer_epoch)  # max keeps the first (last.json) on a tie


def _pointer_epoch(p: Path) -> int:
    epoch = _read_pointer(p).get("epoch")
    if not isinstance(epoch, int) or isinstance(epoch, bool):
        raise CheckpointError(f"checkpoint pointer {p} is corrupt (its epoch is {epoch!r}); delete it or pass the "
                              f".safetensors file directly")
    return epoch


POINTERS = ("newest", "last", "best")


def resolve(path: Union[str, Path], which: str = "newest") -> tuple[Path, Path, dict]:
    """(weights file, state file, expected checksums) from a run dir, its checkpoints/ dir, a pointer
    .json, or a .safetensors (whose checksums come from a pointer beside it that names it, if any).
    For a folder, ``which`` picks the pointer: ``"newest"`` (``newest_pointer``), ``"last"`` or ``"best"``."""
    if which not in POINTERS:
        raise ValueError(f"which must be one of {POINTERS}, got {which!r}")
    p = Path(path)
    if p.is_dir():
        newest = newest_pointer(p) if which == "newest" else None
        name = "last" if which == "newest" else which
        p = newest or (p / "checkpoints" / f"{name}.json" if (p / "checkpoints").is_dir() else p / f"{name}.json")
    sums: dict = {}
    if p.suffix == ".safetensors":
        weights, state = p, p.with_name(p.name[:-len(".safetensors")] + ".state.pt")
        for name in ("last", "best"):
            pointer = p.parent / f"{name}.json"
            if pointer.is_file():
                ref = _read_pointer(pointer)
                if ref["weights"] == p.name:
                    sums = ref
                    break
    else:
        if not p.is_file():
            raise CheckpointNotFoundError(f"no checkpoint at {str(path)!r} (looked for {p}); train first or "
                                          f"pass a run directory, a last.json / best.json or a .safetensors file")
        sums = _read_pointer(p)
        weights, state = p.parent / sums["weights"], p.parent / sums["state"]
    for f in (weights, state):
        if not f.is_file():
            raise CheckpointNotFoundError(f"checkpoint file {f} is missing (referenced from {path})")
    return weights, state, {k: sums[k] for k in ("weights_sha256", "state_sha256") if k in sums}


def _verify(path: Path, expected, what: str) -> None:
    if expected is not None and sha256(path) != expected:
        raise CheckpointError(f"checkpoint {what} {path} is corrupt: its SHA-256 differs from the one recorded "
                              f"when it was saved (disk or copy damage); use another checkpoint or retrain")


def weights_metadata(path: Union[str, Path]) -> dict:
    """The metadata a weights file carries (its tensors' and its state's checksums), from its header."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return dict(f.metadata() or {})
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint weights {path} are corrupt or truncated ({e})") from None


def load_weights(path: Union[str, Path], expected_sha256: str = None, expected_tensors_sha256: str = None) -> dict:
    """The tensors of a weights file, checked against the file checksum given (a pointer's) and against
    the tensor checksum its own metadata records (and ``expected_tensors_sha256``, the state's)."""
    _verify(Path(path), expected_sha256, "weights")
    try:
        weights = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint weights {path} are corrupt or truncated ({e})") from None
    recorded = weights_metadata(path).get("tensors_sha256")
    if recorded is not None or expected_tensors_sha256 is not None:
        content = tensors_sha256(weights)
        if recorded is not None and content != recorded:
            raise CheckpointError(f"checkpoint weights {path} are corrupt: the SHA-256 of their tensors differs from "
                                  f"the one the file recorded when it was saved; use another checkpoint or retrain")
        if expected_tensors_sha256 is not None and content != expected_tensors_sha256:
            raise CheckpointError(f"checkpoint weights {path} do not belong to their state file: the state records "
                                  f"another SHA-256 for its weights' tensors; use the pair a last.json names")
    return weights


def load_state(path: Union[str, Path], expected_sha256: str = None) -> dict:
    _verify(Path(path), expected_sha256, "state")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # unpickling errors come in many types
        raise CheckpointError(f"checkpoint state {path} is corrupt or truncated "
                              f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        raise CheckpointError(f"{path} is not an attnzoo training state (format {STATE_FORMAT})")
    missing = [k for k in STATE_KEYS if k not in state]
    if missing:
        raise CheckpointError(f"checkpoint state {path} lacks {missing}: not a complete attnzoo training state")
    return state


def load_checkpoint(path: Union[str, Path], which: str = "newest") -> tuple[dict, dict]:
    """(weights, state) of a checkpoint, every file verified against a checksum recorded when it was
    saved (a pointer's, or the pair's own when the weights file is named directly);
    CheckpointNotFoundError / CheckpointError with the reason. ``which``: see ``resolve``."""
    weights_file, state_file, sums = resolve(path, which)
    state_sum = sums.get("state_sha256")
    if state_sum is None:  # no pointer names the pair: the weights file records its state's checksum
        state_sum = weights_metadata(weights_file).get("state_sha256")
        if state_sum is None:
            raise CheckpointError(f"checkpoint state {state_file} cannot be verified: no last.json or best.json "
                                  f"names it and {weights_file.name} records no checksum for it (saved by an "
                                  f"older attnzoo); resume from the run's last.json instead")
    state = load_state(state_file, state_sum)
    weights = load_weights(weights_file, sums.get("weights_sha256") or state.get("weights_sha256"),
                           state.get("weights_tensors_sha256"))
    return weights, state


def _differences(saved: dict, wanted: dict, prefix: str = "") -> list[str]:
    out = []
    for k in sorted(set(saved) | set(wanted)):
        a, b = saved.get(k, "<absent>"), wanted.get(k, "<absent>")
        if isinstance(a, dict) and isinstance(b, dict):
            out += _differences(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k}: checkpoint {a!r}, config {b!r}")
    return out


# settings that change no number of a run: a resume may change them freely (the two data pipelines
# give the same batches bit for bit; the device is compared as the device type actually used)
RESUME_INCIDENTAL = ("train.out_dir", "train.progress", "train.plot", "train.log_every", "train.device",
                     "data.data_dir", "data.download", "data.num_workers", "data.pipeline")


def _with_defaults(saved: dict, defaults: dict) -> dict:
    """A saved config with the settings it predates filled in with their defaults (what it ran with)."""
    out = dict(defaults)
    for key, value in saved.items():
        out[key] = _with_defaults(value, defaults[key]) if isinstance(value, dict) and isinstance(
            defaults.get(key), dict) else value
    return out


def check_same_model(state: dict, config: dict, path, defaults: dict = None, advice: str = "") -> dict:
    """The checkpoint's recorded config (settings it predates filled in from ``defaults``), after
    checking that it trained the model ``config`` describes: the whole ``model`` section and the
    dataset. Otherwise a CheckpointError listing each differing key: weights of another attention,
    head count, ... can have the same shapes and load without a word. ``advice``: what to do instead."""
    saved = state.get("config")
    if not isinstance(saved, dict):
        raise CheckpointError(f"checkpoint {path} records no config, so it cannot be checked against this one")
    if defaults is not None:
        saved = _with_defaults(saved, defaults)
    diffs = _differences({"model": saved.get("model", {}), "dataset": saved.get("data", {}).get("dataset")},
                         {"model": config["model"], "dataset": config["data"]["dataset"]})
    if diffs:
        raise CheckpointError(f"checkpoint {path} was trained with a different model: {'; '.join(diffs)}"
                              f"{'; ' + advice if advice else ''}")
    return saved


def check_resumable(state: dict, config: dict, path, allow_change: bool = False,
                    device_type: str = None, defaults: dict = None) -> list[str]:
    """The settings a resume changes, as ``"key: checkpoint A, config B"`` lines. A checkpoint whose
    model (or dataset) differs from the config is always refused; any other change (learning rate,
    seed, batch size, epochs, ..., or the device type) would make the run differ from an
    uninterrupted one, so it is refused unless ``allow_change``. ``defaults``: the config's default
    values, for settings a checkpoint saved by an older attnzoo does not record."""
    saved = check_same_model(state, config, path, defaults,
                             advice="resume with the checkpoint's settings or train into a new train.out_dir")
    rest = lambda c: {k: v for k, v in c.items() if k != "model"}  # noqa: E731
    changes = [d for d in _differences(rest(saved), rest(config)) if d.split(":")[0] not in RESUME_INCIDENTAL]
    saved_device = state.get("device_type")
    if device_type is not None and saved_device is not None and saved_device != device_type:
        changes.append(f"device: checkpoint {saved_device!r}, now {device_type!r}")
    if changes and not allow_change:
        raise CheckpointError(f"checkpoint {path} was trained with other settings: {'; '.join(changes)}; resuming "
                              f"with them would not continue the same run (it would differ from an uninterrupted "
                              f"one); resume with the checkpoint's settings, train into a new train.out_dir, or "
                              f"pass --allow-config-change (the changes are then recorded in metrics.json)")
    return changes


def restore(model: torch.nn.Module, optimizer, scheduler, weights: dict, state: dict, path) -> None:
    """Load a verified checkpoint into the live objects; a mismatch is a CheckpointError, not a raw
    RuntimeError/KeyError from torch."""
    try:
        model.load_state_dict(weights)
    except RuntimeError as e:
        first = " ".join(str(e).split())[:300]
        raise CheckpointError(f"checkpoint {path} holds weights of another architecture ({first})") from None
    try:
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
    except (ValueError, KeyError, TypeError, RuntimeError) as e:
        raise CheckpointError(f"checkpoint {path}: optimizer/scheduler state does not fit this model "
                              f"({type(e).__name__}: {e})") from None
