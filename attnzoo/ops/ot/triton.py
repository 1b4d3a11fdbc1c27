"""Fused OT attention weights in Triton (readable twin: cpu.py; contract: factorised.py).

W_it = sum_j u_ij softmax_t(C_it + G_jt), never storing the (Nq, Nk, |A|) tensor. Tiles are
(BI queries, BJ input templates, BT templates of A); C and G are loaded, never recomputed, so the
query-independent Gram term G costs one matmul in total.
    _lse_kernel   per (i, j): streaming logsumexp over A (online max / rescaled sum)
    _w_kernel     per (i, t): W_it = sum_j u_ij exp(C_it + G_jt - lse_ij)
backward, with P_ijt = exp(C_it + G_jt - lse_ij):
    _g_kernel     per (i, j): g_ij = sum_t P_ijt dW_it   (= du_ij)
    _dc_kernel    per (i, t): dC_it = sum_j u_ij P_ijt (dW_it - g_ij)
    _dg_kernel    per (j, t): dG_jt = sum_i u_ij P_ijt (dW_it - g_ij)
lse is stored (Nq x Nk, the size of u) with +inf where every template is removed, so P is 0 there.
"""
from __future__ import annotations

import torch

from ..linear.triton import HAVE_TRITON, device_reason  # noqa: F401  (one device rule for both)
from .factorised import ot_attention_factorised

if HAVE_TRITON:
    import triton
    import triton.language as tl

BI, BJ, BT = 16, 16, 16


if HAVE_TRITON:
    @triton.jit
    def _bh():
        # batch * head runs on grid axis 0 (up to 2^31 - 1; axes 1 and 2 stop at 65535) and is int64:
        # bh * NQ * NA passes 2^31 for large batches
        return tl.program_id(0).to(tl.int64)

    @triton.jit
    def _load2(ptr, rows, cols, n_rows, n_cols, s_row, other):
        mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
        return tl.load(ptr + rows[:, None] * s_row + cols[None, :], mask=mask, other=other)

    @triton.jit
    def _lse_kernel(C, G, LSE, NQ, NK, NA, BI: tl.constexpr, BJ: tl.constexpr, BT: tl.constexpr):
        bh, pi, pj = _bh(), tl.program_id(1), tl.program_id(2)
        ri, rj, rt = pi * BI + tl.arange(0, BI), pj * BJ + tl.arange(0, BJ), tl.arange(0, BT)
        C, G = C + bh * NQ * NA, G + bh * NK * NA
        m = tl.full((BI, BJ), float("-inf"), C.dtype.element_ty)
        s = tl.zeros((BI, BJ), C.dtype.element_ty)
        for t0 in range(0, NA, BT):
            c = _load2(C, ri, t0 + rt, NQ, NA, NA, float("-inf"))
            g = _load2(G, rj, t0 + rt, NK, NA, NA, 0.0)
            logit = c[:, None, :] + g[None, :, :]
            m_new = tl.maximum(m, tl.max(logit, axis=2))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(logit - m_safe[:, :, None]), axis=2)
            m = m_new
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        lse = tl.where(s > 0, m_safe + tl.log(tl.where(s > 0, s, 1.0)), float("inf"))
        mask = (ri[:, None] < NQ) & (rj[None, :] < NK)
        tl.store(LSE + bh * NQ * NK + ri[:, None] * NK + rj[None, :], lse, mask=mask)

    @triton.jit
    def _w_kernel(C, G, U, LSE, W, NQ, NK, NA, SU_BH, SU_I,
                  BI: tl.constexpr, BJ: tl.constexpr, BT: tl.constexpr):
        bh, pi, pt = _bh(), tl.program_id(1), tl.program_id(2)
        ri, rj, rt = pi * BI + tl.arange(0, BI), tl.arange(0, BJ), pt * BT + tl.arange(0, BT)
        C, G, U, LSE = C + bh * NQ * NA, G + bh * NK * NA, U + bh * SU_BH, LSE + bh * NQ * NK
        c = _load2(C, ri, rt, NQ, NA, NA, float("-inf"))
        w = tl.zeros((BI, BT), C.dtype.element_ty)
        for j0 in range(0, NK, BJ):
            g = _load2(G, j0 + rj, rt, NK, NA, NA, 0.0)
            lse = _load2(LSE, ri, j0 + rj, NQ, NK, NK, float("inf"))
            u = tl.load(U + ri[:, None] * SU_I + (j0 + rj)[None, :],
                        mask=(ri[:, None] < NQ) & ((j0 + rj)[None, :] < NK), other=0.0)
            p = tl.exp(c[:, None, :] + g[None, :, :] - lse[:, :, None])
            w += tl.sum(u[:, :, None] * p, axis=1)
        tl.store(W + bh * NQ * NA + ri[:, None] * NA + rt[None, :], w,
                 mask=(ri[:, None] < NQ) & (rt[None, :] < NA))

    @triton.jit
    def _g_kernel(C, G, LSE, DW, GIJ, NQ, NK, NA, BI: tl.constexpr, BJ: tl.constexpr, BT: tl.constexpr):
        bh, pi, pj = _bh(), tl.program_id(1), tl.program_id(2)
        ri, rj, rt = pi * BI + tl.arange(0, BI), pj * BJ + tl.arange(0, BJ), tl.arange(0, BT)
        C, G, DW = C + bh * NQ * NA, G + bh * NK * NA, DW + bh * NQ * NA
        lse = _load2(LSE + bh * NQ * NK, ri, rj, NQ, NK, NK, float("inf"))
        acc = tl.zeros((BI, BJ), C.dtype.element_ty)
        for t0 in range(0, NA, BT):
            c = _load2(C, ri, t0 + rt, NQ, NA, NA, float("-inf"))
            g = _load2(G, rj, t0 + rt, NK, NA, NA, 0.0)
            dw = _load2(DW, ri, t0 + rt, NQ, NA, NA, 0.0)
            p = tl.exp(c[:, None, :] + g[None, :, :] - lse[:, :, None])
            acc += tl.sum(p * dw[:, None, :], axis=2)
        tl.store(GIJ + bh * NQ * NK + ri[:, None] * NK + rj[None, :], acc,
                 mask=(ri[:, None] < NQ) & (rj[None, :] < NK))

    @triton.jit
    def _dc_kernel(C, G, U, LSE, DW, GIJ, DC, NQ, NK, NA, SU_BH, SU_I,
                   BI: tl.constexpr, BJ: tl.constexpr, BT: tl.constexpr):
        bh, pi, pt = _bh(), tl.program_id(1), tl.program_id(2)
        ri, rj, rt = pi * BI + tl.arange(0, BI), tl.arange(0, BJ), pt * BT + tl.arange(0, BT)
        C, G, U = C + bh * NQ * NA, G + bh * NK * NA, U + bh * SU_BH
        LSE, GIJ = LSE + bh * NQ * NK, GIJ + bh * NQ * NK
        c = _load2(C, ri, rt, NQ, NA, NA, float("-inf"))
        dw = _load2(DW + bh * NQ * NA, ri, rt, NQ, NA, NA, 0.0)
        acc = tl.zeros((BI, BT), C.dtype.element_ty)
        for j0 in range(0, NK, BJ):
            g = _load2(G, j0 + rj, rt, NK, NA, NA, 0.0)
            lse = _load2(LSE, ri, j0 + rj, NQ, NK, NK, float("inf"))
            gij = _load2(GIJ, ri, j0 + rj, NQ, NK, NK, 0.0)
            u = tl.load(U + ri[:, None] * SU_I + (j0 + rj)[None, :],
                        mask=(ri[:, None] < NQ) & ((j0 + rj)[None, :] < NK), other=0.0)
            p = tl.exp(c[:, None, :] + g[None, :, :] - lse[:, :, None])
            acc += tl.sum(u[:, :, None] * p * (dw[:, None, :] - gij[:, :, None]), axis=1)
        tl.store(DC + bh * NQ * NA + ri[:, None] * NA + rt[None, :], acc,
                 mask=(ri[:, None] < NQ) & (rt[None, :] < NA))

    @triton.jit
    def _dg_kernel(C, G, U, LSE, DW, GIJ, DG, NQ, NK, NA, SU_BH, SU_I,
                   BI: tl.constexpr, BJ: tl.constexpr, BT: tl.constexpr):
        bh, pj, pt = _bh(), tl.program_id(1), tl.program_id(2)
        ri, rj, rt = tl.arange(0, BI), pj * BJ + tl.arange(0, BJ), pt * BT + tl.arange(0, BT)
        C, U, DW = C + bh * NQ * NA, U + bh * SU_BH, DW + bh * NQ * NA
        LSE, GIJ = LSE + bh * NQ * NK, GIJ + bh * NQ * NK
        g = _load2(G + bh * NK * NA, rj, rt, NK, NA, NA, 0.0)
        acc = tl.zeros((BJ, BT), G.dtype.element_ty)
        for i0 in range(0, NQ, BI):
            c = _load2(C, i0 + ri, rt, NQ, NA, NA, float("-inf"))
            dw = _load2(DW, i0 + ri, rt, NQ, NA, NA, 0.0)
            lse = _load2(LSE, i0 + ri, rj, NQ, NK, NK, float("inf"))
            gij = _load2(GIJ, i0 + ri, rj, NQ, NK, NK, 0.0)
            u = tl.load(U + (i0 + ri)[:, None] * SU_I + rj[None, :],
                        mask=((i0 + ri)[:, None] < NQ) & (rj[None, :] < NK), other=0.0)
            p = tl.exp(c[:, None, :] + g[None, :, :] - lse[:, :, None])
            acc += tl.sum(u[:, :, None] * p * (dw[:, None, :] - gij[:, :, None]), axis=0)
        tl.store(DG + bh * NK * NA + rj[:, None] * NA + rt[None, :], acc,
                 mask=(rj[:, None] < NK) & (rt[None, :] < NA))


def _flat(c, g, u):
    lead = c.shape[:-2]
    cf = c.reshape((-1,) + c.shape[-2:]).contiguous()
    gf = g.reshape((-1,) + g.shape[-2:]).contiguous()
    uf = u.reshape((-1,) + u.shape[-2:]).contiguous()
    return cf, gf, uf, lead


class _TransportWeightsTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, c, g, u):
        cf, gf, uf, lead = _flat(c, g, u)
        bh, nq, na, nk = cf.shape[0], cf.shape[1], cf.shape[2], gf.shape[1]
        su_i = nk if uf.shape[1] != 1 else 0          # a query-independent u is read with stride 0
        lse = torch.empty((bh, nq, nk), dtype=cf.dtype, device=cf.device)
        w = torch.empty_like(cf)
        with torch.cuda.device_of(cf):   # launch on the inputs' GPU, not the current one
            _lse_kernel[(bh, triton.cdiv(nq, BI), triton.cdiv(nk, BJ))](cf, gf, lse, nq, nk, na, BI=BI, BJ=BJ, BT=BT)
            _w_kernel[(bh, triton.cdiv(nq, BI), triton.cdiv(na, BT))](cf, gf, uf, lse, w, nq, nk, na,
                                                                      uf.shape[1] * nk, su_i, BI=BI, BJ=BJ, BT=BT)
        ctx.save_for_backward(cf, gf, uf, lse)
        ctx.shapes = (c.shape, g.shape, u.shape)
        return w.reshape(c.shape)

    @staticmethod
    def backward(ctx, dw):
        cf, gf, uf, lse = ctx.saved_tensors
        c_shape, g_shape, u_shape = ctx.shapes
        bh, nq, na, nk = cf.shape[0], cf.shape[1], cf.shape[2], gf.shape[1]
        su_i = nk if uf.shape[1] != 1 else 0
        dwf = dw.reshape(cf.shape).contiguous().to(cf.dtype)
        gij = torch.empty_like(lse)
        dc, dg = torch.empty_like(cf), torch.empty_like(gf)
        args = (cf, gf, uf, lse, dwf, gij)
        with torch.cuda.device_of(cf):
            _g_kernel[(bh, triton.cdiv(nq, BI), triton.cdiv(nk, BJ))](cf, gf, lse, dwf, gij, nq, nk, na,
                                                                      BI=BI, BJ=BJ, BT=BT)
            _dc_kernel[(bh, triton.cdiv(nq, BI), triton.cdiv(na, BT))](*args, dc, nq, nk, na, uf.shape[1] * nk,
                                                                       su_i, BI=BI, BJ=BJ, BT=BT)
            _dg_kernel[(bh, triton.cdiv(nk, BJ), triton.cdiv(na, BT))](*args, dg, nq, nk, na, uf.shape[1] * nk,
                                                                       su_i, BI=BI, BJ=BJ, BT=BT)
        du = gij if uf.shape[1] != 1 else gij.sum(1, keepdim=True)
        return dc.reshape(c_shape), dg.reshape(g_shape), du.reshape(u_shape)


def transport_weights(c, g, u):
    """W (..., Nq, A) = sum_j u_ij softmax_t(c_it + g_jt): the Triton twin of ``cpu.transport_weights``."""
    return _TransportWeightsTriton.apply(c, g, u)


def ot_attention_triton(q, k, v, *, attn_mask=None, is_causal=False, scale, alpha=1.0, gamma=None, log_u=None,
                        templates_k=None, templates_v=None, dropout_p=0.0):
    return ot_attention_factorised(transport_weights, q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                                   scale=scale, alpha=alpha, gamma=gamma, log_u=log_u,
                                   templates_k=templates_k, templates_v=templates_v)
