"""One layer class per declared variant: the shared shell of base.py with ``variant`` set.

The classes of the built-in variants are written out at the end of this file, where a reader (and
grep) finds them. ``@from_record`` gives each the docstring of its variant's record (``doc=`` in
``ops/<variant>/__init__.py``) and a signature that lists the variant's own constructor options (its
layer hook's), so the record stays the one place that says them. ``variant_class`` makes the class of
a variant declared later (``attnzoo.register_variant``) the same way and stores it here, so that pickle
finds it by name. tests/test_variant_lists.py checks that every built-in variant has its class below
and that the export lists name exactly these classes."""
from __future__ import annotations

import inspect

from ..ops import variant as catalog
from .base import AttentionLayer


def _signature(record: catalog.Variant) -> inspect.Signature:
    base = list(inspect.signature(AttentionLayer.__init__).parameters.values())[1:]
    base = [p for p in base if p.kind is not p.VAR_KEYWORD and p.name != "kind"]
    own = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=d) for n, d in record.hook.options().items()]
    return inspect.Signature(base + own + [inspect.Parameter("extra", inspect.Parameter.VAR_KEYWORD)])


def _finish(cls: type, record: catalog.Variant) -> type:
    cls.__doc__ = record.doc or f"{record.name} attention (attnzoo.functional.{record.name})."
    cls.__signature__ = _signature(record)
    cls._record_id = id(record)
    return cls


def from_record(cls: type) -> type:
    """Class decorator for a built-in variant's class: the docstring and signature of ``cls.variant``'s record."""
    record = catalog.get(cls.variant)
    if record.class_name != cls.__name__:
        raise ValueError(f"the record of {cls.variant!r} names its class {record.class_name!r}, not {cls.__name__!r}")
    return _finish(cls, record)


def variant_class(record: catalog.Variant) -> type:
    """The layer class of ``record``: the one written below for a built-in variant, else made once."""
    existing = globals().get(record.class_name)
    if isinstance(existing, type) and getattr(existing, "_record_id", None) == id(record):
        return existing
    if existing is not None and not (isinstance(existing, type) and issubclass(existing, AttentionLayer)):
        raise ValueError(f"class_name {record.class_name!r} is taken in {__name__}")
    cls = type(record.class_name, (AttentionLayer,), {"variant": record.name, "__module__": __name__,
                                                       "__qualname__": record.class_name})
    globals()[record.class_name] = _finish(cls, record)
    return cls


def forget(record: catalog.Variant) -> None:
    """Drop the class of a variant taken out of the catalog."""
    if getattr(globals().get(record.class_name), "_record_id", None) == id(record):
        del globals()[record.class_name]


# -- the built-in variants' classes (docstrings and options: their records, ops/<variant>/__init__.py) --

@from_record
class SoftmaxAttention(AttentionLayer):
    variant = "softmax"


@from_record
class L2Attention(AttentionLayer):
    variant = "l2"


@from_record
class SinkhornAttention(AttentionLayer):
    variant = "sinkhorn"


@from_record
class SigmoidAttention(AttentionLayer):
    variant = "sigmoid"


@from_record
class ReLUAttention(AttentionLayer):
    variant = "relu"


@from_record
class LinearAttention(AttentionLayer):
    variant = "linear"


@from_record
class FenchelAttention(AttentionLayer):
    variant = "fenchel"


@from_record
class OTAttention(AttentionLayer):
    variant = "ot"
