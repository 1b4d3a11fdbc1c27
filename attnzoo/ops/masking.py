"""Mask plumbing shared by every variant.

Masks arrive in SDPA's convention: a bool ``attn_mask`` (True = the key takes part) or a float
one added to the logits (``-inf`` = masked), broadcastable to (B, H, Nq, Nk), plus ``is_causal``.
Every variant needs the same two things from them: *which* keys take part (``keep``) and what
finite number is added to each logit (``bias``). Splitting them once here keeps each variant's
math free of mask special cases.
"""
from __future__ import annotations

import math

import torch

from . import validate


def causal_keep(nq: int, nk: int, device=None) -> torch.Tensor:
    """Bool (nq, nk): key j takes part for query i when j <= i + (nk - nq).

    Bottom-right alignment (FlashAttention >= 2.1, torch's ``causal_lower_right``): the last query
    sees every key, so a decoder step with a KV cache (nq=1) sees the whole cache. For nq == nk it
    is the usual lower triangle.
    """
    i = torch.arange(nq, device=device)[:, None]
    j = torch.arange(nk, device=device)[None, :]
    return j <= i + (nk - nq)


def split_mask(attn_mask, is_causal: bool, nq: int, nk: int, device=None):
    """Return ``(keep, bias)``.

    ``keep``: bool tensor broadcastable to (B, H, nq, nk), or None when every key takes part.
    ``bias``: finite float tensor to add to the logits, or None. A float mask's ``-inf`` entries
    go to ``keep`` (and become 0 in ``bias``) so no ``-inf`` ever enters arithmetic.
    """
    keep = None
    bias = None
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            keep = attn_mask
        else:
            finite_or_pos = attn_mask > -math.inf
            # eager on CPU: no keep when nothing is masked; elsewhere always keep: on CUDA reading the
            # answer would be a host sync on every call (and break CUDA-graph capture), and a traced
            # graph takes no data-dependent branch
            if (torch.compiler.is_compiling() or attn_mask.device.type != "cpu"
                    or not bool(finite_or_pos.all())):
                keep = finite_or_pos
            bias = torch.where(finite_or_pos, attn_mask, torch.zeros((), dtype=attn_mask.dtype,
                                                                      device=attn_mask.device))
    if is_causal:
        c = causal_keep(nq, nk, device=device)
        keep = c if keep is None else (keep & c)
    return keep, bias


def key_counts(keep, nk: int, like: torch.Tensor) -> torch.Tensor:
    """Number of keys taking part per query row, shape broadcastable to (..., nq, 1), in like's dtype.

    Variants with a 1/n normalisation (ReLU, identity-linear, sigmoid's -log n bias, OT's uniform u)
    use this n: masking a key is then the same as removing it, and causal attention is the variant
    applied to each prefix (paper 002, eq 2.6).
    """
    if keep is None:
        return torch.full((1,), float(nk), dtype=like.dtype, device=like.device)
    if keep.dim() == 0 or keep.shape[-1] != nk:
        # broadcast along the key axis (e.g. an (Nq, 1) mask): a row keeps all nk keys or none
        return keep.reshape(keep.shape if keep.dim() else (1,)).to(like.dtype) * nk
    return keep.sum(-1, keepdim=True).to(like.dtype)


def masked_softmax(logits: torch.Tensor, keep) -> torch.Tensor:
    """Softmax over the last dim that gives an all-zero row (not NaN) when no key takes part."""
    if keep is not None:
        logits = logits.masked_fill(~keep, -math.inf)
    row_max = logits.amax(-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max)).detach()
    e = torch.exp(logits - row_max)
    total = e.sum(-1, keepdim=True)
    return e / torch.where(total > 0, total, torch.ones_like(total))


def safe_logsumexp(x: torch.Tensor, dim: int, empty_value: float = 0.0) -> torch.Tensor:
    """logsumexp over ``dim`` (keepdim) that returns ``empty_value`` where every entry is -inf,
    with finite gradients there too (torch.logsumexp gives NaN gradients for such rows). A NaN
    entry gives NaN (it is not an empty row): NaN in the inputs propagates, it is never hidden."""
    m = x.amax(dim, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m)).detach()
    total = torch.exp(x - m).sum(dim, keepdim=True)
    empty = total == 0   # False for a NaN total, which then flows through log
    out = torch.log(torch.where(empty, torch.ones_like(total), total)) + m
    return torch.where(empty, torch.full_like(out, empty_value), out)


def propagate_query_nan(out: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """out with NaN in every row whose query q_i holds a NaN: for kernels that would hide it (SDPA's
    fused CPU kernel returns a zero row there, its running max skipping NaN scores).

    On the devices whose values attnzoo may read on the host (``validate.VALUE_CHECK_DEVICES``: CPU,
    where reading a scalar is no device sync) and in eager mode, one sum over q says whether any NaN
    can be there (a NaN, or +inf and -inf together, make the sum NaN) and the common case returns
    ``out`` untouched, adding no operation to the backward. Otherwise (CUDA, where reading the sum
    would be a host sync, or while torch.compile traces) the rows are filled without a branch."""
    if q.device.type in validate.VALUE_CHECK_DEVICES and not torch.compiler.is_compiling():
        if not math.isnan(q.detach().sum()):
            return out
    return out.masked_fill(torch.isnan(q).any(-1, keepdim=True), math.nan)
