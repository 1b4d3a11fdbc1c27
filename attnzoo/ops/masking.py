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


# -- causal masks with more structure than the triangle, for variants that couple queries -----------
#
# The rule (docs/usage.md, "Causal masks and variants that couple queries"): under is_causal=True with a
# mask M, row i of a variant that couples queries (Sinkhorn) is the last row of that variant solved
# NON-causally on the tokens row i sees, T_i = {key j <= i + Nk - Nq : M keeps (i, j)}, with query i
# (and the queries of the tokens in T_i). Inside that problem a pair of tokens takes part, with its bias,
# as M lets the LATER of the two see the EARLIER: the symmetric completion of M's causal part. So only
# M's entries on or below the bottom-right diagonal are read (`block` and `block & tril` are the same
# call), no later token can move an earlier output, a block-causal (packed) mask gives each sequence
# alone, a band gives the variant over the window row i sees, per-key padding removes the padded tokens
# as queries and keys, and the plain triangle gives paper 002 eq (2.6)'s prefix problems.


def causal_completion(attn_mask: torch.Tensor, nq: int, nk: int) -> torch.Tensor:
    """attn_mask (broadcastable to (..., nq, nk), bool or float) -> (..., nq, nk), same dtype: entry
    (a, b) is M's entry for the later of query a's position (a + nk - nq) and key b seeing the earlier
    one. On and below the bottom-right diagonal that is M itself; above it, M[b - (nk - nq), a + nk - nq]
    (key b's own query row). Entries of a query with no position among the keys (a + nk - nq < 0) are
    masked: such a query is in no row's problem."""
    off = nk - nq
    m = attn_mask.expand(*attn_mask.shape[:-2], nq, nk)
    a = torch.arange(nq, device=m.device)[:, None]
    b = torch.arange(nk, device=m.device)[None, :]
    lower = b <= a + off
    rows = torch.where(lower, a, b - off).clamp(0, nq - 1)
    cols = torch.where(lower, b, a + off).clamp(0, nk - 1)
    completed = m[..., rows, cols]
    invalid = (a + off < 0) & ~lower   # a query before the first key: its upper entries have no mirror
    if m.dtype == torch.bool:
        return completed & ~invalid
    return completed.masked_fill(invalid, -math.inf)


def coupled_causal_rows(attn_mask, nq: int, nk: int):
    """For a variant that couples queries, called with is_causal=True and ``attn_mask``: a function
    ``row(i)`` giving the mask of row i's problem over queries 0..i and keys 0..m-1 (m = i + nk - nq + 1,
    the keys visible to query i; m > 0), shape (..., i + 1, m), in attn_mask's dtype (a float one with
    -inf where a pair does not take part); None when attn_mask is None (the plain prefix problem).
    Row i of the causal call is then the last row of the variant run non-causally on
    (q[..., :i + 1, :], k[..., :m, :], v[..., :m, :]) with that mask. Queries and keys outside T_i are
    masked out entirely (a fully masked row or column drops out of a Sinkhorn problem)."""
    if attn_mask is None:
        if nk >= nq:  # every query has a position among the keys: the plain prefix problems
            return lambda i: None
        # more queries than keys: the first nq - nk queries have no position, so no row's problem has them
        attn_mask = torch.ones((), dtype=torch.bool)
    full = attn_mask.expand(*attn_mask.shape[:-2], nq, nk)
    completed = causal_completion(full, nq, nk)
    is_bool = full.dtype == torch.bool
    keep_full = full if is_bool else full > -math.inf
    off = nk - nq

    def row(i: int) -> torch.Tensor:
        m = i + off + 1
        sees = keep_full[..., i, :m]                             # (..., m): T_i
        pos = torch.arange(i + 1, device=full.device) + off      # the key index of each query 0..i
        queries = sees[..., pos.clamp(min=0)] & (pos >= 0)       # the queries of the tokens in T_i ...
        queries = queries | (torch.arange(i + 1, device=full.device) == i)   # ... and query i itself
        keep = sees[..., None, :] & queries[..., :, None]
        sub = completed[..., : i + 1, :m]
        return sub & keep if is_bool else sub.masked_fill(~keep, -math.inf)
    return row


def keeps_only_causal(keep: torch.Tensor, nq: int, nk: int) -> torch.Tensor:
    """0-dim bool tensor: the mask keeps no key j > i + nk - nq (nothing later than bottom-right causality)."""
    return ~(keep & ~causal_keep(nq, nk, keep.device)).any()


def split_causal(attn_mask: torch.Tensor, nq: int, nk: int, band=None):
    """A host's mask that may hold causality (Hugging Face's (B, 1, Nq, Nk) mask of causal AND padding
    AND maybe a window or packed blocks; torch's square subsequent mask) -> (mask for the kernel,
    is_causal). The one place the adapters decide it; it reads the mask's values (a host sync on a GPU).

    A mask that keeps a later key (bidirectional parts) is not causal: (mask, False). Otherwise
    is_causal=True, with None when the mask is exactly the causal pattern, the per-key (..., 1, Nk) last
    row when it is exactly causal AND per-key padding, else the mask itself: under the rule above
    (``coupled_causal_rows``) a variant that couples queries reads only its causal part, and for any
    other variant is_causal adds nothing the mask does not already remove.

    ``band``: a bool (Nq, Nk) sliding window (``logit_extras.window_keep``) that the kernel applies itself
    (it gets ``window_size`` too). The mask is then compared inside the band only, so a mask that is
    exactly causal AND the band AND per-key padding gives None or the per-key row (key j's value, read
    where some query keeps it; the key is masked where none does): the kernel removes the same keys, and
    under the rule a variant that couples queries solves the same problems (within a row's window every
    pair is causal and in the band), without reading a dense mask."""
    keep = attn_mask if attn_mask.dtype == torch.bool else attn_mask > -math.inf
    if not bool(keeps_only_causal(keep, nq, nk)):
        return attn_mask, False
    causal = causal_keep(nq, nk, attn_mask.device)
    if band is None:
        per_key = keep[..., -1:, :]  # the last query sees every key causality allows: only padding is missing
        inside = None
    else:
        inside = band.to(attn_mask.device)
        keep = keep & inside
        causal = causal & inside
        # a key no query keeps (in its band) is removed for all; one in no query's band may stay
        per_key = keep.any(-2, keepdim=True) | ~causal.any(-2, keepdim=True)
    exact = bool((keep == (per_key & causal)).all())
    if exact and attn_mask.dtype != torch.bool:
        exact = bool((attn_mask.masked_fill(~keep, 0) == 0).all())  # a float bias is not padding
    if not exact:
        return attn_mask, True
    if bool(per_key.all()):
        return None, True
    if attn_mask.dtype == torch.bool:
        return per_key, True
    if inside is None:
        return attn_mask[..., -1:, :], True
    return torch.zeros(per_key.shape, dtype=attn_mask.dtype, device=attn_mask.device).masked_fill(~per_key, -math.inf), True
