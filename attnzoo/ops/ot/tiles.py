"""Exact blockwise transport weights: W_it = sum_j u_ij softmax_t(C_it + G_jt) tile by tile.

A tile is (queries i0:i1) x (input templates j0:j1) x (all of A): the softmax over A belongs to
one (i, j) pair, so with A whole in the tile it is an ordinary max-shifted softmax and no running
logsumexp is needed (the Triton kernel, whose tiles must be small, streams over A instead). The
tile size is capped by ``TILE_ELEMENTS`` so the largest temporary does not depend on Nq * Nk.
The backward recomputes each tile's softmax (nothing per (i, j, t) is stored):

    g_ij = sum_t P_ijt dW_it,   dL_ijt = u_ij P_ijt (dW_it - g_ij),
    dC_it = sum_j dL_ijt,       dG_jt = sum_i dL_ijt,       du_ij = g_ij.

``active`` (bool, broadcastable like u) restricts the sum to some (i, j) pairs and skips tiles
without one: cpu.py uses it for the few pairs its matmul path cannot resolve in floating point.
"""
from __future__ import annotations

import torch

TILE_ELEMENTS = 1 << 21   # 8 MB of float32 per (i, j, t) tile


def _blocks(nq, nk, na, tile_elements):
    per_pair = max(1, tile_elements // na)
    bj = min(nk, per_pair)
    bi = min(nq, max(1, per_pair // bj))
    return bi, bj


def _tile_softmax(c_blk, g_blk):
    """P (bi, bj, A) = softmax over A of c_i + g_j, all-zero where every template is removed."""
    p = c_blk.unsqueeze(1) + g_blk.unsqueeze(0)
    m = p.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p.sub_(m).exp_()
    s = p.sum(-1, keepdim=True)
    p.div_(torch.where(s > 0, s, torch.ones_like(s)))
    return p


def _slice(uf, af, b, i0, i1, j0, j1):
    """u's (i0:i1, j0:j1) block (expanded over queries when u has one row), zeroed outside
    ``active``; None when no pair of the block is active (the tile is skipped)."""
    rows = slice(i0, i1) if uf.shape[1] != 1 else slice(0, 1)
    ub = uf[b, rows, j0:j1].expand(i1 - i0, -1)
    if af is None:
        return ub
    ab = af[b, rows, j0:j1].expand(i1 - i0, -1)
    if not bool(ab.any()):
        return None
    return ub * ab


def _flat(c, g, u):
    lead = c.shape[:-2]
    return c.reshape((-1,) + c.shape[-2:]), g.reshape((-1,) + g.shape[-2:]), u.reshape((-1,) + u.shape[-2:]), lead


def _prepare(c, g, u, tile_elements, active):
    tile_elements = TILE_ELEMENTS if tile_elements is None else int(tile_elements)
    if active is not None:
        active = active.expand(u.shape[:-2] + active.shape[-2:]).contiguous()
        u = u.expand(active.shape)
    return c.contiguous(), g.contiguous(), u.contiguous(), tile_elements, active


def _active_tiles(cf, gf, uf, af, tile_elements):
    """(batch, query rows, key cols, u's block, P of the block) for every tile with an active pair;
    P is made afresh per tile (the backward recomputes it instead of keeping it)."""
    nq, na, nk = cf.shape[1], cf.shape[2], gf.shape[1]
    bi, bj = _blocks(nq, nk, na, tile_elements)
    for b in range(cf.shape[0]):
        for i0 in range(0, nq, bi):
            rows = slice(i0, min(nq, i0 + bi))
            for j0 in range(0, nk, bj):
                cols = slice(j0, min(nk, j0 + bj))
                ub = _slice(uf, af, b, rows.start, rows.stop, cols.start, cols.stop)
                if ub is not None:
                    yield b, rows, cols, ub, _tile_softmax(cf[b, rows], gf[b, cols])


def tiles_forward(c, g, u, tile_elements=None, active=None):
    """W (..., Nq, A) over the ``active`` pairs, no autograd (cpu.py's function wraps it)."""
    c, g, u, tile_elements, active = _prepare(c, g, u, tile_elements, active)
    cf, gf, uf, lead = _flat(c, g, u)
    af = None if active is None else active.reshape(uf.shape)
    w = torch.zeros_like(cf)
    for b, rows, cols, ub, p in _active_tiles(cf, gf, uf, af, tile_elements):
        w[b, rows] += (ub.unsqueeze(1) @ p).squeeze(1)
    return w.reshape(lead + w.shape[-2:])


def tiles_backward(dw, c, g, u, tile_elements=None, active=None):
    """(dc, dg, du) of tiles_forward, no autograd; du has the shape of u after ``active`` expanded it."""
    c, g, u, tile_elements, active = _prepare(c, g, u, tile_elements, active)
    cf, gf, uf, lead = _flat(c, g, u)
    af = None if active is None else active.reshape(uf.shape)
    dwf = dw.reshape(cf.shape)
    dc, dg, du = torch.zeros_like(cf), torch.zeros_like(gf), torch.zeros_like(uf)
    per_query_u = uf.shape[1] != 1
    for b, rows, cols, ub, p in _active_tiles(cf, gf, uf, af, tile_elements):
        dl = p * dwf[b, rows].unsqueeze(1)                              # dW broadcast over the keys
        gij = dl.sum(-1, keepdim=True)                                  # (bi, bj, 1)
        dl.sub_(p.mul_(gij)).mul_(ub.unsqueeze(-1))
        dc[b, rows] += dl.sum(1)
        dg[b, cols] += dl.sum(0)
        gij = gij.squeeze(-1)
        if af is not None:
            gij = gij * _slice(af, None, b, rows.start, rows.stop, cols.start, cols.stop)
        if per_query_u:
            du[b, rows, cols] = gij
        else:
            du[b, 0, cols] += gij.sum(0)
    return dc.reshape(c.shape), dg.reshape(g.shape), du.reshape(u.shape)

