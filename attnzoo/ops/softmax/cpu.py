"""Memory-efficient CPU paths for the softmax family (softmax, L2, Fenchel first order): blockwise
online softmax with recomputation in the backward (``ops.blockwise``); no (Nq, Nk) tensor per head.
Same signatures and semantics as the references; dropout is refused by ``backends_softmax_family``."""
from __future__ import annotations

import torch

from ..blockwise import blockwise_attention, split_attn_mask


def l2_augment(q, k):
    """(q', k') with q'.k' = 2 q.k - ||k||^2, so scale * q'.k' = -scale ||q - k||^2 + scale ||q||^2
    and the ||q||^2 term, constant along a softmax row, cancels."""
    ones = torch.ones(q.shape[:-1] + (1,), dtype=q.dtype, device=q.device)
    return (torch.cat([2.0 * q, -ones], dim=-1),
            torch.cat([k, (k * k).sum(-1, keepdim=True)], dim=-1))


def softmax_cpu(q, k, v, *, attn_mask=None, is_causal=False, scale, dropout_p=0.0):
    keep, add = split_attn_mask(attn_mask)
    return blockwise_attention(q, k, v, kind="softmax", scale=scale, is_causal=is_causal, keep=keep, add_a=add)


def l2_cpu(q, k, v, *, attn_mask=None, is_causal=False, scale, dropout_p=0.0):
    if q.dtype in (torch.float16, torch.bfloat16):  # ||k||^2 in half precision would cost the logits ~3 digits
        q, k = q.float(), k.float()
        v_dtype, v = v.dtype, v.float()
        return l2_cpu(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale).to(v_dtype)
    qa, ka = l2_augment(q, k)
    return softmax_cpu(qa, ka, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)


def fenchel_cpu(q, k, v, *, attn_mask=None, is_causal=False, scale, log_u=None, alpha=1.0,
                solve="first_order", dropout_p=0.0):
    """First order only (paper 004 eq 16): softmax(alpha * scale * q.k + log u + mask)."""
    if solve != "first_order":
        raise ValueError(f"the cpu backend computes solve='first_order' only, got solve={solve!r}")
    keep, add = split_attn_mask(attn_mask)
    return blockwise_attention(q, k, v, kind="softmax", scale=alpha * scale, is_causal=is_causal, keep=keep,
                               add_a=add, add_b=log_u)
