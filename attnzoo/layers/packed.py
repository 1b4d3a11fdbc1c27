"""A layer's forward on packed sequences: x (T, dim) holding N sequences back to back with
``cu_seqlens`` (N + 1 offsets, FlashAttention's name for self-attention) and ``max_seqlen``, or a
``torch.nested`` jagged tensor (B, j, dim) (the layout ``nn.MultiheadAttention`` users pass). The
output has the input's layout. Each sequence is its own attention problem (``ops/varlen.py``): the
projections run once on the T tokens, the attention in one packed call (``packed_attend``: one
``attend_varlen`` call when the variant's per-call values allow it, else per sequence length)."""
from __future__ import annotations

from typing import Optional

import torch

from ..ops import varlen
from . import packed_attend

_EXTRAS = ("softcap", "sinks", "window_size")


def _extras(extra: dict) -> dict:
    """Takes the shared softcap / sinks / window_size out of the forward's extra keyword arguments."""
    return {name: extra.pop(name) for name in _EXTRAS if name in extra}


def _check_layout(layer, x, cu_seqlens, max_seqlen, attn_mask):
    name = type(layer).__name__
    if attn_mask is not None:
        raise ValueError(f"{name}: a packed batch takes no attn_mask: the offsets already keep the sequences apart "
                         "(pass a padded (B, N, dim) batch to mask keys inside a sequence)")
    if x.is_nested:
        if x.layout != torch.jagged or x.dim() != 3:
            raise ValueError(f"{name}: a nested x must be a (B, j, dim) tensor of layout torch.jagged, got layout "
                             f"{x.layout} with {x.dim()} dims")
        if cu_seqlens is not None:
            raise ValueError(f"{name}: a nested x carries its own offsets; pass no cu_seqlens with it")
        if x._ragged_idx != 1:
            raise ValueError(f"{name}: a nested x must be ragged in dim 1 (the tokens), got ragged dim {x._ragged_idx}")
        return x.values(), x.offsets()
    if x.dim() != 2:
        raise ValueError(f"{name}: with cu_seqlens, x must be the packed (T, dim) tokens, got shape {tuple(x.shape)}")
    return x, cu_seqlens


def forward_packed(layer, x, cu_seqlens: Optional[torch.Tensor], max_seqlen: Optional[int], attn_mask,
                   is_causal: bool, extra: dict):
    """``AttentionLayer.forward`` for a packed batch (see the module)."""
    tokens, cu = _check_layout(layer, x, cu_seqlens, max_seqlen, attn_mask)
    layer._check_input(tokens[None])
    if max_seqlen is None:
        max_seqlen = int(cu.diff().max()) if cu.numel() > 1 else 1
    q, k, v = (t[0].transpose(0, 1) for t in layer.project_qkv(tokens[None]))      # (T, H, head_dim)
    _, _, offsets, _ = varlen.check(q, k, v, cu, None, max_seqlen, None)
    extras = _extras(extra)                                   # the rest of extra is the hook's
    out = packed_attend.attend(layer, q, k, v, cu, cu, max_seqlen, max_seqlen, offsets, offsets,
                               is_causal=is_causal, tokens=tokens, extras=extras, forward_kwargs=extra)
    out = layer.norm(out.reshape(tokens.shape[0], layer.attn_dim))
    if layer.gate is not None:
        out = out * layer.gate(tokens).sigmoid()
    out = layer.proj_drop(layer.proj(out))
    if x.is_nested:
        return torch.nested.nested_tensor_from_jagged(out, x.offsets())
    return out
