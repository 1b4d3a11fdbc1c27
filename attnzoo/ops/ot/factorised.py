"""OT attention (paper 004 eq 22, M = -a.b + C) written around one kernel: the transport weights.

With A = keys + extra templates, the logit of template t for query i and input template j is

    L_ijt = (alpha q_i.a_t + k_j.a_t) / gamma + bias_it = C_it + G_jt,

a sum of a query term C (Nq, |A|) and the query-independent Gram term G (Nk, |A|): both are
computed once with matmuls. Masks fold into them: C_it = -inf for a template removed from query
i's set (masked key), and the source weights u_ij (uniform or softmax(log_u) over the keys taking
part, 0 elsewhere) carry the source side. What is left is

    W_it = sum_j u_ij softmax_t(C_it + G_jt),      out_i = sum_t W_it a_v_t,

whose (Nq, Nk, |A|) inner tensor only the kernel (cpu.py, triton.py) touches, tile by tile.
Everything here is autograd on O((Nq + Nk) |A| + Nq Nk) tensors.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..common import upcast
from ..masking import causal_keep, masked_softmax


def keep_and_bias(attn_mask, is_causal, nq, nk, device):
    """(keep, bias) as masking.split_mask, without its data-dependent shortcut (a float mask always
    gives a keep tensor), so torch.compile traces it as one graph."""
    keep = bias = None
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            keep = attn_mask
        else:
            keep = attn_mask > -math.inf
            bias = torch.where(keep, attn_mask, torch.zeros((), dtype=attn_mask.dtype, device=attn_mask.device))
    if is_causal:
        c = causal_keep(nq, nk, device=device)
        keep = c if keep is None else keep & c
    return keep, bias


def _pad_keys(x, nk, na, value):
    """(..., Nq|1, Nk|1) -> (..., Nq|1, |A|): broadcast over the keys first (an (Nq, 1) mask), then
    the extra templates get ``value``."""
    return F.pad(x.expand(x.shape[:-1] + (nk,)), (0, na - nk), value=value)


def ot_terms(q, k, *, attn_mask, is_causal, alpha, gamma, log_u, templates_k):
    """(C, G, u) as described above, in q's dtype; u keeps a size-1 query dim when it can."""
    nq, nk = q.shape[-2], k.shape[-2]
    a_k = k if templates_k is None else torch.cat([k, templates_k], dim=-2)
    na = a_k.shape[-2]
    keep, bias = keep_and_bias(attn_mask, is_causal, nq, nk, q.device)
    c = (q * (alpha / gamma)) @ a_k.transpose(-1, -2)
    g = (k * (1.0 / gamma)) @ a_k.transpose(-1, -2)
    if bias is not None:
        c = c + _pad_keys(bias.to(c.dtype), nk, na, 0.0)
    if keep is not None:
        c = c.masked_fill(~_pad_keys(keep, nk, na, True), -math.inf)
    lead = q.shape[:-2]
    if log_u is None:
        lu = torch.zeros(lead + (1, nk), dtype=q.dtype, device=q.device)
    else:
        lu = log_u.to(q.dtype).unsqueeze(-2).expand(lead + (1, nk))
    src_keep = lu > -math.inf if log_u is not None else None
    if keep is not None:
        src_keep = keep if src_keep is None else src_keep & keep
    u = masked_softmax(lu, src_keep)
    return c, g, u.expand(lead + u.shape[-2:])


def ot_attention_factorised(transport_weights, q, k, v, *, attn_mask=None, is_causal=False, scale, alpha=1.0,
                            gamma=None, log_u=None, templates_k=None, templates_v=None):
    (q, k, v, log_u, templates_k, templates_v), out_dtype = upcast(q, k, v, log_u, templates_k, templates_v)
    gamma = 1.0 / scale if gamma is None else gamma
    # the logits and the sums over A in the (upcast) input dtype, not in autocast's bfloat16
    with torch.autocast(q.device.type, enabled=False):
        c, g, u = ot_terms(q, k, attn_mask=attn_mask, is_causal=is_causal, alpha=alpha, gamma=gamma,
                           log_u=log_u, templates_k=templates_k)
        w = transport_weights(c, g, u)
        a_v = v if templates_v is None else torch.cat([v, templates_v], dim=-2)
        return (w @ a_v).to(out_dtype)


def supports_ot_fused(q, k, v, **kw):
    """Shared by the cpu and triton OT backends: None, or why the call needs the reference."""
    if kw.get("dropout_p", 0.0) > 0:
        return "dropout on the weights is only implemented by backend='reference'"
    return None
