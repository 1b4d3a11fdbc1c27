"""A timm Block whose attention is OTAttention and whose forward passes ``templates`` on."""
from __future__ import annotations

from typing import Optional

import torch
from timm.models.vision_transformer import Block

from .. import registry
from ..layers import OTAttention


class OTBlock(Block):
    """timm's pre-norm Block with OTAttention(alpha, gamma). Extra templates go through the same
    ``norm1`` as the block's input before the attention projects them with its key/value weights,
    so an extra template is treated exactly like one of the input's own tokens.

    ``n_queries=n`` computes the block's output for the first n tokens only (all tokens still act as
    keys/templates): OT-ViT's head reads only the class token, so its last layer needs one query,
    which cuts the OT attention's (Nq, Nk, |A|) work by a factor Nq."""

    def __init__(self, dim: int, num_heads: int, *, alpha: float = 1.0, gamma: Optional[float] = None,
                 backend: Optional[str] = None, **kw):
        # timm wants a class: bind alpha/gamma/backend through the registry's spec mechanism
        gamma = None if gamma is None else float(gamma)
        attn_layer = registry.layer(f"ot(alpha={float(alpha)!r}, gamma={gamma!r}, backend={backend!r})")
        super().__init__(dim, num_heads, attn_layer=attn_layer, **kw)
        if not isinstance(self.attn, OTAttention):
            raise TypeError("OTBlock's attention must be an OTAttention")

    def _attention(self, xn, attn_mask, is_causal, templates, n_queries):
        attn = self.attn
        if n_queries is None:
            return attn(xn, attn_mask=attn_mask, is_causal=is_causal, templates=templates)
        # OTAttention.forward with the queries cut to the first n_queries tokens
        q, k, v = attn.project_qkv(xn)
        out = attn.attend(q[:, :, :n_queries], k, v, x=xn, templates=templates)
        out = attn.norm(out.transpose(1, 2).reshape(xn.shape[0], n_queries, attn.attn_dim))
        if attn.gate is not None:
            out = out * attn.gate(xn[:, :n_queries]).sigmoid()
        return attn.proj_drop(attn.proj(out))

    def forward(self, x: torch.Tensor, attn_mask=None, is_causal: bool = False,
                templates: Optional[torch.Tensor] = None, n_queries: Optional[int] = None) -> torch.Tensor:
        if n_queries is not None:
            if attn_mask is not None or is_causal:
                raise ValueError("n_queries cannot be combined with attn_mask or is_causal")
            if isinstance(n_queries, bool) or not isinstance(n_queries, int) or not 0 < n_queries <= x.shape[1]:
                raise ValueError(f"n_queries must be an int in [1, {x.shape[1]}], got {n_queries!r}")
        t = None if templates is None else self.norm1(templates)
        attn = self._attention(self.norm1(x), attn_mask, is_causal, t, n_queries)
        x = (x if n_queries is None else x[:, :n_queries]) + self.drop_path1(self.ls1(attn))
        return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))
