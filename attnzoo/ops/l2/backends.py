"""L2 attention on the shared softmax kernels. -scale ||q_i - k_j||^2 = scale (2 q_i.k_j - ||k_j||^2)
- scale ||q_i||^2, and the last term, constant along a softmax row, cancels: so L2 is softmax
attention on q and k augmented by one coordinate (SDPA, blockwise) or with a per-key term
(FlexAttention); the Triton kernel computes the norms itself (ops/kernels/flash_softmax/)."""
from __future__ import annotations

import torch

from ..kernels.blockwise import blockwise_attention, split_attn_mask
from ..kernels.flash_softmax import varlen as flash_varlen
from ..kernels.flex import flex_attention
from ..kernels.sdpa import at_least_fp32, augment, sdpa_attention


def l2_torch(q, k, v, *, attn_mask=None, is_causal=False, scale, dropout_p=0.0, enable_gqa=False):
    """softmax(scale (2 q.k - ||k||^2) + mask) v on SDPA, ||k||^2 carried in fp32 (two coordinates in
    half precision, see ops/kernels/sdpa.py)."""
    kf = k.to(at_least_fp32(k.dtype))
    key_sq = -(kf * kf).sum(-1, keepdim=True)
    qa, ka = augment(q, k, 2.0, key_sq)
    return sdpa_attention(qa, ka, v, attn_mask, is_causal, scale, dropout_p, enable_gqa)


def l2_augment(q, k):
    """(q', k') with q'.k' = 2 q.k - ||k||^2, so scale * q'.k' = -scale ||q - k||^2 + scale ||q||^2
    and the ||q||^2 term, constant along a softmax row, cancels."""
    ones = torch.ones(q.shape[:-1] + (1,), dtype=q.dtype, device=q.device)
    return (torch.cat([2.0 * q, -ones], dim=-1),
            torch.cat([k, (k * k).sum(-1, keepdim=True)], dim=-1))


def l2_cpu(q, k, v, *, attn_mask=None, is_causal=False, scale, dropout_p=0.0, window_size=None):
    """(No softcap or sinks: the augmented logits are shifted by scale ||q_i||^2 per row, which a softmax
    cancels but a cap or a sink's fixed logit does not.)"""
    if q.dtype in (torch.float16, torch.bfloat16):  # ||k||^2 in half precision would cost the logits ~3 digits
        q, k = q.float(), k.float()
        v_dtype, v = v.dtype, v.float()
        return l2_cpu(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                      window_size=window_size).to(v_dtype)
    qa, ka = l2_augment(q, k)
    keep, add = split_attn_mask(attn_mask)
    return blockwise_attention(qa, ka, v, kind="softmax", scale=scale, is_causal=is_causal, keep=keep, add_a=add,
                               window_size=window_size)


def l2_flex(q, k, v, *, attn_mask=None, is_causal=False, scale, dropout_p=0.0, softcap=None, sinks=None,
            window_size=None):
    """2 scale q.k - scale ||k||^2 on FlexAttention; with a cap or sinks also - scale ||q||^2, so the
    capped value and the sink's rival are the true logit -scale ||q - k||^2."""
    kk = (k.float() * k.float()).sum(-1) * scale
    qq = (q.float() * q.float()).sum(-1) * scale if softcap is not None or sinks is not None else None
    return flex_attention(q, k, v, attn_mask, is_causal, 2.0 * scale, key_term=kk, query_term=qq, softcap=softcap,
                          sinks=sinks, window_size=window_size)


def l2_cpu_varlen(packed, q, k, v, *, scale, softcap, sinks, window_size, options):
    """The blockwise form on packed sequences (ops/kernels/blockwise_varlen.py); no softcap or sinks, as
    ``l2_cpu``. The augmented coordinates are formed in float32 at least (||k||^2 in half precision would
    cost the logits ~3 digits)."""
    if options or softcap is not None or sinks is not None:
        return None
    work = at_least_fp32(q.dtype)
    qa, ka = l2_augment(q.to(work), k.to(work))
    return packed(qa, ka, v.to(work), kind="softmax", scale=scale, window_size=window_size).to(v.dtype)


def l2_triton_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, is_causal, scale, softcap, sinks, window_size, options):
    """The varlen Triton form (ops/varlen_triton.py): the online-softmax kernels with L2 logits on packed
    sequences (the norms computed in the kernel, as the dense ``triton`` backend), softcap, sinks and
    the window fused."""
    if options:
        return None
    return flash_varlen.attention(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, is_causal=is_causal, l2=True,
                                  softcap=softcap, sinks=sinks, window_size=window_size)
