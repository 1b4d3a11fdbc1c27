"""Decide once per call signature: what a call of the same shape may reuse from the last one.

Everything the checks and the dispatcher decide about a call depends on its *signature*: the variant,
the requested backend (and ``use_backend``'s default), grad mode, each tensor's shape, dtype, device
and ``requires_grad``, and the plain values of the flags and options (``is_causal``, ``scale``,
``dropout_p``, ``n_iters``, ...). A :class:`Plan` holds those decisions (the checked scalars, the
checked options when they hold no tensor, the chosen backend and whether it hides NaN queries), kept
in a dictionary keyed by the signature. A call whose signature was seen runs its plan: the only
per-call work left is what depends on tensor *values* (the NaN / +inf check of a float mask on CPU,
the check of tensor options such as ``log_u``) and the kernel.

Not kept: a call with an option of another type (an object, a list: its signature cannot be hashed
safely), a choice that consulted a backend whose ``supports`` reads tensor values, and anything while
torch.compile traces (the trace runs the full checks once and guards on the signature itself). The
kept plans are dropped when a backend is registered or removed (``dispatch.generation``) and by
:func:`clear` (after changing a module constant a ``supports`` predicate reads, e.g. in tests).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from . import dispatch

MAX_PLANS = 4096  # a decoder growing its KV cache makes a new signature per step: start over past this

_PLANS: dict = {}
_generation = -1

_PLAIN_TYPES = (type(None), bool, int, float, str)


class Plan:
    """The decisions for one call signature. ``options`` is None when the options hold a tensor (the
    variant's ``check`` then runs on every call, for the values it reads and the views it makes)."""
    __slots__ = ("fn", "choice", "shared", "options", "restore_nan", "empty", "gqa_group")

    def __init__(self, choice: dispatch.Choice, shared: dict, options: Optional[dict], restore_nan: bool,
                 empty: bool, gqa_group: int, fn: Optional[Callable] = None):
        self.choice = choice
        self.fn: Callable = fn or choice.backend.fn  # the backend, or its form specialised to the signature
        self.shared = shared  # is_causal, scale, dropout_p (checked); attn_mask is per call
        self.options = options
        self.restore_nan = restore_nan
        self.empty = empty
        # 0: k, v have q's heads or the backend indexes the shared heads itself (enable_gqa=True
        # passed on); G > 1: k, v are expanded to q's heads (each key/value head repeated G times)
        self.gqa_group = gqa_group


def _tensor_signature(t: torch.Tensor) -> tuple:
    return (t.shape, t.dtype, t.device, t.requires_grad)


def signature(name: str, backend, q, k, v, attn_mask, is_causal, scale, dropout_p, enable_gqa, options: dict):
    """(the key of this call, whether its options hold a tensor), or (None, None) when the call cannot be
    keyed safely. Plain values enter with their type (1, 1.0 and True are different calls: a check may
    accept one and refuse another)."""
    parts: list[Any] = [name, type(backend), backend, dispatch.default_backend(), torch.is_grad_enabled(),
                        type(is_causal), is_causal, type(scale), scale, type(dropout_p), dropout_p,
                        type(enable_gqa), enable_gqa]
    for t in (q, k, v):
        if type(t) is not torch.Tensor:  # a subclass (fake, DTensor) or not a tensor: the full path
            return None, None
        parts.append(_tensor_signature(t))
    if attn_mask is None:
        parts.append(None)
    elif isinstance(attn_mask, torch.Tensor):
        parts.append(_tensor_signature(attn_mask))
    else:
        return None, None
    has_tensor = False
    for option, value in options.items():
        kind = type(value)
        if kind in _PLAIN_TYPES:
            parts.append((option, kind, value))
        elif kind is torch.Tensor:
            parts.append((option, _tensor_signature(value)))
            has_tensor = True
        else:
            return None, None
    return tuple(parts), has_tensor


def lookup(key) -> Optional[Plan]:
    global _generation
    if _generation != dispatch.generation:
        _PLANS.clear()
        _generation = dispatch.generation
    return _PLANS.get(key)


def keep(key, plan: Plan) -> None:
    if len(_PLANS) >= MAX_PLANS:
        _PLANS.clear()
    _PLANS[key] = plan


def clear() -> None:
    """Forget every kept decision (the next call of each signature decides again)."""
    _PLANS.clear()


def size() -> int:
    return len(_PLANS)
