"""The blockwise CPU path's sliding window done in batches of query blocks (ops/kernels/blockwise.py).

Under a window (left, right), query block g (rows qs..qs+bq-1) needs the keys qs + offset - left ..
qs + bq - 1 + offset + right: bq + left + right keys, a run that starts at the same distance from qs
for every block. Rounded up to L (a multiple of bq) and ending at the band's last key, every block whose
run lies inside 0..Nk-1 (an "interior" block: all but the first and last few) sees its keys through one
strided view of one head's k, (G, L, D) with consecutive blocks bq keys apart, which bmm reads in place
(a batch over heads as well would not be one stride, and matmul would copy every run), and the keys
outside the band drop by one (bq, L) pattern shared by all of them. So G blocks of a head take one
batched matmul per product and one pass per elementwise step, instead of a Python loop body each (the
per-block overhead that kept a window of 128 at N 4096 above 0.1x of the full causal call). The blocks
at the edges keep the per-block loop of blockwise.py.

One (bq, L) block holds the whole band of its rows, so the softmax needs no running max: the row's
max, sum and log-sum-exp come from one block (the sink, softmax only, joins them as a key with no
value). The backward adds a block's dK, dV and the gradient of a broadcast additive term into the
overlapping runs of keys in L / bq pieces, each piece bq keys wide, which no two blocks share.

Chunks hold G blocks of one head with G * bq * L <= CHUNK_SCORES scores. The scores and dL/dw live in two
buffers per call (``Band.buffer``), reused by every chunk and head; the matmuls write into them, into out
and dq, and add straight into dK / dV's runs (``add_runs``) with the scale as their alpha, and dS
overwrites dL/dw, so the call's own temporaries are about two chunks of scores whatever N, B and H are.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

# Scores in one chunk (one head; float32: 512 KiB): time against memory. The backward holds two chunks at
# once (the weights and dL/dw, the call's two buffers). At w = 128, N = 4096, H = 4, 32-row blocks (runs of
# 160 keys), fwd+bwd on one core (benchmarks/cpu_window.py's call, best of 25, the machine shared), with the
# temporaries beyond the returned out, dq, dk, dv: 2^15 ~61 ms / 0.45 MiB, 2^16 ~49 ms / 0.63 MiB, 2^17
# ~44 ms / 1.14 MiB, 1.5 x 2^17 ~44 ms / 1.65 MiB, 2^18 ~53 ms / 2.16 MiB (two 1 MiB buffers); the
# unwindowed call ~560 ms / 17.25 MiB (its 256 x 1024 blocks).
CHUNK_SCORES = 2 ** 17


LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


def exp_(t: Tensor) -> Tensor:
    """exp(t) in place, as 2^(t log2 e): aten's exp_ on one core measured 2-3x slower than mul_ + exp2_
    here (1.9-3.1 ms against 1.1 ms on 786k float32 numbers, AVX512 build), for a relative error of
    ~1e-6 in float32 (~1e-15 in float64); -inf still gives 0. (The batched softmax below folds log2 e
    into the matmul's alpha and needs no mul_ at all.)"""
    return t.mul_(LOG2E).exp2_()


def block_view(t: Tensor, q0: int, k0: int, blocks: int, rows: int, cols: int, b: int, h: int) -> Tensor:
    """Head (b, h) of a (b|1, h|1, nq|1, nk|1) tensor read as (blocks|1, rows|1, cols|1): element [g, r, c]
    is t[b, h, q0 + g rows + r, k0 + g rows + c] (a dimension t broadcasts stays 1). A strided view, no
    copy; the caller keeps every index inside t."""
    _, _, nq, nk = t.shape
    s0, s1, s2, s3 = t.stride()
    by_row, by_col = nq != 1, nk != 1
    step = rows * s2 * by_row + rows * s3 * by_col
    size = (blocks if step else 1, rows if by_row else 1, cols if by_col else 1)
    offset = (t.storage_offset() + (b if t.shape[0] != 1 else 0) * s0 + (h if t.shape[1] != 1 else 0) * s1
              + q0 * s2 * by_row + k0 * s3 * by_col)
    return t.as_strided(size, (step, s2, s3), offset)


def key_runs(t: Tensor, k0: int, blocks: int, rows: int, width: int) -> Tensor:
    """One head's k or v (N, D) as the runs of ``width`` keys that ``blocks`` query blocks of ``rows`` read,
    the first from key k0, each ``rows`` keys after the last: (blocks, width, D), a view with overlapping
    runs that bmm reads in place (its batch stride is free; a 5-D batch over heads would be copied)."""
    s0, s1 = t.stride()
    return t.as_strided((blocks, width, t.shape[1]), (rows * s0, s0, s1), t.storage_offset() + k0 * s0)


def add_runs(target: Tensor, left: Tensor, right: Tensor, k0: int, rows: int, alpha: float = 1.0) -> None:
    """target (N, D) += alpha left @ right, a (G, L, D) product laid out as key_runs' runs, without building
    it: in L / rows pieces, each of which covers every key at most once (block g's piece t starts at
    k0 + (g + t) rows), each added by one batched matmul straight into its strided view of target."""
    blocks, width = left.shape[0], left.shape[1]
    for t in range(0, width, rows):
        key_runs(target, k0 + t, blocks, rows, rows).baddbmm_(left[:, t:t + rows], right, alpha=alpha)


def rows_of(t: Tensor, b: int, h: int, qs: int, blocks: int, rows: int) -> Tensor:
    """Rows qs .. qs + blocks rows - 1 of head (b, h) of a (B, H, N, D) tensor as (blocks, rows, D): a view
    (each head's rows are evenly strided, whatever the layout of the heads)."""
    return t[b, h, qs:qs + blocks * rows].unflatten(0, (blocks, rows))


def add_blocks(target: Tensor, ds: Tensor, q0: int, k0: int, rows: int, b: int, h: int) -> None:
    """The gradient of a broadcast additive term: head (b, h) of target (b|1, h|1, nq|1, nk|1) += ds
    (G, rows, L) summed over what target broadcasts, in pieces of ``rows`` keys (no two blocks write one
    element of a piece; heads that target broadcasts add into it one after another)."""
    blocks, width = ds.shape[0], ds.shape[2]
    for t in range(0, width, rows):
        view = block_view(target, q0, k0 + t, blocks, rows, rows, b, h)
        piece = ds[..., t:t + rows]
        dims = [d for d in range(3) if view.shape[d] == 1 and piece.shape[d] != 1]
        view.add_(piece.sum(dims, keepdim=True) if dims else piece)


class Band:
    """What a windowed call's batched blocks share, decided once per call (None from ``plan`` when the
    call has no two-sided band or no interior block)."""

    def __init__(self, rows: int, width: int, shift: int, first: int, stop: int, blocks: int, drop: Tensor):
        self.rows, self.width, self.shift = rows, width, shift  # key run of the block at qs: qs + shift ..
        self.first, self.stop = first, stop                     # interior blocks: rows first .. stop - 1
        self.blocks = blocks                                    # blocks per chunk
        self.drop = drop                                        # (rows, width) bool: outside the band
        self._buffers: dict = {}                                # name -> scratch block (see buffer)
        self._outside = None                                    # drop as 0 / -inf (see outside)

    @staticmethod
    def plan(masks, block_q: int, device) -> Optional["Band"]:
        if masks.left is None or masks.right is None:
            return None
        rows = block_q
        width = -(-(rows + masks.left + masks.right) // rows) * rows
        shift = rows + masks.offset + masks.right - width  # the run ends at the band's last key + 1
        # interior: qs a multiple of rows with qs + rows <= nq, qs + shift >= 0, qs + shift + width <= nk
        lo = max(0, -shift)
        first = -(-lo // rows) * rows
        stop = min(masks.nq - masks.nq % rows, ((masks.nk - width - shift) // rows + 1) * rows)
        if stop <= first:
            return None
        c = torch.arange(width, device=device)[None, :] - torch.arange(rows, device=device)[:, None]
        d = c + shift - masks.offset  # j - i - offset
        drop = (d > masks.right) | (d < -masks.left)
        return Band(rows, width, shift, first, stop, max(1, CHUNK_SCORES // (rows * width)), drop)

    def spans(self, nq: int, block_q: int):
        """(qs, qe, batched) over the query rows: single blocks at the edges, chunks in between."""
        qs = 0
        while qs < nq:
            if self.first <= qs < self.stop:
                qe = min(self.stop, qs + self.blocks * self.rows)
                yield qs, qe, True
            else:
                qe = min(qs + block_q, nq, self.first if qs < self.first else nq)
                yield qs, qe, False
            qs = qe

    def buffer(self, name: str, blocks: int, cols: int, like: Tensor) -> Tensor:
        """A (blocks, rows, cols) scratch block, one per name, allocated on first use and reused by every later
        chunk and head of the call (written whole before it is read: bmm with beta = 0 ignores what it held)."""
        buf = self._buffers.get(name)
        if buf is None:
            buf = self._buffers[name] = like.new_empty(self.blocks, self.rows, cols)
        return buf[:blocks]

    def outside(self, like: Tensor) -> Tensor:
        """(rows, width): 0 inside the band, -inf outside, in like's dtype (built once per call). Added to the
        scores instead of a masked_fill_ by the bool pattern, which measured ~9x slower on a broadcast block
        (90 us against 10 us for 25 x 32 x 160 float32 numbers, one core), or, without a cap, copied into
        the scores buffer before the matmul adds the product to it (free: bmm with beta 1 costs what beta 0
        does)."""
        if self._outside is None:
            self._outside = like.new_zeros(self.rows, self.width).masked_fill_(self.drop, -math.inf)
        return self._outside

    def scores(self, masks, q_rows: Tensor, kr: Tensor, qs: int, b: int, h: int, alpha: float, unit: float,
               tanh_out=None) -> Tensor:
        """Head (b, h): s = unit (cap(q kr^T scale) + add_a + add_b), -inf outside the band or a kept key,
        shape (G, rows, width), in the call's "scores" buffer; alpha = scale unit is applied by the matmul
        (unit: LOG2E for softmax, whose exp is then an exp2 with no pass to rescale the block, else 1).
        With ``tanh_out``, tanh(raw / cap) is kept there (in the "tanh" buffer)."""
        s = self.buffer("scores", q_rows.shape[0], self.width, q_rows)
        outside = self.outside(s)
        if masks.softcap:  # the cap comes before the band's -inf (tanh would turn it into -cap)
            s = s.baddbmm_(q_rows, kr.transpose(-1, -2), beta=0.0, alpha=alpha)
            cap = masks.softcap * unit  # unit cap(x) = (unit cap) tanh(unit x / (unit cap))
            t = s.div_(cap).tanh_()
            if tanh_out is not None:
                tanh_out.append(self.buffer("tanh", t.shape[0], self.width, t).copy_(t))
            s = t.mul_(cap).add_(outside)
        else:  # the band's -inf first, the product added to it by the matmul
            s = s.copy_(outside.expand_as(s)).baddbmm_(q_rows, kr.transpose(-1, -2), alpha=alpha)
        G, k0 = s.shape[0], qs + self.shift
        for add in (masks.add_a, masks.add_b):
            if add is not None:
                view = block_view(add, qs, k0, G, self.rows, self.width, b, h)
                s = s.add_(view) if unit == 1.0 else s.add_(view, alpha=unit)
        if masks.keep is not None:
            s = s.masked_fill_(~block_view(masks.keep, qs, k0, G, self.rows, self.width, b, h), -math.inf)
        return s

    def forward(self, masks, kind, weights, q, k, v, scale, qs, qe, out, stat, sinks):
        """Writes out[:, :, qs:qe] (and, softmax, their log-sum-exp into stat), one head at a time."""
        B, H, _, D = q.shape
        G, rows = (qe - qs) // self.rows, self.rows
        k0 = qs + self.shift
        unit = LOG2E if kind == "softmax" else 1.0
        for b in range(B):
            for h in range(H):
                s = self.scores(masks, rows_of(q, b, h, qs, G, rows), key_runs(k[b, h], k0, G, rows, self.width),
                                qs, b, h, scale * unit, unit)
                vr = key_runs(v[b, h], k0, G, rows, self.width)
                o = rows_of(out, b, h, qs, G, rows)  # out is the op's own contiguous tensor: written in place
                if kind == "softmax":  # in base 2 (s = LOG2E x the logits): the stat written back is natural
                    row_max = s.amax(-1, keepdim=True)
                    if sinks is not None:
                        sink = sinks[h] * LOG2E
                        row_max = torch.maximum(row_max, sink)
                    empty = row_max == -math.inf  # no key in the row (and no sink)
                    safe_max = row_max.masked_fill(empty, 0.0)
                    p = s.sub_(safe_max).exp2_()
                    total = p.sum(-1, keepdim=True)
                    if sinks is not None:
                        total = total.add_(torch.exp2(sink - safe_max))
                    # a row with a key has total >= 1 (its max term is 2^0); an empty row's 0 becomes 1 (out 0)
                    total = total.clamp_min_(1.0)
                    o.baddbmm_(p, vr, beta=0.0).div_(total)
                    lse = torch.log2(total).add_(safe_max).mul_(LN2).masked_fill_(empty, math.inf)
                    stat[b, h, qs:qe] = lse.view(qe - qs, 1)
                else:
                    n = stat[b, h, qs:qe].reshape(G, rows, 1)
                    o.baddbmm_(weights(kind, s, n), vr, beta=0.0)
                    if kind == "relu":
                        o.div_(n.clamp_min(1.0))

    def backward(self, masks, kind, weights, grad_out, q, k, v, out, stat, scale, qs, qe, grads, sinks):
        """Adds rows qs..qe-1's part into grads = [dq, dk, dv, d_add_a, d_add_b, d_sinks (B, H, 1, 1)]."""
        B, H, _, D = q.shape
        G, rows = (qe - qs) // self.rows, self.rows
        k0 = qs + self.shift
        unit = LOG2E if kind == "softmax" else 1.0
        for b in range(B):
            for h in range(H):
                self._backward_head(masks, kind, weights, grad_out, q, k, v, out, stat, scale, qs, qe, grads,
                                    sinks, b, h, G, rows, k0, unit)

    def _backward_head(self, masks, kind, weights, grad_out, q, k, v, out, stat, scale, qs, qe, grads, sinks,
                       b, h, G, rows, k0, unit):
        """Two (G, rows, width) blocks at a time, both the call's buffers: the weights (in the scores) and
        dL/dw, which turns into dL/ds in place; dq is written and dk, dv added in place by the matmuls."""
        dq, dk, dv, d_add_a, d_add_b, d_sinks = grads
        qh = rows_of(q, b, h, qs, G, rows)
        kr, vr = key_runs(k[b, h], k0, G, rows, self.width), key_runs(v[b, h], k0, G, rows, self.width)
        do = rows_of(grad_out, b, h, qs, G, rows)
        tanh = []
        s = self.scores(masks, qh, kr, qs, b, h, scale * unit, unit, tanh)
        row_stat = stat[b, h, qs:qe].reshape(G, rows, 1)
        if kind == "relu":
            do = do / row_stat.clamp_min(1.0)
        if kind == "softmax":
            w = s.sub_(row_stat * LOG2E).exp2_()  # the weights, from the base-2 scores
        else:
            w = weights(kind, s, row_stat)
        dw = self.buffer("grads", G, self.width, w).baddbmm_(do, vr.transpose(-1, -2), beta=0.0)  # dL/dw
        add_runs(dv[b, h], w.transpose(-1, -2), do, k0, rows)
        if kind == "softmax":
            if sinks is not None:  # as blockwise.backward_impl: -exp(sink - lse_i) delta_i summed over rows
                delta = (do * rows_of(out, b, h, qs, G, rows)).sum(-1, keepdim=True)
                d_sinks[b, h] -= (torch.exp(sinks[h] - row_stat) * delta).sum()
            # w (dw - delta) with delta_i = dO_i . O_i = sum_j w_ij dw_ij (the block holds the row's every key;
            # a sink has no value): aten's fused softmax backward, one kernel for the block, written over dw
            # (each row's sum is read before the row is written)
            ds = torch.ops.aten._softmax_backward_data.out(dw, w, -1, w.dtype, grad_input=dw)
        elif kind == "relu":
            ds = torch.ops.aten.threshold_backward.grad_input(dw, w, 0.0, grad_input=dw)
        else:
            ds = torch.ops.aten.sigmoid_backward.grad_input(dw, w, grad_input=dw)
        for add, d_add in ((masks.add_a, d_add_a), (masks.add_b, d_add_b)):
            if add is not None:
                add_blocks(d_add, ds, qs, k0, rows, b, h)
        if tanh:  # d cap(x) / dx = 1 - tanh^2, in place in the kept tanh
            ds = ds.mul_(tanh[0].mul_(tanh[0]).neg_().add_(1.0))
        # ds is d / d(the natural logit): dq = scale ds kr, dk += scale ds^T q
        rows_of(dq, b, h, qs, G, rows).baddbmm_(ds, kr, beta=0.0, alpha=scale)
        add_runs(dk[b, h], ds.transpose(-1, -2), qh, k0, rows, alpha=scale)
