"""Optimal-transport attention layer (paper 004 sec 9, eq 22), the last layer of OT-ViT."""
from __future__ import annotations

from typing import Optional

import torch

from .. import functional as AF
from ..ops import validate as V
from .base import AttentionLayer


class OTAttention(AttentionLayer):
    """``forward(x, attn_mask=None, is_causal=False, templates=None)``: ``templates`` (B, M, dim) are
    extra tokens (OT-ViT's same-class templates) projected with this layer's key and value weights
    (and k_norm) and added to the template set A. gamma defaults to sqrt(head_dim)."""
    variant = "ot"

    def __init__(self, dim, num_heads=8, *args, alpha: float = 1.0, gamma: Optional[float] = None, **kw):
        super().__init__(dim, num_heads, *args, **kw)
        self.alpha = V.check_positive("alpha", alpha)
        self.gamma = None if gamma is None else V.check_positive("gamma", gamma)

    def kernel_kwargs(self):
        return {"alpha": self.alpha, "gamma": self.gamma}

    def forward(self, x, attn_mask=None, is_causal=False, templates: Optional[torch.Tensor] = None):
        return super().forward(x, attn_mask=attn_mask, is_causal=is_causal, templates=templates)

    def attend(self, q, k, v, attn_mask=None, is_causal=False, x=None, templates=None, **extra):
        tk = tv = None
        if templates is not None:
            if templates.dim() != 3 or templates.shape[0] != x.shape[0] or templates.shape[2] != x.shape[2]:
                raise ValueError(f"templates must have shape (B={x.shape[0]}, M, dim={x.shape[2]}), "
                                 f"got {tuple(templates.shape)}")
            if templates.shape[1] > 0:
                _, tk, tv = self.raw_qkv(templates)
                tk = self.k_norm(tk)
        return AF.ot(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=self.scale, alpha=self.alpha,
                     gamma=self.gamma, templates_k=tk, templates_v=tv,
                     dropout_p=self.attn_drop.p if self.training else 0.0, backend=self.backend)
