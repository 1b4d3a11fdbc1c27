"""ReLU attention (paper 002 eq 2.5), eager reference: sum_j relu(s_ij + mask_ij) v_j / n_i
(n_i = keys taking part in row i)."""
from __future__ import annotations

import torch

from ..kernels.pointwise.reference import pointwise_attention


def relu_attention(q, k, v, *, attn_mask=None, is_causal=False, scale, dropout_p=0.0, softcap=None):
    return pointwise_attention(q, k, v, attn_mask, is_causal, scale, dropout_p,
                               lambda s, n: torch.relu(s) / n.clamp_min(1.0), softcap)
