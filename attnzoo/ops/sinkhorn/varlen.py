"""Packed (varlen) Sinkhorn attention on the Triton kernels: every sequence of a packed call in one launch
per pass, each its own Sinkhorn problem (ops/varlen.py's layout and semantics; the route there reaches
this through ops/varlen_triton.py).

q (T_q, H, D), k and v (T_k, H_kv, .) hold N sequences back to back; ``cu_q`` / ``cu_k`` (N + 1 offsets,
tensors on q's device) are read by the kernels at their entry, never on the host; ``max_q`` / ``max_k``
(Python ints) size the grids, (cdiv(max_x, BLOCK_X), N * H), whose programs past their sequence's end
return at once. So a call costs the sum over sequences of n_iters n_q n_k, no tile crosses a boundary,
and the marginals (rows 1, columns n_q / n_k, c = log(n_q / n_k)) are each sequence's own
(triton_kernels.py, "Packed sequences").

The passes are TritonEngine's (triton.py), run by ``PackedEngine``, which changes only what the
kernels are handed: q, k, v, the output and every per-row vector in per-sequence (H, n) blocks
(ops/triton_packed.py; one gather in, one out: an extra pass over q, k, v, out and the gradients,
O(T H D) against the passes' O(n_iters sum n^2 H D)), the offsets and the VARLEN flag with every launch,
the column target as 1 (each program scales it by its own c), and the stacks of the adjoint's terms
regrouped per sequence for the two kernels that index them by iteration. Grouped-query k and v are
expanded to q's heads (the kernels' dK / dV are per program; the expansion's backward sums the group).

Forward and backward are the custom ops ``attnzoo::sinkhorn_varlen_fwd`` / ``_bwd`` (the unrolled
gradient, first order only, as the dense ones). Causal packed Sinkhorn is each sequence's prefix loop
(row i = the last row of Sinkhorn on its prefix): ``causal`` runs prefix i of every sequence as one
packed problem, max_q launch sets in all instead of one per (distinct length, prefix); it reads the
offsets on the host for the prefixes' sizes, so while torch.compile traces the route declines causal calls
and ops/varlen.py runs them as one padded batch (``padded_coupled``: one graph, fullgraph=True holds).
A non-causal ``window_size`` is each sequence's band (bottom-right on its own lengths), and every pass skips
the tiles outside it as the dense passes do (triton.py); a causal window is each row's own window problem,
which the per-length route batches (causal_window.py). The route (``route``) takes calls without a causal
window, dropout or sinks, of the dtypes and head dims the
dense kernels take, and returns None for the others, which ops/varlen.py then runs per sequence length
through the variant's own function (its checks and errors), as it does the implicit backward
("triton_implicit" is not this route's backend name).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from .. import logit_extras
from .. import validate as V
from ..triton_logit_extras import band_bounds
from ..triton_packed import blocked_rows
from ..triton_utils import HAVE_TRITON, kernel_op, tracing_only
from .functional import check
from .streaming import Problem

if HAVE_TRITON:
    from .triton import FOLD_BELOW, HALF, TritonEngine, unsupported_reason
else:  # the route is never registered without Triton; the names keep the module importable
    TritonEngine = object


@dataclass
class PackedProblem(Problem):
    """A packed call: q, k, v are (1, H, T, D) views of per-sequence (H, n, D) blocks (``to_blocks``)."""
    cu_q: Optional[Tensor] = None
    cu_k: Optional[Tensor] = None
    max_q: int = 0
    max_k: int = 0

    @property
    def n_seq(self) -> int:
        return self.cu_q.shape[0] - 1

    @property
    def col_target(self) -> float:
        """1: the kernels multiply it by each sequence's own c = log(n_q / n_k) (triton_kernels.py)."""
        return 1.0


def to_blocks(t: Tensor, rows: Tensor) -> Tensor:
    """Packed (T, H, D) -> (1, H, T, D) holding per-sequence (H, n, D) blocks; ``rows`` =
    ``blocked_rows(cu, T, H)`` (where each (token, head) row goes)."""
    T, H, D = t.shape
    out = t.new_empty(H * T, D).index_copy_(0, rows.reshape(-1), t.reshape(T * H, D))
    return out.view(1, H, T, D)


def from_blocks(t: Tensor, rows: Tensor) -> Tensor:
    """``to_blocks``' inverse: (1, H, T, D) blocks -> packed (T, H, D)."""
    _, H, T, D = t.shape
    return t.reshape(H * T, D).index_select(0, rows.reshape(-1)).view(T, H, D)


def per_sequence_stack(stack: Tensor, cu: Tensor, total: int, heads: int) -> Tensor:
    """A stack of T' vectors in per-sequence (H, n) blocks (its first H * total entries of each) -> the
    same values grouped per sequence: sequence s's (T', H, n) block from T' H cu[s], the layout
    _factors_kernel and _grad_qk_kernel index under VARLEN. Device ops only (no host read)."""
    entries = stack.shape[0]
    flat = stack.reshape(entries, -1)[:, :heads * total]
    position = blocked_rows(cu, total, heads).reshape(-1)                # the blocked rows, any order
    cu64 = cu.to(torch.int64)
    seq = torch.searchsorted(heads * cu64[1:], position, right=True)
    start, n = cu64[seq], cu64[seq + 1] - cu64[seq]
    t = torch.arange(entries, device=stack.device)[:, None]
    dest = (entries - 1) * heads * start[None, :] + t * heads * n[None, :] + position[None, :]
    out = flat.new_empty(entries * heads * total)
    out[dest.reshape(-1)] = flat[:, position].reshape(-1)
    return out.view(entries, -1)


class PackedEngine(TritonEngine):
    """TritonEngine's passes on a ``PackedProblem`` (module doc): its launches, sizes and grids with the
    maxima for Nq / Nk, N * H programs along the batch-head axis and the offsets appended."""

    def _setup(self, p: PackedProblem) -> dict:
        if getattr(p, "_triton", None) is not None:
            return p._triton
        s = super()._setup(p)
        packed = dict(CU_Q=p.cu_q, CU_K=p.cu_k, VARLEN=True)
        s.update(B=p.n_seq, nq=p.max_q, nk=p.max_k, BH=p.n_seq * s["H"],
                 fold=p.n_seq * s["H"] * p.max_q * p.max_k < FOLD_BELOW and p.band is None,
                 factors_packed=dict(HEADS=s["H"], **packed))
        s["meta"].update(packed)
        return s

    def _vec(self, p, n, *lead):
        """Room for N * H rows of the longest length n (a per-sequence (H, n_s) block layout fits in it)."""
        return torch.empty(*lead, p.n_seq, p.q.shape[1], n, dtype=torch.float32, device=p.q.device)

    def _orient(self, p, s, rows):
        X, Y, nx, ny, strides, meta = super()._orient(p, s, rows)
        return X, Y, nx, ny, strides, dict(meta, X_IS_Q=rows)

    def grad_qk(self, p, g, lse, dout, delta, terms):
        if terms is not None:
            F, G, DG, DF = terms
            T_q, T_k, H = p.q.shape[2], p.k.shape[2], p.q.shape[1]
            terms = (per_sequence_stack(F, p.cu_q, T_q, H), per_sequence_stack(G, p.cu_k, T_k, H),
                     per_sequence_stack(DG, p.cu_k, T_k, H), per_sequence_stack(DF, p.cu_q, T_q, H))
        return super().grad_qk(p, g, lse, dout, delta, terms)


ENGINE = PackedEngine()


def _problem(q, k, v, cu_q, cu_k, max_q, max_k, scale, eps, l2, tune, softcap, window) -> PackedProblem:
    """``window``: (left, right) of a non-causal sliding window, (-1, -1) none. Its band is each
    sequence's own (the kernels align it bottom-right on their sequence's lengths); an unbounded side
    reaches past the longest sequence."""
    band = None if tuple(window) == (-1, -1) else band_bounds(tuple(window), False, max_q, max_k)
    return PackedProblem(q, k, v, None, None, scale, eps, "l2" if l2 else "dot", None, tune, softcap, band,
                         cu_q=cu_q, cu_k=cu_k, max_q=max_q, max_k=max_k)


def _rows(q, k, cu_q, cu_k):
    return blocked_rows(cu_q, q.shape[0], q.shape[1]), blocked_rows(cu_k, k.shape[0], k.shape[1])


if HAVE_TRITON:
    @kernel_op("attnzoo::sinkhorn_varlen_fwd", mutates_args=())
    def sinkhorn_varlen_fwd(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int,
                            scale: float, eps: float, l2: bool, n_iters: int, tune: bool,
                            softcap: float, window_left: int = -1,
                            window_right: int = -1) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """(out (T_q, H, Dv) in q's dtype; then, for the backward: the row lse, the potential stacks F, G
        (float32, per-sequence blocks in (N, H, max) room) and the output it takes delta = dout.out from,
        in blocks (float32 and unrounded for half inputs)). k, v have q's heads; ``tune``: large launches
        may autotune (not in the causal prefix loop, where every prefix is a new shape)."""
        T_q, H, _ = q.shape
        n_seq, DV = cu_q.shape[0] - 1, v.shape[2]
        if tracing_only(q):
            vec = lambda n, *lead: torch.empty(*lead, n_seq, H, n, dtype=torch.float32, device=q.device)
            resid = torch.empty(1, H, T_q, DV, dtype=torch.float32 if q.dtype in HALF else q.dtype, device=q.device)
            return q.new_empty(T_q, H, DV), vec(max_q), vec(max_q, n_iters), vec(max_k, n_iters + 1), resid
        rows_q, rows_k = _rows(q, k, cu_q, cu_k)
        p = _problem(to_blocks(q, rows_q), to_blocks(k, rows_k), to_blocks(v, rows_k), cu_q, cu_k, max_q, max_k,
                     scale, eps, l2, tune, softcap, (window_left, window_right))
        out, lse, F, G, exact = ENGINE.forward(p, n_iters)
        return from_blocks(out, rows_q), lse, F, G, (exact if q.dtype in HALF else out)

    @kernel_op("attnzoo::sinkhorn_varlen_bwd", mutates_args=())
    def sinkhorn_varlen_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, resid: Tensor, lse: Tensor, F: Tensor,
                            G: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int, scale: float, eps: float,
                            l2: bool, tune: bool, softcap: float, window_left: int = -1,
                            window_right: int = -1) -> tuple[Tensor, Tensor, Tensor]:
        """(dq, dk, dv) packed like q, k, v: the unrolled iterations' exact gradient."""
        if tracing_only(q):
            return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        rows_q, rows_k = _rows(q, k, cu_q, cu_k)
        p = _problem(to_blocks(q, rows_q), to_blocks(k, rows_k), to_blocks(v, rows_k), cu_q, cu_k, max_q, max_k,
                     scale, eps, l2, tune, softcap, (window_left, window_right))
        dq, dk, dv = ENGINE.backward_unrolled(p, to_blocks(dout, rows_q), resid, lse, F, G)
        return from_blocks(dq, rows_q).to(q.dtype), from_blocks(dk, rows_k), from_blocks(dv, rows_k)

    def _setup_context(ctx, inputs, output):
        q, k, v, cu_q, cu_k, max_q, max_k, scale, eps, l2, n_iters, tune, softcap, left, right = inputs
        _, lse, F, G, resid = output
        ctx.save_for_backward(q, k, v, resid, lse, F, G, cu_q, cu_k)
        ctx.config = (max_q, max_k, scale, eps, l2, tune, softcap, left, right)

    def _grad(ctx, dout, _dlse, _dF, _dG, _dresid):
        q, k, v, resid, lse, F, G, cu_q, cu_k = ctx.saved_tensors
        dq, dk, dv = sinkhorn_varlen_bwd(dout.contiguous(), q, k, v, resid, lse, F, G, cu_q, cu_k, *ctx.config)
        return dq, dk, dv, None, None, None, None, None, None, None, None, None, None, None, None

    sinkhorn_varlen_fwd.register_autograd(_grad, setup_context=_setup_context)


def _packed_call(q, k, v, cu_q, cu_k, max_q, max_k, config, tune, window=(-1, -1)) -> Tensor:
    scale, eps, cost, n_iters, softcap = config
    out, *_ = sinkhorn_varlen_fwd(q, k, v, cu_q, cu_k, int(max_q), int(max_k), float(scale), float(eps),
                                  cost == "l2", int(n_iters), bool(tune), float(softcap or 0.0), *window)
    return out


def _ranges(starts: list[int], lengths: list[int], device) -> Tensor:
    """The token indices start .. start + length - 1 of each range, concatenated (device ops; sizes from
    the host's lists)."""
    lengths_t = torch.tensor(lengths, device=device)
    firsts = torch.tensor(starts, device=device).repeat_interleave(lengths_t, output_size=sum(lengths))
    offsets = torch.tensor([0] + lengths[:-1], device=device).cumsum(0).repeat_interleave(
        lengths_t, output_size=sum(lengths))
    return firsts + torch.arange(sum(lengths), device=device) - offsets


@torch.compiler.disable
def causal(q, k, v, cu_q, cu_k, config) -> Tensor:
    """Causal packed Sinkhorn: row i of a sequence is the last row of Sinkhorn on its prefix (queries 0..i,
    keys 0..i + n_k - n_q: paper 002 eq 2.6, streaming.causal_by_prefix), and prefix i of every sequence
    long enough is one packed problem, one launch set: max_q of them instead of one per (distinct length,
    prefix). Each runs under activation checkpointing (autograd keeps q, k, v and the rows, as the
    per-length prefix loop). The offsets are read on the host here (the prefix problems' sizes), so ``route``
    does not take causal calls while torch.compile traces (ops/varlen.py's padded batch runs them)."""
    offsets_q, offsets_k = cu_q.tolist(), cu_k.tolist()
    starts_q, starts_k = offsets_q[:-1], offsets_k[:-1]
    n_q = [b - a for a, b in zip(offsets_q, offsets_q[1:])]
    n_k = [b - a for a, b in zip(offsets_k, offsets_k[1:])]
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))

    def prefix_rows(index_q, index_k, cu_qi, cu_ki, last_rows, longest_q, longest_k, q, k, v):
        out = _packed_call(q.index_select(0, index_q), k.index_select(0, index_k), v.index_select(0, index_k),
                           cu_qi, cu_ki, longest_q, longest_k, config, False)
        return out.index_select(0, last_rows)

    rows, targets = [], []
    for i in range(max(n_q)):
        seqs = [s for s in range(len(n_q)) if i < n_q[s] and i + n_k[s] - n_q[s] >= 0]   # rows with a key
        if not seqs:
            continue
        # with more queries than keys the first n_q - n_k queries have no position among the keys, so no
        # row's problem has them (masking.coupled_causal_rows): queries max(0, n_q - n_k) .. i
        first_q = [max(0, n_q[s] - n_k[s]) for s in seqs]
        len_q = [i + 1 - f for f in first_q]
        len_k = [i + n_k[s] - n_q[s] + 1 for s in seqs]
        cu_qi, cu_ki = (torch.tensor([0] + n, device=q.device).cumsum(0).to(torch.int32) for n in (len_q, len_k))
        index_q = _ranges([starts_q[s] + f for s, f in zip(seqs, first_q)], len_q, q.device)
        index_k = _ranges([starts_k[s] for s in seqs], len_k, q.device)
        last_rows = cu_qi[1:].to(torch.int64) - 1
        args = (index_q, index_k, cu_qi, cu_ki, last_rows, max(len_q), max(len_k), q, k, v)
        rows.append(checkpoint(prefix_rows, *args, use_reentrant=False) if grad else prefix_rows(*args))
        targets.append(torch.tensor([starts_q[s] + i for s in seqs], device=q.device))
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[2])          # rows that see no key stay zero
    if not rows:
        return out
    return out.index_copy(0, torch.cat(targets), torch.cat(rows))


def attention(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int, *, scale: float,
              n_iters: int, eps: float, cost: str, softcap: Optional[float] = None, is_causal: bool = False,
              window: tuple[int, int] = (-1, -1)) -> Tensor:
    """Packed q (T_q, H, D), k (T_k, H_kv, D), v (T_k, H_kv, Dv) -> (T_q, H, Dv): Sinkhorn attention of
    every sequence on its own, causal (``causal``) or not (the arguments checked by ``route``); a
    non-causal ``window`` is each sequence's band of its transport problem (tiles outside skipped)."""
    group = q.shape[1] // k.shape[1]
    if group > 1:  # grouped-query heads: expanded (module doc)
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    config = (scale, eps, cost, n_iters, softcap)
    if is_causal:
        return causal(q, k, v, cu_q, cu_k, config)
    return _packed_call(q, k, v, cu_q, cu_k, max_q, max_k, config, True, window)


def route(q, k, v, cu_q, cu_k, max_q: int, max_k: int, is_causal, kwargs: dict) -> Optional[Tensor]:
    """ops/varlen_triton.py's route for Sinkhorn: the packed kernels (causal: ``causal``), or None for what
    they do not take (a causal window, dropout, sinks, an option this route does not know, dtypes and head dims
    the kernels refuse), which the per-length route then runs or refuses with the variant's own errors."""
    options = dict(kwargs)
    options.pop("backend", None)
    is_causal = V.check_flag("is_causal", is_causal)
    if options.pop("dropout_p", 0.0) != 0.0:
        return None
    if options.pop("sinks", None) is not None:
        return None
    window = logit_extras.check_window_size(options.pop("window_size", None))
    if window is not None and is_causal:  # each row's own window problem: the per-length route batches them
        return None
    if is_causal and torch.compiler.is_compiling():  # ``causal`` reads the offsets: ops/varlen.py's padded
        return None                                  # batch for coupled variants keeps one graph
    q4, k4, v4 = (t.transpose(0, 1)[None] for t in (q, k, v))                 # (1, H, T, D) views
    V.check_qkv(q4, k4, v4, V.check_flag("enable_gqa", options.pop("enable_gqa", False)))
    if unsupported_reason(q4, v=v4) is not None:
        return None
    scale = V.resolve_scale(options.pop("scale", None), q4)
    softcap = logit_extras.check_softcap(options.pop("softcap", None))
    known = {name: options.pop(name) for name in ("n_iters", "eps", "cost") if name in options}
    if options:  # something this route does not know: the variant's function names it
        return None
    checked = check(q4, k4, v4, scale=scale, **known)
    return attention(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, softcap=softcap, is_causal=is_causal,
                     window=window or (-1, -1), **checked)


__all__ = ["attention", "route"]
