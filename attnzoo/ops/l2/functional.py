"""The public L2 attention function (re-exported as ``attnzoo.functional.l2``)."""
from __future__ import annotations

from ..call_path import attend


def l2(q, k, v, attn_mask=None, is_causal=False, scale=None, *, dropout_p=0.0, backend=None, enable_gqa=False,
       softcap=None, sinks=None, window_size=(-1, -1)):
    """softmax_j(-scale * ||q_i - k_j||^2) v_j (paper 002 sec 2.3; Kim et al. 2021)."""
    return attend("l2", q, k, v, attn_mask, is_causal, scale, dropout_p, backend, enable_gqa,
                  softcap=softcap, sinks=sinks, window_size=window_size)
