"""Triton kernels for the streaming Sinkhorn passes (see streaming.py for the math of each pass).

Layout: q (BH, Nq, D), k (BH, Nk, D), v (BH, Nk, Dv) contiguous; potentials (BH, N) float32;
masks are (B, H, Nq, Nk) views given by their strides (0 on broadcast dims), so a key-padding
mask is read, never expanded. Every tile is oriented (query block m, key block n). ROWS programs
own a query block and stream over keys; column programs own a key block and stream over queries.
Logits and every reduction are float32; dots take the input dtype with a float32 accumulator
(exact products for fp16/bf16) except under TRITON_INTERPRET=1, where CDT upcasts to float32
because the interpreter's bf16 dot is wrong.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _load_rows(ptr, offs, n, offs_d, d):
    return tl.load(ptr + offs[:, None] * d + offs_d[None, :], mask=(offs[:, None] < n) & (offs_d[None, :] < d),
                   other=0.0)


@triton.jit
def _logits(Q, K, KEEP, BIAS, b, h, offs_m, offs_n, Nq, Nk, D, a,
            sk_b, sk_h, sk_m, sk_n, sb_b, sb_h, sb_m, sb_n,
            COST_L2: tl.constexpr, HAS_KEEP: tl.constexpr, HAS_BIAS: tl.constexpr,
            BLOCK_D: tl.constexpr, CDT: tl.constexpr, PREC: tl.constexpr):
    """Logits tile (BLOCK_M, BLOCK_N), float32, -inf where a key does not take part. Q, K point at
    this (b, h)'s rows."""
    offs_d = tl.arange(0, BLOCK_D)
    q = _load_rows(Q, offs_m, Nq, offs_d, D)
    k = _load_rows(K, offs_n, Nk, offs_d, D)
    s = tl.dot(q.to(CDT), tl.trans(k.to(CDT)), input_precision=PREC)
    if COST_L2:
        qf = q.to(tl.float32)
        kf = k.to(tl.float32)
        d2 = tl.sum(qf * qf, 1)[:, None] + tl.sum(kf * kf, 1)[None, :] - 2.0 * s
        L = -a * tl.maximum(d2, 0.0)
    else:
        L = a * s
    valid = (offs_m[:, None] < Nq) & (offs_n[None, :] < Nk)
    if HAS_BIAS:
        L += tl.load(BIAS + b * sb_b + h * sb_h + offs_m[:, None] * sb_m + offs_n[None, :] * sb_n,
                     mask=valid, other=0.0).to(tl.float32)
    if HAS_KEEP:
        kp = tl.load(KEEP + b * sk_b + h * sk_h + offs_m[:, None] * sk_m + offs_n[None, :] * sk_n,
                     mask=valid, other=0)
        valid = valid & (kp != 0)
    return tl.where(valid, L, float("-inf"))


@triton.jit
def _lse_kernel(Q, K, KEEP, BIAS, OTHER, OUT, H, Nq, Nk, D, a,
                sk_b, sk_h, sk_m, sk_n, sb_b, sb_h, sb_m, sb_n,
                ROWS: tl.constexpr, COST_L2: tl.constexpr, HAS_KEEP: tl.constexpr, HAS_BIAS: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                CDT: tl.constexpr, PREC: tl.constexpr):
    """ROWS: OUT_i = lse_j(L_ij + OTHER_j); else OUT_j = lse_i(L_ij + OTHER_i). Empty -> 0."""
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    Qh = Q + bh * Nq * D
    Kh = K + bh * Nk * D
    if ROWS:
        offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_M], tl.float32)
        for n0 in range(0, Nk, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            L = _logits(Qh, Kh, KEEP, BIAS, b, h, offs_m, offs_n, Nq, Nk, D, a, sk_b, sk_h, sk_m, sk_n,
                        sb_b, sb_h, sb_m, sb_n, COST_L2, HAS_KEEP, HAS_BIAS, BLOCK_D, CDT, PREC)
            s = L + tl.load(OTHER + bh * Nk + offs_n, mask=offs_n < Nk, other=0.0)[None, :]
            m_new = tl.maximum(m, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            l = l * tl.exp(m - m_safe) + tl.sum(tl.exp(s - m_safe[:, None]), 1)
            m = m_new
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        out = tl.where(l > 0, m_safe + tl.log(tl.where(l > 0, l, 1.0)), 0.0)
        tl.store(OUT + bh * Nq + offs_m, out, mask=offs_m < Nq)
    else:
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        m = tl.full([BLOCK_N], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_N], tl.float32)
        for m0 in range(0, Nq, BLOCK_M):
            offs_m = m0 + tl.arange(0, BLOCK_M)
            L = _logits(Qh, Kh, KEEP, BIAS, b, h, offs_m, offs_n, Nq, Nk, D, a, sk_b, sk_h, sk_m, sk_n,
                        sb_b, sb_h, sb_m, sb_n, COST_L2, HAS_KEEP, HAS_BIAS, BLOCK_D, CDT, PREC)
            s = L + tl.load(OTHER + bh * Nq + offs_m, mask=offs_m < Nq, other=0.0)[:, None]
            m_new = tl.maximum(m, tl.max(s, 0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            l = l * tl.exp(m - m_safe) + tl.sum(tl.exp(s - m_safe[None, :]), 0)
            m = m_new
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        out = tl.where(l > 0, m_safe + tl.log(tl.where(l > 0, l, 1.0)), 0.0)
        tl.store(OUT + bh * Nk + offs_n, out, mask=offs_n < Nk)


@triton.jit
def _wsum_kernel(Q, K, KEEP, BIAS, A, BV, W, OUT, H, Nq, Nk, D, a,
                 sk_b, sk_h, sk_m, sk_n, sb_b, sb_h, sb_m, sb_n,
                 ROWS: tl.constexpr, COST_L2: tl.constexpr, HAS_KEEP: tl.constexpr, HAS_BIAS: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                 CDT: tl.constexpr, PREC: tl.constexpr):
    """E_ij = exp(L_ij + A_i + BV_j) (a plan entry, <= 1 near the fixed point). ROWS: OUT_i =
    sum_j E_ij W_j (W over keys); else OUT_j = sum_i E_ij W_i (W over queries)."""
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    Qh = Q + bh * Nq * D
    Kh = K + bh * Nk * D
    if ROWS:
        offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        am = tl.load(A + bh * Nq + offs_m, mask=offs_m < Nq, other=0.0)
        acc = tl.zeros([BLOCK_M], tl.float32)
        for n0 in range(0, Nk, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            L = _logits(Qh, Kh, KEEP, BIAS, b, h, offs_m, offs_n, Nq, Nk, D, a, sk_b, sk_h, sk_m, sk_n,
                        sb_b, sb_h, sb_m, sb_n, COST_L2, HAS_KEEP, HAS_BIAS, BLOCK_D, CDT, PREC)
            bn = tl.load(BV + bh * Nk + offs_n, mask=offs_n < Nk, other=0.0)
            wn = tl.load(W + bh * Nk + offs_n, mask=offs_n < Nk, other=0.0)
            acc += tl.sum(tl.exp(L + am[:, None] + bn[None, :]) * wn[None, :], 1)
        tl.store(OUT + bh * Nq + offs_m, acc, mask=offs_m < Nq)
    else:
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        bn = tl.load(BV + bh * Nk + offs_n, mask=offs_n < Nk, other=0.0)
        acc = tl.zeros([BLOCK_N], tl.float32)
        for m0 in range(0, Nq, BLOCK_M):
            offs_m = m0 + tl.arange(0, BLOCK_M)
            L = _logits(Qh, Kh, KEEP, BIAS, b, h, offs_m, offs_n, Nq, Nk, D, a, sk_b, sk_h, sk_m, sk_n,
                        sb_b, sb_h, sb_m, sb_n, COST_L2, HAS_KEEP, HAS_BIAS, BLOCK_D, CDT, PREC)
            am = tl.load(A + bh * Nq + offs_m, mask=offs_m < Nq, other=0.0)
            wm = tl.load(W + bh * Nq + offs_m, mask=offs_m < Nq, other=0.0)
            acc += tl.sum(tl.exp(L + am[:, None] + bn[None, :]) * wm[:, None], 0)
        tl.store(OUT + bh * Nk + offs_n, acc, mask=offs_n < Nk)


@triton.jit
def _attend_kernel(Q, K, V, KEEP, BIAS, G, OUT, LSE, H, Nq, Nk, D, DV, a,
                   sk_b, sk_h, sk_m, sk_n, sb_b, sb_h, sb_m, sb_n,
                   COST_L2: tl.constexpr, HAS_KEEP: tl.constexpr, HAS_BIAS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                   CDT: tl.constexpr, PREC: tl.constexpr):
    """OUT_i = sum_j softmax_j(L_ij + G_j) V_j (online softmax); LSE_i of that softmax (0 if empty)."""
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for n0 in range(0, Nk, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        L = _logits(Q + bh * Nq * D, K + bh * Nk * D, KEEP, BIAS, b, h, offs_m, offs_n, Nq, Nk, D, a,
                    sk_b, sk_h, sk_m, sk_n, sb_b, sb_h, sb_m, sb_n, COST_L2, HAS_KEEP, HAS_BIAS, BLOCK_D, CDT, PREC)
        s = L + tl.load(G + bh * Nk + offs_n, mask=offs_n < Nk, other=0.0)[None, :]
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = _load_rows(V + bh * Nk * DV, offs_n, Nk, offs_dv, DV)
        acc = acc * alpha[:, None] + tl.dot(p.to(CDT), v.to(CDT), input_precision=PREC)
        m = m_new
    nonempty = l > 0
    l_safe = tl.where(nonempty, l, 1.0)
    out = acc / l_safe[:, None]
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    tl.store(LSE + bh * Nq + offs_m, tl.where(nonempty, m_safe + tl.log(l_safe), 0.0), mask=offs_m < Nq)
    tl.store(OUT + bh * Nq * DV + offs_m[:, None] * DV + offs_dv[None, :], out.to(OUT.dtype.element_ty),
             mask=(offs_m[:, None] < Nq) & (offs_dv[None, :] < DV))


@triton.jit
def _plan_and_dS(L, G, LSE, DO, V, DELTA, bh, offs_m, offs_n, Nq, Nk, DV,
                 BLOCK_DV: tl.constexpr, CDT: tl.constexpr, PREC: tl.constexpr):
    """P_ij = exp(L_ij + G_j - LSE_i) (the final plan) and dS_ij = P_ij (dout_i . v_j - DELTA_i)."""
    offs_dv = tl.arange(0, BLOCK_DV)
    g = tl.load(G + bh * Nk + offs_n, mask=offs_n < Nk, other=0.0)
    lse = tl.load(LSE + bh * Nq + offs_m, mask=offs_m < Nq, other=0.0)
    delta = tl.load(DELTA + bh * Nq + offs_m, mask=offs_m < Nq, other=0.0)
    p = tl.exp(L + g[None, :] - lse[:, None])
    do = _load_rows(DO + bh * Nq * DV, offs_m, Nq, offs_dv, DV)
    v = _load_rows(V + bh * Nk * DV, offs_n, Nk, offs_dv, DV)
    dp = tl.dot(do.to(CDT), tl.trans(v.to(CDT)), input_precision=PREC)
    return p, p * (dp - delta[:, None]), do


@triton.jit
def _grad_v_kernel(Q, K, V, KEEP, BIAS, G, LSE, DO, DELTA, DVOUT, DG, H, Nq, Nk, D, DV, a,
                   sk_b, sk_h, sk_m, sk_n, sb_b, sb_h, sb_m, sb_n,
                   COST_L2: tl.constexpr, HAS_KEEP: tl.constexpr, HAS_BIAS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                   CDT: tl.constexpr, PREC: tl.constexpr):
    """Per key block: dV_j = sum_i P_ij dout_i and dG_j = sum_i dS_ij (the adjoint of the last g)."""
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_dv = tl.arange(0, BLOCK_DV)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    dg = tl.zeros([BLOCK_N], tl.float32)
    for m0 in range(0, Nq, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        L = _logits(Q + bh * Nq * D, K + bh * Nk * D, KEEP, BIAS, b, h, offs_m, offs_n, Nq, Nk, D, a,
                    sk_b, sk_h, sk_m, sk_n, sb_b, sb_h, sb_m, sb_n, COST_L2, HAS_KEEP, HAS_BIAS, BLOCK_D, CDT, PREC)
        p, ds, do = _plan_and_dS(L, G, LSE, DO, V, DELTA, bh, offs_m, offs_n, Nq, Nk, DV, BLOCK_DV, CDT, PREC)
        dv += tl.dot(tl.trans(p).to(CDT), do.to(CDT), input_precision=PREC)
        dg += tl.sum(ds, 0)
    tl.store(DVOUT + bh * Nk * DV + offs_n[:, None] * DV + offs_dv[None, :], dv,
             mask=(offs_n[:, None] < Nk) & (offs_dv[None, :] < DV))
    tl.store(DG + bh * Nk + offs_n, dg, mask=offs_n < Nk)


@triton.jit
def _dlogits(L, G, LSE, DO, V, DELTA, FT, GC, GR, DGT, DFT, T, BH, bh, offs_m, offs_n, Nq, Nk, DV,
             BLOCK_DV: tl.constexpr, CDT: tl.constexpr, PREC: tl.constexpr):
    """dL_ij = dS_ij - sum_t [exp(L + FT_t,i + GC_t,j) DGT_t,j + exp(L + FT_t,i + GR_t,j) DFT_t,i]."""
    _, dl, _ = _plan_and_dS(L, G, LSE, DO, V, DELTA, bh, offs_m, offs_n, Nq, Nk, DV, BLOCK_DV, CDT, PREC)
    mm = offs_m < Nq
    mn = offs_n < Nk
    for t in range(T):
        rq = t * BH * Nq + bh * Nq + offs_m
        rk = t * BH * Nk + bh * Nk + offs_n
        lf = L + tl.load(FT + rq, mask=mm, other=0.0)[:, None]
        dl -= tl.exp(lf + tl.load(GC + rk, mask=mn, other=0.0)[None, :]) * tl.load(DGT + rk, mask=mn, other=0.0)[None, :]
        dl -= tl.exp(lf + tl.load(GR + rk, mask=mn, other=0.0)[None, :]) * tl.load(DFT + rq, mask=mm, other=0.0)[:, None]
    return dl


@triton.jit
def _grad_q_kernel(Q, K, V, KEEP, BIAS, G, LSE, DO, DELTA, FT, GC, GR, DGT, DFT, T, DQ, H, Nq, Nk, D, DV, a,
                   sk_b, sk_h, sk_m, sk_n, sb_b, sb_h, sb_m, sb_n,
                   COST_L2: tl.constexpr, HAS_KEEP: tl.constexpr, HAS_BIAS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                   CDT: tl.constexpr, PREC: tl.constexpr):
    """Per query block: dq_i = sum_j dL_ij dL_ij/dq_i (l2: 2a (k_j - q_i); dot: a k_j)."""
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    BH = tl.num_programs(1)
    b = bh // H
    h = bh % H
    offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    rowsum = tl.zeros([BLOCK_M], tl.float32)
    for n0 in range(0, Nk, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        L = _logits(Q + bh * Nq * D, K + bh * Nk * D, KEEP, BIAS, b, h, offs_m, offs_n, Nq, Nk, D, a,
                    sk_b, sk_h, sk_m, sk_n, sb_b, sb_h, sb_m, sb_n, COST_L2, HAS_KEEP, HAS_BIAS, BLOCK_D, CDT, PREC)
        dl = _dlogits(L, G, LSE, DO, V, DELTA, FT, GC, GR, DGT, DFT, T, BH, bh, offs_m, offs_n, Nq, Nk, DV,
                      BLOCK_DV, CDT, PREC)
        k = _load_rows(K + bh * Nk * D, offs_n, Nk, offs_d, D)
        dq += tl.dot(dl, k.to(tl.float32), input_precision="ieee")
        rowsum += tl.sum(dl, 1)
    if COST_L2:
        q = _load_rows(Q + bh * Nq * D, offs_m, Nq, offs_d, D).to(tl.float32)
        dq = 2.0 * a * (dq - q * rowsum[:, None])
    else:
        dq = a * dq
    tl.store(DQ + bh * Nq * D + offs_m[:, None] * D + offs_d[None, :], dq,
             mask=(offs_m[:, None] < Nq) & (offs_d[None, :] < D))


@triton.jit
def _grad_k_kernel(Q, K, V, KEEP, BIAS, G, LSE, DO, DELTA, FT, GC, GR, DGT, DFT, T, DK, H, Nq, Nk, D, DV, a,
                   sk_b, sk_h, sk_m, sk_n, sb_b, sb_h, sb_m, sb_n,
                   COST_L2: tl.constexpr, HAS_KEEP: tl.constexpr, HAS_BIAS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                   CDT: tl.constexpr, PREC: tl.constexpr):
    """Per key block: dk_j = sum_i dL_ij dL_ij/dk_j (l2: 2a (q_i - k_j); dot: a q_i)."""
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    BH = tl.num_programs(1)
    b = bh // H
    h = bh % H
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    colsum = tl.zeros([BLOCK_N], tl.float32)
    for m0 in range(0, Nq, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        L = _logits(Q + bh * Nq * D, K + bh * Nk * D, KEEP, BIAS, b, h, offs_m, offs_n, Nq, Nk, D, a,
                    sk_b, sk_h, sk_m, sk_n, sb_b, sb_h, sb_m, sb_n, COST_L2, HAS_KEEP, HAS_BIAS, BLOCK_D, CDT, PREC)
        dl = _dlogits(L, G, LSE, DO, V, DELTA, FT, GC, GR, DGT, DFT, T, BH, bh, offs_m, offs_n, Nq, Nk, DV,
                      BLOCK_DV, CDT, PREC)
        q = _load_rows(Q + bh * Nq * D, offs_m, Nq, offs_d, D)
        dk += tl.dot(tl.trans(dl), q.to(tl.float32), input_precision="ieee")
        colsum += tl.sum(dl, 0)
    if COST_L2:
        k = _load_rows(K + bh * Nk * D, offs_n, Nk, offs_d, D).to(tl.float32)
        dk = 2.0 * a * (dk - k * colsum[:, None])
    else:
        dk = a * dk
    tl.store(DK + bh * Nk * D + offs_n[:, None] * D + offs_d[None, :], dk,
             mask=(offs_n[:, None] < Nk) & (offs_d[None, :] < D))
