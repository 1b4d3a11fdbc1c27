"""Causal Sinkhorn under a sliding window of left w, as batches of window problems.

The rule (docs/usage.md, ``masking.coupled_causal_rows``): row i of a causal call is the last row of
Sinkhorn solved non-causally on the tokens row i sees. Under a window of left w (bottom-right aligned,
off = Nk - Nq) those are the keys ka_i..i + off, ka_i = max(0, i + off - w), and the queries of the
same positions, qa_i..i with qa_i = max(0, i - w, -off); every pair of them takes part (two tokens of
one window are at most w apart, so the later one sees the earlier one). So row i's problem is that
window alone, never a growing prefix:

- the rows i >= w + max(0, -off) ("full" rows) all have a (w + 1) x (w + 1) problem with no mask: the
  windows are unfold views of q, k, v, stacked along the batch axis, and solved by one non-causal call
  (more calls when the rows are very many: ``rows_per_call`` keeps the grid within CUDA's limit and one
  call's gathered windows within MAX_ELEMENTS_PER_CALL);
- the at most w rows before them ("short" rows) have smaller windows: they are padded to w + 1 tokens
  on the left with positions masked out entirely (a fully masked row or column drops out of a Sinkhorn
  problem; the column target's constant does not change the plan), and solved by one more call;
- rows with no key (i + off < 0, more queries than keys) are zero rows, as every empty row.

With a mask that is one value per key ((B|1, H|1, 1, Nk), bool or float: key padding) the rule still gives
each row a problem inside its window: the window's tokens the mask keeps, as keys and as queries, plus
query i itself (whatever its own key), every pair of them taking part with the bias of the earlier of
the two tokens (the mask's value for the later one seeing the earlier one). Every row is then gathered
as the short rows are, with a (w + 1) x (w + 1) mask of its own built from the gathered key values
(``_masked_rows``). Any other mask (per query row, per pair) is not sliced: the caller runs the prefix
loop (``takes`` says which).

Work O(n_iters N w^2 D) instead of the prefix loop's O(n_iters N^3 D), in O(1) calls instead of N
(two at short lengths: the short rows and the full ones).
Each call runs under activation checkpointing when gradients are recorded (as the prefix loop): what
autograd keeps is q, k, v, not each call's (rows, w + 1, D) windows and potentials.
"""
from __future__ import annotations

import math

import torch
from torch.utils.checkpoint import checkpoint

# the kernels' grid has B*H (here B*H*rows) on its second axis, which CUDA caps at 2^16 - 1
MAX_GRID_Y = 65535
# elements of one call's gathered q (B * H * rows * (w + 1) * D; k and v alike): bounds a call's memory
MAX_ELEMENTS_PER_CALL = 1 << 27


def window_restricts(left: int, nk: int) -> bool:
    """Whether a causal window of this left reach removes any key (else it is plain causal)."""
    return 0 <= left < nk - 1


def per_key(attn_mask, nk: int):
    """attn_mask as a (B|1, H|1, 1, Nk) view when it holds one value per key (the same for every query row:
    one row, or rows broadcast with stride 0), else None."""
    if attn_mask is None or attn_mask.dim() < 2 or attn_mask.dim() > 4 or attn_mask.shape[-1] != nk:
        return None
    m = attn_mask[(None,) * (4 - attn_mask.dim())]
    if m.shape[-2] == 1:
        return m
    return m[..., :1, :] if m.stride(-2) == 0 else None


def takes(is_causal: bool, attn_mask, left: int, nk: int) -> bool:
    """Whether a call runs as batched window problems: causal, a window that removes keys, and no mask or a
    per-key one (any other mask keeps the exact prefix loop)."""
    return (is_causal and window_restricts(left, nk)
            and (attn_mask is None or per_key(attn_mask, nk) is not None))


def rows_per_call(batch_heads: int, width: int, head_dim: int, masked: bool = False) -> int:
    """How many rows' window problems of ``width`` tokens one call solves (for every batch and head);
    ``masked``: each problem also has its own width x width mask."""
    bh = max(1, batch_heads)
    per_row = width * max(head_dim, width if masked else 1, 1)
    return max(1, min(MAX_GRID_Y // bh, MAX_ELEMENTS_PER_CALL // (bh * per_row)))


def _solve(run, qw, kw, vw, mask):
    """Last row of each problem: qw (P, B, H, w + 1, D) etc. -> (B, H, P, Dv)."""
    P, B, H, W = qw.shape[:4]
    flat = lambda t: t.reshape(P * B, H, W, t.shape[-1])
    out = run(flat(qw), flat(kw), flat(vw), mask)[:, :, -1]      # (P * B, H, Dv)
    return out.reshape(P, B, H, -1).permute(1, 2, 0, 3)


def _full_rows(run, q, k, v, left, first, last):
    """Rows first..last - 1, all full: one unmasked (w + 1) x (w + 1) problem each."""
    off = k.shape[-2] - q.shape[-2]
    W = left + 1

    def windows(t, start, n):  # (B, H, N, D) -> (n, B, H, W, D): n windows of W tokens from start
        return t[..., start:start + n + left, :].unfold(-2, W, 1).permute(2, 0, 1, 4, 3)

    n = last - first
    return _solve(run, windows(q, first - left, n), windows(k, first + off - left, n),
                  windows(v, first + off - left, n), None)


def _short_rows(run, q, k, v, left, first, last):
    """Rows first..last - 1, each padded to w + 1 tokens on the left with the padding masked out."""
    off = k.shape[-2] - q.shape[-2]
    W = left + 1
    rows = torch.arange(first, last, device=q.device)[:, None]
    slot = torch.arange(W, device=q.device)[None, :] - left          # -w..0
    q_pos, k_pos = rows + slot, rows + off + slot                       # (n, W) each
    q_ok = (q_pos >= 0) & (q_pos + off >= 0)    # a query with no position among the keys is in no problem
    k_ok = k_pos >= 0
    mask = (q_ok[:, :, None] & k_ok[:, None, :])                        # (n, W, W)
    B = q.shape[0]
    mask = mask[:, None, None].expand(-1, B, 1, W, W).reshape(-1, 1, W, W)
    gather = lambda t, pos: t[:, :, pos.clamp(min=0)].permute(2, 0, 1, 3, 4)   # (n, B, H, W, D)
    return _solve(run, gather(q, q_pos), gather(k, k_pos), gather(v, k_pos), mask)


def _masked_rows(run, q, k, v, left, keep, bias, first, last):
    """Rows first..last - 1 under a per-key mask: keep (B|1, H|1, Nk) bool, bias the same shape (float) or
    None. Each row's window is gathered (padded on the left as the short rows) with its own mask."""
    off = k.shape[-2] - q.shape[-2]
    W = left + 1
    rows = torch.arange(first, last, device=q.device)[:, None]
    slot = torch.arange(W, device=q.device)[None, :] - left          # -w..0: slot 0 is query i itself
    q_pos, k_pos = rows + slot, rows + off + slot                       # (n, W) each
    at = k_pos.clamp(min=0)
    kept = keep[..., at] & (k_pos >= 0)                                  # (B', H', n, W): the keys in T_i
    # the queries of those tokens, and query i itself (a query needs a position among the keys)
    queries = (kept | (slot == 0)) & (q_pos >= 0) & (k_pos >= 0)
    mask = queries[..., :, None] & kept[..., None, :]                   # (B', H', n, W, W)
    if bias is not None:   # each pair as the later token sees the earlier one: the earlier key's bias
        earlier = torch.minimum(torch.arange(W, device=q.device)[:, None], torch.arange(W, device=q.device)[None, :])
        mask = bias[..., at][..., earlier].masked_fill(~mask, -math.inf)
    B, n = q.shape[0], rows.shape[0]
    mask = mask.permute(2, 0, 1, 3, 4).expand(n, B, -1, W, W).reshape(n * B, -1, W, W)
    gather = lambda t, pos: t[:, :, pos.clamp(min=0)].permute(2, 0, 1, 3, 4)   # (n, B, H, W, D)
    return _solve(run, gather(q, q_pos), gather(k, k_pos), gather(v, k_pos), mask)


def _split_key_mask(attn_mask, nk: int):
    """(keep (B|1, H|1, Nk) bool, bias of that shape or None) of a per-key mask."""
    m = per_key(attn_mask, nk)[..., 0, :]
    if m.dtype == torch.bool:
        return m, None
    keep = m > -math.inf
    return keep, torch.where(keep, m, torch.zeros((), dtype=m.dtype, device=m.device))


def causal_by_window(run, q, k, v, left: int, attn_mask=None):
    """Causal Sinkhorn under the window (left, any right) with no other mask or a per-key one (module
    doc). ``run(q, k, v, mask)``: a non-causal Sinkhorn call; ``takes(True, attn_mask, left, Nk)`` holds."""
    B, H, nq, nk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    off = nk - nq
    first = max(0, -off)                    # rows before it see no key
    full_from = min(first + left, nq)       # rows from it on have a whole window
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    parts = []
    if first > 0:
        parts.append(v.new_zeros(B, H, min(first, nq), v.shape[-1]))

    def call(fn, a, b, *mask):
        if grad:
            parts.append(checkpoint(fn, run, q, k, v, left, *mask, a, b, use_reentrant=False))
        else:
            parts.append(fn(run, q, k, v, left, *mask, a, b))

    step = rows_per_call(B * H, left + 1, max(q.shape[-1], v.shape[-1]), masked=attn_mask is not None)
    if attn_mask is not None:   # every row gathered with its own mask
        key_mask = _split_key_mask(attn_mask, nk)
        for a in range(first, nq, step):
            call(_masked_rows, a, min(a + step, nq), *key_mask)
    else:
        for a in range(first, full_from, step):
            call(_short_rows, a, min(a + step, full_from))
        for a in range(full_from, nq, step):
            call(_full_rows, a, min(a + step, nq))
    with torch.autocast(q.device.type, enabled=False):  # as causal_by_prefix: the rows have the output dtype
        return torch.cat(parts, dim=-2)
