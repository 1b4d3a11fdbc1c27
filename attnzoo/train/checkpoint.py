"""Checkpoints: weights in safetensors, the rest (optimizer, scheduler, RNG, step, history) in a
torch file read back with ``weights_only=True``. Every file is written to a temporary name and
renamed (atomic on POSIX); ``last.json`` / ``best.json`` name the pair of files that belong together
and are themselves replaced atomically, so a crash at any moment leaves a loadable checkpoint."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Union

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

STATE_FORMAT = "attnzoo-train-state/1"
_UMASK = os.umask(0o022)
os.umask(_UMASK)


class CheckpointError(RuntimeError):
    """A checkpoint exists but cannot be used (corrupt, truncated, mismatched)."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No checkpoint where one was expected."""


def _atomic_write(path: Path, write: Callable[[str], Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600 files; give the usual permissions
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def save_checkpoint(ckpt_dir: Union[str, Path], epoch: int, weights: dict, state: dict,
                    is_best: bool = False) -> Path:
    """Write epochNNNN.{safetensors,state.pt}, point last.json (and best.json) at them, drop the
    files no pointer names any more."""
    ckpt_dir = Path(ckpt_dir)
    stem = f"epoch{epoch:04d}"
    weights = {k: v.detach().cpu().contiguous() for k, v in weights.items()}
    _atomic_write(ckpt_dir / f"{stem}.safetensors",
                  lambda p: save_file(weights, p, metadata={"epoch": str(epoch), "format": STATE_FORMAT}))
    _atomic_write(ckpt_dir / f"{stem}.state.pt", lambda p: torch.save({"format": STATE_FORMAT, **state}, p))
    pointer = json.dumps({"epoch": epoch, "weights": f"{stem}.safetensors", "state": f"{stem}.state.pt"})
    for name in (["last", "best"] if is_best else ["last"]):
        _atomic_write(ckpt_dir / f"{name}.json", lambda p: Path(p).write_text(pointer))
    _remove_unreferenced(ckpt_dir)
    return ckpt_dir / f"{stem}.safetensors"


def _remove_unreferenced(ckpt_dir: Path) -> None:
    keep = set()
    for name in ("last", "best"):
        p = ckpt_dir / f"{name}.json"
        if p.is_file():
            ref = json.loads(p.read_text())
            keep |= {ref["weights"], ref["state"]}
    for f in ckpt_dir.glob("epoch*"):
        if f.name not in keep:
            f.unlink(missing_ok=True)


def resolve(path: Union[str, Path], which: str = "last") -> tuple[Path, Path]:
    """(weights file, state file) from a run dir, its checkpoints/ dir, a pointer .json, or a .safetensors."""
    p = Path(path)
    if p.is_dir():
        p = p / "checkpoints" / f"{which}.json" if (p / "checkpoints").is_dir() else p / f"{which}.json"
    if p.suffix == ".safetensors":
        weights, state = p, p.with_name(p.name[:-len(".safetensors")] + ".state.pt")
    else:
        if not p.is_file():
            raise CheckpointNotFoundError(f"no checkpoint at {str(path)!r} (looked for {p}); train first or "
                                          f"pass a run directory, a {which}.json or a .safetensors file")
        try:
            ref = json.loads(p.read_text())
            weights, state = p.parent / ref["weights"], p.parent / ref["state"]
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"checkpoint pointer {p} is corrupt ({e}); delete it or pass the "
                                  f".safetensors file directly") from None
    for f in (weights, state):
        if not f.is_file():
            raise CheckpointNotFoundError(f"checkpoint file {f} is missing (referenced from {path})")
    return weights, state


def load_weights(path: Union[str, Path]) -> dict:
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint weights {path} are corrupt or truncated ({e})") from None


def load_state(path: Union[str, Path]) -> dict:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # unpickling errors come in many types
        raise CheckpointError(f"checkpoint state {path} is corrupt or truncated "
                              f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        raise CheckpointError(f"{path} is not an attnzoo training state (format {STATE_FORMAT})")
    return state


def load_checkpoint(path: Union[str, Path], which: str = "last") -> tuple[dict, dict]:
    """(weights, state) of a checkpoint; CheckpointNotFoundError / CheckpointError with the reason."""
    weights_file, state_file = resolve(path, which)
    weights, state = load_weights(weights_file), load_state(state_file)
    return weights, state
