"""Turning an exception raised by a benchmarked call into a recorded status and reason."""
from __future__ import annotations

import torch

OK, OOM, UNSUPPORTED, UNAVAILABLE, SKIPPED, ERROR = "ok", "oom", "unsupported", "unavailable", "skipped", "error"
STATUSES = (OK, OOM, UNSUPPORTED, UNAVAILABLE, SKIPPED, ERROR)

_OOM_PHRASES = ("out of memory", "can't allocate memory", "cannot allocate memory", "failed to allocate")


def short(message: str, limit: int = 400) -> str:
    text = " ".join(str(message).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def classify(exc: BaseException) -> tuple[str, str]:
    """(status, reason): out-of-memory (torch.OutOfMemoryError, MemoryError, or an allocator
    RuntimeError), unsupported (NotImplementedError, SDPA's "No available kernel"), else error."""
    message = short(f"{type(exc).__name__}: {exc}")
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return OOM, message
    low = str(exc).lower()
    if isinstance(exc, RuntimeError) and any(p in low for p in _OOM_PHRASES):
        return OOM, message
    if isinstance(exc, NotImplementedError) or "no available kernel" in low:
        return UNSUPPORTED, message
    return ERROR, message


def free_cached_memory(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


class Unsupported(Exception):
    """This target cannot run this problem (the reason is the message)."""


class Unavailable(Exception):
    """The library behind this target is not installed."""


class Skipped(Exception):
    """Not run on purpose (predicted too slow or too large, or not meant for this device)."""
