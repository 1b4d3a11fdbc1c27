"""Which packed calls run the varlen Triton kernels (ops/kernels/flash_softmax/varlen.py: softmax, l2,
fenchel first order; ops/kernels/pointwise/varlen.py: sigmoid, relu; ops/linear/varlen.py: linear;
ops/sinkhorn/varlen.py: sinkhorn; ops/ot/varlen.py: OT) in one launch per kernel for all sequences, instead of
the other routes of ops/varlen.py.

Every variant registers here from its own folder's ``__init__`` (so this shared module imports no
variant folder). The softmax and pointwise families register a *form* (``register``), which the
shared checks below wrap; a variant with checks of its own (linear: no logits scale default, its own
dtypes; sinkhorn: its options, its causal prefix loop; OT: its options and the dense backend's dtypes) registers a
whole *route* (``register_route``).

Taken when the variant registered a Triton varlen form here (from its folder's ``__init__``), the
backend asked for is "triton", or "auto" on a CUDA tensor (auto never picks an interpreted kernel, as
for the dense Triton backends; on CPU under TRITON_INTERPRET=1 a call asks for "triton" by name, which
is how the tests run this route), the kernels can run the call (``triton_utils.common_reason``:
device, dtype, head dims), it drops nothing (``dropout_p == 0``), and the form can express the
variant's options. ``softcap``, ``sinks`` and ``window_size`` are checked here (logit_extras) and
handed to the form, which fuses them in the kernels (the pointwise forms decline sinks: their variants
refuse them on the per-length route, by name). Nothing here reads the offsets' values: under
torch.compile the route traces with them as tensors and ``max_q`` / ``max_k`` as ints. Otherwise: None, and the caller takes its other routes (the
blockwise CPU path, the sequences per length, or the padded batch while compiling), where the variant's
own function checks and dispatches the call.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from . import dispatch, logit_extras
from . import validate as V
from .triton_utils import common_reason

# variant name -> route(q, k, v, cu_q, cu_k, max_q, max_k, is_causal, kwargs) -> Tensor | None
ROUTES: dict[str, Callable] = {}


def register_route(variant: str, route: Callable) -> None:
    """``route(q, k, v, cu_q, cu_k, max_q, max_k, is_causal, kwargs)`` -> (T_q, H, Dv), or None when the
    call does not take the variant's varlen kernels; ``kwargs``: scale, dropout_p, backend, enable_gqa
    and the variant's options as the call gave them. A route never reads the offsets on the host."""
    ROUTES[variant] = route


def register(variant: str, form: Callable) -> None:
    """``form(q, k, v, cu_q, cu_k, max_q, max_k, *, is_causal, scale, softcap, sinks, window_size,
    options)``: the variant on packed (T, H, D) inputs through a varlen kernel (k, v with H or fewer
    heads, checked; softcap, sinks and window_size checked, None when absent), or None when ``options``
    (the variant's other keyword arguments) or an extra hold something it cannot take; reached through
    the shared checks of the softmax and pointwise families (``family_route``)."""
    register_route(variant, lambda *args: family_route(form, *args))


def chosen(name: str, q: torch.Tensor, backend: Optional[str]) -> bool:
    """Whether a packed call of variant ``name`` on q asking for ``backend`` goes to a varlen kernel
    (before the call's own options are looked at)."""
    if name not in ROUTES:
        return False
    backend = backend or dispatch.default_backend()
    return backend == "triton" or (backend == dispatch.AUTO and q.device.type == "cuda")


def family_route(form: Callable, q, k, v, cu_q, cu_k, max_q: int, max_k: int, is_causal, kwargs: dict
                 ) -> Optional[torch.Tensor]:
    """The softmax and pointwise families' route: the shared checks (see the module), then ``form``."""
    options = dict(kwargs)
    if options.pop("dropout_p", 0.0) != 0.0 or common_reason(q, k, v) is not None:
        return None
    options.pop("backend", None)
    q4, k4, v4 = (t.transpose(0, 1)[None] for t in (q, k, v))                 # (1, H, T, D) views
    V.check_qkv(q4, k4, v4, V.check_flag("enable_gqa", options.pop("enable_gqa", False)))
    scale = V.resolve_scale(options.pop("scale", None), q4)
    softcap = logit_extras.check_softcap(options.pop("softcap", None))
    sinks = logit_extras.check_sinks(options.pop("sinks", None), q4)
    window = logit_extras.check_window_size(options.pop("window_size", None))
    return form(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=V.check_flag("is_causal", is_causal),
                scale=scale, softcap=softcap, sinks=sinks, window_size=window, options=options)


def run(name: str, q, k, v, cu_q, cu_k, max_q: int, max_k: int, is_causal, kwargs: dict
        ) -> Optional[torch.Tensor]:
    """Packed q (T_q, H, D), k, v (T_k, H_kv, D / Dv) -> (T_q, H, Dv) through the variant's varlen Triton
    route, or None when the call does not take it (see the module). The offsets were checked by the
    caller (ops/varlen.check)."""
    if not chosen(name, q, kwargs.get("backend")):
        return None
    return ROUTES[name](q, k, v, cu_q, cu_k, max_q, max_k, is_causal, kwargs)
