"""Sigmoid attention (paper 002 eq 2.5; Ramapuram et al. 2024), eager reference:
sum_j sigmoid(s_ij + b + mask_ij) v_j, b = -log(n_i) by default (n_i = keys taking part in row i)."""
from __future__ import annotations

import torch

from ..kernels.pointwise.reference import pointwise_attention


def default_sigmoid_bias(n: torch.Tensor) -> torch.Tensor:
    """-log(n), with rows that have no key left mapped to 0 (their weights are masked anyway)."""
    return -torch.log(n.clamp_min(1.0))


def sigmoid_attention(q, k, v, *, attn_mask=None, is_causal=False, scale, bias=None, dropout_p=0.0, softcap=None):
    def f(s, n):
        b = default_sigmoid_bias(n) if bias is None else bias
        if isinstance(b, torch.Tensor):
            b = b.to(s.dtype)
        return torch.sigmoid(s + b)
    return pointwise_attention(q, k, v, attn_mask, is_causal, scale, dropout_p, f, softcap)
