"""The blockwise CPU path on packed sequences: one call for all the sequences of a packed batch.

q (1, H, T_q, D), k (1, H, T_k, D), v (1, H, T_k, Dv) hold N sequences back to back; sequence i is
rows offsets_q[i]:offsets_q[i+1] of q and offsets_k[i]:offsets_k[i+1] of k and v. Each sequence is
its own attention problem: the (query block, key block) pairs visited are those inside one sequence
(blocks start at each sequence's first row), so the work and the largest temporary follow the sum of
n_q n_k over the sequences, never T_q T_k, and no call is made per distinct length. The block math is
ops/kernels/blockwise.py's (``forward_impl`` / ``backward_impl`` on each sequence's rows, is_causal
and the window bottom-right aligned inside the sequence, n_i and the log-sum-exp per row); what this
file adds is the walk over the sequences and one autograd node for all of them.

Each variant that has a blockwise form registers a ``form`` here (its folder's ``__init__``): the
function that maps the variant's options onto a kind, a scale and an additive term, or declines a
call whose options it cannot express (then ``ops/varlen.py`` runs the sequences per length).
"""
from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
from torch import Tensor

from ..first_order import first_order_only
from . import blockwise

# variant name -> form(packed, q, k, v, *, scale, softcap, sinks, window_size, options) -> Tensor | None
FORMS: dict[str, Callable] = {}


def register(variant: str, form: Callable) -> None:
    """``form(packed, q, k, v, *, scale, softcap, sinks, window_size, options)``: the variant on packed
    (1, H, T, D) inputs through ``packed`` (``attention`` below with the offsets and is_causal bound),
    or None when ``options`` (the variant's other keyword arguments) hold something it cannot take."""
    FORMS[variant] = form


def _sequences(offsets_q, offsets_k):
    return zip(offsets_q, offsets_q[1:], offsets_k, offsets_k[1:])


def _own(add_b: Optional[Tensor], a: int, b: int, c: int, d: int) -> Optional[Tensor]:
    """The part of a packed (1, H|1, T_q|1, T_k|1) additive term that belongs to the sequence of query
    rows a:b and keys c:d (a view: the backward accumulates into it); a broadcast dim stays whole."""
    if add_b is None:
        return None
    rows = slice(a, b) if add_b.shape[2] != 1 else slice(None)
    cols = slice(c, d) if add_b.shape[3] != 1 else slice(None)
    return add_b[:, :, rows, cols]


class _PackedBlockwise(torch.autograd.Function):
    """All sequences in one node: the forward saves the per-row statistic (log-sum-exp or n_i) of each
    sequence's rows, the backward recomputes each sequence's blocks from it."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, add_b, config):
        offsets_q, offsets_k, kind, scale, is_causal, block_q, block_k, left, right, softcap = config
        out = q.new_empty(q.shape[:3] + (v.shape[3],))
        stat = q.new_empty(q.shape[:3])
        for a, b, c, d in _sequences(offsets_q, offsets_k):
            out[:, :, a:b], stat[:, :, a:b] = blockwise.forward_impl(
                q[:, :, a:b], k[:, :, c:d], v[:, :, c:d], None, None, _own(add_b, a, b, c, d), kind, scale,
                is_causal, block_q, block_k, left, right, softcap, sinks)
        ctx.save_for_backward(q, k, v, out, stat, sinks, add_b)
        ctx.config = config
        return out

    @staticmethod
    def backward(ctx, grad_out):
        return _PackedBlockwise._backward(ctx, grad_out)

    @staticmethod
    @functools.partial(first_order_only, name="the packed blockwise backward (backend 'cpu' on packed sequences)")
    def _backward(ctx, grad_out):
        q, k, v, out, stat, sinks, add_b = ctx.saved_tensors
        offsets_q, offsets_k, kind, scale, is_causal, block_q, block_k, left, right, softcap = ctx.config
        grad_out = grad_out.contiguous()
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        d_sinks = None if sinks is None else torch.zeros_like(sinks)
        d_add_b = torch.zeros_like(add_b) if ctx.needs_input_grad[4] else None
        for a, b, c, d in _sequences(offsets_q, offsets_k):
            own_b = _own(add_b, a, b, c, d)
            dqi, dki, dvi, _, dbi, dsi = blockwise.backward_impl(
                grad_out[:, :, a:b], q[:, :, a:b], k[:, :, c:d], v[:, :, c:d], out[:, :, a:b], stat[:, :, a:b],
                None, None, own_b, kind, scale, is_causal, block_q, block_k, left, right, softcap, sinks)
            dq[:, :, a:b] = dqi
            dk[:, :, c:d] += dki
            dv[:, :, c:d] += dvi
            if d_sinks is not None:
                d_sinks += dsi
            if d_add_b is not None:
                _own(d_add_b, a, b, c, d).add_(dbi)
        return dq, dk, dv, d_sinks, d_add_b, None


def attention(q: Tensor, k: Tensor, v: Tensor, offsets_q: list[int], offsets_k: list[int], *, kind: str,
              scale: float, is_causal: bool, window_size: Optional[tuple[int, int]] = None,
              softcap: Optional[float] = None, sinks: Optional[Tensor] = None, add_b=None,
              block_q: Optional[int] = None, block_k: Optional[int] = None) -> Tensor:
    """Blockwise attention of ``kind`` (blockwise.KINDS) on each packed sequence (see the module):
    q (1, H, T_q, D), k (1, H, T_k, D), v (1, H, T_k, Dv) -> (1, H, T_q, Dv). ``add_b``: a term added to
    the scores, a constant (sigmoid's bias) or a tensor of shape (1, H|1, T_q|1, T_k|1) in the packed
    layout (a per-head bias; Fenchel's log u per key token), which receives its gradient. Half precision
    is computed in float32, as ``blockwise_attention``."""
    if kind not in blockwise.KINDS:
        raise ValueError(f"kind must be one of {blockwise.KINDS}, got {kind!r}")
    if sinks is not None and kind != "softmax":
        raise ValueError(f"sinks are defined for kind 'softmax' only, got kind={kind!r}")
    out_dtype = q.dtype
    work = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    q, k, v = (t.to(work).contiguous() for t in (q, k, v))   # packed (T, H, D) views: rows contiguous per head
    if isinstance(add_b, Tensor):
        expected = (1, (1, q.shape[1]), (1, q.shape[2]), (1, k.shape[2]))
        if add_b.dim() != 4 or add_b.shape[0] != 1 or any(n not in e for n, e in zip(add_b.shape[1:], expected[1:])):
            raise ValueError(f"add_b must be a number or a (1, H|1, T_q|1, T_k|1) tensor with H={q.shape[1]}, "
                             f"T_q={q.shape[2]}, T_k={k.shape[2]}, got shape {tuple(add_b.shape)}")
        bias = add_b.to(work)
    else:
        bias = None if add_b is None else torch.full((1, 1, 1, 1), float(add_b), dtype=work, device=q.device)
    left, right = window_size if window_size is not None else (-1, -1)
    if block_q is None and window_size is not None:
        block_q = blockwise.window_block_q(left, right, is_causal, k.shape[2])
    config = (list(offsets_q), list(offsets_k), kind, float(scale), bool(is_causal),
              int(block_q or blockwise.DEFAULT_BLOCK_Q), int(block_k or blockwise.DEFAULT_BLOCK_K), int(left),
              int(right), float(softcap or 0.0))
    out = _PackedBlockwise.apply(q, k, v, None if sinks is None else sinks.to(work), bias, config)
    return out.to(out_dtype)
