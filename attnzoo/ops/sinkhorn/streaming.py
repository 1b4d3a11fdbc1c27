"""Streaming Sinkhorn attention: the algorithm, independent of where the tiles are computed.

The N x N logits are never stored. Everything the forward and backward need is expressed as a few
*passes* over (query block, key block) tiles, each reducing the tile to an O(N) vector; an
*engine* (``cpu.TorchEngine``, ``triton.TritonEngine``) implements the passes. With

    L_ij  = logits (cost "l2" or "dot", float mask added, -inf where a key does not take part)
    c     = log(Nq / Nk)                        (column target; any constant gives the same P)

the forward is (paper 002 sec 2.4, log domain, g^0 = 0)

    f^t_i = -lse_j (L_ij + g^{t-1}_j)           engine.lse_rows
    g^t_j = c - lse_i (L_ij + f^t_i)            engine.lse_cols
    out_i = sum_j softmax_j(L_ij + g^T_j) v_j   engine.attend (also returns lse_i of that softmax)

Backward, "unrolled" (exact gradient of the n_iters computed): with P = the final weights,
dS_ij = P_ij (dout_i . v_j - dout_i . out_i) and dg^T_j = sum_i dS_ij, for t = T..1

    df^t_i     = -sum_j dg^t_j     C^t_ij,  C^t_ij = exp(L_ij + f^t_i + g^t_j - c)   (wsum_rows)
    dg^{t-1}_j = -sum_i df^t_i     R^t_ij,  R^t_ij = exp(L_ij + f^t_i + g^{t-1}_j)   (wsum_cols)

and finally dL_ij = dS_ij - sum_t (C^t_ij dg^t_j + R^t_ij df^t_i), pushed to q and k tile by tile
(engine.grad_qk, which takes the terms as the stacks (F, G, DG, DF) = (f^1..f^T, g^0..g^T,
dg^1..dg^T, df^1..df^T): C^t from F[t], G[t + 1] - c, R^t from F[t], G[t]). Only the potentials
f^t, g^t (O(n_iters N)) are kept between forward and backward.

Backward, "implicit" (gradient of the fixed point g*(L), implicit function theorem): at the fixed
point every C^t and R^t equals the final P up to the constant e^{-c}, so the adjoint recursion above
becomes a Neumann series dg <- e^{-c} P^T P dg run to convergence, and dL needs only the two sums
W_g = sum_m dg_m, W_f = sum_m df_m: dL = dS - P (e^{-c} W_g + W_f). It matches the unrolled gradient
only as n_iters grows (the forward must be near the fixed point).

An engine may also work with *reduced* potentials: for cost "l2", L_ij = 2a q_i.k_j - a|q_i|^2 - a|k_j|^2,
and the norms can live in the potentials (f~_i = f_i - a|q_i|^2, g~_j = g_j - a|k_j|^2) so that
every pass sees the dot-product logits 2a q.k. The iterations are the same with g~^0 = -a|k|^2
(``engine.initial_g``); every exp(L + f + g) above is unchanged, and so are the outputs.

Causal attention is Sinkhorn on every prefix (paper 002 eq 2.6): ``causal_by_prefix`` runs a
non-causal function once per query row on the visible prefix. That is exact and O(N)
memory, but costs O(n_iters N^3): no cheaper formulation exists for a fixed number of iterations,
because every prefix has its own potentials.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Optional

import torch
from torch.utils.checkpoint import checkpoint

from ..masking import coupled_causal_rows

GRAD_MODES = ("unrolled", "implicit")
# relative size of the Neumann term at which the implicit adjoint stops: about the accumulator's roundoff
IMPLICIT_TOL = {torch.float32: 1e-6, torch.float64: 1e-12}
IMPLICIT_MAX_ITERS = 200   # cap for badly conditioned plans (small eps): documented, not silent


@dataclass
class Problem:
    """One (non-causal) Sinkhorn attention call, arguments already validated.

    keep / bias are None or views broadcast to (B, H, Nq, Nk): engines slice tiles out of them, so a
    key-padding mask of shape (B, 1, 1, Nk) never becomes an N x N tensor.
    """
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    keep: Optional[torch.Tensor]
    bias: Optional[torch.Tensor]
    scale: float
    eps: float
    cost: str
    mask: Optional[torch.Tensor] = None   # the raw attn_mask (engines that read it as is; keep/bias None)
    tune: bool = True                      # engines may autotune tiles for this shape
    softcap: float = 0.0                   # the logit cap (0: none), on the whole logit before the mask's bias
    band: Optional[tuple] = None           # (left, right) of a window (triton_logit_extras.band_bounds): the
                                           # passes visit only the tiles that meet it

    @property
    def col_target(self) -> float:
        return math.log(self.q.shape[-2] / self.k.shape[-2])

    @property
    def logit_scale(self) -> float:
        """L = logit_scale * q.k (dot) or -logit_scale * ||q - k||^2 (l2)."""
        return self.scale / (2.0 * self.eps) if self.cost == "l2" else self.scale / self.eps


def sinkhorn_potentials(engine, p: Problem, n_iters: int):
    """The row potentials f^1..f^T and column potentials g^0..g^T (fp32, or fp64 for fp64 inputs)."""
    g = engine.initial_g(p)
    fs, gs = [], [g]
    for _ in range(n_iters):
        f = -engine.lse_rows(p, g)
        g = p.col_target - engine.lse_cols(p, f)
        fs.append(f)
        gs.append(g)
    return fs, gs


def _adjoint_unrolled(engine, p, fs, gs, dg):
    """Walk the iterations backwards; returns the stacks (F, G, DG, DF) of engine.grad_qk."""
    c = p.col_target
    T = len(fs)
    DG, DF = [None] * T, [None] * T
    for t in range(T - 1, -1, -1):
        DG[t] = dg
        DF[t] = -engine.wsum_rows(p, fs[t], gs[t + 1] - c, dg)
        # g^0 is no iteration's output: 0, or -a|k|^2 with reduced potentials, whose gradient the
        # engine takes from the column sums of dL (sum_i dL_ij is the adjoint of g^0_j)
        if t > 0:
            dg = -engine.wsum_cols(p, fs[t], gs[t], DF[t])
    if T == 0:
        return None
    st = torch.stack
    return st(fs), st(gs), st(DG), st(DF)


def _adjoint_implicit(engine, p, g, lse, dg):
    """Neumann series of the implicit-function adjoint at the (approximate) fixed point g."""
    c = p.col_target
    f = -lse  # row potential of the final plan: P_ij = exp(L_ij + f_i + g_j)
    w_g = torch.zeros_like(dg)
    w_f = torch.zeros_like(f)
    # g is only defined up to a constant (g + t gives the same P): that direction has eigenvalue 1 in
    # the series, exactly balanced at the fixed point, slowly drifting off it. Removing the mean of dg
    # over the keys that carry mass is exact at the fixed point and keeps the series contracting.
    active = (engine.wsum_cols(p, f, g, torch.ones_like(f)) > 0).to(dg.dtype)
    n_active = active.sum(-1, keepdim=True).clamp_min(1.0)
    center = lambda x: x - active * (x * active).sum(-1, keepdim=True) / n_active
    dg = center(dg)
    start, tol = dg.norm(), IMPLICIT_TOL[dg.dtype]
    for _ in range(IMPLICIT_MAX_ITERS):
        df = -engine.wsum_rows(p, f, g - c, dg)
        w_g = w_g + dg
        w_f = w_f + df
        dg = center(-engine.wsum_cols(p, f, g, df))
        size = dg.norm()
        if size <= tol * start:
            break
        if size > 10 * start:  # P^T P e^{-c} has spectral radius > 1 when the forward is far from converged
            warnings.warn("Sinkhorn implicit backward: the adjoint series diverges (the forward is far from its "
                          "fixed point: raise n_iters or use grad_mode='unrolled')", RuntimeWarning, stacklevel=2)
            break
    else:
        warnings.warn(f"Sinkhorn implicit backward: the adjoint series did not converge in {IMPLICIT_MAX_ITERS} "
                      "terms (eps too small or the forward far from its fixed point); use grad_mode='unrolled'",
                      RuntimeWarning, stacklevel=2)
    # one term with C = exp(L + f + g - c), R = exp(L + f + g): the stacks' G[t + 1] - c and G[t]
    return f[None], torch.stack([g, g]), w_g[None], w_f[None]


def streaming_backward(engine, p: Problem, dout, out, lse, fs, gs, grad_mode):
    """(dq, dk, dv) of one non-causal call from what its forward kept (output, final row lse,
    potentials f^1..f^T, g^0..g^T), in the engine's accumulation dtype or the input dtype."""
    dout = dout.contiguous()
    delta = engine.row_dot(dout, out)                     # dout_i . out_i
    dv, dg = engine.grad_v_and_bias(p, gs[-1], lse, dout, delta)
    if grad_mode == "implicit" and len(fs) > 0:
        terms = _adjoint_implicit(engine, p, gs[-1], lse, dg)
    else:
        terms = _adjoint_unrolled(engine, p, list(fs), list(gs), dg)
    dq, dk = engine.grad_qk(p, gs[-1], lse, dout, delta, terms)
    return dq, dk, dv


def causal_by_prefix(run, q, k, v, attn_mask=None):
    """Causal Sinkhorn (paper 002 eq 2.6): row i is the last row of Sinkhorn on queries 0..i and the
    keys visible to query i (j <= i + Nk - Nq, bottom-right alignment); with ``attn_mask`` (bool or
    float, broadcastable to (B, H, Nq, Nk)) that problem is shaped as ``masking.coupled_causal_rows``
    defines (the tokens row i sees, each pair as the mask lets the later one see the earlier one).

    ``run(q, k, v, mask)`` is a non-causal Sinkhorn call taking an attn_mask (or None). Each prefix
    problem runs under activation checkpointing: what autograd keeps per row is then a reference to
    the shared q, k, v and the output row, not the prefix's output and potentials (O(N^2) over all
    rows); the backward recomputes each prefix's forward once.
    """
    B, H, nq, nk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    row_mask = coupled_causal_rows(attn_mask, nq, nk)

    def last_row(i, m, q, k, v):
        out = run(q[..., : i + 1, :], k[..., :m, :], v[..., :m, :], row_mask(i))
        return out[..., -1:, :]

    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    rows = []
    for i in range(nq):
        m = i + nk - nq + 1  # keys visible to query i
        if m <= 0:  # no key visible: a zero row, as every variant returns for an empty row
            rows.append(v.new_zeros(B, H, 1, v.shape[-1]))
        elif grad:
            rows.append(checkpoint(last_row, i, m, q, k, v, use_reentrant=False))
        else:
            rows.append(last_row(i, m, q, k, v))
    # every row has the output dtype already; CPU autocast's cat rejects float16 rows outright
    with torch.autocast(q.device.type, enabled=False):
        return torch.cat(rows, dim=-2)
