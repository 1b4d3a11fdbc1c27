"""attnzoo.MultiheadAttention (torch's MHA interface) behind timm's Attention interface, so the
"multihead" registry name can sit in a timm Block like every other variant."""
from __future__ import annotations

import torch
from torch import nn

from ..layers import MultiheadAttention


class MultiheadAsTimmAttention(nn.Module):
    """timm's constructor and ``forward(x, attn_mask=None, is_causal=False)`` around an
    attnzoo.MultiheadAttention (batch_first). Masks use SDPA's convention (True = take part)."""

    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = True, attn_drop: float = 0.0,
                 proj_drop: float = 0.0, kind: str = "softmax", backend=None, device=None, dtype=None,
                 **ignored) -> None:
        super().__init__()
        # nn.MultiheadAttention has one bias switch for both in- and out-projections
        self.mha = MultiheadAttention(dim, num_heads, dropout=attn_drop, bias=bool(qkv_bias), batch_first=True,
                                      kind=kind, backend=backend, device=device, dtype=dtype)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: torch.Tensor, attn_mask=None, is_causal: bool = False) -> torch.Tensor:
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            attn_mask = ~attn_mask  # torch MHA: True = masked out
        out, _ = self.mha(x, x, x, need_weights=False, attn_mask=attn_mask, is_causal=is_causal)
        return self.proj_drop(out)
