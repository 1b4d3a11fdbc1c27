"""Input checks shared by every functional: errors name the argument and what was expected.

Value checks (NaN / +inf in a mask or bias) read the tensor's data. They run in eager mode only
(``torch.compiler.is_compiling()`` false, so ``torch.compile(fullgraph=True)`` traces no data-dependent
branch) and only on the devices in ``VALUE_CHECK_DEVICES``: by default CPU. On CUDA the read would be
a host sync on every attention call, stalling the launch queue of every layer of a model for a check
that almost never fires, so it is off there; add "cuda" to ``VALUE_CHECK_DEVICES`` to debug a model
on the GPU. Unchecked, a NaN in a mask gives backend-dependent output.
"""
from __future__ import annotations

import difflib
import math
import numbers

import torch

VALUE_CHECK_DEVICES = {"cpu"}


def _shape(t) -> str:
    return "(" + ", ".join(str(s) for s in t.shape) + ")"


def check_qkv(q, k, v, enable_gqa: bool = False) -> None:
    """q (B, H, Nq, D), k (B, H_kv, Nk, D), v (B, H_kv, Nk, Dv) of one float dtype and device; H_kv == H,
    or with ``enable_gqa`` any divisor of H (grouped-query attention, SDPA's convention)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have shape (B, H, N, D) (4 dims), got {t.dim()} dims {_shape(t)}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise TypeError(f"q, k, v must share one dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}")
    if q.device != k.device or q.device != v.device:
        raise ValueError(f"q, k, v must be on one device, got q={q.device}, k={k.device}, v={v.device}")
    B, H, Nq, D = q.shape
    if k.shape[0] != B or v.shape[0] != B:
        raise ValueError(f"batch size mismatch: q {_shape(q)}, k {_shape(k)}, v {_shape(v)} (dim 0 must agree)")
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"head count mismatch: k {_shape(k)} and v {_shape(v)} must have the same number of heads "
                         "(dim 1)")
    if k.shape[1] != H:
        if not enable_gqa:
            raise ValueError(f"head count mismatch: q {_shape(q)}, k {_shape(k)}, v {_shape(v)} (dim 1 must agree; "
                             "for grouped-query attention, k and v with fewer heads, pass enable_gqa=True)")
        if k.shape[1] == 0 or H % k.shape[1] != 0:
            raise ValueError(f"enable_gqa=True needs q's head count to be a multiple of k's and v's, got q {_shape(q)}, "
                             f"k {_shape(k)}, v {_shape(v)} (dim 1)")
    if k.shape[3] != D:
        raise ValueError(f"k must have head dim D={D} like q, got k {_shape(k)}")
    if v.shape[2] != k.shape[2]:
        raise ValueError(f"v must have Nk={k.shape[2]} rows like k, got v {_shape(v)}")
    if Nq == 0 or k.shape[2] == 0:
        raise ValueError(f"empty sequence: q has Nq={Nq}, k has Nk={k.shape[2]}; both must be >= 1")
    if D == 0 or v.shape[3] == 0:
        raise ValueError(f"head dims must be >= 1, got q {_shape(q)}, v {_shape(v)}")


def _broadcastable(shape, target) -> bool:
    if len(shape) > len(target):
        return False
    for s, t in zip(reversed(shape), reversed(target)):
        if s != 1 and s != t:
            return False
    return True


def check_broadcast(name: str, t, target, like: torch.Tensor, allow_bool: bool = True) -> None:
    if t is None:
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
    if not allow_bool and not t.is_floating_point():
        raise TypeError(f"{name} must be a float tensor, got {t.dtype}")
    if t.dtype != torch.bool and not t.is_floating_point():
        raise TypeError(f"{name} must be bool (True = take part) or float (added to logits), got {t.dtype}")
    if t.device != like.device:
        raise ValueError(f"{name} must be on {like.device} like q, got {t.device}")
    if not _broadcastable(tuple(t.shape), tuple(target)):
        raise ValueError(f"{name} of shape {_shape(t)} is not broadcastable to (B, H, Nq, Nk) = {tuple(target)}")


def check_mask(attn_mask, q, k) -> None:
    B, H, Nq, _ = q.shape
    check_broadcast("attn_mask", attn_mask, (B, H, Nq, k.shape[2]), q)


def as_4d(t):
    """t with leading size-1 dims up to 4 dims (a view, no copy); None stays None. Every backend
    then receives masks, biases and preferences as (B|1, H|1, Nq|1, Nk|1)."""
    if t is None or t.dim() >= 4:
        return t
    return t[(None,) * (4 - t.dim())]


def check_values(name: str, t, what: str = "-inf (the key does not take part) but no NaN or +inf") -> None:
    """ValueError if the float tensor ``t`` holds NaN or +inf (a mask or bias: such an entry has no
    meaning and different kernels would turn it into different outputs). Eager mode and
    VALUE_CHECK_DEVICES only: see the module docstring."""
    if t is None or t.dtype == torch.bool or t.device.type not in VALUE_CHECK_DEVICES:
        return
    if torch.compiler.is_compiling():
        return
    t = t.detach()
    if bool((t < math.inf).all()):  # False for NaN and +inf, True for finite and -inf
        return
    n_nan, n_inf = int(torch.isnan(t).sum()), int((t == math.inf).sum())
    raise ValueError(f"{name} holds {n_nan} NaN and {n_inf} +inf entries; it may hold finite values and {what}")


def is_finite(value: float) -> bool:
    """math.isfinite for the scalars of a call. While torch.compile traces, a float attribute of a module
    can be a symbolic float, which dynamo cannot pass to math.isfinite (torch 2.11 fails the whole graph
    there); the value was checked when the module was built, so it is taken as finite."""
    if torch.compiler.is_compiling():
        return True
    return math.isfinite(value)


def check_real(name: str, value) -> float:
    """A Python / numpy real number (not bool, str or Tensor) as a float."""
    if isinstance(value, (bool, torch.Tensor)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number (int or float), got {type(value).__name__} {value!r}")
    return float(value)


def check_flag(name: str, value) -> bool:
    """A bool (Python or numpy): strings like 'no' or numbers are refused instead of read as truthy."""
    if isinstance(value, bool) or (type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")):
        return bool(value)
    raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")


def resolve_scale(scale, q, default=None) -> float:
    if scale is None:
        return default if default is not None else 1.0 / math.sqrt(q.shape[-1])
    if isinstance(scale, torch.Tensor):
        raise TypeError("scale must be a Python float, got a Tensor")
    scale = check_real("scale", scale)
    if not is_finite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    return scale


def check_positive(name: str, value, allow_zero: bool = False) -> float:
    value = check_real(name, value)
    if not is_finite(value) or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be finite and {bound}, got {value}")
    return value


def close_match(value, choices) -> str:
    """' (did you mean 'x'?)' for a string close to one of ``choices``, else ''."""
    if not isinstance(value, str):
        return ""
    close = difflib.get_close_matches(value, [c for c in choices if isinstance(c, str)], n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def check_choice(name: str, value, choices) -> str:
    if value not in choices:
        raise ValueError(f"{name} must be one of {sorted(choices)}, got {value!r}{close_match(value, choices)}")
    return value


def check_dropout(p, name: str = "dropout_p") -> float:
    if isinstance(p, (bool, str, torch.Tensor)) or not isinstance(p, numbers.Real):
        raise TypeError(f"{name} must be a float in [0, 1), got {type(p).__name__} {p!r}")
    p = float(p)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {p}")
    return p
