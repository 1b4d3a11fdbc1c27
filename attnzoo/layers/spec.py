"""Spec strings such as ``"sinkhorn(n_iters=5, eps=0.5)"``: a name with literal keyword arguments.

``split_spec`` is the one parser behind every place that takes them: ``attnzoo.create`` /
``attnzoo.layer`` / ``attnzoo.parse_spec`` (registry.py, which also checks the name against the
registered ones) and a wrapper's ``kind=`` (MaskedAttention, MultiheadAttention), read by
``split_kind``. It lives here, below the registry, because the wrappers need it."""
from __future__ import annotations

import ast
from typing import Any


def split_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``"sinkhorn(n_iters=5, eps=0.5)"`` -> ("sinkhorn", {"n_iters": 5, "eps": 0.5}); literals only.
    Checks the form, not the name."""
    if not isinstance(spec, str):
        raise TypeError(f"spec must be a string such as 'sinkhorn(n_iters=5)', got {type(spec).__name__}")
    text = spec.strip()
    try:
        node = ast.parse(text, mode="eval").body
    except SyntaxError as e:
        raise ValueError(f"spec {spec!r} is not of the form name or name(key=value, ...): {e.msg}") from None
    if isinstance(node, ast.Name):
        return node.id, {}
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args):
        raise ValueError(f"spec {spec!r} is not of the form name or name(key=value, ...) (keyword arguments only)")
    kwargs = {}
    for kw in node.keywords:
        if kw.arg is None:
            raise ValueError(f"spec {spec!r}: **kwargs are not allowed")
        try:
            kwargs[kw.arg] = ast.literal_eval(kw.value)
        except ValueError:
            raise ValueError(f"spec {spec!r}: the value of {kw.arg!r} must be a literal "
                             f"(number, string, bool, None, tuple/list/dict)") from None
    return node.func.id, kwargs


def split_kind(kind: Any, given: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """A wrapper's ``kind`` as a name (``"sinkhorn"``) or a spec string (``"sinkhorn(n_iters=5)"``):
    returns the kind's name and its options, those of the spec merged with ``given`` (the options
    passed as keyword arguments). An option in both is a TypeError: neither silently wins.
    A ``kind`` that is not a string is returned as it is, for the caller's own check to name."""
    if not isinstance(kind, str) or "(" not in kind:
        return kind, dict(given)
    name, options = split_spec(kind)
    both = sorted(set(options) & set(given))
    if both:
        raise TypeError(f"kind={kind!r} and the keyword arguments both set {both}: give each option once")
    return name, {**options, **given}
