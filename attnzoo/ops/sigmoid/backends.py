"""Sigmoid attention on the blockwise CPU path (no row statistics beyond n_i, recomputation in the
backward); the Triton kernels are the pointwise family's (ops/kernels/pointwise/)."""
from __future__ import annotations

import torch

from .. import validate as V
from ..kernels.blockwise import blockwise_attention, split_attn_mask
from ..kernels.pointwise import varlen as pointwise_varlen


def sigmoid_cpu(q, k, v, *, attn_mask=None, is_causal=False, scale, bias=None, dropout_p=0.0, softcap=None,
                window_size=None):
    keep, add = split_attn_mask(attn_mask)
    if bias is None:
        return blockwise_attention(q, k, v, kind="sigmoid_default", scale=scale, is_causal=is_causal, keep=keep,
                                   add_a=add, softcap=softcap, window_size=window_size)
    if not isinstance(bias, torch.Tensor):
        bias = torch.full((1, 1, 1, 1), float(bias), dtype=q.dtype, device=q.device)
    return blockwise_attention(q, k, v, kind="sigmoid", scale=scale, is_causal=is_causal, keep=keep, add_a=add,
                               add_b=bias, softcap=softcap, window_size=window_size)


def sigmoid_cpu_varlen(packed, q, k, v, *, scale, softcap, sinks, window_size, options):
    """The blockwise form on packed sequences (ops/kernels/blockwise_varlen.py): the default bias -log n_i
    per sequence, a constant ``bias``, or a tensor bias that is one value per head (or one in all), the
    same in every sequence (a learned per-head shift on a fixed bias); another tensor bias is declined:
    its (B, H, Nq, Nk) layout has no packed meaning."""
    bias = options.get("bias")
    if set(options) - {"bias"} or sinks is not None:
        return None
    if isinstance(bias, torch.Tensor):
        if bias.dim() > 4 or any(n != 1 for i, n in enumerate(V.as_4d(bias).shape) if i != 1):
            return None
        bias = V.as_4d(bias)
        if bias.shape[1] not in (1, q.shape[1]):
            return None                           # the per-length route's check names the mismatch
        V.check_values("bias", bias, what="-inf (weight 0) but no NaN or +inf")   # the variant's own rule
        return packed(q, k, v, kind="sigmoid", scale=scale, softcap=softcap, window_size=window_size, add_b=bias)
    if bias is not None:   # the variant's own rule: a finite real number
        bias = V.check_real("bias", bias)
        if not V.is_finite(bias):
            raise ValueError(f"bias must be finite, got {bias}")
    if bias is None:
        return packed(q, k, v, kind="sigmoid_default", scale=scale, softcap=softcap, window_size=window_size)
    return packed(q, k, v, kind="sigmoid", scale=scale, softcap=softcap, window_size=window_size, add_b=bias)


def sigmoid_triton_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, is_causal, scale, softcap, sinks, window_size,
                          options):
    """The varlen Triton form (ops/varlen_triton.py): the pointwise kernels on packed sequences, the
    default bias -log n_i per sequence or a constant ``bias`` (a tensor bias is declined, as in the
    packed blockwise form), softcap and the window fused; sinks declined (the per-length route refuses
    them by name)."""
    bias = options.get("bias")
    if set(options) - {"bias"} or isinstance(bias, torch.Tensor) or sinks is not None:
        return None
    if bias is not None:   # the variant's own rule: a finite real number
        bias = V.check_real("bias", bias)
        if not V.is_finite(bias):
            raise ValueError(f"bias must be finite, got {bias}")
    return pointwise_varlen.attention(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, is_causal=is_causal,
                                      sigmoid=True, bias=bias, softcap=softcap, window_size=window_size)
