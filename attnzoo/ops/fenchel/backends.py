"""Fenchel attention, first order (paper 004 eq 16: softmax(alpha * scale * q.k + log u + mask)), on
the shared softmax kernels: SDPA (``torch``), the blockwise CPU path (``cpu``) and FlexAttention
(``flex``); the Triton kernel takes a per-key log u itself (ops/kernels/flash_softmax/).

On SDPA a per-key log u (one value per key, no attn_mask) is one more coordinate, q' = [q, 1],
k' = [k, log u / (alpha * scale)], so SDPA runs its fastest mask-free kernel; any other log u is an
additive float mask."""
from __future__ import annotations

import math

import torch

from .. import validate as V
from ..kernels.blockwise import blockwise_attention, split_attn_mask
from ..kernels.flash_softmax import varlen as flash_varlen
from ..kernels.flex import flex_attention
from ..kernels.sdpa import at_least_fp32, augment, sdpa_attention
from ..varlen_options import PerKey


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
    keeps any other key; rows left with none are zeroed, as everywhere in attnzoo. Not for float16
    inputs: the sentinel (and g / scale) must fit the coordinate's dtype (bfloat16 has fp32's range)."""
    g = log_u_keys.to(at_least_fp32(q.dtype)).expand(*log_u_keys.shape[:-1], k.shape[-2])
    finite = g > -math.inf
    g = torch.where(finite, g, torch.full((), -1e30, dtype=g.dtype, device=g.device))
    qa, ka = augment(q, k, 1.0, (g / scale).unsqueeze(-1))
    out = sdpa_attention(qa, ka, v, None, is_causal, scale, dropout_p)
    has_key = _rows_with_a_key(finite, is_causal, q.shape[-2], k.shape[-2])
    return torch.where(has_key, out, torch.zeros((), dtype=out.dtype, device=out.device))


def fenchel_torch(q, k, v, *, attn_mask=None, is_causal=False, scale, log_u=None, alpha=1.0,
                  solve="first_order", dropout_p=0.0):
    if solve != "first_order":
        raise ValueError(f"the torch backend computes solve='first_order' only, got solve={solve!r}")
    scale = alpha * scale
    # the coordinate carries log u / scale in q's dtype: float16's range (65504) holds neither the
    # sentinel of a removed key nor a strongly negative log u, so float16 takes the additive mask (exact
    # for -inf; a log u below float16's range is a weight that underflows to 0 anyway)
    if attn_mask is None and log_u is not None and scale > 0 and q.dtype != torch.float16:
        per_key = log_u.reshape((1,) * (4 - log_u.dim()) + tuple(log_u.shape)) if log_u.dim() < 4 else log_u
        if per_key.shape[-2] == 1:
            return _fenchel_key_coordinate(q, k, v, per_key[..., 0, :], is_causal, scale, dropout_p)
    mask = fenchel_additive_mask(attn_mask, log_u, q.dtype)
    return sdpa_attention(q, k, v, mask, is_causal, scale, dropout_p)


def fenchel_cpu(q, k, v, *, attn_mask=None, is_causal=False, scale, log_u=None, alpha=1.0,
                solve="first_order", dropout_p=0.0, softcap=None, sinks=None, window_size=None):
    """First order only (paper 004 eq 16): softmax(alpha * scale * q.k + log u + mask), blockwise."""
    if solve != "first_order":
        raise ValueError(f"the cpu backend computes solve='first_order' only, got solve={solve!r}")
    keep, add = split_attn_mask(attn_mask)
    return blockwise_attention(q, k, v, kind="softmax", scale=alpha * scale, is_causal=is_causal, keep=keep,
                               add_a=add, add_b=log_u, softcap=softcap, sinks=sinks, window_size=window_size)


def fenchel_flex(q, k, v, *, attn_mask=None, is_causal=False, scale, log_u=None, alpha=1.0,
                 solve="first_order", dropout_p=0.0, softcap=None, sinks=None, window_size=None):
    """First order: softmax(cap(alpha scale q.k) + log u + mask) on FlexAttention (log u and the mask
    are added after the cap, as in the reference)."""
    mask = fenchel_additive_mask(attn_mask, log_u, q.dtype)
    return flex_attention(q, k, v, mask, is_causal, alpha * scale, softcap=softcap, sinks=sinks,
                          window_size=window_size)


def t5_flex(q, k, v, table, lut, *, attn_mask=None, is_causal=False, scale):
    """softmax(scale q.k + table[lut[j - i + Nq - 1], h] + mask) v; ``lut`` from ``t5_offset_lut``."""
    return flex_attention(q, k, v, attn_mask, is_causal, scale, offset_bias=(table, lut))


def fenchel_cpu_varlen(packed, q, k, v, *, scale, softcap, sinks, window_size, options):
    """The blockwise form on packed sequences (ops/kernels/blockwise_varlen.py): first order, with no
    preference or a log u given per key token (``varlen_options.PerKey``: a layer's context preference,
    each sequence's keys their own rows); a plain log u tensor or a T5 table is declined (their
    (B, H, Nq, Nk) layout and relative positions belong to one sequence: they run per length)."""
    log_u = options.get("log_u")
    if (set(options) - {"alpha", "solve", "log_u", "relative_bias"} or options.get("relative_bias") is not None
            or (log_u is not None and not isinstance(log_u, PerKey))
            or options.get("solve", "first_order") != "first_order"):
        return None
    alpha = V.check_positive("alpha", options.get("alpha", 1.0))   # the variant's own rule: alpha > 0
    add_b = None
    if log_u is not None:
        add_b = log_u.packed()
        V.check_values("log_u", add_b)                               # the variant's own rule: no NaN or +inf
    return packed(q, k, v, kind="softmax", scale=alpha * scale, softcap=softcap, sinks=sinks,
                  window_size=window_size, add_b=add_b)


def fenchel_triton_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, is_causal, scale, softcap, sinks, window_size,
                          options):
    """The varlen Triton form (ops/varlen_triton.py): first order with no preference, as the packed
    blockwise form (a packed call has no (B, H, Nq, Nk) log u), on the online-softmax kernels with the
    logit scale alpha * scale; softcap, sinks and the window fused."""
    if (set(options) - {"alpha", "solve", "log_u", "relative_bias"} or options.get("log_u") is not None
            or options.get("relative_bias") is not None or options.get("solve", "first_order") != "first_order"):
        return None
    alpha = V.check_positive("alpha", options.get("alpha", 1.0))   # the variant's own rule: alpha > 0
    return flash_varlen.attention(q, k, v, cu_q, cu_k, max_q, max_k, scale=alpha * scale, is_causal=is_causal,
                                  softcap=softcap, sinks=sinks, window_size=window_size)
