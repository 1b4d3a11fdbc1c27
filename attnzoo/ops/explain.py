"""``attnzoo.explain``: which backend runs a call and why the others were skipped, checked as the
variant's function checks it; and ``check_keywords``, the unknown-keyword error it shares."""
from __future__ import annotations

import inspect
from typing import Any, Mapping

from . import call, dispatch
from . import logit_extras
from . import validate as V
from .call_path import _with_extras, backend_kwargs, window_route
from .catalog import _VARIANTS
from .record import SHARED_ARGS, Variant

def explain(name: str, q, k, v, backend=None, **kwargs) -> dispatch.Choice:
    """Which backend runs this call and why the others were skipped. The arguments are checked exactly
    as the variant's function checks them (an unknown keyword is a TypeError naming it); the
    function's defaults fill the options not given."""
    V.check_choice("variant", name, _VARIANTS)
    record = _VARIANTS[name]
    check_keywords(record, kwargs)
    options = {**record.options, **{n: a for n, a in kwargs.items() if n not in SHARED_ARGS},
               **{n: kwargs[n] for n in logit_extras.NAMES if n in kwargs}}
    options, window = _with_extras(record, options)
    shared = {n: kwargs[n] for n in call.SHARED_KWARGS + ("enable_gqa",) if n in kwargs}
    kw = backend_kwargs(name, q, k, v, **shared, **options)
    group = call.gqa_group(q, k)
    kk, vv = (call.expand_heads(k, group), call.expand_heads(v, group)) if group > 1 else (k, v)
    native = None
    if window is not None:  # as the call path routes it (ops/call_path.py)
        native, band = window_route(name, backend or dispatch.default_backend(), q, kk, vv, kw, window)
        if native is None:
            kw["attn_mask"] = logit_extras.mask_with_window(kw["attn_mask"], band)
    if native is not None:
        choice = dispatch.Choice(name, native, backend or dispatch.default_backend(),
                                 notes=(f"window_size={window}: '{native.name}' skips what lies outside the band",))
    else:
        choice = dispatch.choose(name, backend, q, kk, vv, **kw)
        if window is not None:
            choice.notes = choice.notes + (f"window_size={window}: '{choice.backend.name}' does not take windows: "
                                           "the band is folded into its mask (an (Nq, Nk) bool tensor)",)
    if group > 1:
        how = ("indexes each shared key/value head in place" if choice.backend.gqa else
               "does not index shared heads: k and v are expanded to q's heads first (a copy)")
        choice.notes = choice.notes + (f"grouped-query attention, {call.gqa_group(q, k)} query heads per key/value "
                                       f"head: '{choice.backend.name}' {how}",)
    return choice


def check_keywords(record: Variant, kwargs: Mapping[str, Any]) -> None:
    """TypeError for a keyword the variant's function does not take, with the closest one it does."""
    params = inspect.signature(record.functional).parameters
    accepted = {n for n, p in params.items() if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
    accepted.discard("q"), accepted.discard("k"), accepted.discard("v")
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        accepted |= set(record.options) | set(SHARED_ARGS)
    accepted.add("enable_gqa")
    for keyword in kwargs:
        if keyword not in accepted:
            raise TypeError(f"{record.name}() got an unexpected keyword argument {keyword!r}"
                            f"{V.close_match(keyword, accepted)}; it takes {sorted(accepted)}")
