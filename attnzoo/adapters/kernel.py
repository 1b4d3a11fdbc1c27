"""An attnzoo layer used as a bare kernel: its variant math and extra parameters (sigmoid's bias shift,
Fenchel's preference, ...) without its own projections, for hosts that keep theirs
(nn.MultiheadAttention's in_proj, a Hugging Face module's query/key/value)."""
from __future__ import annotations

import math
from typing import Optional

import torch

from ..layers.base import AttentionLayer
from .spec import Target


def kernel_layer(target: Target, dim: int, num_heads: int, head_dim: int, *, device=None,
                 dtype=None) -> AttentionLayer:
    """``dim`` is the width of the key tokens (Fenchel's context preference reads them)."""
    layer = target.build_layer(dim, num_heads, head_dim, device=device, dtype=dtype)
    # the host projects q, k, v and the output itself; dropping these keeps them out of state_dict
    layer.qkv = None
    layer.proj = None
    return layer


def couples_queries(layer: AttentionLayer) -> bool:
    """Sinkhorn normalises columns too, so every query row shapes every other row's weights."""
    kind = getattr(layer, "kind", None) if layer.variant == "masked" else layer.variant
    return kind == "sinkhorn"


def drop_padded_queries(attn_mask, nq: int):
    """Self-attention with a padding mask: a token no query may attend to is padding, so its query row
    is masked too (its output becomes 0). Only Sinkhorn needs this: a padded query would otherwise
    take part in the column normalisation and change the unpadded tokens' outputs."""
    if attn_mask is None or attn_mask.shape[-1] != nq:
        return attn_mask
    attn_mask = attn_mask.expand(*attn_mask.shape[:-2], nq, nq)  # a (B, 1, 1, Nk) padding mask covers every row
    keep = attn_mask if attn_mask.dtype == torch.bool else attn_mask > -math.inf
    seen = keep.any(-2)                       # (..., Nk): key j is attended by some query
    if bool(seen.all()):
        return attn_mask
    rows = seen.unsqueeze(-1)                 # query i == token i in self-attention
    if attn_mask.dtype == torch.bool:
        return attn_mask & rows
    return attn_mask.masked_fill(~rows, -math.inf)


def run_kernel(layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
               attn_mask=None, is_causal: bool = False, dropout_p: float = 0.0,
               scale: Optional[float] = None, x: Optional[torch.Tensor] = None,
               self_attention: bool = False) -> torch.Tensor:
    """(B, H, Nq, D) x3 -> (B, H, Nq, Dv) through the layer's variant (its ``attend``).
    ``self_attention``: q and k come from the same tokens (see drop_padded_queries)."""
    if self_attention and couples_queries(layer):
        attn_mask = drop_padded_queries(attn_mask, q.shape[-2])
    if getattr(layer, "tie_qk", False):
        if k.shape != q.shape:
            raise ValueError("l2(tie_qk=True) uses the queries as keys, so it needs self-attention without "
                             f"a key cache; got q {tuple(q.shape)} and k {tuple(k.shape)}")
        k = q
    if x is None:
        if getattr(layer, "context_net", None) is not None:
            raise ValueError("fenchel(preference='context') needs the key tokens x, which this host does not provide")
        x = q  # other variants read x only for its device and dtype (Fenchel's T5 buckets)
    if scale is not None:
        layer.scale = float(scale)
    layer.attn_drop.p = float(dropout_p)  # the host decides dropout (0 at eval, for attention weights)
    return layer.attend(q, k, v, attn_mask=attn_mask, is_causal=is_causal, x=x)
