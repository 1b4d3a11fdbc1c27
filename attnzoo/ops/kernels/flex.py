"""FlexAttention (CUDA only) with attnzoo's mask semantics: the ``flex`` backends of l2 and fenchel
and the fused T5 path run through ``flex_attention``.

FlexAttention compiles a score modifier into a fused kernel; ``flex_attention`` offers these terms on
top of scale * q.k: minus a per-query and a per-key term (L2's scale ||q_i||^2 and scale ||k_j||^2;
the query term cancels in a softmax and is subtracted only when a cap or a sink needs the true
logit), the logit cap softcap * tanh(s / softcap) (Gemma 2: on the logit, before the terms below), a
float mask, and a per-head bias read by query-key offset, table[lut[j - i + Nq - 1], h] (T5), whose
gradient FlexAttention's backward returns (a captured tensor that requires grad). Masks use the same
preparation as the SDPA path (``sdpa.sdpa_mask``): bottom-right causal, rows with no key opened and
then zeroed; a causal block mask is built once per (Nq, Nk, device) and reused.

A window (left, right) is the block mask's mask_mod (bottom-right aligned, causality folded in), so
FlexAttention skips the tiles outside the band; the band's block mask alone is built once per (Nq, Nk,
window, device). Sinks join the normaliser after the kernel, from the row's log-sum-exp that
FlexAttention returns: out_i exp(lse_i) / (exp(lse_i) + exp(sink_h)) = out_i sigmoid(lse_i - sink_h)
(``with_sinks``). Their gradient is autograd's through that product and FlexAttention's own backward,
which takes the gradient of the lse it returned (torch's flex backward subtracts it from its row term
delta): d sink_h = -sum_i sigmoid(sink_h - lse_i) (dO_i . out_i), the sink formula of the blockwise
path; tests/test_flex_extras.py checks the renormalisation's gradients against float64.

The backends accept CUDA tensors only (FlexAttention has no backward on CPU); the forward logic is
checked on CPU under no_grad by opt-in tests (ATTNZOO_FLEX_CPU=1: tests/test_cpu_softmax_family.py,
tests/test_flex_extras.py), CUDA and the backward by tests/test_triton_gpu.py and the GPU benchmark's
correctness pass.
"""
from __future__ import annotations

import functools
import math

import torch

from .sdpa import sdpa_mask


def flex_available() -> bool:
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


@functools.lru_cache(maxsize=1)
def compiled_flex_attention():
    """flex_attention wrapped by torch.compile once per process: every caller (these backends, the
    benchmark's FlexAttention baseline) shares one compiled function and so one dynamo cache, instead
    of a fresh torch.compile object, and a fresh compile, per call site or per call."""
    from torch.nn.attention.flex_attention import flex_attention
    return torch.compile(flex_attention, dynamic=False)


@functools.lru_cache(maxsize=32)
def _causal_block_mask(nq: int, nk: int, device: torch.device):
    """Top-left causal (j <= i) block mask for Nq == Nk; built once per shape: building it evaluates
    the predicate over the whole (Nq, Nk) grid."""
    from torch.nn.attention.flex_attention import create_block_mask
    return create_block_mask(lambda b, h, i, j: j <= i, None, None, nq, nk, device=device)


@functools.lru_cache(maxsize=32)
def _band_block_mask(nq: int, nk: int, left: int, right: int, device: torch.device):
    """The block mask of a window with no other mask, built once per shape and window; a row with no
    key in the band (Nq > Nk) is opened to every key (its output is zeroed after)."""
    from torch.nn.attention.flex_attention import create_block_mask
    lo, hi = _band_rows(nq, nk, left, right, device)
    empty = lo > hi

    def mask_mod(b, h, i, j):
        return in_band(i, j, nk - nq, left, right) | empty[i]
    has_key = (~empty).view(nq, 1) if bool(empty.any()) else None
    return create_block_mask(mask_mod, None, None, nq, nk, device=device), has_key


def in_band(i, j, shift, left, right):
    """Whether key j takes part for query i under the band (left, right; -1 unbounded) of a mask_mod."""
    d = j - i - shift  # bottom-right aligned: the diagonal is j = i + Nk - Nq
    keep = d == d
    if left >= 0:
        keep = keep & (d >= -left)
    if right >= 0:
        keep = keep & (d <= right)
    return keep


def _band_rows(nq, nk, left, right, device):
    """(lo, hi), (Nq,) each: the first and last key of each row's band, clipped to 0 .. Nk - 1."""
    i = torch.arange(nq, device=device) + (nk - nq)
    lo = (i - left).clamp(min=0) if left >= 0 else torch.zeros_like(i)
    hi = (i + right).clamp(max=nk - 1) if right >= 0 else torch.full_like(i, nk - 1)
    return lo, hi


def _rows_with_key(kept, nq, nk, left, right, device):
    """Bool (b, h, Nq, 1): the rows with a key that ``kept`` (b, h, Nq|1, Nk) keeps inside the band, from
    prefix counts of kept keys (no (Nq, Nk) band is formed)."""
    lo, hi = _band_rows(nq, nk, left, right, device)
    counts = torch.nn.functional.pad(kept.to(torch.int32).cumsum(-1), (1, 0))
    counts = counts.expand(kept.shape[0], kept.shape[1], nq, nk + 1)
    index = lambda t: t.view(1, 1, nq, 1).expand(kept.shape[0], kept.shape[1], nq, 1)  # noqa: E731
    last = counts.gather(-1, index((hi + 1).clamp(min=0)))
    return (last - counts.gather(-1, index(lo))) > 0


def _window_masks(mask, is_causal, window, B, H, nq, nk, device, dtype):
    """(block_mask, additive float mask or None, has_key or None) for a call with a window."""
    from torch.nn.attention.flex_attention import create_block_mask
    left, right = window
    if is_causal:
        right = 0 if right < 0 else min(right, 0)
    if mask is None:
        block_mask, has_key = _band_block_mask(nq, nk, left, right, device)
        return block_mask, None, has_key
    if mask.dtype == torch.bool:
        keep, additive = mask, None
    else:
        additive = mask.to(dtype)
        keep = additive > -math.inf
    has_key = _rows_with_key(keep, nq, nk, left, right, device)
    opened = (~has_key[..., 0]).expand(B, H, nq)
    if additive is not None:  # a row with no key: finite scores (its output is zeroed after)
        additive = torch.where(has_key, additive, torch.zeros((), dtype=dtype, device=device)).expand(B, H, nq, nk)
        keep = None
    else:
        keep = keep.expand(B, H, nq, nk)
    shift = nk - nq

    def mask_mod(b, h, i, j):
        inside = in_band(i, j, shift, left, right)
        if keep is not None:
            inside = inside & keep[b, h, i, j]
        return inside | opened[b, h, i]
    return create_block_mask(mask_mod, B, H, nq, nk, device=device), additive, has_key


def with_sinks(out, lse, sinks):
    """out (B, H, Nq, Dv) normalised over the keys, lse (B, H, Nq) its natural log-sum-exp: the output
    with each head's sink in the normaliser, out_i exp(lse_i) / (exp(lse_i) + exp(sink_h))."""
    work = torch.promote_types(lse.dtype, torch.float32)
    weight = torch.sigmoid(lse.to(work) - sinks.to(work).view(1, -1, 1))
    return out * weight.unsqueeze(-1).to(out.dtype)


def _lse_request():
    """The keyword that asks flex_attention for the log-sum-exp: torch >= 2.9 return_aux, earlier
    return_lse; and how to read it from the second result."""
    from torch.nn.attention import flex_attention as flex_module
    aux_request = getattr(flex_module, "AuxRequest", None)
    if aux_request is not None:
        return {"return_aux": aux_request(lse=True)}, lambda aux: aux.lse
    return {"return_lse": True}, lambda aux: aux


def flex_attention(q, k, v, mask, is_causal, scale, key_term=None, offset_bias=None, *, query_term=None,
                   softcap=None, sinks=None, window_size=None):
    """softmax(cap(scale q.k - query_term_i - key_term_j) + mask_ij + table[lut[j - i + Nq - 1], h]) v
    with attnzoo's mask semantics, restricted to ``window_size``'s band, with ``sinks`` (H,) in the
    normaliser; ``offset_bias`` is (table (num_buckets, H), lut (Nq + Nk - 1,) int) or None."""
    from torch.nn.attention.flex_attention import create_block_mask
    B, H, nq, _ = q.shape
    nk = k.shape[2]
    block_mask = None
    additive = None
    if window_size is not None:
        block_mask, additive, has_key = _window_masks(mask, is_causal, window_size, B, H, nq, nk, q.device,
                                                      q.dtype)
    else:
        mask, causal, has_key = sdpa_mask(mask, is_causal, nq, nk, q.device, q.dtype)
        if causal:
            block_mask = _causal_block_mask(nq, nk, q.device)
        elif mask is not None and mask.dtype == torch.bool:
            full = mask.expand(B, H, nq, nk)
            block_mask = create_block_mask(lambda b, h, i, j: full[b, h, i, j], B, H, nq, nk, device=q.device)
        elif mask is not None:
            additive = mask.expand(B, H, nq, nk)

    def score_mod(score, b, h, i, j):
        if query_term is not None:
            score = score - query_term[b, h, i]
        if key_term is not None:
            score = score - key_term[b, h, j]
        if softcap is not None:
            score = softcap * torch.tanh(score / softcap)
        if additive is not None:
            score = score + additive[b, h, i, j]
        if offset_bias is not None:
            score = score + offset_bias[0][offset_bias[1][j - i + (nq - 1)], h]
        return score

    if sinks is None:
        out = compiled_flex_attention()(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale)
    else:
        request, read_lse = _lse_request()
        out, aux = compiled_flex_attention()(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale,
                                             **request)
        out = with_sinks(out, read_lse(aux), sinks)
    if has_key is not None:
        out = torch.where(has_key, out, torch.zeros((), dtype=out.dtype, device=out.device))
    return out


def flex_reason(q, k, v, **kw):
    """A FlexAttention backend's ``supports``: CUDA, this torch build, no dropout."""
    if q.device.type != "cuda":
        return "FlexAttention runs here on CUDA tensors only (it has no backward on CPU)"
    if not flex_available():
        return "torch.nn.attention.flex_attention is not available in this torch build"
    if kw.get("dropout_p", 0.0) > 0:
        return "FlexAttention has no dropout on the weights"
    return None
