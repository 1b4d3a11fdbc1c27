"""The one path from a public attention function to a kernel: shared argument checks, then the
dispatcher's choice, then the chosen backend.

Every variant's functional (ops/<variant>/functional.py, or the one ``ops.variant`` makes for a
variant declared with only a reference) checks its own arguments and calls ``run``.
"""
from __future__ import annotations

import torch

from . import dispatch
from . import validate as V
from .masking import propagate_query_nan


def common_args(q, k, v, attn_mask, is_causal, scale, dropout_p, default_scale=None) -> dict:
    """Checks shared by every variant; the keyword arguments every backend receives: attn_mask as a
    4-D view, is_causal, scale (``default_scale``, else 1/sqrt(D), when None) and dropout_p."""
    V.check_qkv(q, k, v)
    V.check_mask(attn_mask, q, k)
    V.check_values("attn_mask", attn_mask)
    return {"attn_mask": V.as_4d(attn_mask), "is_causal": V.check_flag("is_causal", is_causal),
            "scale": V.resolve_scale(scale, q, default_scale), "dropout_p": V.check_dropout(dropout_p)}


def run(variant: str, backend, q, k, v, **kw):
    """Run ``variant`` on the backend the dispatcher picks (an unknown or refusing backend raises)."""
    choice = dispatch.choose(variant, backend, q, k, v, **kw)
    if q.shape[0] == 0 or q.shape[1] == 0:  # no (batch, head) pair: nothing to attend, no kernel to launch
        return empty_output(q, k, v)
    out = choice.backend.fn(q, k, v, **kw)
    if q.device.type in choice.backend.hides_query_nan_on:
        out = propagate_query_nan(out, q)
    return out


def empty_output(q, k, v):
    """The (B, H, Nq, Dv) output when B * H == 0, attached to the graph of q, k, v (its gradients are
    the empty zeros autograd expects)."""
    out = torch.zeros(q.shape[:3] + (v.shape[3],), dtype=q.dtype, device=q.device)
    return out + (q.sum() + k.sum() + v.sum()) * 0  # sums over no elements: 0
