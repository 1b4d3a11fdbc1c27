"""The call path: every public attention function ends in ``attend``, which checks a call, decides
once per call signature (ops/plan.py) and runs the chosen backend (docs/design.md, "The call path").
The file reads top to bottom: ``attend`` first, then what it calls in the order it calls them."""
from __future__ import annotations

from typing import Optional

import torch

from . import call, dispatch
from . import plan as plan_cache
from . import logit_extras
from . import record as record_module
from . import validate as V
from .catalog import _VARIANTS, get
from .masking import propagate_query_nan
from .record import Variant


def attend(name: str, q, k, v, attn_mask=None, is_causal=False, scale=None, dropout_p=0.0, backend=None,
           enable_gqa=False, **options):
    """Check the arguments of a ``name`` call, then run it on the backend the dispatcher picks.

    The checks and the choice are made once per call signature (``ops/plan.py``); a later call with
    the same signature does only the value checks and the kernel. ``window_size`` is part of the
    signature: how a window runs (on a backend that takes it, or folded into the mask) is decided with
    the backend."""
    record = _VARIANTS.get(name) or get(name)  # get() names the variants when name is not one
    requested = backend or dispatch.default_backend()  # read once: the key and the choice see one value
    window = None
    if options and ("window_size" in options or "softcap" in options or "sinks" in options):
        # softcap / sinks reach the backends only when given; the window leaves the options (it is
        # keyed and routed on its own). Inline, without a helper: this runs on every call (issue 28)
        options = dict(options)
        window = options.pop("window_size", None)
        if "softcap" in options and options["softcap"] is None:
            del options["softcap"]
        if "sinks" in options and options["sinks"] is None:
            del options["sinks"]
        if type(window) is tuple and len(window) == 2 and type(window[0]) is int and type(window[1]) is int:
            if window == logit_extras.NO_WINDOW:
                window = None  # the functions' default
        elif window is not None:  # another form (a list, numpy ints, a wrong value): checked now, to key it
            window = logit_extras.check_window_size(window)
    key = per_call = None
    if not torch.compiler.is_compiling():
        key, per_call = plan_cache.signature(name, requested, q, k, v, attn_mask, is_causal, scale, dropout_p,
                                             enable_gqa, options, window)
        if key is not None:
            p = plan_cache.lookup(key)
            if p is not None:
                return _run_plan(record, p, q, k, v, attn_mask, options)
    p, kw = _make_plan(name, requested, q, k, v, attn_mask, is_causal, scale, dropout_p, enable_gqa, options,
                       key if not per_call else None, options_per_call=key is None or per_call, window=window)
    if key is not None and p.choice.reusable:
        plan_cache.keep(key, p)
    return _run_plan(record, p, q, k, v, attn_mask, options, kw)


def _with_extras(record: Variant, options: dict):
    """(the options with softcap / sinks only when given, the checked window or None); softcap and sinks
    are refused here for a variant that does not define them (ops/logit_extras.py). For ``explain``."""
    window = logit_extras.check_window_size(options.pop("window_size", None))
    for name in logit_extras.BACKEND_EXTRAS:
        if name in options and options[name] is None:
            del options[name]
    logit_extras.refuse_undefined(record, options)
    return options, window


# a folded band at most this many entries (Nq * Nk) is kept with the plan; a larger one is built per
# call (a plan cache of MAX_PLANS signatures must not pin long-context N x N masks in memory)
KEEP_BAND_ENTRIES = 1 << 16


def window_route(name: str, requested: str, q, k, v, kw: dict, window: tuple[int, int]):
    """(the backend that takes ``window`` itself, None) or (None, the band to fold into the mask) for a
    windowed call whose checked backend arguments are ``kw``; ``k``, ``v`` with q's heads."""
    native = logit_extras.native_window_backend(name, requested, q, k, v, {**kw, "window_size": window})
    if native is not None:
        return native, None
    return None, logit_extras.window_band(window, q.shape[-2], k.shape[-2], q.device)


def _make_plan(name: str, requested: str, q, k, v, attn_mask, is_causal, scale, dropout_p, enable_gqa,
               options: dict, key, options_per_call: bool, window=None) -> tuple[plan_cache.Plan, dict]:
    """Every check and the dispatcher's choice for this call: (its plan, its backend keyword arguments).
    ``requested``: the backend asked for, ``use_backend``'s default already read (once per call, so
    the plan's key and its choice agree whatever another thread sets meanwhile). ``window``: the
    call's ``window_size`` (unchecked) or None."""
    if window is not None:
        window = logit_extras.check_window_size(window)
    if options:
        logit_extras.refuse_undefined(get(name), options)
    kw = backend_kwargs(name, q, k, v, attn_mask, is_causal, scale, dropout_p, enable_gqa, **options)
    group = call.gqa_group(q, k) if enable_gqa else 1
    # the backends' predicates see the heads they compute with (once per signature)
    kk, vv = (call.expand_heads(k, group), call.expand_heads(v, group)) if group > 1 else (k, v)
    native = band = None
    if window is not None:
        native, band = window_route(name, requested, q, kk, vv, kw, window)
        if band is not None:
            kw["attn_mask"] = logit_extras.mask_with_window(kw["attn_mask"], band)
    if native is not None:
        choice = dispatch.Choice(name, native, requested, reusable=not native.reads_values)
    else:
        choice = plan_cache.choose(name, requested, q, kk, vv, kw, key)
    shared = {n: kw[n] for n in ("is_causal", "scale", "dropout_p")}
    if native is not None:
        shared["window_size"] = kw["window_size"] = window
    if group > 1 and choice.backend.gqa:
        shared["enable_gqa"], group = True, 0
    kept_options = None if options_per_call else {
        n: a for n, a in kw.items() if n not in call.SHARED_KWARGS and n != "window_size"}
    restore_nan = q.device.type in choice.backend.hides_query_nan_on
    special = None
    empty = q.shape[0] == 0 or q.shape[1] == 0  # no (batch, head) pair: no launch to bind
    if choice.backend.specialize is not None and group <= 1 and not empty:
        special = choice.backend.specialize(q, k, v, **kw, **{n: a for n, a in shared.items() if n == "enable_gqa"})
    kept_band = band if band is not None and band.numel() <= KEEP_BAND_ENTRIES else None
    return plan_cache.Plan(choice, shared, kept_options, restore_nan, empty, group if group > 1 else 0, special,
                           window if band is not None else None, kept_band), kw


def backend_kwargs(name: str, q, k, v, attn_mask=None, is_causal=False, scale=None, dropout_p=0.0,
                   enable_gqa=False, **options) -> dict:
    """The keyword arguments ``name``'s backends receive for this call (every argument checked)."""
    record = get(name)
    kw = call.common_args(q, k, v, attn_mask, is_causal, scale, dropout_p, record.default_scale, enable_gqa)
    return {**kw, **_checked_options(record, q, k, v, kw["scale"], options)}


def _checked_options(record: Variant, q, k, v, scale, options: dict) -> dict:
    extras = {n: options[n] for n in logit_extras.BACKEND_EXTRAS if n in options}
    own = {n: a for n, a in options.items() if n not in extras}
    checked = record.check(q, k, v, scale=scale, **own) if record.check is not None else own
    if "softcap" in extras:
        checked["softcap"] = logit_extras.check_softcap(extras["softcap"])
    if "sinks" in extras:
        checked["sinks"] = logit_extras.check_sinks(extras["sinks"], q)
    return checked


def _run_plan(record: Variant, p: plan_cache.Plan, q, k, v, attn_mask, options: dict, kw: Optional[dict] = None):
    """Run a call on its plan; ``kw`` (the first call's checked arguments) saves checking them again."""
    if kw is None:
        if attn_mask is not None:  # the value check of a float mask (eager, CPU by default)
            V.check_values("attn_mask", attn_mask)
            attn_mask = V.as_4d(attn_mask)
        if p.fold_window is not None:  # a window the backend does not take: its band joins the mask
            band = p.band if p.band is not None else logit_extras.window_band(p.fold_window, q.shape[-2],
                                                                              k.shape[-2], q.device)
            attn_mask = band if attn_mask is None else logit_extras.mask_with_window(attn_mask, band)
        kw = {"attn_mask": attn_mask, **p.shared}
        if p.options is None:
            kw.update(_checked_options(record, q, k, v, p.shared["scale"], options))
        elif p.options:
            kw.update(p.options)
    else:
        kw = {**kw, **{n: a for n, a in p.shared.items() if n == "enable_gqa"}}
    if p.empty:  # no (batch, head) pair: nothing to attend, no kernel to launch
        return call.empty_output(q, k, v)
    if p.gqa_group:
        k, v = call.expand_heads(k, p.gqa_group), call.expand_heads(v, p.gqa_group)
    out = p.fn(q, k, v, **kw)
    if p.restore_nan:
        out = propagate_query_nan(out, q)
    return out


record_module.use_call_path(attend)
