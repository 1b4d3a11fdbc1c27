"""ReLU attention on the blockwise CPU path (recomputation in the backward); the Triton kernels are
the pointwise family's (ops/kernels/pointwise/)."""
from __future__ import annotations

from ..kernels.blockwise import blockwise_attention, split_attn_mask
from ..kernels.pointwise import varlen as pointwise_varlen


def relu_cpu(q, k, v, *, attn_mask=None, is_causal=False, scale, dropout_p=0.0, softcap=None, window_size=None):
    keep, add = split_attn_mask(attn_mask)
    return blockwise_attention(q, k, v, kind="relu", scale=scale, is_causal=is_causal, keep=keep, add_a=add,
                               softcap=softcap, window_size=window_size)


def relu_cpu_varlen(packed, q, k, v, *, scale, softcap, sinks, window_size, options):
    """The blockwise form on packed sequences (ops/kernels/blockwise_varlen.py): n_i per sequence."""
    if options or sinks is not None:
        return None
    return packed(q, k, v, kind="relu", scale=scale, softcap=softcap, window_size=window_size)


def relu_triton_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, is_causal, scale, softcap, sinks, window_size,
                       options):
    """The varlen Triton form (ops/varlen_triton.py): the pointwise kernels on packed sequences, n_i per
    sequence, softcap and the window fused; sinks declined (the per-length route refuses them by name)."""
    if options or sinks is not None:
        return None
    return pointwise_varlen.attention(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, is_causal=is_causal,
                                      sigmoid=False, softcap=softcap, window_size=window_size)
