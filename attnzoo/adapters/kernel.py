"""An attnzoo layer used as a bare kernel: its variant math and extra parameters (sigmoid's bias shift,
Fenchel's preference, ...) without its own projections, for hosts that keep theirs
(nn.MultiheadAttention's in_proj, a Hugging Face module's query/key/value)."""
from __future__ import annotations

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


def run_kernel(layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
               attn_mask=None, is_causal: bool = False, dropout_p: float = 0.0,
               scale: Optional[float] = None, x: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(B, H, Nq, D) x3 -> (B, H, Nq, Dv) through the layer's variant (its ``attend``)."""
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
