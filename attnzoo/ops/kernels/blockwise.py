"""Blockwise attention in plain PyTorch: the memory-efficient CPU path of the softmax family.

The (Nq, Nk) score matrix is never built. Queries are cut into blocks of ``block_q`` rows and keys
into blocks of ``block_k`` columns; each (query block, key block) pair builds its scores, uses them
and drops them, so the largest temporary holds B*H*block_q*block_k numbers whatever N is.

kinds (what turns a score block s into weights w):
  softmax          online softmax over the key blocks (running max and sum, FlashAttention);
                   the forward saves only the per-row log-sum-exp for the backward;
  sigmoid          w = sigmoid(s) where s already holds the caller's bias (passed as add_b);
  sigmoid_default  w = sigmoid(s - log n_i), n_i = keys taking part in row i;
  relu             w = relu(s) / n_i.
The backward recomputes every score block from q, k and the saved row statistic (lse or n_i).

Masks come as ``keep`` (bool, True = take part), ``add_a`` / ``add_b`` (float, added to the
scores; -inf = the key does not take part), ``is_causal`` (bottom-right aligned, see
``ops.masking.causal_keep``) and a window (``window_left``, ``window_right``, -1 unbounded: the band
of ``ops.logit_extras``, bottom-right aligned too), all broadcastable to (B, H, Nq, Nk) and read
block by block, so a broadcast (1, H, 1, Nk) preference vector costs nothing extra. Key blocks
outside the causal triangle or the band are never visited: a window of w costs O(N w), not O(N^2).
Under a window with both sides bounded (causal counts as right = 0), the query blocks whose run of
keys lies inside 0..Nk-1 are done G at a time by ``blockwise_band.Band`` (one batched matmul per
product over strided views of k and v); the blocks at the edges keep the loop below.
n_i counts the keys allowed by keep, causal, the window and add_a (add_b is a bias, not a mask:
sigmoid's b and Fenchel's log u go there).

``softcap`` (0: none) caps the raw scores, s -> softcap tanh(s / softcap), before add_a / add_b; the
backward multiplies by 1 - tanh^2. ``sinks`` (softmax only; (H,) or None) start each row's online
softmax as a key with no value: the row's running max is the sink and its sum exp(0) = 1, so the
log-sum-exp the backward reads holds it, and d sinks_h = -sum_i exp(sink_h - lse_i) (dO_i . O_i).

The op is a ``torch.library.custom_op`` with a fake (meta) implementation and a registered
autograd formula, so ``torch.compile`` treats it as one opaque node (no graph break, and no
unrolling of the block loops into the graph). The backward op has no derivative of its own: double
backward (create_graph=True) is refused with the way out (``first_order.first_order_only``).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from ..first_order import first_order_only
from .blockwise_band import Band, exp_

KINDS = ("softmax", "sigmoid", "sigmoid_default", "relu")
# Chosen by measurement (benchmarks/fused_softmax_family.py --mode blocks, docs/kernels_cpu_torch.md):
# on one core at N = 2048, 256 x 512 .. 1024 x 1024 were within noise of each other (0.78-0.98 s
# fwd+bwd); 128-row blocks were ~2x slower (Python overhead per block).
DEFAULT_BLOCK_Q = 256
DEFAULT_BLOCK_K = 1024
MIN_WINDOW_BLOCK_Q = 32  # the smallest query block a window asks for (Python overhead per block below it)


class _Masks:
    """Reads keep / add_a / add_b / causal one block at a time."""

    def __init__(self, keep, add_a, add_b, is_causal, nq, nk, window=(-1, -1), softcap=0.0):
        self.keep, self.add_a, self.add_b = keep, add_a, add_b
        self.is_causal = is_causal
        self.nq, self.nk = nq, nk
        self.offset = nk - nq  # key j takes part for query i when j <= i + offset
        # the band: i + offset - left <= j <= i + offset + right (None: unbounded on that side)
        self.left = window[0] if window[0] >= 0 else None
        right = window[1] if window[1] >= 0 else None
        if is_causal:
            right = 0 if right is None else min(right, 0)
        self.right = right
        self.softcap = softcap
        self._bands: dict = {}  # (j0 - i0, rows, cols) -> the band's dropped block (see band_block)

    @staticmethod
    def block(t, qs, qe, ks, ke):
        rows = slice(qs, qe) if t.shape[2] != 1 else slice(None)
        cols = slice(ks, ke) if t.shape[3] != 1 else slice(None)
        return t[:, :, rows, cols]

    def key_blocks(self, qs, qe, block_k):
        """Key blocks that can hold a kept key for queries qs..qe-1 (blocks past the diagonal of a
        causal call or outside the window's band are skipped: they would only hold -inf)."""
        last = self.nk if self.right is None else min(self.nk, qe - 1 + self.offset + self.right + 1)
        first = 0 if self.left is None else max(0, qs + self.offset - self.left)
        for ks in range(first, max(last, first), block_k):
            yield ks, min(ks + block_k, last)

    def dropped(self, qs, qe, ks, ke, device, with_add_a=True):
        """Bool block, True where the key does not take part (keep, causal, add_a = -inf), or None."""
        out = None
        if self.keep is not None:
            out = ~self.block(self.keep, qs, qe, ks, ke)
        c = self.band_block(qs, qe, ks, ke, device)
        if c is not None:
            out = c if out is None else (out | c)
        if with_add_a and self.add_a is not None:
            a = self.block(self.add_a, qs, qe, ks, ke) == -math.inf
            out = a if out is None else (out | a)
        return out

    def band_block(self, qs, qe, ks, ke, device):
        """Bool block, True outside the causal triangle / the window's band, or None when the block lies
        inside. It depends only on ks - qs and the block's shape, so a window's blocks (all alike but the
        first few) share one tensor, built once per call instead of once per block and pass."""
        upper = self.right is not None and ke - 1 > qs + self.offset + self.right  # crosses the band's top
        lower = self.left is not None and ks < qe - 1 + self.offset - self.left    # or its bottom edge
        if not (upper or lower):
            return None
        slot = (ks - qs, qe - qs, ke - ks, upper, lower)
        hit = self._bands.get(slot)
        if hit is None or hit.device != device:
            d = (torch.arange(ks, ke, device=device)[None, :] - torch.arange(qs, qe, device=device)[:, None]
                 - self.offset)  # j - i - offset
            hit = None
            if upper:
                hit = d > self.right
            if lower:
                hit = (d < -self.left) if hit is None else (hit | (d < -self.left))
            self._bands[slot] = hit
        return hit

    def scores(self, q_scaled, k, qs, qe, ks, ke, tanh_out=None):
        """s = cap(q_scaled k^T) + add_a + add_b for one block, -inf where the key does not take part;
        with a cap and a list ``tanh_out``, tanh(s / softcap) is appended to it (for the backward)."""
        s = q_scaled @ k[:, :, ks:ke].transpose(-1, -2)
        if self.softcap:
            t = s.div_(self.softcap).tanh_()
            if tanh_out is not None:
                tanh_out.append(t.clone())
            s = t.mul_(self.softcap)
        for add in (self.add_a, self.add_b):
            if add is not None:
                s = s.add_(self.block(add, qs, qe, ks, ke))  # s is a fresh (B, H, bq, bk) block
        drop = self.dropped(qs, qe, ks, ke, s.device, with_add_a=False)  # add_a's -inf is already in s
        if drop is not None:
            s = s.masked_fill_(drop, -math.inf)
        return s

    def counts(self, shape, dtype, device, block_q, block_k):
        """n_i, shape (B, H, Nq, 1): keys taking part in each row."""
        if self.keep is None and self.add_a is None:  # the band alone: its width at row i, clipped to 0..Nk-1
            if self.left is None and self.right is None:
                return torch.full(shape[:3] + (1,), float(self.nk), dtype=dtype, device=device)
            i = torch.arange(self.nq, device=device, dtype=dtype) + self.offset
            last = i + self.right if self.right is not None else torch.full_like(i, self.nk - 1)
            first = i - self.left if self.left is not None else torch.zeros_like(i)
            n = (last.clamp(max=self.nk - 1) - first.clamp(min=0) + 1).clamp(min=0)
            return n.view(1, 1, -1, 1).expand(shape[:3] + (1,)).contiguous()
        n = torch.zeros(shape[:3] + (1,), dtype=dtype, device=device)
        for qs in range(0, self.nq, block_q):
            qe = min(qs + block_q, self.nq)
            for ks, ke in self.key_blocks(qs, qe, block_k):
                drop = self.dropped(qs, qe, ks, ke, device)
                if drop is None:  # a block inside the band with no mask: every key
                    n[:, :, qs:qe] += ke - ks
                    continue
                kept = (~drop).sum(-1, keepdim=True, dtype=dtype)
                if drop.shape[-1] != ke - ks:  # a mask broadcast along the keys: all of the block or none
                    kept = kept * (ke - ks)
                n[:, :, qs:qe] += kept
        return n


def _blocks(nq, block_q):
    """(qs, qe, batched=False) for every query block: the loop of a call without a band to batch."""
    for qs in range(0, nq, block_q):
        yield qs, min(qs + block_q, nq), False


def _pointwise_weights(kind, s, n):
    """Weights of one score block for the pointwise kinds, computed in place in s (s = -inf gives 0).
    relu leaves out the 1/n_i factor: the callers apply it per row, which is cheaper."""
    if kind == "relu":
        return s.relu_()
    if kind == "sigmoid_default":
        s = s.sub_(torch.log(n.clamp_min(1.0)))
    return s.sigmoid_()


def _check_kind(kind):
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


def _forward_rows(masks, kind, q, k, v, scale, qs, qe, block_k, out, stat, sinks):
    """Query rows qs..qe-1 over their key blocks: writes out and stat there. A function of its own so that
    its blocks are freed on return, not kept alive by the caller's loop variables while the next rows run."""
    B, H, dv = q.shape[0], q.shape[1], v.shape[3]
    qb = q[:, :, qs:qe] * scale
    row_max = None  # softmax: None until the first key block (or the sink) sets the running max and sum
    if kind == "softmax" and sinks is not None:  # the sink: the first key, with no value
        row_max = sinks.view(1, H, 1, 1).expand(B, H, qe - qs, 1).clone()
        row_sum = torch.exp(row_max - torch.where(row_max > -math.inf, row_max, torch.zeros_like(row_max)))
    acc = None
    for ks, ke in masks.key_blocks(qs, qe, block_k):
        s = masks.scores(qb, k, qs, qe, ks, ke)
        if kind == "softmax" and row_max is None:
            # the first block starts the running max and sum: no rescale of zeros (under a window
            # most query blocks have this one key block only)
            row_max = s.amax(-1, keepdim=True)
            safe_max = torch.where(row_max > -math.inf, row_max, torch.zeros_like(row_max))
            p = exp_(s.sub_(safe_max))
            row_sum = p.sum(-1, keepdim=True)
            acc = p @ v[:, :, ks:ke]
        elif kind == "softmax":
            new_max = torch.maximum(row_max, s.amax(-1, keepdim=True))
            safe_max = torch.where(new_max > -math.inf, new_max, torch.zeros_like(new_max))
            p = exp_(s.sub_(safe_max))
            rescale = torch.exp(row_max - safe_max)
            row_sum = row_sum * rescale + p.sum(-1, keepdim=True)
            pv = p @ v[:, :, ks:ke]
            acc = pv if acc is None else acc.mul_(rescale).add_(pv)
            row_max = new_max
        else:
            pv = _pointwise_weights(kind, s, stat[:, :, qs:qe]) @ v[:, :, ks:ke]
            acc = pv if acc is None else acc.add_(pv)
    if acc is None:  # no key block (every key outside the band or after the diagonal)
        acc = q.new_zeros(B, H, qe - qs, dv)
        if kind == "softmax" and row_max is None:
            row_max, row_sum = q.new_full((B, H, qe - qs, 1), -math.inf), q.new_zeros(B, H, qe - qs, 1)
    if kind == "softmax":
        nonempty = row_sum > 0
        total = torch.where(nonempty, row_sum, torch.ones_like(row_sum))
        out[:, :, qs:qe] = acc / total
        stat[:, :, qs:qe] = torch.where(nonempty, row_max + torch.log(total), stat[:, :, qs:qe])
    elif kind == "relu":
        out[:, :, qs:qe] = acc / stat[:, :, qs:qe].clamp_min(1.0)
    else:
        out[:, :, qs:qe] = acc


def forward_impl(q, k, v, keep, add_a, add_b, kind, scale, is_causal, block_q, block_k, window_left=-1,
                 window_right=-1, softcap=0.0, sinks=None):
    """Returns (out, stat): stat is the row log-sum-exp (softmax; +inf for a row with no key) or
    n_i (pointwise kinds), shape (B, H, Nq)."""
    _check_kind(kind)
    B, H, nq, _ = q.shape
    nk, dv = k.shape[2], v.shape[3]
    masks = _Masks(keep, add_a, add_b, is_causal, nq, nk, (window_left, window_right), softcap)
    out = q.new_empty(B, H, nq, dv)  # every row block is written below
    if kind == "softmax":
        stat = q.new_full((B, H, nq, 1), math.inf)
    else:
        stat = masks.counts((B, H, nq, nk), q.dtype, q.device, block_q, block_k)
    band = Band.plan(masks, block_q, q.device)
    for qs, qe, batched in band.spans(nq, block_q) if band is not None else _blocks(nq, block_q):
        if batched:  # interior query blocks of a window, G at a time (blockwise_band.py)
            band.forward(masks, kind, _pointwise_weights, q, k, v, scale, qs, qe, out, stat, sinks)
        else:
            _forward_rows(masks, kind, q, k, v, scale, qs, qe, block_k, out, stat, sinks)
    return out, stat.squeeze(-1)


def _accumulate(grad, ds, qs, qe, ks, ke):
    """Add a score-gradient block into the gradient of a broadcast additive tensor."""
    dims = [d for d in range(4) if grad.shape[d] == 1 and ds.shape[d] != 1]
    _Masks.block(grad, qs, qe, ks, ke).add_(ds.sum(dim=dims, keepdim=True) if dims else ds)


def _backward_rows(masks, kind, grad_out, q, k, v, out, stat, scale, qs, qe, block_k, grads, sinks):
    """Query rows qs..qe-1's part of the gradients: writes dq there, adds into dk, dv, the additive terms'
    gradients and d_sinks (grads = (dq, dk, dv, d_add_a, d_add_b, d_sinks)); its blocks are freed on return."""
    dq, dk, dv, d_add_a, d_add_b, d_sinks = grads
    d_adds = (d_add_a, d_add_b)
    add_a, add_b = masks.add_a, masks.add_b
    H = q.shape[1]
    qb = q[:, :, qs:qe] * scale
    do = grad_out[:, :, qs:qe]
    if kind == "softmax":
        lse = stat[:, :, qs:qe]
        delta = (do * out[:, :, qs:qe]).sum(-1, keepdim=True)
        if sinks is not None:  # the sink's weight exp(sink - lse_i) times dL/d(its logit) = -delta_i
            d_sinks -= (torch.exp(sinks.view(1, H, 1, 1) - lse) * delta).sum(2, keepdim=True)
    elif kind == "relu":
        do = do / stat[:, :, qs:qe].clamp_min(1.0)  # w = relu(s) / n_i: fold 1/n_i into the rows of dO
    dqb = None
    for ks, ke in masks.key_blocks(qs, qe, block_k):
        tanh = []
        s = masks.scores(qb, k, qs, qe, ks, ke, tanh)
        vb = v[:, :, ks:ke]
        ds = do @ vb.transpose(-1, -2)  # dL/dw, turned into dL/ds in place below
        if kind == "softmax":
            w = exp_(s.sub_(lse))  # lse = +inf on empty rows: w = 0 there
            ds = ds.sub_(delta).mul_(w)
        else:
            w = _pointwise_weights(kind, s, stat[:, :, qs:qe])
            # aten's fused backward kernels: one pass over the block instead of three
            if kind == "relu":
                ds = torch.ops.aten.threshold_backward(ds, w, 0.0)  # ds where w > 0, else 0
            else:
                ds = torch.ops.aten.sigmoid_backward(ds, w)  # ds * w * (1 - w)
        dv[:, :, ks:ke] += w.transpose(-1, -2) @ do
        for add, d_add in zip((add_a, add_b), d_adds):
            if add is not None:
                _accumulate(d_add, ds, qs, qe, ks, ke)
        if tanh:  # through the cap: d cap(x) / dx = 1 - tanh^2
            ds = ds * (1.0 - tanh[0] * tanh[0])
        dqb = ds @ k[:, :, ks:ke] if dqb is None else dqb.add_(ds @ k[:, :, ks:ke])
        dk[:, :, ks:ke] += ds.transpose(-1, -2) @ qb
    if dqb is not None:
        dq[:, :, qs:qe] = dqb.mul_(scale)
    else:  # no key block: no gradient
        dq[:, :, qs:qe] = 0


def backward_impl(grad_out, q, k, v, out, stat, keep, add_a, add_b, kind, scale, is_causal, block_q, block_k,
                  window_left=-1, window_right=-1, softcap=0.0, sinks=None):
    """Gradients (dq, dk, dv, d_add_a, d_add_b, d_sinks); a missing add or sinks gets an empty tensor."""
    _check_kind(kind)
    B, H, nq, _ = q.shape
    nk = k.shape[2]
    masks = _Masks(keep, add_a, add_b, is_causal, nq, nk, (window_left, window_right), softcap)
    d_sinks = q.new_zeros(B, H, 1, 1) if sinks is not None else q.new_empty(0)
    grad_out = grad_out.to(q.dtype)
    dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)  # dq: every row block written
    d_adds = [torch.zeros_like(a) if a is not None else q.new_empty(0) for a in (add_a, add_b)]
    stat = stat.unsqueeze(-1)
    band = Band.plan(masks, block_q, q.device)
    grads = (dq, dk, dv, *d_adds, d_sinks)
    for qs, qe, batched in band.spans(nq, block_q) if band is not None else _blocks(nq, block_q):
        if batched:
            band.backward(masks, kind, _pointwise_weights, grad_out, q, k, v, out, stat, scale, qs, qe, grads, sinks)
        else:
            _backward_rows(masks, kind, grad_out, q, k, v, out, stat, scale, qs, qe, block_k, grads, sinks)
    return dq, dk, dv, d_adds[0], d_adds[1], d_sinks.sum(0).reshape(-1) if sinks is not None else d_sinks


# --- the custom op: opaque to torch.compile, with fake shapes and an autograd formula ------------

@torch.library.custom_op("attnzoo::blockwise_attention", mutates_args=())
def _blockwise_op(q: Tensor, k: Tensor, v: Tensor, keep: Optional[Tensor], add_a: Optional[Tensor],
                  add_b: Optional[Tensor], kind: str, scale: float, is_causal: bool, block_q: int,
                  block_k: int, window_left: int, window_right: int, softcap: float,
                  sinks: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    return forward_impl(q, k, v, keep, add_a, add_b, kind, scale, is_causal, block_q, block_k, window_left,
                        window_right, softcap, sinks)


@_blockwise_op.register_fake
def _(q, k, v, keep, add_a, add_b, kind, scale, is_causal, block_q, block_k, window_left, window_right, softcap,
      sinks):
    B, H, nq, _ = q.shape
    return q.new_empty(B, H, nq, v.shape[3]), q.new_empty(B, H, nq)


@torch.library.custom_op("attnzoo::blockwise_attention_backward", mutates_args=())
def _blockwise_backward_op(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, stat: Tensor,
                           keep: Optional[Tensor], add_a: Optional[Tensor], add_b: Optional[Tensor],
                           kind: str, scale: float, is_causal: bool, block_q: int,
                           block_k: int, window_left: int, window_right: int, softcap: float,
                           sinks: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    return backward_impl(grad_out, q, k, v, out, stat, keep, add_a, add_b, kind, scale, is_causal,
                         block_q, block_k, window_left, window_right, softcap, sinks)


@_blockwise_backward_op.register_fake
def _(grad_out, q, k, v, out, stat, keep, add_a, add_b, kind, scale, is_causal, block_q, block_k, window_left,
      window_right, softcap, sinks):
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            torch.empty_like(add_a) if add_a is not None else q.new_empty(0),
            torch.empty_like(add_b) if add_b is not None else q.new_empty(0),
            torch.empty_like(sinks) if sinks is not None else q.new_empty(0))


def _setup_context(ctx, inputs, output):
    q, k, v, keep, add_a, add_b, kind, scale, is_causal, block_q, block_k, wl, wr, softcap, sinks = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], keep, add_a, add_b, sinks)
    ctx.config = (kind, scale, is_causal, block_q, block_k, wl, wr, softcap)


def _backward(ctx, grad_out, _grad_stat):
    q, k, v, out, stat, keep, add_a, add_b, sinks = ctx.saved_tensors
    dq, dk, dv, da, db, ds = _blockwise_backward_op(grad_out.contiguous(), q, k, v, out, stat, keep, add_a, add_b,
                                                    *ctx.config, sinks)
    return (dq, dk, dv, None, da if add_a is not None else None, db if add_b is not None else None,
            None, None, None, None, None, None, None, None, ds if sinks is not None else None)


_blockwise_op.register_autograd(first_order_only(_backward, "the blockwise backward (backend 'cpu', and 'torch' "
                                                            "for sigmoid and relu)"),
                                setup_context=_setup_context)


def window_block_q(left: int, right: int, is_causal: bool, nk: int) -> int:
    """Query rows per block under a window (left, right): a power of two near a quarter of the band's
    width w. A block of r rows reads r + w keys per row (blockwise_band.py batches the blocks, so small
    blocks cost little Python); measured at w = 128, N = 4096 (benchmarks/cpu_window.py): 32 rows
    ~0.058 s fwd+bwd, 64 ~0.067 s, 128 ~0.080 s."""
    if is_causal:
        right = 0 if right < 0 else min(right, 0)
    width = (left if left >= 0 else nk) + (right if right >= 0 else nk)
    return max(MIN_WINDOW_BLOCK_Q, min(DEFAULT_BLOCK_Q, 1 << (width // 4).bit_length()))


def _as4d(t):
    return None if t is None else t.reshape((1,) * (4 - t.dim()) + tuple(t.shape))


def blockwise_attention(q, k, v, *, kind: str, scale: float, is_causal: bool = False, keep=None, add_a=None,
                        add_b=None, block_q: Optional[int] = None, block_k: Optional[int] = None,
                        window_size=None, softcap: Optional[float] = None, sinks=None) -> Tensor:
    """Blockwise attention (see the module docstring). Half-precision inputs are computed in
    float32, like the references; float32 and float64 stay as they are. ``window_size``: (left, right)
    or None; ``softcap``: None or > 0; ``sinks``: (H,) or None (kind "softmax" only)."""
    _check_kind(kind)
    if sinks is not None and kind != "softmax":
        raise ValueError(f"sinks are defined for kind 'softmax' only, got kind={kind!r}")
    out_dtype = q.dtype
    work = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    q, k, v = (t.to(work) for t in (q, k, v))
    add_a, add_b = (None if a is None else _as4d(a).to(work) for a in (add_a, add_b))
    keep = _as4d(keep)
    left, right = window_size if window_size is not None else (-1, -1)
    if block_q is None and window_size is not None:
        block_q = window_block_q(left, right, is_causal, k.shape[2])
    out, _ = _blockwise_op(q, k, v, keep, add_a, add_b, kind, float(scale), bool(is_causal),
                           int(block_q or DEFAULT_BLOCK_Q), int(block_k or DEFAULT_BLOCK_K), int(left), int(right),
                           float(softcap or 0.0), None if sinks is None else sinks.to(work))
    return out.to(out_dtype)


def split_attn_mask(attn_mask):
    """SDPA-style attn_mask -> (keep, add): a bool mask selects keys, a float one is added
    (its -inf entries drop keys inside the op, block by block)."""
    if attn_mask is None:
        return None, None
    if attn_mask.dtype == torch.bool:
        return attn_mask, None
    return None, attn_mask


# -- how the blockwise path serves as a variant's "cpu" backend ------------------------------------

# Below this many scores per call (B * H * Nq * Nk) auto keeps the eager reference instead of the
# blockwise path. Measured (benchmarks/results/cpu/dispatch_crossover.json, fp32, fwd+bwd, 1 thread):
# at 2^22 scores (B=1, H=4, N=1024) blockwise sigmoid/relu were still 1.05-1.4x slower than the
# reference, at 2^23 (B=8, H=4, N=512) every variant was as fast or faster (0.5-0.96x), and from
# 2^24 on it is 2-4x faster with 10-40x less memory.
SMALL_CALL_ELEMENTS = 2 ** 23
DESCRIPTION = "blockwise online softmax / pointwise weights with recomputation in backward, no N x N tensor"


def refuses_dropout(q, k, v, **kw):
    if kw.get("dropout_p", 0.0) > 0:
        return ("dropout_p > 0 is not supported: the backward recomputes the weights block by block and "
                "would need each block's dropout mask; 'reference' supports it (and SDPA's 'torch' for "
                "softmax, l2 and fenchel)")
    return None


def small_call(q, k, v, **kw):
    """(auto only) Why the reference is kept for a call this small, or None."""
    n = q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2]
    if n < SMALL_CALL_ELEMENTS:
        return (f"small call ({n} scores < {SMALL_CALL_ELEMENTS}): the reference was measured faster "
                f"here and its N x N weights are small")
    return None


def register(variant: str, fn, *checks, name: str = "cpu", priority: int = 10, description: str = DESCRIPTION,
             extras=("window_size",)):
    """Register ``fn`` (a variant's form of the blockwise path) as its CPU backend: refuses dropout and
    whatever ``checks`` refuse; auto picks it on CPU tensors from SMALL_CALL_ELEMENTS scores on.
    ``extras``: which of softcap, sinks and window_size ``fn`` takes (ops/logit_extras.py)."""
    from ..dispatch import all_of, register_backend
    register_backend(variant, name, fn, supports=all_of(refuses_dropout, *checks), priority=priority,
                     description=description, auto_devices=("cpu",), auto_prefers=small_call, extras=extras)
