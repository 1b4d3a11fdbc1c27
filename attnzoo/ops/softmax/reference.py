"""Softmax attention, eager reference: softmax_j(cap(scale * q_i . k_j) + mask_ij) v_j, with
cap(s) = softcap * tanh(s / softcap) when ``softcap`` is given and exp(sinks[h]) added to every row's
normaliser when ``sinks`` is (ops/logit_extras.py)."""
from __future__ import annotations

from ..common import dot_logits, upcast, weights_dropout
from ..logit_extras import cap_logits, masked_softmax_with_sinks
from ..masking import split_mask


def softmax_attention(q, k, v, *, attn_mask=None, is_causal=False, scale, dropout_p=0.0, softcap=None, sinks=None):
    (q, k, v), out_dtype = upcast(q, k, v)
    keep, bias = split_mask(attn_mask, is_causal, q.shape[-2], k.shape[-2], q.device)
    s = cap_logits(dot_logits(q, k, scale), softcap)
    if bias is not None:
        s = s + bias.to(s.dtype)
    p = weights_dropout(masked_softmax_with_sinks(s, keep, sinks), dropout_p)
    return (p @ v).to(out_dtype)
