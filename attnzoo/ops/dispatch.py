"""Choosing a kernel per call: ``backend="auto" | "reference" | "triton" | "torch" | ...``.

Each variant has a table of backends. A backend is a function with the variant's reference
signature plus a ``supports(q, k, v, **kwargs)`` predicate that returns None when it can run the
call or a sentence saying why not. A backend named explicitly either runs or raises with its reason
(it never silently hands the call to another kernel). ``auto`` tries, in order:

1. on a device with a measured table (``ops/measured.py``: a per-device JSON file written by
   ``benchmarks/gpu_speed.py``), the backends that table ranks fastest for the nearest measured
   shape of this variant, dtype and causality;
2. then every backend by priority, highest first.

The first one that supports the call (and, for auto, is allowed on this device type and not vetoed
by its ``auto_prefers``) runs.

The global default is a plain module attribute set by ``use_backend(...)`` (like
``torch.nn.attention.sdpa_kernel``'s flags): torch.compile reads it while tracing and guards on its
value, so changing it recompiles instead of being ignored, and nothing on the forward path reads a
ContextVar (which dynamo cannot trace). It is process-wide, not per thread.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Optional

from . import measured
from .validate import close_match

AUTO = "auto"


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
    # device types on which this backend returns a zero row for a query holding NaN (SDPA's fused CPU
    # kernel: its running max skips NaN scores); the caller then puts the NaN back (attnzoo's rule is
    # that NaN in q reaches the output row of that query, on every backend)
    hides_query_nan_on: tuple = ()
    # True when ``supports`` reads tensor values (not only shapes, dtypes, devices and flags): a choice
    # that consulted it is made again on every call instead of being kept for the call's signature
    reads_values: bool = False
    # True when the backend takes ``enable_gqa=True`` with k, v of fewer heads than q (each key/value
    # head shared by H / H_kv query heads, indexed in place); other backends get k, v expanded
    gqa: bool = False
    # None, or ``specialize(q, k, v, **kwargs) -> fn or None``: a function of the backend's signature
    # that does only what calls of this signature need (decided once per signature, ops/plan.py)
    specialize: Optional[Callable] = None
    # which of softcap and sinks (ops/logit_extras.py) the backend implements: a call passing another is
    # declined with the reason, so it runs on a backend that does (never on one that would ignore it)
    extras: frozenset = frozenset()


def extras_reason(backend: Backend, kwargs) -> Optional[str]:
    """Why ``backend`` cannot run a call that passes softcap or sinks it does not implement, or None."""
    missing = [n for n in ("softcap", "sinks") if kwargs.get(n) is not None and n not in backend.extras]
    return f"does not implement {' or '.join(missing)}" if missing else None


@dataclass
class Choice:
    variant: str
    backend: Backend
    requested: str
    reasons: dict = field(default_factory=dict)  # backend name -> why it was not chosen
    measured_order: tuple = ()  # the device table's ranking for this call, fastest first, if any
    # False when a backend consulted for it reads tensor values: the same signature may choose otherwise
    reusable: bool = True
    notes: tuple = ()  # what else explain says about the call (e.g. how grouped-query heads are handled)

    def __str__(self) -> str:
        lines = [f"{self.variant}: runs '{self.backend.name}' ({self.backend.description or 'no description'})"
                 + (f", requested '{self.requested}'" if self.requested != AUTO else ", chosen by auto")]
        if self.measured_order:
            lines.append(f"  measured on this device, fastest first: {', '.join(self.measured_order)}")
        for name, why in self.reasons.items():
            lines.append(f"  skipped '{name}': {why}")
        lines.extend(f"  {note}" for note in self.notes)
        return "\n".join(lines)


_TABLE: dict[str, dict[str, Backend]] = {}

# Bumped whenever a table changes, so decisions kept for a call signature (ops/plan.py) are dropped.
generation = 0


def _changed() -> None:
    global generation
    generation += 1


class _Default:
    """The backend a call without ``backend=`` asks for (an attribute, so dynamo guards on it)."""
    name: str = AUTO


def register_backend(variant: str, name: str, fn: Callable, supports=None, priority: int = 0,
                     description: str = "", auto_devices: tuple = ("cpu", "cuda"), auto_prefers=None,
                     hides_query_nan_on: tuple = (), reads_values: bool = False, gqa: bool = False,
                     specialize: Optional[Callable] = None, extras=()) -> None:
    """Add (or replace) backend ``name`` of ``variant``. ``supports`` and ``auto_prefers`` must decide
    from the call's shapes, dtypes, devices, ``requires_grad``, grad mode and plain option values, so
    a decision can be kept per call signature; one that reads tensor values says ``reads_values=True``.
    ``gqa=True``: the backend takes ``enable_gqa=True`` (fewer key/value heads than query heads).
    ``specialize``: see :class:`Backend`. ``extras``: which of softcap and sinks it implements."""
    _TABLE.setdefault(variant, {})[name] = Backend(name, fn, supports or (lambda *a, **k: None),
                                                   priority, description, tuple(auto_devices), auto_prefers,
                                                   tuple(hides_query_nan_on), bool(reads_values), bool(gqa),
                                                   specialize, frozenset(extras))
    _changed()


def all_of(*checks):
    """A ``supports`` predicate: the first reason any of ``checks`` gives, or None."""
    def supports(q, k, v, **kw):
        for check in checks:
            why = check(q, k, v, **kw)
            if why is not None:
                return why
        return None
    return supports


def forget(variant: str) -> None:
    """Drop every backend of ``variant`` (a variant removed from the catalog)."""
    _TABLE.pop(variant, None)
    _changed()


def backends(variant: str) -> list[str]:
    return sorted(_TABLE.get(variant, {}), key=lambda n: -_TABLE[variant][n].priority)


def backend_table(variant: str) -> dict[str, Backend]:
    """The registered backends of ``variant`` by name (a copy: register_backend changes the table)."""
    if variant not in _TABLE:
        raise ValueError(f"variant must be one of {sorted(_TABLE)}, got {variant!r}")
    return dict(_TABLE[variant])


def default_backend() -> str:
    """The backend a call without ``backend=`` asks for: "auto" unless ``use_backend`` set another."""
    return _Default.name


def _known_backend_names() -> set:
    return {AUTO} | {name for table in _TABLE.values() for name in table}


@contextlib.contextmanager
def use_backend(name: str):
    """Set the default backend for every attnzoo call inside the block (explicit args still win).
    Process-wide: another thread calling attnzoo inside the block sees it too."""
    known = _known_backend_names()
    if not isinstance(name, str) or name not in known:
        raise ValueError(f"use_backend: name must be one of {sorted(known)}, got {name!r}{close_match(name, known)}")
    previous = _Default.name
    _Default.name = name
    try:
        yield
    finally:
        _Default.name = previous


def _auto_candidates(variant: str, q, k, v, kwargs) -> tuple[list[str], tuple]:
    """Backend names in the order auto tries them: the device table's ranking, then priority."""
    by_priority = backends(variant)
    ranked = measured.ranking(variant, q, k, v, kwargs)
    ranked = tuple(name for name in ranked if name in _TABLE[variant])
    return list(ranked) + [name for name in by_priority if name not in ranked], ranked


def choose(variant: str, backend: Optional[str], q, k, v, **kwargs) -> Choice:
    table = _TABLE.get(variant)
    if not table:
        raise ValueError(f"no backend registered for variant {variant!r}")
    requested = backend or _Default.name
    if not isinstance(requested, str) or requested != AUTO:
        if not isinstance(requested, str) or requested not in table:
            raise ValueError(f"backend must be 'auto' or one of {backends(variant)} for {variant}, got {requested!r}"
                             f"{close_match(requested, [AUTO, *table])}")
        chosen = table[requested]
        why = extras_reason(chosen, kwargs) or chosen.supports(q, k, v, **kwargs)
        if why is not None:
            raise ValueError(f"backend={requested!r} cannot run this {variant} call: {why}")
        return Choice(variant, chosen, requested, reusable=not chosen.reads_values)
    reasons = {}
    reusable = True
    order, ranked = _auto_candidates(variant, q, k, v, kwargs)
    for name in order:
        cand = table[name]
        if q.device.type not in cand.auto_devices:
            reasons[name] = f"auto does not pick it for {q.device.type} tensors (ask for it by name)"
            continue
        reusable = reusable and not cand.reads_values
        why = extras_reason(cand, kwargs) or cand.supports(q, k, v, **kwargs)
        if why is None and cand.auto_prefers is not None:
            why = cand.auto_prefers(q, k, v, **kwargs)
        if why is None:
            return Choice(variant, cand, requested, reasons, ranked, reusable)
        reasons[name] = why
    raise ValueError(f"no backend can run this {variant} call: {reasons}")
