"""An attnzoo layer used as a bare kernel: its variant math and extra parameters (sigmoid's bias shift,
Fenchel's preference, ...) without its own projections, for hosts that keep theirs
(nn.MultiheadAttention's in_proj, a Hugging Face module's query/key/value)."""
from __future__ import annotations

import math
from typing import Optional

import torch

from ..layers.base import AttentionLayer
from ..ops.logit_extras import window_keep
from ..ops.masking import split_causal
from .spec import Target


def kernel_layer(target: Target, dim: int, num_heads: int, head_dim: int, *, device=None,
                 dtype=None) -> AttentionLayer:
    """``dim`` is the width of the key tokens (Fenchel's context preference reads them)."""
    layer = target.build_layer(dim, num_heads, head_dim, device=device, dtype=dtype)
    # the host projects q, k, v and the output itself; dropping these keeps them out of state_dict
    layer.qkv = None
    layer.proj = None
    return layer


def drop_padded_queries(attn_mask, nq: int, first_token_key: int = 0):
    """Self-attention with a padding mask: a token no query may attend to is padding, so its query row
    is masked too (its output becomes 0). Only Sinkhorn needs this: a padded query would otherwise
    take part in the column normalisation and change the unpadded tokens' outputs. Keys before
    ``first_token_key`` are not tokens (MultiheadAttention's add_bias_kv / add_zero_attn keys)."""
    if attn_mask is None or attn_mask.shape[-1] - first_token_key != nq:
        return attn_mask
    # a (B, 1, 1, Nk) padding mask covers every row
    attn_mask = attn_mask.expand(*attn_mask.shape[:-2], nq, attn_mask.shape[-1])
    keep = attn_mask if attn_mask.dtype == torch.bool else attn_mask > -math.inf
    seen = keep[..., first_token_key:].any(-2)  # (..., N): token j is attended by some query
    if bool(seen.all()):
        return attn_mask
    rows = seen.unsqueeze(-1)                 # query i == token i in self-attention
    if attn_mask.dtype == torch.bool:
        return attn_mask & rows
    return attn_mask.masked_fill(~rows, -math.inf)


def padded_rows(attn_mask, nq: int, first_token_key: int = 0):
    """Causal self-attention with a per-key mask (..., 1, Nk), Nk == nq: the (..., nq, 1) rows of the
    padded tokens (True), whose outputs drop_padded_queries would make 0; None for any other mask.
    Under the causal rule (masking.coupled_causal_rows) a padded token is in no other row's problem
    already, so the kernel may keep the per-key mask (a causal window then runs batched, not as the
    prefix loop of a per-pair mask) and these rows are zeroed after the call: the same outputs."""
    if (attn_mask is None or first_token_key != 0 or attn_mask.dim() < 2 or attn_mask.shape[-2] != 1
            or attn_mask.shape[-1] != nq):
        return None
    keep = attn_mask if attn_mask.dtype == torch.bool else attn_mask > -math.inf
    return ~keep.transpose(-1, -2)


def causal_and_rest(attn_mask: torch.Tensor, nq: int, nk: int,
                    window: Optional[tuple[int, int]] = None) -> tuple[Optional[torch.Tensor], bool]:
    """A host's mask that already holds causality (Hugging Face builds one (B, 1, Nq, Nk) mask of
    causal AND padding, maybe AND a window or packed blocks) -> (mask for the kernel, is_causal):
    ``ops.masking.split_causal``, the one definition both adapters use. A causal mask reaches the
    kernel as is_causal=True (with the per-key padding, or the mask itself when it has more structure),
    so a variant that couples queries solves each row's problem as ``masking.coupled_causal_rows``
    defines and no later token moves an earlier output. ``window``: the window_size the kernel gets
    too; the mask's band is then redundant (split_causal's ``band``). Reads the mask's values (a host
    sync on a GPU)."""
    band = None if window is None else window_keep(window, nq, nk, attn_mask.device)
    return split_causal(attn_mask, nq, nk, band)


def attend_each_prefix(layer: AttentionLayer, q, k, v, attn_mask, x, first: int = 0, **call) -> torch.Tensor:
    """Cross-attention whose queries are causal (a decoder's positions attending to an encoder's
    tokens), for a variant that couples queries (Sinkhorn): query i is solved together with queries
    0..i only, as paper 002 eq 2.6 defines causal attention, so a later decoder token cannot move an
    earlier one's output through the column normalisation. One kernel call per query: O(Nq^2 Nk).
    Rows ``first``.. only (a cached decode step: q holds the earlier positions' queries too)."""
    nq = q.shape[-2]
    rows = []
    for i in range(first, nq):
        mask_i = attn_mask[..., :i + 1, :] if attn_mask is not None and attn_mask.shape[-2] == nq else attn_mask
        rows.append(layer.attend(q[..., :i + 1, :], k, v, attn_mask=mask_i, is_causal=False, x=x, **call)[..., -1:, :])
    return torch.cat(rows, dim=-2)


def attend_last_rows(layer: AttentionLayer, q, k, v, attn_mask, rows: int, x, **call) -> torch.Tensor:
    """The last ``rows`` rows of causal self-attention over N positions (q, k, v all N long) for a
    variant that couples queries: row i is the last row of the variant on positions 0..i (paper 002
    eq 2.6), one non-causal problem per row, O(rows N^2) instead of the N prefixes of the full causal
    call. ``attn_mask``: None, per key (..., 1, N) or per pair (..., N, N), padded queries already
    masked (drop_padded_queries). ``x``: the key tokens (B, N, dim) or None (the kernel does not read them)."""
    n = q.shape[-2]
    out = []
    for i in range(n - rows, n):
        mask_i = attn_mask
        if attn_mask is not None:
            mask_i = attn_mask[..., :i + 1, :i + 1] if attn_mask.shape[-2] == n else attn_mask[..., :i + 1]
        out.append(layer.attend(q[..., :i + 1, :], k[..., :i + 1, :], v[..., :i + 1, :], attn_mask=mask_i,
                                is_causal=False, x=q if x is None else x[:, :i + 1], **call)[..., -1:, :])
    return torch.cat(out, dim=-2)


def keys_and_values(layer: AttentionLayer, q, k, v):
    """(B, H, N, D) k and v as the layer's variant takes them: the queries as keys for l2's tie_qk
    (self-attention without a key cache only), with grouped values repeated to the query heads."""
    if not layer.keys_are_queries:
        return k, v
    if k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"{type(layer).__name__} uses the queries as keys (l2's tie_qk=True), so it needs "
                         f"self-attention without a key cache; got q {tuple(q.shape)} and k {tuple(k.shape)}")
    if v.shape[1] != q.shape[1]:  # grouped values: one per query head now that the keys are the queries
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    return q, v


def check_key_tokens(layer: AttentionLayer, x) -> None:
    if x is None and layer.needs_key_tokens:
        raise ValueError(f"{type(layer).__name__} reads the key tokens x (fenchel's preference='context'), "
                         "which this host does not provide")


def host_scale(layer: AttentionLayer, scale) -> Optional[float]:
    """The host's logit scale, or None (the layer's own) for a variant without logits."""
    return float(scale) if scale is not None and layer.uses_logit_scale else None


def run_kernel(layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
               attn_mask=None, is_causal: bool = False, dropout_p: float = 0.0,
               scale: Optional[float] = None, x: Optional[torch.Tensor] = None,
               self_attention: bool = False, causal_queries: bool = False,
               last_rows: Optional[int] = None, first_token_key: int = 0, enable_gqa: bool = False,
               extras: Optional[dict] = None) -> torch.Tensor:
    """(B, H, Nq, D) x3 -> (B, H, Nq, Dv) through the layer's variant (its ``attend``), with the host's
    logit ``scale`` (ignored by a variant without logits) and ``dropout_p``.
    ``self_attention``: q and k come from the same tokens (see drop_padded_queries).
    ``causal_queries``: the queries are a causal decoder's positions (see attend_each_prefix).
    ``last_rows``: only the last rows are wanted, (B, H, last_rows, Dv): a cached decode step of a
    variant that couples queries, where q also holds the earlier positions' queries (decode_state).
    ``first_token_key``: keys before it are not tokens (see drop_padded_queries).
    ``enable_gqa``: k and v may have fewer heads than q (grouped-query attention), passed on to the kernel.
    ``extras``: softcap / sinks / window_size (ops/logit_extras.py), passed on to the kernel."""
    nq = q.shape[-2]
    rows = nq if last_rows is None else last_rows
    padded = None
    if self_attention and layer.couples_queries:
        padded = padded_rows(attn_mask, nq, first_token_key) if is_causal and rows == nq else None
        if padded is None:
            attn_mask = drop_padded_queries(attn_mask, nq, first_token_key)
    k, v = keys_and_values(layer, q, k, v)
    if causal_queries and not self_attention and layer.reads_positions:
        # offsets j - i between a decoder position and an encoder token are bottom-right aligned on the
        # call's Nq, so an earlier position's output would move with the number of later positions
        # (and a cached step, Nq = 1, would compute another answer): no such offset has a meaning
        raise ValueError(f"{type(layer).__name__} reads relative positions (fenchel's preference='t5'), which a "
                         "decoder's cross-attention does not have (its queries and keys are positions of two "
                         "sequences); swap the self-attention modules only (exclude= the cross-attention ones)")
    check_key_tokens(layer, x)
    call = {"dropout_p": float(dropout_p), "scale": host_scale(layer, scale)}
    if enable_gqa:
        call["enable_gqa"] = True
    if extras:
        call.update(extras)
    if causal_queries and not is_causal and not self_attention and nq > 1 and layer.couples_queries:
        return attend_each_prefix(layer, q, k, v, attn_mask, x if x is not None else q, first=nq - rows, **call)
    if rows < nq:
        if not (is_causal and self_attention and layer.couples_queries):
            raise ValueError("last_rows is for causal self-attention or causal queries of a variant that "
                             "couples queries")
        return attend_last_rows(layer, q, k, v, attn_mask, rows, x, **call)
    out = layer.attend(q, k, v, attn_mask=attn_mask, is_causal=is_causal, x=x if x is not None else q, **call)
    return out if padded is None else out.masked_fill(padded, 0.0)
