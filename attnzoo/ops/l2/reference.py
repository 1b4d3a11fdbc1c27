"""L2 attention (paper 002 sec 2.3; Kim et al. 2021), eager reference:
softmax_j(cap(-scale * ||q_i - k_j||^2) + mask_ij) v_j; softcap and sinks as softmax's
(ops/logit_extras.py)."""
from __future__ import annotations

from ..common import sq_dist, upcast, weights_dropout
from ..logit_extras import cap_logits, masked_softmax_with_sinks
from ..masking import split_mask


def l2_attention(q, k, v, *, attn_mask=None, is_causal=False, scale, dropout_p=0.0, softcap=None, sinks=None):
    (q, k, v), out_dtype = upcast(q, k, v)
    keep, bias = split_mask(attn_mask, is_causal, q.shape[-2], k.shape[-2], q.device)
    s = cap_logits(-scale * sq_dist(q, k), softcap)
    if bias is not None:
        s = s + bias.to(s.dtype)
    p = weights_dropout(masked_softmax_with_sinks(s, keep, sinks), dropout_p)
    return (p @ v).to(out_dtype)
