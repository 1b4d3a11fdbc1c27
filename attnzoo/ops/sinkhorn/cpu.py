"""Blockwise Sinkhorn attention in plain PyTorch (the "cpu" backend; it runs on any device).

Every pass of ``streaming.py`` is a sweep over (query block, key block) tiles whose logits are
recomputed from q and k; each tile is reduced into O(N) accumulators (running logsumexp, weighted
sums, gradient rows), so peak memory is a few tiles plus O(n_iters N) potentials, never N x N.
Tiles hold B*H*block_q*block_k elements: the default block size keeps that near 2^20 (4 MB fp32).
A softcap caps each tile's logits as it is formed (the backward multiplies dL by the cap's slope); a
non-causal window's passes visit only the tiles that meet the band, sized to it (``band_tiles``).

A non-causal call is the torch op ``attnzoo::sinkhorn_streaming`` (and ``_backward``), with fake shapes
and its autograd formula registered: opaque to torch.compile, which then neither traces the tile loops
nor the hand-written backward (torch 2.11's dynamo traced the autograd.Function this used to be and
returned wrong gradients: zeros at n_iters = 0).
"""
from __future__ import annotations

import math

import torch

from ..common import upcast
from ..kernels.blockwise import _Masks as BandBlocks
from ..logit_extras import NO_WINDOW, mask_with_window, window_band
from ..masking import split_mask
from ..triton_logit_extras import band_bounds
from .causal_window import causal_by_window, takes
from typing import Optional

from torch import Tensor

from ..first_order import first_order_only
from ..triton_utils import _autograd_function, eager_call
from .streaming import GRAD_MODES, Problem, causal_by_prefix, sinkhorn_potentials, streaming_backward

TILE_ELEMENTS = 1 << 20
MIN_BAND_BLOCK = 16   # the fewest query rows per tile a band asks for (Python overhead per tile below it)


def band_tiles(left: int, right: int, side: int) -> tuple[int, int]:
    """(query rows, keys) per tile under a band of offsets (left, right) (band_bounds': finite) narrower
    than ``side``: about w = left + right rows, and the keys of their whole band (rows + w), so a query
    block's band is one tile and a pass computes ~2 N w logits. Measured at N 2048, w (128, 0), fwd+bwd,
    one thread (benchmarks/sinkhorn_window.py's call): 128 x 256 ~0.057 s, 128 x 128 ~0.075 s,
    256 x 256 ~0.080 s, 64 x 64 ~0.13 s."""
    rows = min(side, max(MIN_BAND_BLOCK, 1 << max(0, (left + right).bit_length() - 1)))
    return rows, rows + left + right


def _empty_to_zero(lse: torch.Tensor) -> torch.Tensor:
    """A row (column) with no key (query) taking part has lse = -inf: the reference maps it to 0."""
    return torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)


class TorchEngine:
    """The streaming passes as PyTorch tile loops (see streaming.py for what each pass computes)."""

    def __init__(self, block_q: int | None = None, block_k: int | None = None):
        self.block_q, self.block_k = block_q, block_k

    @staticmethod
    def acc_dtype(p: Problem):
        return torch.float64 if p.q.dtype == torch.float64 else torch.float32

    def _block_sizes(self, p: Problem):
        bh = p.q.shape[0] * p.q.shape[1]
        side = 1 << max(4, int(math.log2(max(1.0, math.sqrt(TILE_ELEMENTS / bh)))))
        if p.band is not None and sum(p.band) < side:
            rows, keys = band_tiles(*p.band, side)
            return self.block_q or rows, self.block_k or keys
        return self.block_q or side, self.block_k or side

    def _spans(self, p: Problem):
        """(query slice, key slice, bool block True outside the band or None) of every tile a pass
        visits: all of them, or under a band only the key blocks that meet each query block's band
        (blockwise.py's band arithmetic; the same tiles serve the column passes)."""
        spans = getattr(p, "_spans", None)
        if spans is None:
            bq, bk = self._block_sizes(p)
            nq, nk = p.q.shape[-2], p.k.shape[-2]
            if p.band is None:
                spans = [(slice(i0, min(i0 + bq, nq)), slice(j0, min(j0 + bk, nk)), None)
                         for i0 in range(0, nq, bq) for j0 in range(0, nk, bk)]
            else:
                band = BandBlocks(None, None, None, False, nq, nk, p.band)
                spans = [(slice(i0, i1), slice(j0, j1), band.band_block(i0, i1, j0, j1, p.q.device))
                         for i0 in range(0, nq, bq) for i1 in [min(i0 + bq, nq)]
                         for j0, j1 in band.key_blocks(i0, i1, bk)]
            p._spans = spans
        return spans

    def _tiles(self, p: Problem, slope: bool = False):
        """Yield (query slice, key slice, logits tile (B, H, bq, bk) with -inf where masked), and with
        ``slope`` the cap's slope 1 - tanh^2 of the tile (None without a cap) as a fourth item."""
        spans = self._spans(p)
        if len(spans) == 1:
            # one tile covers the problem: keep it for the passes of this forward (or backward)
            # instead of recomputing it 2 n_iters + 1 times; it is no larger than any tile
            cached = getattr(p, "_single_tile", None)
            if cached is None or (slope and cached[3] is None and p.softcap):
                cached = self._tile(p, *spans[0], slope=slope)
                p._single_tile = cached
            yield cached if slope else cached[:3]
            return
        for span in spans:
            tile = self._tile(p, *span, slope=slope)
            yield tile if slope else tile[:3]

    def _tile(self, p: Problem, qs, ks, drop, slope=False):
        a = p.logit_scale
        qb, kb = p.q[..., qs, :], p.k[..., ks, :]
        L = qb @ kb.transpose(-1, -2)
        if p.cost == "l2":  # in place: every pass recomputes this tile
            qq = (qb * qb).sum(-1, keepdim=True)
            kk = (kb * kb).sum(-1).unsqueeze(-2)
            L = L.mul_(-2.0).add_(qq).add_(kk).clamp_min_(0.0).mul_(-a)
        else:
            L = L.mul_(a)
        dcap = None
        if p.softcap:  # the whole logit is capped, before the mask's bias (reference.py)
            t = L.div_(p.softcap).tanh_()
            if slope:
                dcap = 1.0 - t * t
            L = t.mul_(p.softcap)
        if p.bias is not None:
            L = L.add_(p.bias[..., qs, ks].to(L.dtype))
        if p.keep is not None:
            L = L.masked_fill(~p.keep[..., qs, ks], -math.inf)
        if drop is not None:  # a tile on the band's edge: the keys outside it
            L = L.masked_fill(drop, -math.inf)
        return qs, ks, L, dcap

    def _vec(self, p, n):
        return torch.zeros(p.q.shape[0], p.q.shape[1], n, dtype=self.acc_dtype(p), device=p.q.device)

    def initial_g(self, p):
        return self._vec(p, p.k.shape[-2])

    def row_dot(self, a, b):
        acc = torch.float64 if a.dtype == torch.float64 else torch.float32
        return (a.to(acc) * b.to(acc)).sum(-1)

    def lse_rows(self, p, g):
        acc = torch.full_like(self._vec(p, p.q.shape[-2]), -math.inf)
        for qs, ks, L in self._tiles(p):
            acc[..., qs] = torch.logaddexp(acc[..., qs], torch.logsumexp(L + g[..., None, ks], dim=-1))
        return _empty_to_zero(acc)

    def lse_cols(self, p, f):
        acc = torch.full_like(self._vec(p, p.k.shape[-2]), -math.inf)
        for qs, ks, L in self._tiles(p):
            acc[..., ks] = torch.logaddexp(acc[..., ks], torch.logsumexp(L + f[..., qs, None], dim=-2))
        return _empty_to_zero(acc)

    def attend(self, p, g):
        """Online softmax over key tiles of L + g (the final row normalisation), then @ v."""
        nq = p.q.shape[-2]
        m = torch.full_like(self._vec(p, nq), -math.inf)
        denom = self._vec(p, nq)
        out = torch.zeros(p.q.shape[:-1] + (p.v.shape[-1],), dtype=m.dtype, device=m.device)
        for qs, ks, L in self._tiles(p):
            s = L + g[..., None, ks]
            m_new = torch.maximum(m[..., qs], s.amax(-1))
            m_safe = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)
            alpha = torch.exp(m[..., qs] - m_safe)
            e = torch.exp(s - m_safe[..., None])
            denom[..., qs] = denom[..., qs] * alpha + e.sum(-1)
            out[..., qs, :] = out[..., qs, :] * alpha[..., None] + e @ p.v[..., ks, :].to(e.dtype)
            m[..., qs] = m_new
        nonempty = denom > 0
        safe = torch.where(nonempty, denom, torch.ones_like(denom))
        out = out / safe[..., None]
        m_safe = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
        lse = torch.where(nonempty, m_safe + torch.log(safe), torch.zeros_like(m))
        return out.to(p.q.dtype), lse

    def _plan_and_dS(self, p, qs, ks, L, g, lse, dout, delta):
        P = torch.add(L, g[..., None, ks]).sub_(lse[..., qs, None]).exp_()
        dP = dout[..., qs, :].to(P.dtype) @ p.v[..., ks, :].to(P.dtype).transpose(-1, -2)
        return P, dP.sub_(delta[..., qs, None]).mul_(P)

    def grad_v_and_bias(self, p, g, lse, dout, delta):
        dv = torch.zeros(p.v.shape, dtype=lse.dtype, device=lse.device)
        dg = self._vec(p, p.k.shape[-2])
        for qs, ks, L in self._tiles(p):
            P, dS = self._plan_and_dS(p, qs, ks, L, g, lse, dout, delta)
            dv[..., ks, :] += P.transpose(-1, -2) @ dout[..., qs, :].to(P.dtype)
            dg[..., ks] += dS.sum(-2)
        return dv, dg

    def wsum_rows(self, p, a, b, w):
        out = self._vec(p, p.q.shape[-2])
        for qs, ks, L in self._tiles(p):
            e = torch.add(L, a[..., qs, None]).add_(b[..., None, ks]).exp_()
            out[..., qs] += (e @ w[..., ks, None]).squeeze(-1)
        return out

    def wsum_cols(self, p, a, b, w):
        out = self._vec(p, p.k.shape[-2])
        for qs, ks, L in self._tiles(p):
            e = torch.add(L, a[..., qs, None]).add_(b[..., None, ks]).exp_()
            out[..., ks] += (w[..., None, qs] @ e).squeeze(-2)
        return out

    def grad_qk(self, p, g, lse, dout, delta, terms):
        acc = self.acc_dtype(p)
        dq = torch.zeros(p.q.shape, dtype=acc, device=p.q.device)
        dk = torch.zeros(p.k.shape, dtype=acc, device=p.k.device)
        a = p.logit_scale
        for qs, ks, L, dcap in self._tiles(p, slope=True):
            _, dL = self._plan_and_dS(p, qs, ks, L, g, lse, dout, delta)
            if terms is not None:
                F, G, DG, DF = terms   # C^t from F[t], G[t + 1] - c; R^t from F[t], G[t] (streaming.py)
                c = p.col_target
                for t in range(F.shape[0]):  # in place: 2 n_iters exponentials per tile entry
                    Lf = L + F[t][..., qs, None]
                    dL.sub_(torch.add(Lf, G[t + 1][..., None, ks] - c).exp_().mul_(DG[t][..., None, ks]))
                    dL.sub_(Lf.add_(G[t][..., None, ks]).exp_().mul_(DF[t][..., qs, None]))
            if dcap is not None:  # dL above is the capped logit's; the raw logit's is dL (1 - tanh^2)
                dL.mul_(dcap)
            qb, kb = p.q[..., qs, :].to(acc), p.k[..., ks, :].to(acc)
            if p.cost == "l2":  # L = -a ||q - k||^2: dL/dq_i = 2a (k_j - q_i)
                dq[..., qs, :] += 2 * a * (dL @ kb - qb * dL.sum(-1, keepdim=True))
                dk[..., ks, :] += 2 * a * (dL.transpose(-1, -2) @ qb - kb * dL.sum(-2)[..., None])
            else:
                dq[..., qs, :] += a * (dL @ kb)
                dk[..., ks, :] += a * (dL.transpose(-1, -2) @ qb)
        return dq, dk


def check_options(dropout_p: float, grad_mode: str) -> None:
    if dropout_p > 0:
        raise ValueError("dropout_p must be 0 for streaming Sinkhorn: dropping entries of the transport "
                         "plan needs the N x N weights (use backend='reference')")
    if grad_mode not in GRAD_MODES:
        raise ValueError(f"grad_mode must be one of {list(GRAD_MODES)}, got {grad_mode!r}")


def sinkhorn_attention(q, k, v, *, attn_mask=None, is_causal=False, scale=None, n_iters=3, eps=1.0,
                       cost="l2", dropout_p=0.0, grad_mode="unrolled", block_q=None, block_k=None,
                       window_size=None, softcap=None):
    """Same semantics as ``reference.sinkhorn_attention`` with O(N) memory per head.

    grad_mode="unrolled" (default) differentiates exactly the n_iters iterations computed, as the
    reference does; "implicit" differentiates the fixed point instead (see streaming.py).

    ``softcap`` caps every tile's whole logit, softcap tanh(L / softcap), before the mask's bias, in every
    pass (the prefix loop's and the window batches' calls too); the unrolled backward multiplies dL by
    1 - tanh^2. The implicit backward refuses it (as the Triton backend's: the cap is computed with the
    unrolled gradient only).

    ``window_size`` (left, right), logit_extras' meaning (checked by the call path): non-causal, every
    pass visits only the tiles that meet the band (edge tiles masked elementwise): O(n_iters N w) work.
    Causal, with a left reach that removes keys, no attn_mask or a per-key one and the unrolled backward,
    row i's problem lies in its window and the rows are solved in batches (causal_window.py,
    O(n_iters N w^2) instead of the prefix loop's O(n_iters N^3)); any other causal call gets the band
    folded into the mask and runs the prefix loop (exact by ``masking.coupled_causal_rows``).
    """
    check_options(dropout_p, grad_mode)
    if softcap is not None and grad_mode == "implicit":
        raise ValueError("softcap is computed with grad_mode='unrolled' only (the implicit backward is the fixed "
                         "point of uncapped logits): use backend='cpu'")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    (q, k, v), out_dtype = upcast(q, k, v)
    kw = dict(scale=scale, eps=eps, cost=cost, n_iters=n_iters, grad_mode=grad_mode, softcap=float(softcap or 0.0))
    engine = TorchEngine(block_q, block_k)

    def run(q, k, v, mask, band=None):
        keep, bias = split_mask(mask, False, q.shape[-2], k.shape[-2], q.device)
        return streaming_sinkhorn(engine, q, k, v, keep, bias, band=band, **kw)
    window = NO_WINDOW if window_size is None else (int(window_size[0]), int(window_size[1]))
    if window != NO_WINDOW and not is_causal:
        band = band_bounds(window, False, q.shape[-2], k.shape[-2])
        return run(q, k, v, attn_mask, band).to(out_dtype)
    if window != NO_WINDOW and grad_mode == "unrolled" and takes(is_causal, attn_mask, window[0], k.shape[-2]):
        return causal_by_window(run, q, k, v, window[0], attn_mask).to(out_dtype)
    if window != NO_WINDOW:
        attn_mask = mask_with_window(attn_mask, window_band(window, q.shape[-2], k.shape[-2], q.device))
    out = causal_by_prefix(run, q, k, v, attn_mask) if is_causal else run(q, k, v, attn_mask)
    return out.to(out_dtype)


# --- the non-causal call as a torch op: opaque to torch.compile, fake shapes, its autograd formula -------

def _problem(q, k, v, keep, bias, scale, eps, cost, softcap, banded, band_left, band_right) -> Problem:
    return Problem(q, k, v, keep, bias, scale, eps, cost, softcap=softcap,
                   band=(band_left, band_right) if banded else None)


def _streaming_host(q: Tensor, k: Tensor, v: Tensor, keep: Optional[Tensor], bias: Optional[Tensor], scale: float,
                  eps: float, cost: str, n_iters: int, softcap: float, banded: bool, band_left: int, band_right: int,
                  block_q: int, block_k: int, grad_mode: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(out, the final row lse, F = f^1..f^T stacked, G = g^0..g^T stacked); q, k, v float32 / float64;
    ``grad_mode`` is the backward's ("unrolled" or "implicit"); block sizes 0: chosen per problem."""
    engine = TorchEngine(block_q or None, block_k or None)
    p = _problem(q, k, v, keep, bias, scale, eps, cost, softcap, banded, band_left, band_right)
    fs, gs = sinkhorn_potentials(engine, p, n_iters)
    out, lse = engine.attend(p, gs[-1])
    F = torch.stack(fs) if fs else lse.new_empty((0,) + lse.shape)
    return out, lse, F, torch.stack(gs)


_streaming_op = torch.library.custom_op("attnzoo::sinkhorn_streaming", mutates_args=())(_streaming_host)


@_streaming_op.register_fake
def _(q, k, v, keep, bias, scale, eps, cost, n_iters, softcap, banded, band_left, band_right, block_q, block_k,
      grad_mode):
    B, H, nq, nk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    return (q.new_empty(B, H, nq, v.shape[3]), q.new_empty(B, H, nq), q.new_empty(n_iters, B, H, nq),
            q.new_empty(n_iters + 1, B, H, nk))


@torch.library.custom_op("attnzoo::sinkhorn_streaming_backward", mutates_args=())
def _streaming_backward_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, F: Tensor,
                           G: Tensor, keep: Optional[Tensor], bias: Optional[Tensor], scale: float, eps: float,
                           cost: str, softcap: float, banded: bool, band_left: int, band_right: int, block_q: int,
                           block_k: int, grad_mode: str) -> tuple[Tensor, Tensor, Tensor]:
    engine = TorchEngine(block_q or None, block_k or None)
    p = _problem(q, k, v, keep, bias, scale, eps, cost, softcap, banded, band_left, band_right)
    dq, dk, dv = streaming_backward(engine, p, dout, out, lse, list(F.unbind(0)), list(G.unbind(0)), grad_mode)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@_streaming_backward_op.register_fake
def _(dout, q, k, v, out, lse, F, G, keep, bias, scale, eps, cost, softcap, banded, band_left, band_right, block_q,
      block_k, grad_mode):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, keep, bias, scale, eps, cost, n_iters, softcap, banded, left, right, block_q, block_k, grad_mode = inputs
    out, lse, F, G = output
    ctx.save_for_backward(q, k, v, out, lse, F, G, keep, bias)
    ctx.config = (scale, eps, cost, softcap, banded, left, right, block_q, block_k, grad_mode)


def _backward(ctx, dout, _dlse, _dF, _dG):
    """The gradient reaches q, k, v through the output only (lse and the potentials are kept for this
    backward, not differentiated); none for the output (the eager route does not materialise zeros): none."""
    if dout is None:
        return (None,) * 16
    q, k, v, out, lse, F, G, keep, bias = ctx.saved_tensors
    dq, dk, dv = _streaming_backward_op(dout.contiguous(), q, k, v, out, lse, F, G, keep, bias, *ctx.config)
    return (dq, dk, dv) + (None,) * 13


_streaming_op.register_autograd(first_order_only(_backward, "the streaming Sinkhorn backward (backends 'cpu', "
                                                            "'cpu_implicit')"), setup_context=_setup_context)
# eager calls skip the op's dispatch (about 15% of a small call's fwd + bwd host time): the same host function,
# backward and setup_context in an autograd.Function, as triton_utils.KernelOp does for the kernels
_EAGER = _autograd_function("attnzoo::sinkhorn_streaming", _streaming_host, _backward, _setup_context)


def streaming_sinkhorn(engine: TorchEngine, q, k, v, keep, bias, *, scale, eps, cost, n_iters, grad_mode, softcap=0.0,
                       band=None) -> Tensor:
    """One non-causal streaming Sinkhorn call through the op: keep / bias as from ``masking.split_mask`` (views
    broadcast to (B, H, Nq, Nk), never materialised), ``softcap`` (0: none) and ``band`` as ``Problem``'s."""
    B, H, nq, nk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    if keep is not None:
        keep = keep.expand(B, H, nq, nk)
    if bias is not None:
        bias = bias.expand(B, H, nq, nk)
    left, right = band if band is not None else (0, 0)
    args = (q.contiguous(), k.contiguous(), v.contiguous(), keep, bias, float(scale), float(eps), cost, int(n_iters),
            float(softcap), band is not None, int(left), int(right), engine.block_q or 0, engine.block_k or 0,
            grad_mode)
    if not eager_call(q):
        return _streaming_op(*args)[0]
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _EAGER.apply(*args)[0]
    return _streaming_host(*args)[0]
