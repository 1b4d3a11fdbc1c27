"""The public Fenchel-dual attention function (re-exported as ``attnzoo.functional.fenchel``)."""
from __future__ import annotations

from .. import call, dispatch
from .. import validate as V
from ..call_path import attend
from . import t5
from .reference import SOLVES


def check(q, k, v, *, scale, log_u=None, alpha=1.0, solve="first_order", relative_bias=None) -> dict:
    """log u broadcastable to (B, H, Nq, Nk) (a 4-D view), alpha > 0, solve one of SOLVES; a T5
    ``relative_bias`` becomes the dense log u it stands for."""
    if relative_bias is not None:
        if log_u is not None:
            raise ValueError("give log_u or relative_bias, not both")
        t5.check_bias(relative_bias, q)
        log_u = t5.dense_log_u(relative_bias, q.shape[2], k.shape[2])
    V.check_broadcast("log_u", log_u, (q.shape[0], q.shape[1], q.shape[2], k.shape[2]), q, allow_bool=False)
    V.check_values("log_u", log_u)
    return {"log_u": V.as_4d(log_u), "alpha": V.check_positive("alpha", alpha),
            "solve": V.check_choice("solve", solve, SOLVES)}


def _may_fuse(q, backend) -> bool:
    """Whether t5.choose may pick a fused T5 path (a fused backend named, or auto on CUDA)."""
    requested = backend or dispatch.default_backend()
    return requested in t5.FUSED or (requested == dispatch.AUTO and q.device.type == "cuda")


def fenchel(q, k, v, attn_mask=None, is_causal=False, scale=None, *, log_u=None, alpha=1.0,
            solve="first_order", relative_bias=None, dropout_p=0.0, backend=None, enable_gqa=False,
            softcap=None, sinks=None, window_size=(-1, -1)):
    """Paper 004 eq (16): weights proportional to u_ij exp(alpha s_ij), u = exp(log_u)
    (broadcastable to (B, H, Nq, Nk), -inf = masked); solve="second_order" uses eq (13),
    solve="exact" maximises the dual (7) per query. ``relative_bias``: a learned T5 relative-position
    log u (``ops.fenchel.t5.T5Bias``, paper 004 eqs 17-18) instead of ``log_u``; at first order the
    fused kernels read it from its table, tile by tile (ops/fenchel/t5.py)."""
    extras = softcap is not None or sinks is not None or window_size not in ((-1, -1), None)
    if relative_bias is not None and solve == "first_order" and log_u is None and not extras:
        shared = call.common_args(q, k, v, attn_mask, is_causal, scale, dropout_p, enable_gqa=enable_gqa)
        t5.check_bias(relative_bias, q)
        kf, vf = k, v
        if k.shape[1] != q.shape[1] and _may_fuse(q, backend):
            # the fused T5 kernels take q's head count for k and v: grouped-query k, v are expanded (on the
            # dense route the backend would say its per-key log_u cannot vary with the query, naming an
            # argument the caller never passed: issue 31)
            group = call.gqa_group(q, k)
            kf, vf = call.expand_heads(k, group), call.expand_heads(v, group)
        out = t5.t5_attention(q, kf, vf, relative_bias, attn_mask=shared["attn_mask"], is_causal=shared["is_causal"],
                              scale=shared["scale"], alpha=V.check_positive("alpha", alpha),
                              dropout_p=shared["dropout_p"], backend=backend)
        if out is not None:
            return out
    return attend("fenchel", q, k, v, attn_mask, is_causal, scale, dropout_p, backend, enable_gqa, log_u=log_u,
                  alpha=alpha,
                  solve=solve, relative_bias=relative_bias,
                  softcap=softcap, sinks=sinks, window_size=window_size)
