"""Which packed calls take the blockwise CPU path in one call for all sequences
(ops/kernels/blockwise_varlen.py) instead of one call per distinct length (``varlen.per_sequence``).

Taken when the variant registered a blockwise form (softmax, l2, fenchel, sigmoid, relu), q is a CPU
tensor, the call runs no dropout (the backward recomputes the weights), the backend asked for is
"cpu", or "auto" with at least ``blockwise.SMALL_CALL_ELEMENTS`` scores in all (below that, auto's
per-call choice keeps the eager reference, measured faster there), and the form can express the
variant's options. Otherwise: None, and the caller runs the sequences per length, where the variant's
own function checks and dispatches each call.
"""
from __future__ import annotations

from functools import partial
from typing import Optional

import torch

from . import dispatch, logit_extras
from . import validate as V
from .kernels import blockwise, blockwise_varlen


def _scores(q, k, offsets_q, offsets_k) -> int:
    lengths = zip(offsets_q, offsets_q[1:], offsets_k, offsets_k[1:])
    return q.shape[1] * sum((b - a) * (d - c) for a, b, c, d in lengths)


def run(name: str, q, k, v, offsets_q: list[int], offsets_k: list[int], is_causal, kwargs: dict
        ) -> Optional[torch.Tensor]:
    """Packed q (T_q, H, D), k, v (T_k, H_kv, D / Dv) -> (T_q, H, Dv) on the packed blockwise path, or
    None when the call does not take it (see the module)."""
    form = blockwise_varlen.FORMS.get(name)
    options = dict(kwargs)
    backend = options.pop("backend", None) or dispatch.default_backend()
    dropout_p = options.pop("dropout_p", 0.0)
    if form is None or q.device.type != "cpu" or backend not in ("cpu", dispatch.AUTO) or dropout_p != 0.0:
        return None
    if backend == dispatch.AUTO and _scores(q, k, offsets_q, offsets_k) < blockwise.SMALL_CALL_ELEMENTS:
        return None
    q4, k4, v4 = (t.transpose(0, 1)[None] for t in (q, k, v))                 # (1, H, T, D) views
    enable_gqa = options.pop("enable_gqa", False)
    V.check_qkv(q4, k4, v4, V.check_flag("enable_gqa", enable_gqa))
    if k4.shape[1] != q4.shape[1]:                                              # grouped heads: shared k, v
        k4, v4 = (t.repeat_interleave(q4.shape[1] // t.shape[1], dim=1) for t in (k4, v4))
    scale = V.resolve_scale(options.pop("scale", None), q4)
    softcap = logit_extras.check_softcap(options.pop("softcap", None))
    sinks = logit_extras.check_sinks(options.pop("sinks", None), q4)
    window = logit_extras.check_window_size(options.pop("window_size", None))
    packed = partial(blockwise_varlen.attention, offsets_q=offsets_q, offsets_k=offsets_k,
                     is_causal=V.check_flag("is_causal", is_causal))
    out = form(packed, q4, k4, v4, scale=scale, softcap=softcap, sinks=sinks, window_size=window, options=options)
    return None if out is None else out[0].transpose(0, 1).contiguous()
