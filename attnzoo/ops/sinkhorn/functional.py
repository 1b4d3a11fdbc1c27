"""The public Sinkhorn attention function (re-exported as ``attnzoo.functional.sinkhorn``)."""
from __future__ import annotations

from .. import validate as V
from ..call_path import attend

COSTS = ("l2", "dot")


def check_n_iters(n_iters) -> int:
    if isinstance(n_iters, bool) or not isinstance(n_iters, int) or n_iters < 0:
        raise ValueError(f"n_iters must be an int >= 0, got {n_iters!r}")
    return n_iters


def check(q, k, v, *, scale, n_iters=3, eps=1.0, cost="l2") -> dict:
    return {"n_iters": check_n_iters(n_iters), "eps": V.check_positive("eps", eps),
            "cost": V.check_choice("cost", cost, COSTS)}


def sinkhorn(q, k, v, attn_mask=None, is_causal=False, scale=None, *, n_iters=3, eps=1.0, cost="l2",
             dropout_p=0.0, backend=None, enable_gqa=False,
             softcap=None, sinks=None, window_size=(-1, -1)):
    """Log-domain Sinkhorn on exp(-scale ||q_i - k_j||^2 / (2 eps)) (cost="dot": exp(s_ij / eps)),
    n_iters (row, column) rounds then a final row normalisation (paper 002 sec 2.4)."""
    return attend("sinkhorn", q, k, v, attn_mask, is_causal, scale, dropout_p, backend, enable_gqa, n_iters=n_iters,
                  eps=eps,
                  cost=cost,
                  softcap=softcap, sinks=sinks, window_size=window_size)
