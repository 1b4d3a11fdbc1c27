"""Optimal-transport attention (paper 004 sec 9, eq 22) with cost M(a, b) = -a.b + C, eager.

For query i with input templates T = {k_j} (the keys taking part) and template set
A = T plus the extra templates:
    out_i = sum_{t in A} v_t * sum_{j in T} u_ij * softmax_{t in A}((alpha q_i.k_t + k_j.k_t) / gamma + mask_it)
C cancels inside the softmax. u_i is uniform over the keys taking part, or softmax(log_u) over them.
gamma defaults to 1/scale = sqrt(D). Extra templates are never masked.
This materialises the (B, H, Nq, Nk, |A|) tensor: it is the ground truth, not the fast path.
"""
from __future__ import annotations

import math

import torch

from ..common import upcast, weights_dropout
from ..masking import masked_softmax, split_mask


def ot_weights(q, k, *, attn_mask=None, is_causal=False, alpha=1.0, gamma, log_u=None, templates_k=None):
    """W (B, H, Nq, |A|): the weight of each template in A for each query (rows sum to 1 or 0)."""
    nq, nk = q.shape[-2], k.shape[-2]
    keep, bias = split_mask(attn_mask, is_causal, nq, nk, q.device)
    shape = q.shape[:-1] + (nk,)
    lu = torch.zeros(shape, dtype=q.dtype, device=q.device) if log_u is None else log_u.to(q.dtype).unsqueeze(-2).expand(shape)
    src_keep = keep
    if log_u is not None:
        finite = lu > -math.inf
        src_keep = finite if src_keep is None else src_keep & finite
    u = masked_softmax(lu, src_keep)                                      # (B,H,Nq,Nk)
    a_keys = k if templates_k is None else torch.cat([k, templates_k], dim=-2)
    na = a_keys.shape[-2]
    query_term = alpha * (q @ a_keys.transpose(-1, -2))                   # (B,H,Nq,A)
    gram = k @ a_keys.transpose(-1, -2)                                   # (B,H,Nk,A)
    logits = (query_term.unsqueeze(-2) + gram.unsqueeze(-3)) / gamma      # (B,H,Nq,Nk,A)
    t_keep = None
    if keep is not None or bias is not None:
        pad = na - nk
        if bias is not None:
            b = torch.nn.functional.pad(bias.to(q.dtype).expand(shape), (0, pad))
            logits = logits + b.unsqueeze(-2)
        if keep is not None:
            t_keep = torch.nn.functional.pad(keep.expand(shape), (0, pad), value=True).unsqueeze(-2)
    s = masked_softmax(logits, t_keep)
    return (u.unsqueeze(-1) * s).sum(-2)


def ot_attention(q, k, v, *, attn_mask=None, is_causal=False, scale, alpha=1.0, gamma=None, log_u=None,
                 templates_k=None, templates_v=None, dropout_p=0.0):
    (q, k, v, log_u, templates_k, templates_v), out_dtype = upcast(q, k, v, log_u, templates_k, templates_v)
    gamma = 1.0 / scale if gamma is None else gamma
    w = ot_weights(q, k, attn_mask=attn_mask, is_causal=is_causal, alpha=alpha, gamma=gamma,
                   log_u=log_u, templates_k=templates_k)
    a_values = v if templates_v is None else torch.cat([v, templates_v], dim=-2)
    return (weights_dropout(w, dropout_p) @ a_values).to(out_dtype)
