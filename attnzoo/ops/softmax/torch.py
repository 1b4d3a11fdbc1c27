"""torch's own fused kernels for the softmax family: ``F.scaled_dot_product_attention`` (SDPA) on
every device, FlexAttention on CUDA.

attnzoo's semantics on top of SDPA's:
- causal is bottom-right aligned: SDPA's ``is_causal=True`` (top-left) is used only when Nq == Nk,
  otherwise the (Nq, Nk) bool mask is built once (not per head);
- a query row with no key returns zeros, forward and backward: such rows are opened to every key
  before SDPA (so it computes finite numbers there) and their output is replaced by zeros after,
  which also zeroes every gradient flowing through them;
- q, k and v are zero-padded to one head dim (SDPA's fused kernels need it);
- L2: q' = [2q, -1], k' = [k, ||k||^2] so q'.k' = 2 q.k - ||k||^2 = -||q - k||^2 + ||q||^2, and the
  ||q||^2 term, constant along a softmax row, cancels;
- Fenchel first order: softmax(alpha * scale * q.k + log u + mask) is SDPA with scale' = alpha *
  scale and log u as an additive float mask.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..masking import causal_keep
from .cpu import l2_augment


def sdpa_mask(attn_mask, is_causal, nq, nk, device, dtype):
    """(mask for SDPA or None, SDPA's is_causal, has_key or None); has_key (bool, (..., Nq, 1))
    marks the rows with at least one key when some row might have none."""
    if attn_mask is None:
        if not is_causal:
            return None, False, None
        if nq == nk:
            return None, True, None
        keep = causal_keep(nq, nk, device)
        if nq < nk:  # bottom-right: every row keeps key 0 .. i + (nk - nq) >= 0
            return keep, False, None
        attn_mask = keep
    elif is_causal:
        c = causal_keep(nq, nk, device)
        if attn_mask.dtype == torch.bool:
            attn_mask = attn_mask & c
        else:
            attn_mask = attn_mask.masked_fill(~c, -math.inf)
    if attn_mask.dtype == torch.bool:
        has_key = attn_mask.any(-1, keepdim=True)
        return attn_mask | ~has_key, False, has_key
    attn_mask = attn_mask.to(dtype)
    has_key = (attn_mask > -math.inf).any(-1, keepdim=True)
    return torch.where(has_key, attn_mask, torch.zeros((), dtype=dtype, device=device)), False, has_key


def _same_head_dims(q, k, v):
    """SDPA's fused kernels (CPU flash, FlashAttention-2) need one head dim for q, k and v, else it
    takes its math kernel (N x N weights); zero columns change neither q.k nor the output's first Dv
    columns."""
    dqk, dv = q.shape[-1], v.shape[-1]
    if dv < dqk:
        v = F.pad(v, (0, dqk - dv))
    elif dqk < dv:
        q, k = F.pad(q, (0, dv - dqk)), F.pad(k, (0, dv - dqk))
    return q, k, v


def _sdpa(q, k, v, attn_mask, is_causal, scale, dropout_p):
    mask, causal, has_key = sdpa_mask(attn_mask, is_causal, q.shape[-2], k.shape[-2], q.device, q.dtype)
    dv = v.shape[-1]
    q, k, v = _same_head_dims(q, k, v)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=causal,
                                         scale=scale)[..., :dv]
    if has_key is not None:
        out = torch.where(has_key, out, torch.zeros((), dtype=out.dtype, device=out.device))
    return out


def softmax_torch(q, k, v, *, attn_mask=None, is_causal=False, scale, dropout_p=0.0):
    return _sdpa(q, k, v, attn_mask, is_causal, scale, dropout_p)


def l2_torch(q, k, v, *, attn_mask=None, is_causal=False, scale, dropout_p=0.0):
    out_dtype = q.dtype
    if out_dtype in (torch.float16, torch.bfloat16):  # ||k||^2 in half precision would cost ~3 digits
        q, k, v = q.float(), k.float(), v.float()
    qa, ka = l2_augment(q, k)
    return _sdpa(qa, ka, v, attn_mask, is_causal, scale, dropout_p).to(out_dtype)


def fenchel_additive_mask(attn_mask, log_u, dtype):
    """log u plus the float mask (a bool mask becomes 0 / -inf), broadcast together; None if neither."""
    if log_u is None:
        return attn_mask
    log_u = log_u.to(dtype)
    if attn_mask is None:
        return log_u
    if attn_mask.dtype == torch.bool:
        return log_u.masked_fill(~attn_mask, -math.inf)
    return log_u + attn_mask.to(dtype)


def fenchel_torch(q, k, v, *, attn_mask=None, is_causal=False, scale, log_u=None, alpha=1.0,
                  solve="first_order", dropout_p=0.0):
    if solve != "first_order":
        raise ValueError(f"the torch backend computes solve='first_order' only, got solve={solve!r}")
    mask = fenchel_additive_mask(attn_mask, log_u, q.dtype)
    return _sdpa(q, k, v, mask, is_causal, alpha * scale, dropout_p)
