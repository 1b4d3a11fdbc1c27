"""Softmax attention on the shared kernels: SDPA (``torch``) and the blockwise CPU path (``cpu``)."""
from __future__ import annotations

from ..kernels.blockwise import blockwise_attention, split_attn_mask
from ..kernels.flash_softmax import varlen as flash_varlen
from ..kernels.sdpa import sdpa_attention, sdpa_with_sinks


def softmax_torch(q, k, v, *, attn_mask=None, is_causal=False, scale, dropout_p=0.0, enable_gqa=False, sinks=None):
    if sinks is not None:
        return sdpa_with_sinks(q, k, v, attn_mask, is_causal, scale, dropout_p, enable_gqa, sinks)
    return sdpa_attention(q, k, v, attn_mask, is_causal, scale, dropout_p, enable_gqa)


def softmax_cpu(q, k, v, *, attn_mask=None, is_causal=False, scale, dropout_p=0.0, softcap=None, sinks=None,
                window_size=None):
    keep, add = split_attn_mask(attn_mask)
    return blockwise_attention(q, k, v, kind="softmax", scale=scale, is_causal=is_causal, keep=keep, add_a=add,
                               softcap=softcap, sinks=sinks, window_size=window_size)


def softmax_cpu_varlen(packed, q, k, v, *, scale, softcap, sinks, window_size, options):
    """The blockwise form on packed sequences (ops/kernels/blockwise_varlen.py)."""
    if options:
        return None
    return packed(q, k, v, kind="softmax", scale=scale, softcap=softcap, sinks=sinks, window_size=window_size)


def softmax_triton_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, is_causal, scale, softcap, sinks, window_size,
                          options):
    """The varlen Triton form (ops/varlen_triton.py): the online-softmax kernels on packed sequences,
    softcap, sinks and the window fused."""
    if options:
        return None
    return flash_varlen.attention(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, is_causal=is_causal,
                                  softcap=softcap, sinks=sinks, window_size=window_size)
