"""The public optimal-transport attention function (re-exported as ``attnzoo.functional.ot``)."""
from __future__ import annotations

import torch

from .. import validate as V
from ..call_path import attend


def check(q, k, v, *, scale, alpha=1.0, gamma=None, log_u=None, templates_k=None, templates_v=None) -> dict:
    """log u broadcastable to (B, H, Nk) (a (B|1, H|1, Nk) view), templates (B, H, M, D) / (B, H, M, Dv)
    given together, alpha > 0, gamma > 0 (default 1 / scale)."""
    B, H, _, D = q.shape
    V.check_broadcast("log_u", log_u, (B, H, k.shape[2]), q, allow_bool=False)
    V.check_values("log_u", log_u)
    if log_u is not None and log_u.dim() < 3:  # (B|1, H|1, Nk) view
        log_u = log_u[(None,) * (3 - log_u.dim())]
    if (templates_k is None) != (templates_v is None):
        raise ValueError("templates_k and templates_v must be given together")
    if templates_k is not None:
        for name, t, last in (("templates_k", templates_k, D), ("templates_v", templates_v, v.shape[-1])):
            if not isinstance(t, torch.Tensor) or t.dim() != 4 or t.shape[0] != B or t.shape[1] != H or t.shape[3] != last:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"{name} must have shape (B={B}, H={H}, M, {last}), got {got}")
            if t.dtype != q.dtype or t.device != q.device:
                raise TypeError(f"{name} must match q's dtype/device ({q.dtype}, {q.device}), got ({t.dtype}, {t.device})")
        if templates_k.shape[2] != templates_v.shape[2]:
            raise ValueError(f"templates_k and templates_v must hold the same number M of templates, got "
                             f"{templates_k.shape[2]} and {templates_v.shape[2]}")
    alpha = V.check_positive("alpha", alpha)
    if gamma is None and scale == 0:
        raise ValueError("scale must be nonzero for ot when gamma is not given (gamma defaults to 1/scale)")
    gamma = 1.0 / scale if gamma is None else V.check_positive("gamma", gamma)
    if not gamma > 0:
        raise ValueError(f"gamma must be > 0 (it defaults to 1/scale), got scale={scale}")
    return {"alpha": alpha, "gamma": gamma, "log_u": log_u, "templates_k": templates_k, "templates_v": templates_v}


def ot(q, k, v, attn_mask=None, is_causal=False, scale=None, *, alpha=1.0, gamma=None, log_u=None,
       templates_k=None, templates_v=None, dropout_p=0.0, backend=None, enable_gqa=False,
       softcap=None, sinks=None, window_size=(-1, -1)):
    """Paper 004 eq (22) with M(a, b) = -a.b + C:
    out_i = sum_{t in A} v_t sum_{j in T} u_j softmax_{t in A}((alpha q_i.k_t + k_j.k_t) / gamma);
    gamma defaults to 1/scale = sqrt(D); templates_k (B, H, M, D) / templates_v (B, H, M, Dv) extend A."""
    return attend("ot", q, k, v, attn_mask, is_causal, scale, dropout_p, backend, enable_gqa, alpha=alpha,
                  gamma=gamma,
                  log_u=log_u, templates_k=templates_k, templates_v=templates_v,
                  softcap=softcap, sinks=sinks, window_size=window_size)
