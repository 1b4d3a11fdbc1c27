"""The public sigmoid attention function (re-exported as ``attnzoo.functional.sigmoid``)."""
from __future__ import annotations

import torch

from .. import validate as V
from ..call_path import attend


def check(q, k, v, *, scale, bias=None) -> dict:
    """bias: None (-log n_i), a finite real number, or a float tensor broadcastable to (B, H, Nq, Nk)
    (a 4-D view; -inf gives weight 0)."""
    if bias is not None:
        if isinstance(bias, torch.Tensor):
            V.check_broadcast("bias", bias, (q.shape[0], q.shape[1], q.shape[2], k.shape[2]), q, allow_bool=False)
            V.check_values("bias", bias, what="-inf (weight 0) but no NaN or +inf")
            bias = V.as_4d(bias)
        else:
            bias = V.check_real("bias", bias)
            if not V.is_finite(bias):
                raise ValueError(f"bias must be finite, got {bias}")
    return {"bias": bias}


def sigmoid(q, k, v, attn_mask=None, is_causal=False, scale=None, *, bias=None, dropout_p=0.0, backend=None,
            enable_gqa=False,
            softcap=None, sinks=None, window_size=(-1, -1)):
    """sum_j sigmoid(s_ij + b) v_j with b = -log(n_i) by default (n_i = keys taking part in row i);
    ``bias``: a real number or a float tensor broadcastable to (B, H, Nq, Nk)."""
    return attend("sigmoid", q, k, v, attn_mask, is_causal, scale, dropout_p, backend, enable_gqa, bias=bias,
                  softcap=softcap, sinks=sinks, window_size=window_size)
