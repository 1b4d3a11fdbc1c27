"""Decide once per call signature: what a call of the same shape may reuse from the last one.

Everything the checks and the dispatcher decide about a call depends on its *signature*: the variant,
the requested backend (and ``use_backend``'s default), grad mode, each tensor's shape, dtype, device
and ``requires_grad``, and the plain values of the flags and options (``is_causal``, ``scale``,
``dropout_p``, ``n_iters``, ``window_size``, ...). A :class:`Plan` holds those decisions (the checked
scalars, the checked options when they hold no tensor, the chosen backend and whether it hides NaN
queries, how a window runs: passed to a backend that takes it or its band folded into the mask), kept
in a dictionary keyed by the signature. A call whose signature was seen runs its plan: the only
per-call work left is what depends on tensor *values* (the NaN / +inf check of a float mask on CPU,
the check of tensor options such as ``log_u``) and the kernel.

A decoder growing its KV cache makes a new signature per generated token. The dispatcher's choice is
therefore also kept per *length class* (:func:`choose`): the signature with the sequence lengths
replaced by their power-of-two buckets, the sign of Nk - Nq and whether a length is 1 (a rule may
single out one query: OT's CPU crossover does). A new length runs the checks (they are exact, per
signature) and reuses the class's choice; a new class asks the dispatcher at the call and at the
class's two extreme corners (the smallest and the largest Nq x Nk it holds) on shape-only stand-ins,
and keeps the choice only when all three agree. The size rules of the built-in backends (small-call
thresholds, the nearest measured case) are monotone in the lengths otherwise, so a choice that holds
at both corners holds inside: a 200-token ``generate`` makes a handful of choices, not 200.

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
_CHOICES: dict = {}  # length class -> dispatch.Choice (see choose)
_generation = -1

_PLAIN_TYPES = (type(None), bool, int, float, str)


class Plan:
    """The decisions for one call signature. ``options`` is None when the options hold a tensor (the
    variant's ``check`` then runs on every call, for the values it reads and the views it makes)."""
    __slots__ = ("fn", "choice", "shared", "options", "restore_nan", "empty", "gqa_group", "fold_window", "band")

    def __init__(self, choice: dispatch.Choice, shared: dict, options: Optional[dict], restore_nan: bool,
                 empty: bool, gqa_group: int, fn: Optional[Callable] = None, fold_window=None, band=None):
        self.choice = choice
        self.fn: Callable = fn or choice.backend.fn  # the backend, or its form specialised to the signature
        self.shared = shared  # is_causal, scale, dropout_p (checked); attn_mask is per call
        self.options = options
        self.restore_nan = restore_nan
        self.empty = empty
        # 0: k, v have q's heads or the backend indexes the shared heads itself (enable_gqa=True
        # passed on); G > 1: k, v are expanded to q's heads (each key/value head repeated G times)
        self.gqa_group = gqa_group
        # a window the backend does not take: (left, right), its band folded into each call's mask, and
        # the band itself ((1, 1, Nq, Nk) bool) when it was small enough to keep (else built per call).
        # A backend that takes the window finds it in ``shared`` instead ("window_size").
        self.fold_window = fold_window
        self.band = band


def _tensor_signature(t: torch.Tensor) -> tuple:
    return (t.shape, t.dtype, t.device, t.requires_grad)


def signature(name: str, backend, q, k, v, attn_mask, is_causal, scale, dropout_p, enable_gqa, options: dict,
              window=None):
    """(the key of this call, whether its options hold a tensor), or (None, None) when the call cannot be
    keyed safely. Plain values enter with their type (1, 1.0 and True are different calls: a check may
    accept one and refuse another). ``window``: None, or the call's ``window_size`` as a pair of ints
    (``call_path.attend`` passes only that form; its values are checked when the plan is made)."""
    if not (type(backend) in _PLAIN_TYPES and type(is_causal) in _PLAIN_TYPES and type(scale) in _PLAIN_TYPES
            and type(dropout_p) in _PLAIN_TYPES and type(enable_gqa) in _PLAIN_TYPES):
        return None, None  # an array or a list: the full path's checks name the argument
    parts: list[Any] = [name, type(backend), backend, torch.is_grad_enabled(),
                        type(is_causal), is_causal, type(scale), scale, type(dropout_p), dropout_p,
                        type(enable_gqa), enable_gqa, window]
    if type(q) is not torch.Tensor or type(k) is not torch.Tensor or type(v) is not torch.Tensor:
        return None, None  # a subclass (fake, DTensor) or not a tensor: the full path
    # _tensor_signature written out: this runs on every call
    parts += [(q.shape, q.dtype, q.device, q.requires_grad), (k.shape, k.dtype, k.device, k.requires_grad),
              (v.shape, v.dtype, v.device, v.requires_grad)]
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
        _CHOICES.clear()
        _generation = dispatch.generation
    return _PLANS.get(key)


def keep(key, plan: Plan) -> None:
    if len(_PLANS) >= MAX_PLANS:
        _PLANS.clear()
    _PLANS[key] = plan


def clear() -> None:
    """Forget every kept decision (the next call of each signature decides again)."""
    _PLANS.clear()
    _CHOICES.clear()


# -- the dispatcher's choice per length class --------------------------------------------------------

def _bucket(n: int) -> tuple[int, int]:
    """The power-of-two length bucket holding n: (its first length, its last length); 1..16 is one."""
    hi = max(16, 1 << (n - 1).bit_length())
    return (1 if hi == 16 else hi // 2 + 1), hi


def _class_shape(shape, nq, nk, length_dim) -> Optional[tuple]:
    """A 4-D shape with its length dims named by role ("q", "k") instead of their values, or None when a
    length dim is neither 1 nor the call's length (the call then cannot share a class)."""
    out = list(shape)
    if length_dim == 2:  # q: (B, H, Nq, D); k, v: (B, H, Nk, D)
        out[2] = "n"
    else:  # a 4-D mask (B|1, H|1, Nq|1, Nk|1)
        for dim, n, role in ((2, nq, "q"), (3, nk, "k")):
            if out[dim] != 1:  # 1 stays 1 (broadcast), also where the length is 1
                if out[dim] != n:
                    return None
                out[dim] = role
    return tuple(out)


def _class_key(key, q, k, v, kw) -> Optional[tuple]:
    """The length class of a call: its signature key with q, k, v and the mask keyed by their shapes
    less the lengths, plus the lengths' buckets and the sign of Nk - Nq. None when a checked
    argument other than the mask is a tensor (its shape may hold a length a stand-in cannot copy)."""
    nq, nk = q.shape[2], k.shape[2]
    mask = kw["attn_mask"]
    # one query (a decode step) or one key is a class of its own: rules may single it out (OT's CPU
    # crossover has a limit for one query), so it must not share a choice with 2..16
    parts = [_bucket(nq), _bucket(nk), (nk > nq) - (nk < nq), nq == 1, nk == 1,
             tuple(q.shape[:2]) + tuple(q.shape[3:]),
             tuple(k.shape[:2]) + tuple(k.shape[3:]), tuple(v.shape[:2]) + tuple(v.shape[3:])]
    if mask is not None:
        mask_shape = _class_shape(mask.shape, nq, nk, 4)
        if mask_shape is None:
            return None
        parts.append(mask_shape)
    for name, value in kw.items():
        if name == "attn_mask":
            continue
        if isinstance(value, torch.Tensor):
            return None
        parts.append((name, type(value), value))
    # the signature with its tensors' exact shapes left out (the class parts above replace them)
    return (tuple(p[1:] if isinstance(p, tuple) and p and isinstance(p[0], torch.Size) else p for p in key),
            tuple(parts))


def _stand_in(t: torch.Tensor, shape) -> torch.Tensor:
    """A shape-only tensor of ``t``'s dtype, device and requires_grad (one element, expanded)."""
    base = torch.empty((1,) * len(shape), dtype=t.dtype, device=t.device)
    return base.requires_grad_(t.requires_grad).expand(shape)


def _corners(nq: int, nk: int) -> tuple:
    """The smallest and the largest (Nq, Nk) of the class of (nq, nk): each length in its bucket, the
    sign of Nk - Nq kept."""
    (q_lo, q_hi), (k_lo, k_hi) = _bucket(nq), _bucket(nk)
    if nq == 1:
        q_lo = q_hi = 1
    if nk == 1:
        k_lo = k_hi = 1
    if nq == nk:
        return (q_lo, q_lo), (q_hi, q_hi)
    if nk > nq:
        return (q_lo, max(k_lo, q_lo + 1)), (min(q_hi, k_hi - 1), k_hi)
    return (max(q_lo, k_lo + 1), k_lo), (q_hi, min(k_hi, q_hi - 1))


def _decide(name: str, requested: str, q, k, v, kw: dict, key) -> dispatch.Choice:
    """The dispatcher's choice for this call, kept for its length class when the class's corners agree."""
    choice = dispatch.choose(name, requested, q, k, v, **kw)
    class_key = _class_key(key, q, k, v, kw) if key is not None and choice.reusable else None
    if class_key is None:
        return choice
    mask = kw["attn_mask"]
    for nq, nk in _corners(q.shape[2], k.shape[2]):
        corner = dict(kw)
        try:
            if mask is not None:
                corner["attn_mask"] = _stand_in(mask, tuple(
                    nq if s == "q" else nk if s == "k" else s for s in _class_shape(mask.shape, q.shape[2],
                                                                                   k.shape[2], 4)))
            other = dispatch.choose(name, requested, _stand_in(q, q.shape[:2] + (nq,) + q.shape[3:]),
                                    _stand_in(k, k.shape[:2] + (nk,) + k.shape[3:]),
                                    _stand_in(v, v.shape[:2] + (nk,) + v.shape[3:]), **corner)
        except ValueError:  # no backend (or not the named one) runs the corner: the class is not uniform
            return choice
        except RuntimeError:  # inside a functorch transform (jacrev, vmap) no stand-in may need a gradient
            return choice
        if other.backend is not choice.backend or not other.reusable:
            return choice
    if len(_CHOICES) >= MAX_PLANS:
        _CHOICES.clear()
    _CHOICES[class_key] = choice
    return choice


def choose(name: str, requested: str, q, k, v, kw: dict, key) -> dispatch.Choice:
    """The dispatcher's choice for a call whose checked backend arguments are ``kw``: the one kept for
    its length class, else a new decision (``key``: the call's signature, None when it has none)."""
    if key is not None and _CHOICES:
        class_key = _class_key(key, q, k, v, kw)
        if class_key is not None:
            choice = _CHOICES.get(class_key)
            if choice is not None:
                return choice
    return _decide(name, requested, q, k, v, kw, key)


def size() -> int:
    return len(_PLANS)
