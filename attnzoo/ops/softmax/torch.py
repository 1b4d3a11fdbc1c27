"""torch's own fused kernels for the softmax family: ``F.scaled_dot_product_attention`` (SDPA) on
every device, FlexAttention on CUDA.

attnzoo's semantics on top of SDPA's:
- causal is bottom-right aligned: SDPA's ``is_causal=True`` (top-left) is used only when Nq == Nk,
  otherwise the (Nq, Nk) bool mask is built once (not per head);
- a query row with no key returns zeros, forward and backward: such rows are opened to every key
  before SDPA (so it computes finite numbers there) and their output is replaced by zeros after,
  which also zeroes every gradient flowing through them;
- q, k and v are zero-padded to one head dim, a multiple of 8 on CUDA (SDPA's fused kernels, cuDNN
  and FlashAttention, need it);
- L2: q' = [2q, -1], k' = [k, ||k||^2] so q'.k' = 2 q.k - ||k||^2 = -||q - k||^2 + ||q||^2, and the
  ||q||^2 term, constant along a softmax row, cancels;
- Fenchel first order: softmax(alpha * scale * q.k + log u + mask). A per-key log u (one value per
  key, no attn_mask) is one more coordinate, q' = [q, 1], k' = [k, log u / (alpha * scale)], so SDPA
  runs its fastest mask-free kernel; any other log u is an additive float mask.

Half precision: a bf16/fp16 coordinate holding ||k||^2 or log u would carry only 8 (11) bits, an
absolute logit error of ~0.4% of ||k||^2. Those values are computed in fp32 and split into two
coordinates, hi = x rounded to the input dtype and lo = (x - hi) rounded, with q' = 1 in both: the
kernel's fp32 dot product adds them back to ~16 (22) bits. Gradients flow through autograd
(d hi / dx = 1, d lo / dx = 0 once hi's dependence is counted), so they are exact as well.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..masking import causal_keep


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


def _round_up_head_dims(q, k, v):
    """SDPA's fused kernels (cuDNN, FlashAttention-2, the CPU flash kernel) need one head dim for q,
    k and v, a multiple of 8 on CUDA; otherwise SDPA falls back to a kernel that stores the N x N
    weights or is slower. Zero columns change neither q.k nor the output's first Dv columns."""
    dqk, dv = q.shape[-1], v.shape[-1]
    target = max(dqk, dv)
    if q.device.type == "cuda":
        target = -(-target // 8) * 8
    if dqk < target:
        q, k = F.pad(q, (0, target - dqk)), F.pad(k, (0, target - dqk))
    if dv < target:
        v = F.pad(v, (0, target - dv))
    return q, k, v


def _sdpa(q, k, v, attn_mask, is_causal, scale, dropout_p):
    mask, causal, has_key = sdpa_mask(attn_mask, is_causal, q.shape[-2], k.shape[-2], q.device, q.dtype)
    dv = v.shape[-1]
    q, k, v = _round_up_head_dims(q, k, v)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=causal,
                                         scale=scale)[..., :dv]
    if has_key is not None:
        out = torch.where(has_key, out, torch.zeros((), dtype=out.dtype, device=out.device))
    return out


def softmax_torch(q, k, v, *, attn_mask=None, is_causal=False, scale, dropout_p=0.0):
    return _sdpa(q, k, v, attn_mask, is_causal, scale, dropout_p)


def _at_least_fp32(dtype):
    return torch.promote_types(dtype, torch.float32)


def split_coordinate(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x (..., 1), fp32 -> the coordinates that carry it in ``dtype``: itself for fp32/fp64, (hi, lo)
    for bf16/fp16 (hi + lo == x to about twice the dtype's mantissa bits; see the module docstring)."""
    if dtype not in (torch.float16, torch.bfloat16):
        return x.to(dtype)
    hi = x.to(dtype)
    lo = (x - hi.to(x.dtype)).to(dtype)
    return torch.cat([hi, lo], dim=-1)


def augment(q, k, q_coeff: float, key_values: torch.Tensor):
    """(q', k') with q'.k' = q_coeff * q.k + key_values_j (key_values (..., Nk, 1) fp32)."""
    extra = split_coordinate(key_values, k.dtype)
    ones = torch.ones(q.shape[:-1] + (extra.shape[-1],), dtype=q.dtype, device=q.device)
    qa = q if q_coeff == 1.0 else q_coeff * q
    return torch.cat([qa, ones], dim=-1), torch.cat([k, extra.expand(k.shape[:-1] + (extra.shape[-1],))], dim=-1)


def l2_torch(q, k, v, *, attn_mask=None, is_causal=False, scale, dropout_p=0.0):
    """softmax(scale (2 q.k - ||k||^2) + mask) v: -scale ||q - k||^2 up to the per-row ||q||^2."""
    kf = k.to(_at_least_fp32(k.dtype))
    key_sq = -(kf * kf).sum(-1, keepdim=True)
    qa, ka = augment(q, k, 2.0, key_sq)
    return _sdpa(qa, ka, v, attn_mask, is_causal, scale, dropout_p)


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


def _rows_with_a_key(finite_keys, is_causal, nq, nk):
    """(B|1, H|1, Nq|1, 1) bool: the query rows that keep at least one key whose log u is finite."""
    if not is_causal:
        return finite_keys.any(-1, keepdim=True).unsqueeze(-1)
    seen = finite_keys.cumsum(-1) > 0                            # any finite key among 0..j
    last = torch.arange(nq, device=finite_keys.device) + (nk - nq)  # each row's last visible key
    rows = seen.index_select(-1, last.clamp(0, nk - 1)) & (last >= 0)
    return rows.unsqueeze(-1)


def _fenchel_key_coordinate(q, k, v, log_u_keys, is_causal, scale, dropout_p):
    """softmax(scale q.k + g_j) v for a per-key g (B|1, H|1, Nk) with the mask-free SDPA kernels.
    A key with g = -inf is given a logit so negative that its weight is exactly 0 whenever its row
    keeps any other key; rows left with none are zeroed, as everywhere in attnzoo."""
    g = log_u_keys.to(_at_least_fp32(q.dtype)).expand(*log_u_keys.shape[:-1], k.shape[-2])
    finite = g > -math.inf
    g = torch.where(finite, g, torch.full((), -1e30, dtype=g.dtype, device=g.device))
    qa, ka = augment(q, k, 1.0, (g / scale).unsqueeze(-1))
    out = _sdpa(qa, ka, v, None, is_causal, scale, dropout_p)
    has_key = _rows_with_a_key(finite, is_causal, q.shape[-2], k.shape[-2])
    return torch.where(has_key, out, torch.zeros((), dtype=out.dtype, device=out.device))


def fenchel_torch(q, k, v, *, attn_mask=None, is_causal=False, scale, log_u=None, alpha=1.0,
                  solve="first_order", dropout_p=0.0):
    if solve != "first_order":
        raise ValueError(f"the torch backend computes solve='first_order' only, got solve={solve!r}")
    scale = alpha * scale
    if attn_mask is None and log_u is not None and scale > 0:
        per_key = log_u.reshape((1,) * (4 - log_u.dim()) + tuple(log_u.shape)) if log_u.dim() < 4 else log_u
        if per_key.shape[-2] == 1:
            return _fenchel_key_coordinate(q, k, v, per_key[..., 0, :], is_causal, scale, dropout_p)
    mask = fenchel_additive_mask(attn_mask, log_u, q.dtype)
    return _sdpa(q, k, v, mask, is_causal, scale, dropout_p)
