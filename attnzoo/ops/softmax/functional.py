"""The public softmax attention function (re-exported as ``attnzoo.functional.softmax``)."""
from __future__ import annotations

from ..call_path import attend


def softmax(q, k, v, attn_mask=None, is_causal=False, scale=None, *, dropout_p=0.0, backend=None, enable_gqa=False,
            softcap=None, sinks=None, window_size=(-1, -1)):
    """softmax_j(scale * q_i . k_j) v_j."""
    return attend("softmax", q, k, v, attn_mask, is_causal, scale, dropout_p, backend, enable_gqa,
                  softcap=softcap, sinks=sinks, window_size=window_size)
