"""Pointwise (row-statistics-free) attention, eager: sum_j w(s_ij + mask_ij, n_i) v_j, where n_i counts
the keys taking part in row i (= Nk without a mask), so a masked key is a removed key; ``softcap`` caps s
before the mask is added. The sigmoid and ReLU variants (ops/sigmoid, ops/relu) give w; their Triton
kernels are triton_kernels.py."""
from __future__ import annotations

from ...common import dot_logits, upcast, weights_dropout
from ...logit_extras import cap_logits
from ...masking import key_counts, split_mask


def pointwise_attention(q, k, v, attn_mask, is_causal, scale, dropout_p, weights, softcap=None):
    """``weights(s, n)`` -> w of the (B, H, Nq, Nk) logits s (mask added) and key counts n (B|1, H|1, Nq, 1)."""
    (q, k, v), out_dtype = upcast(q, k, v)
    keep, bias = split_mask(attn_mask, is_causal, q.shape[-2], k.shape[-2], q.device)
    s = cap_logits(dot_logits(q, k, scale), softcap)
    if bias is not None:
        s = s + bias.to(s.dtype)
    n = key_counts(keep, k.shape[-2], s)
    w = weights(s, n)
    if keep is not None:
        w = w.masked_fill(~keep, 0.0)
    return (weights_dropout(w, dropout_p) @ v).to(out_dtype)
