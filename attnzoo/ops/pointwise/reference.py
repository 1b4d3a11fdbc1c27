"""Pointwise (row-statistics-free) attention, eager references (paper 002 eq 2.5):
sigmoid: sum_j sigmoid(s_ij + b + mask_ij) v_j, b = -log(n_i) by default (Ramapuram et al.);
relu:    sum_j relu(s_ij + mask_ij) v_j / n_i.
n_i counts the keys taking part in row i (= Nk without a mask), so a masked key is a removed key.
"""
from __future__ import annotations

import torch

from ..common import dot_logits, upcast, weights_dropout
from ..masking import key_counts, split_mask


def _apply(q, k, v, attn_mask, is_causal, scale, dropout_p, pointwise):
    (q, k, v), out_dtype = upcast(q, k, v)
    keep, bias = split_mask(attn_mask, is_causal, q.shape[-2], k.shape[-2], q.device)
    s = dot_logits(q, k, scale)
    if bias is not None:
        s = s + bias.to(s.dtype)
    n = key_counts(keep, k.shape[-2], s)
    w = pointwise(s, n)
    if keep is not None:
        w = w.masked_fill(~keep, 0.0)
    return (weights_dropout(w, dropout_p) @ v).to(out_dtype)


def default_sigmoid_bias(n: torch.Tensor) -> torch.Tensor:
    """-log(n), with rows that have no key left mapped to 0 (their weights are masked anyway)."""
    return -torch.log(n.clamp_min(1.0))


def sigmoid_attention(q, k, v, *, attn_mask=None, is_causal=False, scale, bias=None, dropout_p=0.0):
    def f(s, n):
        b = default_sigmoid_bias(n) if bias is None else bias
        if isinstance(b, torch.Tensor):
            b = b.to(s.dtype)
        return torch.sigmoid(s + b)
    return _apply(q, k, v, attn_mask, is_causal, scale, dropout_p, f)


def relu_attention(q, k, v, *, attn_mask=None, is_causal=False, scale, dropout_p=0.0):
    return _apply(q, k, v, attn_mask, is_causal, scale, dropout_p,
                  lambda s, n: torch.relu(s) / n.clamp_min(1.0))
