"""The catalog of declared variants: ``declare`` adds a record (and registers its reference as the
backend "reference"), ``get`` / ``names`` / ``records`` read it."""
from __future__ import annotations

from . import dispatch
from .record import Variant

_VARIANTS: dict[str, Variant] = {}


def declare(record: Variant) -> Variant:
    """Add ``record`` to the catalog and register its reference as the backend "reference"."""
    if not isinstance(record, Variant):
        raise TypeError(f"declare expects a Variant record, got {type(record).__name__}")
    if record.name in _VARIANTS and _VARIANTS[record.name] is not record:
        raise ValueError(f"a variant named {record.name!r} is already declared")
    _VARIANTS[record.name] = record
    dispatch.register_backend(record.name, "reference", record.reference, priority=0, extras=record.extras,
                              description="eager PyTorch, materialises the N x N weights (the ground truth)")
    return record


def remove(name: str) -> None:
    """Take a variant out of the catalog and the dispatcher."""
    _VARIANTS.pop(name, None)
    dispatch.forget(name)


def get(name: str) -> Variant:
    if name not in _VARIANTS:
        raise ValueError(f"variant must be one of {list(_VARIANTS)}, got {name!r}")
    return _VARIANTS[name]


def names() -> list[str]:
    return list(_VARIANTS)


def records() -> list[Variant]:
    return list(_VARIANTS.values())


def is_declared(name) -> bool:
    return name in _VARIANTS

