"""Linear attention under a sliding window in O(N w): the "band" backend.

A window is linear attention restricted to the band (docs/usage.md): query i reads the keys j with
-left <= j - (i + Nk - Nq) <= right (bottom-right aligned; ``is_causal`` caps right at 0), each with its
weight phi(q_i) . phi(k_j) (times a key mask's keep / exp(bias)), normalised by the band's sum of
weights (elu, relu) or divided by the band's count of kept keys (identity, paper 002 eq 2.2). The
factorised forms (cpu.py, the Triton kernels) sum over every key or every prefix; a band is neither, so
the other backends get it folded into an (Nq, Nk) mask and run the N x N reference.

Here the queries go in blocks of BLOCK rows; block b's band lies inside one run of
BLOCK + left + right consecutive keys, the same run shape for every block, so the runs are one
``unfold`` view of the (zero-padded) keys and values, not copies, and a block's weights are one batched
matmul, (BLOCK, D) x (D, BLOCK + left + right), with the band a fixed (BLOCK, BLOCK + left + right)
pattern (query r, run column c: in the band iff 0 <= c - r <= left + right). Padding keys have zero
features and zero values, so they add nothing. Work and memory O(N (BLOCK + w) D) instead of O(N^2 D);
plain autograd (unfold's backward sums the overlapping runs). Any device: on CUDA the matmuls are
cuBLAS's.

It runs any call with a mask that is the same for every query (key padding, (..., 1, Nk)) and no
dropout (otherwise ``supports_band`` says why and dispatch runs the folded mask on the reference): an
unbounded side of the window (or no window) reaches every key, so the runs are then about as long as
the keys and the cost O(N^2), as the folded mask's. Dispatch takes it for windowed calls (the only
linear backend that takes ``window_size``); for calls without a window its priority is below "cpu"'s
O(N) factorised forms, so auto never picks it there.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..common import upcast
from ..logit_extras import check_window_size
from .factorised import _key_weights, key_only_mask
from .reference import EPS, feature_map_fn

BLOCK = 64   # query rows per block: the run of keys a block reads is BLOCK + left + right long


def band_reach(window_size, is_causal: bool, nq: int, nk: int) -> tuple[int, int]:
    """(left, right) of the band with causality applied (right <= 0); an unbounded side (or no window)
    becomes nq + nk, past every key."""
    window = check_window_size(window_size) or (-1, -1)
    reach = nq + nk
    left, right = (reach if side < 0 else min(side, reach) for side in window)
    if is_causal:
        right = min(right, 0)
    return left, right


def supports_band(q, k, v, *, attn_mask=None, dropout_p=0.0, **_):
    """None, or why the band backend does not run the call."""
    if dropout_p > 0:
        return "dropout on the weights needs the N x N weight matrix (use backend='reference')"
    if not key_only_mask(attn_mask):
        return ("a query-dependent attn_mask (not of shape (..., 1, Nk)) besides the window needs the N x N "
                "weights (use backend='reference')")
    return None


def _runs(t: torch.Tensor, first: int, blocks: int, width: int) -> torch.Tensor:
    """(..., N, C) -> (..., blocks, width, C): block b's run of ``width`` rows from row first + b * BLOCK,
    rows outside [0, N) zeros (a padded copy, then one unfold view)."""
    n = t.shape[-2]
    pad_before = max(0, -first)
    pad_after = max(0, first + (blocks - 1) * BLOCK + width - n)
    padded = F.pad(t, (0, 0, pad_before, pad_after))
    start = first + pad_before
    span = padded[..., start:start + (blocks - 1) * BLOCK + width, :]
    return span.unfold(-2, width, BLOCK).transpose(-1, -2)


def linear_attention_band(q, k, v, *, attn_mask=None, is_causal=False, scale=1.0, feature_map="elu",
                          dropout_p=0.0, window_size=None):
    """Linear attention on the band of ``window_size`` (see the module); same semantics as
    ``reference.linear_attention`` with the band folded into the mask."""
    why = supports_band(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p)
    if why is not None:
        raise ValueError(why)
    left, right = band_reach(window_size, is_causal, q.shape[-2], k.shape[-2])
    (q, k, v), out_dtype = upcast(q, k, v)
    phi = feature_map_fn(feature_map)
    fq, fk = phi(q * scale), phi(k)
    nq, nk, d, dv = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    weight, keep, shift = _key_weights(attn_mask, nk, q.dtype)
    if weight is not None:
        fk = fk * weight
    lead = torch.broadcast_shapes(fq.shape[:-2], fk.shape[:-2], v.shape[:-2])
    fq, fk, v = fq.expand(*lead, nq, d), fk.expand(*lead, nk, d), v.expand(*lead, nk, dv)
    blocks = -(-nq // BLOCK)
    width = BLOCK + left + right
    first = (nk - nq) - left                                   # block 0's first key
    row = torch.arange(BLOCK, device=q.device)[:, None]
    col = torch.arange(width, device=q.device)[None, :]
    in_band = (col - row >= 0) & (col - row <= left + right)   # (BLOCK, width), the same for every block
    fq_blocks = F.pad(fq, (0, 0, 0, blocks * BLOCK - nq)).reshape(*lead, blocks, BLOCK, d)
    w = fq_blocks @ _runs(fk, first, blocks, width).transpose(-1, -2)       # (..., blocks, BLOCK, width)
    # where, not a product: a NaN or inf feature of a key outside the band stays outside it
    w = torch.where(in_band, w, w.new_zeros(()))
    num = w @ _runs(v, first, blocks, width)                                # (..., blocks, BLOCK, Dv)
    if feature_map != "identity":
        # EPS in the shifted units of a float key mask, floored as the reference does
        eps = EPS if shift is None else (EPS * torch.exp(-shift)).clamp_min(torch.finfo(q.dtype).tiny ** 0.5)
        if shift is not None:
            eps = eps.unsqueeze(-3)                                         # (b, h, 1, 1, 1) over the blocks
        out = num / (w.sum(-1, keepdim=True) + eps)
    else:
        kept = torch.ones(nk, 1, dtype=q.dtype, device=q.device) if keep is None else \
            keep.to(q.dtype).transpose(-1, -2)                              # (..., Nk, 1)
        count = (in_band.to(q.dtype) @ _runs(kept, first, blocks, width))   # (..., blocks, BLOCK, 1)
        out = num / count.clamp_min(1.0)
        if shift is not None:
            out = out * torch.exp(shift).unsqueeze(-3)
    out = out.reshape(*lead, blocks * BLOCK, dv)[..., :nq, :]
    return out.to(out_dtype)
