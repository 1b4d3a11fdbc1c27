"""Sigmoid attention on the blockwise CPU path (no row statistics beyond n_i, recomputation in the
backward); the Triton kernels are the pointwise family's (ops/kernels/pointwise/)."""
from __future__ import annotations

import torch

from ..kernels.blockwise import blockwise_attention, split_attn_mask


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
