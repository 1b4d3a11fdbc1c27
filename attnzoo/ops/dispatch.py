"""Choosing a kernel per call: ``backend="auto" | "reference" | "triton" | "torch" | ...``.

Each variant has a table of backends. A backend is a function with the variant's reference
signature plus a ``supports(q, k, v, **kwargs)`` predicate that returns None when it can run the
call or a sentence saying why not. ``auto`` takes the highest-priority backend that supports the
call; a backend named explicitly either runs or raises with its reason (it never silently hands
the call to another kernel). The global default is set with ``use_backend(...)``.
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field
from typing import Callable, Optional

AUTO = "auto"
_default_backend: contextvars.ContextVar[str] = contextvars.ContextVar("attnzoo_backend", default=AUTO)


@dataclass
class Backend:
    name: str
    fn: Callable
    supports: Callable[..., Optional[str]] = lambda *a, **k: None
    priority: int = 0
    description: str = ""
    # device types on which `auto` may pick this backend; naming it explicitly bypasses this (its
    # `supports` still decides). Triton kernels list only "cuda": under TRITON_INTERPRET=1 they
    # also run on CPU tensors, far too slowly to be anyone's default.
    auto_devices: tuple = ("cpu", "cuda")
    # consulted by `auto` only, after `supports`: None, or a sentence saying why auto prefers a
    # lower-priority backend for this call (e.g. a size where the reference was measured faster);
    # naming the backend explicitly bypasses it.
    auto_prefers: Optional[Callable[..., Optional[str]]] = None


@dataclass
class Choice:
    variant: str
    backend: Backend
    requested: str
    reasons: dict = field(default_factory=dict)  # backend name -> why it was not chosen

    def __str__(self) -> str:
        lines = [f"{self.variant}: runs '{self.backend.name}' ({self.backend.description or 'no description'})"
                 + (f", requested '{self.requested}'" if self.requested != AUTO else ", chosen by auto")]
        for name, why in self.reasons.items():
            lines.append(f"  skipped '{name}': {why}")
        return "\n".join(lines)


_TABLE: dict[str, dict[str, Backend]] = {}


def register_backend(variant: str, name: str, fn: Callable, supports=None, priority: int = 0,
                     description: str = "", auto_devices: tuple = ("cpu", "cuda"), auto_prefers=None) -> None:
    _TABLE.setdefault(variant, {})[name] = Backend(name, fn, supports or (lambda *a, **k: None),
                                                   priority, description, tuple(auto_devices), auto_prefers)


def backends(variant: str) -> list[str]:
    return sorted(_TABLE.get(variant, {}), key=lambda n: -_TABLE[variant][n].priority)


def default_backend() -> str:
    """The backend a call without ``backend=`` asks for: "auto" unless ``use_backend`` set another."""
    return _default_backend.get()


@contextlib.contextmanager
def use_backend(name: str):
    """Set the default backend for every attnzoo call inside the block (explicit args still win)."""
    token = _default_backend.set(name)
    try:
        yield
    finally:
        _default_backend.reset(token)


def choose(variant: str, backend: Optional[str], q, k, v, **kwargs) -> Choice:
    table = _TABLE.get(variant)
    if not table:
        raise ValueError(f"no backend registered for variant {variant!r}")
    requested = backend or _default_backend.get()
    if requested != AUTO:
        if requested not in table:
            raise ValueError(f"backend must be 'auto' or one of {backends(variant)} for {variant}, got {requested!r}")
        chosen = table[requested]
        why = chosen.supports(q, k, v, **kwargs)
        if why is not None:
            raise ValueError(f"backend={requested!r} cannot run this {variant} call: {why}")
        return Choice(variant, chosen, requested)
    reasons = {}
    for name in backends(variant):
        cand = table[name]
        if q.device.type not in cand.auto_devices:
            reasons[name] = f"auto does not pick it for {q.device.type} tensors (ask for it by name)"
            continue
        why = cand.supports(q, k, v, **kwargs)
        if why is None and cand.auto_prefers is not None:
            why = cand.auto_prefers(q, k, v, **kwargs)
        if why is None:
            return Choice(variant, cand, requested, reasons)
        reasons[name] = why
    raise ValueError(f"no backend can run this {variant} call: {reasons}")


def call(variant: str, backend: Optional[str], q, k, v, **kwargs):
    return choose(variant, backend, q, k, v, **kwargs).backend.fn(q, k, v, **kwargs)
