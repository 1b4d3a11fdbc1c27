"""Linear attention, eager reference.

feature_map="elu" (Katharopoulos et al. 2020): phi(x) = elu(x) + 1,
    out_i = phi(q_i) . sum_j phi(k_j) v_j^T / (phi(q_i) . sum_j phi(k_j) + 1e-6)
feature_map="relu": the same with phi = relu.
feature_map="identity" (paper 002 eq 2.2, unnormalised): out_i = (1/n_i) sum_j (q_i . k_j) v_j.

There are no logits, so ``scale`` defaults to 1 (the formulas above) and, when given, multiplies q
before the feature map. A float mask acts as a log-weight: a pair's weight is multiplied by
exp(mask_ij), so 0 leaves it and -inf removes it, as it would in a softmax. exp is taken of the
mask minus its row maximum (no overflow for large finite entries) and the maximum put back exactly.

Without a general mask the sums over keys are computed once (non-causal: two matmuls) or as
prefix sums (causal: O(N D Dv) memory, never N x N). A general mask needs the N x N form.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..common import upcast, weights_dropout
from ..masking import causal_keep, key_counts, split_mask

EPS = 1e-6
FEATURE_MAPS = ("elu", "relu", "identity")


def feature_map_fn(name):
    if name == "elu":
        return lambda x: F.elu(x) + 1.0
    if name == "relu":
        return torch.relu
    return lambda x: x


def linear_attention(q, k, v, *, attn_mask=None, is_causal=False, scale=1.0, feature_map="elu",
                     dropout_p=0.0):
    (q, k, v), out_dtype = upcast(q, k, v)
    phi = feature_map_fn(feature_map)
    fq, fk = phi(q * scale), phi(k)
    nq, nk = q.shape[-2], k.shape[-2]
    normalised = feature_map != "identity"
    if attn_mask is None and dropout_p == 0.0:
        if not is_causal:
            num = fq @ (fk.transpose(-1, -2) @ v)
            if normalised:
                den = fq @ fk.sum(-2).unsqueeze(-1)
            else:
                den = torch.full_like(num[..., :1], float(nk))
            return (num / (den + EPS) if normalised else num / den).to(out_dtype)
        # causal via prefix sums; query i sees the prefix of length i + 1 + (nk - nq)
        kv = torch.cumsum(fk.unsqueeze(-1) * v.unsqueeze(-2), dim=-3)   # (B, H, Nk, D, Dv)
        ks = torch.cumsum(fk, dim=-2)                                    # (B, H, Nk, D)
        last = torch.arange(nq, device=q.device) + (nk - nq)             # last visible key
        has = last >= 0
        idx = last.clamp_min(0)
        num = torch.einsum("bhid,bhide->bhie", fq, kv[..., idx, :, :])
        num = num * has[:, None].to(num.dtype)
        if normalised:
            den = (fq * ks[..., idx, :]).sum(-1, keepdim=True) * has[:, None].to(num.dtype)
            return (num / (den + EPS)).to(out_dtype)
        n = (last + 1).clamp_min(1).to(num.dtype)[:, None]
        return (num / n).to(out_dtype)
    keep, bias = split_mask(attn_mask, is_causal, nq, nk, q.device)
    w = fq @ fk.transpose(-1, -2)
    # exp(bias) overflows from bias ~ 89 in fp32: weigh by exp(bias - shift), shift = the row's
    # largest bias, and put exp(shift) back where the formula allows (EPS, or the output row)
    shift = None
    if bias is not None:
        bias = bias.to(w.dtype)
        shift = bias.amax(-1, keepdim=True).detach()
        w = w * torch.exp(bias - shift)
    if keep is not None:
        w = w.masked_fill(~keep, 0.0)
    if normalised:
        # EPS in the shifted units, floored where it underflows so a row whose weights are all 0 stays
        # 0 / eps = 0 with finite gradients (the floor's square, in d/d den, is still a normal number)
        eps = EPS if shift is None else (EPS * torch.exp(-shift)).clamp_min(torch.finfo(w.dtype).tiny ** 0.5)
        w = w / (w.sum(-1, keepdim=True) + eps)
    else:
        w = w / key_counts(keep, nk, w).clamp_min(1.0)
    out = weights_dropout(w, dropout_p) @ v
    if shift is not None and not normalised:
        out = out * torch.exp(shift)
    return out.to(out_dtype)


__all__ = ["linear_attention", "FEATURE_MAPS", "causal_keep"]
