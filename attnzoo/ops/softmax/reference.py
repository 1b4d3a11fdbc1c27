"""Softmax attention, eager reference: softmax_j(scale * q_i . k_j + mask_ij) v_j."""
from __future__ import annotations

from ..common import dot_logits, upcast, weights_dropout
from ..masking import masked_softmax, split_mask


def softmax_attention(q, k, v, *, attn_mask=None, is_causal=False, scale, dropout_p=0.0):
    (q, k, v), out_dtype = upcast(q, k, v)
    keep, bias = split_mask(attn_mask, is_causal, q.shape[-2], k.shape[-2], q.device)
    s = dot_logits(q, k, scale)
    if bias is not None:
        s = s + bias.to(s.dtype)
    p = weights_dropout(masked_softmax(s, keep), dropout_p)
    return (p @ v).to(out_dtype)
