"""The public linear attention function (re-exported as ``attnzoo.functional.linear``)."""
from __future__ import annotations

from .. import validate as V
from ..call_path import attend
from .reference import FEATURE_MAPS


def check(q, k, v, *, scale, feature_map="elu") -> dict:
    return {"feature_map": V.check_choice("feature_map", feature_map, FEATURE_MAPS)}


def linear(q, k, v, attn_mask=None, is_causal=False, scale=None, *, feature_map="elu", dropout_p=0.0,
           backend=None, enable_gqa=False,
           softcap=None, sinks=None, window_size=(-1, -1)):
    """phi(q_i) . sum_j phi(k_j) v_j^T / (phi(q_i) . sum_j phi(k_j) + 1e-6), phi = elu + 1;
    feature_map="identity": (1/n_i) sum_j (q_i . k_j) v_j. scale defaults to 1 here (no logits)."""
    return attend("linear", q, k, v, attn_mask, is_causal, scale, dropout_p, backend, enable_gqa,
                  feature_map=feature_map,
                  softcap=softcap, sinks=sinks, window_size=window_size)
