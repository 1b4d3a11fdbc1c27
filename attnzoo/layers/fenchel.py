"""Preference-weighted attention (paper 004): softmax(alpha * s_ij + log u_ij), with a learned log u.

preference="uniform": u uniform (alpha = 1 is plain softmax attention).
preference="t5":      log u_ij = b[h, bucket(j - i)], T5's relative-position buckets (paper 004
                      eqs 17-18): exact buckets for small offsets, log-spaced up to max_distance,
                      bidirectional (sign gets half the buckets) or causal (only j <= i offsets).
preference="context": log u_j = a small MLP of the key token x_j, one output per head (paper 004
                      sec 7, "factor in the input context"); its last layer starts at zero, so a
                      fresh layer starts uniform.
"""
from __future__ import annotations

import torch
from torch import nn

from .. import functional as AF
from ..ops import validate as V
from ..ops.fenchel import t5
from ..ops.fenchel.t5_buckets import t5_relative_buckets
from .base import AttentionLayer


class FenchelAttention(AttentionLayer):
    variant = "fenchel"

    def __init__(self, dim, num_heads=8, *args, preference: str = "uniform", alpha: float = 1.0,
                 solve: str = "first_order", num_buckets: int = 32, max_distance: int = 128,
                 bidirectional: bool = True, context_hidden: int = 64, **kw):
        super().__init__(dim, num_heads, *args, **kw)
        self.preference = V.check_choice("preference", preference, ("uniform", "t5", "context"))
        self.alpha = V.check_positive("alpha", alpha)
        self.solve = V.check_choice("solve", solve, ("first_order", "second_order", "exact"))
        self.num_buckets, self.max_distance, self.bidirectional = num_buckets, max_distance, bidirectional
        self.relative_bias = None
        self.context_net = None
        if preference == "t5":
            self.relative_bias = nn.Embedding(num_buckets, num_heads)
            nn.init.zeros_(self.relative_bias.weight)
        elif preference == "context":
            self.context_net = nn.Sequential(nn.Linear(dim, context_hidden), nn.GELU(),
                                             nn.Linear(context_hidden, num_heads))
            nn.init.zeros_(self.context_net[-1].weight)
            nn.init.zeros_(self.context_net[-1].bias)

    def kernel_kwargs(self):
        return {"alpha": self.alpha, "solve": self.solve}

    def log_preference(self, x: torch.Tensor, nq: int, nk: int):
        """log u broadcastable to (B, H, Nq, Nk), or None for uniform."""
        if self.relative_bias is not None:
            i = torch.arange(nq, device=x.device)[:, None] + (nk - nq)
            j = torch.arange(nk, device=x.device)[None, :]
            buckets = t5_relative_buckets(j - i, self.num_buckets, self.max_distance, self.bidirectional)
            return self.relative_bias(buckets).permute(2, 0, 1).unsqueeze(0).to(x.dtype)  # (1,H,Nq,Nk)
        if self.context_net is not None:
            return self.context_net(x).transpose(1, 2).unsqueeze(2)  # (B,H,1,Nk)
        return None

    def attend(self, q, k, v, attn_mask=None, is_causal=False, x=None, **extra):
        dropout_p = self.attn_drop.p if self.training else 0.0
        if self.relative_bias is not None and self.solve == "first_order":
            # the fused T5 paths build the bias tile by tile from the table: no (Nq, Nk) log u
            out = t5.t5_attention(q, k, v, self.relative_bias.weight, self.num_buckets, self.max_distance,
                                  self.bidirectional, attn_mask=attn_mask, is_causal=is_causal, scale=self.scale,
                                  alpha=self.alpha, dropout_p=dropout_p, backend=self.backend)
            if out is not None:
                return out
        log_u = self.log_preference(x, q.shape[-2], k.shape[-2])
        return AF.fenchel(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=self.scale, log_u=log_u,
                          alpha=self.alpha, solve=self.solve, dropout_p=dropout_p, backend=self.backend)
