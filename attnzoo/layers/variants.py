"""One layer class per declared variant (``SoftmaxAttention``, ``SinkhornAttention``, ...), made from its
record: the shared shell of base.py with ``variant`` set, the record's docstring, and a signature
that lists the variant's own constructor options. ``variant_class`` makes the class of a variant
declared later (``attnzoo.register_variant``); each class is an attribute of this module, so pickle
finds it by name."""
from __future__ import annotations

import inspect

from ..ops import variant as catalog
from .base import AttentionLayer


def _signature(record: catalog.Variant) -> inspect.Signature:
    base = list(inspect.signature(AttentionLayer.__init__).parameters.values())[1:]
    base = [p for p in base if p.kind is not p.VAR_KEYWORD and p.name != "kind"]
    own = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=d) for n, d in record.hook.options().items()]
    return inspect.Signature(base + own + [inspect.Parameter("extra", inspect.Parameter.VAR_KEYWORD)])


def variant_class(record: catalog.Variant) -> type:
    """The layer class of ``record`` (made once per record)."""
    existing = globals().get(record.class_name)
    if isinstance(existing, type) and getattr(existing, "_record_id", None) == id(record):
        return existing
    if existing is not None and not (isinstance(existing, type) and issubclass(existing, AttentionLayer)):
        raise ValueError(f"class_name {record.class_name!r} is taken in {__name__}")
    cls = type(record.class_name, (AttentionLayer,), {
        "variant": record.name, "__doc__": record.doc or f"{record.name} attention (attnzoo.functional.{record.name}).",
        "__module__": __name__, "__qualname__": record.class_name, "_record_id": id(record),
        "__signature__": _signature(record)})
    globals()[record.class_name] = cls
    return cls


def forget(record: catalog.Variant) -> None:
    """Drop the class of a variant taken out of the catalog."""
    if getattr(globals().get(record.class_name), "_record_id", None) == id(record):
        del globals()[record.class_name]


for _record in catalog.records():
    variant_class(_record)
del _record
