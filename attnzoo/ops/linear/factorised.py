"""Linear attention written around one kernel: the causal product.

Every form in ``reference.py`` (elu+1 / relu / identity feature maps, normalised or not, key masks,
bottom-right causal with Nq != Nk) reduces to

    causal_product(fq, fk, v, s0)_i = fq_i^T (s0 + sum_{j <= i} fk_j v_j^T)

with two tricks:
- the normaliser fq_i . sum_j fk_j is the same product with a column of ones appended to v, so one
  kernel call gives numerator and denominator;
- a key mask (bool, or float acting as a log-weight) multiplies fk_j by keep_j * exp(bias_j), and
  the identity map's 1/n_i is a prefix count of kept keys.
Bottom-right causal alignment: with Nk > Nq the first Nk - Nq keys are seen by every query (they
become the initial state s0); with Nk < Nq the first Nq - Nk queries see nothing (zeros).
The kernels (cpu.py, triton.py) only implement ``causal_product``; everything here is plain
autograd on O(N D) tensors.
"""
from __future__ import annotations

import torch

from ..common import upcast
from ..masking import split_mask
from .reference import EPS, feature_map_fn


def key_only_mask(attn_mask) -> bool:
    """True when the mask is the same for every query (shape (..., 1, Nk) or fewer dims)."""
    return attn_mask is None or attn_mask.dim() < 2 or attn_mask.shape[-2] == 1


def _key_weights(attn_mask, nk, dtype):
    """(weight (b, h, Nk, 1) or None, keep (b, h, 1, Nk) bool or None, shift (b, h, 1, 1) or None)
    from a key-only mask. weight_j = exp(bias_j - shift) with shift = max_j bias_j, so a large float
    mask cannot overflow exp; the caller multiplies exp(shift) back in."""
    if attn_mask is None:
        return None, None, None
    m = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))
    keep, bias = split_mask(m, False, 1, nk, m.device)
    if keep is not None:  # a mask broadcast along the keys keeps all of them or none
        keep = keep.expand(keep.shape[:-1] + (nk,))
    weight = shift = None
    if bias is not None:
        bias = bias.to(dtype)
        shift = bias.amax(-1, keepdim=True).detach()
        weight = torch.exp(bias - shift)
    if keep is not None:
        weight = keep.to(dtype) if weight is None else weight.masked_fill(~keep, 0.0)
    return (None if weight is None else weight.transpose(-1, -2)), keep, shift


def _causal_count(keep, nq, nk, dtype, device):
    """n_i = kept keys among 0 .. i + (nk - nq), shape broadcastable to (..., nq, 1)."""
    last = torch.arange(nq, device=device) + (nk - nq)
    if keep is None:
        return (last + 1).clamp_min(0).to(dtype)[:, None]
    prefix = keep.to(dtype).cumsum(-1).transpose(-1, -2)                  # (b, h, Nk, 1)
    return prefix[..., last.clamp_min(0), :] * (last >= 0).to(dtype)[:, None]


def _causal_numerator(causal_product, fq, fk, v):
    """fq_i^T sum_{j <= i + nk - nq} fk_j v_j^T (bottom-right causal), zeros for rows seeing no key."""
    nq, nk = fq.shape[-2], fk.shape[-2]
    off = nk - nq
    if off >= 0:
        s0 = fk[..., :off, :].transpose(-1, -2) @ v[..., :off, :]
        return causal_product(fq, fk[..., off:, :], v[..., off:, :], s0)
    s0 = fk.new_zeros(fk.shape[:-2] + (fk.shape[-1], v.shape[-1]))
    tail = causal_product(fq[..., -off:, :], fk, v, s0)
    return torch.cat([tail.new_zeros(tail.shape[:-2] + (-off, tail.shape[-1])), tail], dim=-2)


def linear_attention_factorised(causal_product, q, k, v, *, attn_mask=None, is_causal=False, scale=1.0,
                                feature_map="elu"):
    (q, k, v), out_dtype = upcast(q, k, v)
    phi = feature_map_fn(feature_map)
    fq, fk = phi(q * scale), phi(k)
    nq, nk, dv = q.shape[-2], k.shape[-2], v.shape[-1]
    weight, keep, shift = _key_weights(attn_mask, nk, q.dtype)
    if weight is not None:
        fk = fk * weight
    if feature_map != "identity":
        # num e^-shift / (den e^-shift + EPS e^-shift), the last term floored where it underflows so a
        # row of zero weights stays 0 with finite gradients
        eps = EPS if shift is None else (EPS * torch.exp(-shift)).clamp_min(torch.finfo(q.dtype).tiny ** 0.5)
        if not is_causal:   # two matmuls, and a matrix-vector product for the normaliser
            out = (fq @ (fk.transpose(-1, -2) @ v)) / (fq @ fk.sum(-2).unsqueeze(-1) + eps)
        else:               # the ones column turns the numerator product into the denominator too
            num = _causal_numerator(causal_product, fq, fk, torch.cat([v, torch.ones_like(v[..., :1])], dim=-1))
            out = num[..., :dv] / (num[..., dv:] + eps)
        return out.to(out_dtype)
    if not is_causal:
        num = fq @ (fk.transpose(-1, -2) @ v)
        count = (torch.tensor(float(nk), dtype=q.dtype, device=q.device) if keep is None
                 else keep.sum(-1, keepdim=True).to(q.dtype).transpose(-1, -2))
    else:
        num = _causal_numerator(causal_product, fq, fk, v)
        count = _causal_count(keep, nq, nk, q.dtype, q.device)
    out = num / count.clamp_min(1.0)
    return (out if shift is None else out * torch.exp(shift)).to(out_dtype)
