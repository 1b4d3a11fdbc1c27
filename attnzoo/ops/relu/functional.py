"""The public ReLU attention function (re-exported as ``attnzoo.functional.relu``)."""
from __future__ import annotations

from ..call_path import attend


def relu(q, k, v, attn_mask=None, is_causal=False, scale=None, *, dropout_p=0.0, backend=None, enable_gqa=False,
         softcap=None, sinks=None, window_size=(-1, -1)):
    """sum_j relu(s_ij) v_j / n_i (n_i = keys taking part in row i, Nk without a mask)."""
    return attend("relu", q, k, v, attn_mask, is_causal, scale, dropout_p, backend, enable_gqa,
                  softcap=softcap, sinks=sinks, window_size=window_size)
