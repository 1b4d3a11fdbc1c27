"""Logit softcapping, attention sinks and sliding windows: the three arguments every variant's function
takes beside the mask (Gemma 2's ``attn_logit_softcapping``, gpt-oss's learned sinks, Mistral's and
FlashAttention's windows).

- ``softcap``: s -> softcap * tanh(s / softcap) on the logits, before masks and biases are added
  (Gemma 2, FlashAttention). A variant whose weights are not a function of logits (linear attention)
  refuses it.
- ``sinks``: a tensor of shape (H,), one logit per query head that joins the row's normaliser as a key
  with no value (gpt-oss): a softmax-type row sum gets exp(sinks[h]) added, so the weights of a row sum
  to less than one. Learnable: its gradient is computed. A variant without a normaliser over keys
  refuses it.
- ``window_size=(left, right)``: FlashAttention's and ``torch.nn.attention.varlen.varlen_attn``'s
  meaning, -1 unbounded, (-1, -1) no window. Key j takes part for query i iff
  i + (Nk - Nq) - left <= j <= i + (Nk - Nq) + right: bottom-right aligned, as ``is_causal``. It is
  combined with ``is_causal`` and ``attn_mask`` (a key takes part when all of them let it), so every
  variant is that variant restricted to the band: a key outside the band is a removed key, exactly as
  a masked one (for Sinkhorn, whose columns couple the queries, the band is a mask of the transport
  problem: rows and columns are normalised over the band's entries only).

Which of ``softcap`` and ``sinks`` a variant's math defines is its record's ``extras``; the reason it
refuses one is in ``extras_refused``. A backend says which it implements (``register_backend(...,
extras=...)``): the dispatcher declines a backend for a call that passes one it does not implement,
so a call never runs on a backend that would ignore it.
"""
from __future__ import annotations

import math
import numbers
from typing import Optional

import torch

from . import dispatch
from . import validate as V
from .masking import masked_softmax

# the arguments this module owns, in every variant's function signature
NAMES = ("softcap", "sinks", "window_size")
# the two that reach the backends as options; a window reaches a backend that lists it in its extras
# as ``window_size`` and any other folded into the mask (ops/call_path.py decides, once per signature)
BACKEND_EXTRAS = ("softcap", "sinks")
NO_WINDOW = (-1, -1)
WORDS = {"softcap": "logit softcapping (softcap)", "sinks": "attention sinks (sinks)",
         "window_size": "sliding windows (window_size)"}


def check_window_size(window_size) -> Optional[tuple[int, int]]:
    """(left, right) as ints, or None for no window ((-1, -1) or None)."""
    if window_size is None:
        return None
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or any(isinstance(w, bool) or not isinstance(w, numbers.Integral) or w < -1 for w in window_size)):
        raise ValueError("window_size must be a pair (left, right) of ints >= -1 (-1: unbounded on that side), "
                         f"got {window_size!r}")
    left, right = int(window_size[0]), int(window_size[1])
    return None if (left, right) == NO_WINDOW else (left, right)


def window_keep(window: tuple[int, int], nq: int, nk: int, device=None) -> torch.Tensor:
    """Bool (nq, nk): key j is in query i's band, bottom-right aligned (the diagonal is j = i + nk - nq)."""
    offset = torch.arange(nk, device=device)[None, :] - torch.arange(nq, device=device)[:, None] - (nk - nq)
    left, right = window
    keep = torch.ones(nq, nk, dtype=torch.bool, device=device)
    if left >= 0:
        keep = keep & (offset >= -left)
    if right >= 0:
        keep = keep & (offset <= right)
    return keep


def window_band(window: tuple[int, int], nq: int, nk: int, device=None) -> torch.Tensor:
    """The band as a (1, 1, nq, nk) bool mask: what a backend that does not take the window receives
    (folded into the call's mask by :func:`mask_with_window`)."""
    return window_keep(window, nq, nk, device)[None, None]


def mask_with_window(attn_mask, band: torch.Tensor):
    """``attn_mask`` with the keys outside ``band`` (:func:`window_band`) removed: a bool mask AND the
    band, a float mask with -inf outside it, or the band itself. (The mask was checked: bool or
    floating, broadcastable.)"""
    if attn_mask is None:
        return band
    if attn_mask.dtype == torch.bool:
        return attn_mask & band
    return attn_mask.masked_fill(~band, -math.inf)


def check_softcap(softcap) -> Optional[float]:
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real) or not (0 < float(softcap) < math.inf):
        raise ValueError(f"softcap must be None or a positive finite number (the logit cap), got {softcap!r}")
    return float(softcap)


def check_sinks(sinks, q: torch.Tensor) -> Optional[torch.Tensor]:
    """None, or the (H,) tensor of one sink logit per query head (H = q.shape[1]) on q's device."""
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"sinks must be None or a tensor of shape (H,) (one logit per head), got "
                        f"{type(sinks).__name__}")
    if not sinks.is_floating_point():
        raise TypeError(f"sinks must be a floating-point tensor, got {sinks.dtype}")
    if sinks.shape != (q.shape[1],):
        raise ValueError(f"sinks must have shape (H,) = ({q.shape[1]},), one logit per query head, got "
                         f"{tuple(sinks.shape)}")
    if sinks.device != q.device:
        raise ValueError(f"sinks must be on q's device {q.device}, got {sinks.device}")
    V.check_values("sinks", sinks)
    return sinks


def refuse_undefined(record, options: dict) -> None:
    """ValueError when a call passes softcap or sinks to a variant whose math does not define it."""
    for name in BACKEND_EXTRAS:
        if options.get(name) is not None and name not in record.extras:
            why = record.extras_refused.get(name, "its math does not define it")
            raise ValueError(f"{record.name} attention does not support {WORDS[name]}: {why}")


def cap_logits(s: torch.Tensor, softcap: Optional[float]) -> torch.Tensor:
    """softcap * tanh(s / softcap), or s without a cap."""
    return s if softcap is None else softcap * torch.tanh(s / softcap)


def sink_logits(sinks: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The (H,) sinks as a (1, H, 1, 1) column in ``like``'s dtype (the reference's compute dtype)."""
    return sinks.to(like.dtype).reshape(1, -1, 1, 1)


def masked_softmax_with_sinks(logits: torch.Tensor, keep, sinks: Optional[torch.Tensor]) -> torch.Tensor:
    """softmax over the last dim with exp(sinks[h]) added to every row's sum (a key with no value); an
    all-masked row gives zeros. Without sinks: the plain masked softmax."""
    if sinks is None:
        return masked_softmax(logits, keep)
    if keep is not None:
        logits = logits.masked_fill(~keep, -math.inf)
    sink = sink_logits(sinks, logits).expand(logits.shape[:-1] + (1,))
    row_max = torch.maximum(logits.amax(-1, keepdim=True), sink)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max)).detach()
    e = torch.exp(logits - row_max)
    return e / (e.sum(-1, keepdim=True) + torch.exp(sink - row_max))


def native_window_backend(name: str, requested: str, q, k, v, kw: dict) -> Optional[dispatch.Backend]:
    """The backend that runs this windowed call with the window itself, or None (then the band is folded
    into the mask): the one named if it takes windows and accepts the call; under auto the first by
    priority that takes windows, may run on this device and accepts the call (``auto_prefers`` too).
    ``requested``: the backend asked for (``use_backend``'s default already read); ``k``, ``v`` with
    q's heads (grouped heads expanded: the predicates see what a backend computes with); ``kw``: the
    checked backend arguments with ``window_size``. Decided once per call signature (ops/call_path.py)."""
    natives = [b for b in dispatch.backend_table(name).values() if "window_size" in b.extras]
    for b in sorted(natives, key=lambda b: -b.priority):
        if requested != dispatch.AUTO and b.name != requested:
            continue
        if requested == dispatch.AUTO and q.device.type not in b.auto_devices:
            continue
        why = dispatch.extras_reason(b, kw) or b.supports(q, k, v, **kw)
        if why is None and requested == dispatch.AUTO and b.auto_prefers is not None:
            why = b.auto_prefers(q, k, v, **kw)
        if why is None:
            return b
    return None
