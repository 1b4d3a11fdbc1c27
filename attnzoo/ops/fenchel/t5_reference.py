"""Eager reference of the T5-bias attention kernel (paper 004 eqs 16-18):
softmax_j(alpha * scale * q_i.k_j + table[bucket(j - i), h] + mask_ij) v_j.

It builds the (1, H, Nq, Nk) log-preference from the table exactly as FenchelAttention(preference="t5")
does (bottom-right offsets, T5 buckets) and hands it to the first-order Fenchel reference, so autograd
gives the table's gradient. ``attnzoo.ops.fenchel.t5.t5_bias_attention`` (the Triton kernel) is tested against it.
"""
from __future__ import annotations

import torch

from .. import validate as V
from .reference import fenchel_attention
from .t5_buckets import t5_relative_buckets


def t5_log_preference(table: torch.Tensor, num_buckets: int, max_distance: int, bidirectional: bool,
                      nq: int, nk: int) -> torch.Tensor:
    """log u (1, H, Nq, Nk) with log u_ij = table[bucket(j - (i + nk - nq)), h]."""
    i = torch.arange(nq, device=table.device)[:, None] + (nk - nq)
    j = torch.arange(nk, device=table.device)[None, :]
    buckets = t5_relative_buckets(j - i, num_buckets, max_distance, bidirectional)
    return table[buckets].permute(2, 0, 1).unsqueeze(0)


def t5_bias_attention_reference(q, k, v, table, num_buckets, max_distance, bidirectional, attn_mask=None,
                                is_causal=False, scale=None, *, alpha=1.0):
    scale = V.resolve_scale(scale, q)
    log_u = t5_log_preference(table, num_buckets, max_distance, bidirectional, q.shape[2], k.shape[2])
    return fenchel_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                             log_u=log_u, alpha=alpha)
