"""Triton kernels for the streaming Sinkhorn passes (streaming.py gives the math of each pass).

Logits. Every kernel sees the dot-product logits A x.y (A = 2a for cost "l2", a for "dot", a the
logit scale); the l2 norms live in the potentials (streaming.py, reduced potentials), so no kernel
reads a norm. Exponentials are base 2: a tile is t = A log2(e) x.y + (potentials) log2(e), and
logsumexps are converted back to natural logs when stored, so every potential kept between kernels
is in natural-log units.

Orientation. A kernel owns a block of BLOCK_X rows of X and streams over BLOCK_Y rows of Y; a row
pass over queries is launched on (X, Y) = (q, k), a column pass on (k, q) with the mask's strides
swapped: one kernel for both. Layout: X (BH, Nx, D), Y (BH, Ny, D) contiguous; per-row vectors
(BH, N) float32; the mask a (B, H, Nx, Ny) view given by strides (0 on broadcast dims), so a
key-padding mask is read, never expanded.

tune_nx / tune_ny: power-of-two buckets of Nx / Ny, unused by the code: the autotuning key, so a
new length retunes only when it changes bucket (triton.py).

Out-of-range rows and columns need no 2-D bounds mask: the per-Y vectors are loaded with -inf
(or +inf for a subtracted log-normaliser) past the end, which makes every exponential there 0, and
the loaded X / Y rows are zeros there, so nothing is NaN. Masks (MASK_KIND 1 = bool as uint8,
2 = float with -inf for masked entries) are applied to t once per tile; a mask broadcast along
one axis of the tile (key padding, a per-query mask) is read as one vector.

Precision: dots take the input dtype with a float32 accumulator (tensor cores for fp16 / bf16;
``mm`` upcasts to float32 under TRITON_INTERPRET=1, whose bf16 dot is wrong); every exponential,
reduction and accumulator is float32 whatever dtype the host hands in (bf16 under autocast too).
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..triton_utils import mm

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _load_rows(ptr, offs, n, offs_d, d):
    return tl.load(ptr + offs[:, None] * d + offs_d[None, :], mask=(offs[:, None] < n) & (offs_d[None, :] < d),
                   other=0.0)


@triton.jit
def _load_vec(ptr, offs, n, fill):
    return tl.load(ptr + offs, mask=offs < n, other=fill)


@triton.jit
def _apply_mask(t, MASK, offs_x, offs_y, Nx, Ny, sm_x, sm_y, MASK_KIND: tl.constexpr, MASK_SHAPE: tl.constexpr):
    """t (log2 units) with the attention mask: -inf where masked, a float mask's value added.
    MASK_SHAPE 1: the mask is constant along x (sm_x == 0, e.g. key padding in a row pass) and is
    read as one vector over y; 2: constant along y (sm_y == 0), one vector over x; 0: a full tile."""
    if MASK_KIND != 0:
        if MASK_SHAPE == 1:
            mv = tl.load(MASK + offs_y * sm_y, mask=offs_y < Ny, other=0)[None, :]
        elif MASK_SHAPE == 2:
            mv = tl.load(MASK + offs_x * sm_x, mask=offs_x < Nx, other=0)[:, None]
        else:
            mv = tl.load(MASK + offs_x[:, None] * sm_x + offs_y[None, :] * sm_y,
                         mask=(offs_x[:, None] < Nx) & (offs_y[None, :] < Ny), other=0)
        if MASK_KIND == 1:
            t = tl.where(mv != 0, t, float("-inf"))
        else:  # -inf entries give -inf; finite ones shift the logit
            t = t + mv.to(tl.float32) * LOG2E
    return t


@triton.jit
def _lse_kernel(X, Y, OTHER, OUT, MASK, H, Nx, Ny, D, A,
                sm_b, sm_h, sm_x, sm_y, tune_nx, tune_ny,
                MASK_KIND: tl.constexpr, MASK_SHAPE: tl.constexpr,
                BLOCK_X: tl.constexpr, BLOCK_Y: tl.constexpr, BLOCK_D: tl.constexpr,
                UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """OUT_x = lse_y(A x.y + OTHER_y) over the y taking part (natural log); 0 where none does."""
    A = tl.cast(A, tl.float32)  # inductor hands Python floats over as fp64 scalars: keep fp32 arithmetic
    pid = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)   # flattened batch-head; int64: a full mask's offsets pass 2^31
    Xh, Yh, Mh = X + bh * Nx * D, Y + bh * Ny * D, MASK + (bh // H) * sm_b + (bh % H) * sm_h
    offs_x = pid * BLOCK_X + tl.arange(0, BLOCK_X)
    offs_d = tl.arange(0, BLOCK_D)
    x = _load_rows(Xh, offs_x, Nx, offs_d, D)
    a2 = A * LOG2E
    m = tl.full([BLOCK_X], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_X], tl.float32)
    for y0 in range(0, Ny, BLOCK_Y):
        offs_y = y0 + tl.arange(0, BLOCK_Y)
        y = _load_rows(Yh, offs_y, Ny, offs_d, D)
        other = _load_vec(OTHER + bh * Ny, offs_y, Ny, float("-inf")) * LOG2E
        t = mm(x, tl.trans(y), UPCAST, PRECISION) * a2 + other[None, :]
        t = _apply_mask(t, Mh, offs_x, offs_y, Nx, Ny, sm_x, sm_y, MASK_KIND, MASK_SHAPE)
        m_new = tl.maximum(m, tl.max(t, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l = l * tl.exp2(m - m_safe) + tl.sum(tl.exp2(t - m_safe[:, None]), 1)
        m = m_new
    # l == 0: no y takes part. A NaN l (a NaN logit) stays NaN: it is not an empty row
    out = tl.where(l == 0, 0.0, (m + tl.log2(tl.where(l == 0, 1.0, l))) * LN2)
    tl.store(OUT + bh * Nx + offs_x, out, mask=offs_x < Nx)


@triton.jit
def _wsum_kernel(X, Y, XP, YP, W, OUT, MASK, H, Nx, Ny, D, A,
                 sm_b, sm_h, sm_x, sm_y, tune_nx, tune_ny,
                 MASK_KIND: tl.constexpr, MASK_SHAPE: tl.constexpr,
                BLOCK_X: tl.constexpr, BLOCK_Y: tl.constexpr, BLOCK_D: tl.constexpr,
                 UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """OUT_x = sum_y exp(A x.y + XP_x + YP_y) W_y. The callers' exponents are entries of a transport
    plan (<= 1 up to rounding), so no running maximum is needed."""
    A = tl.cast(A, tl.float32)  # inductor hands Python floats over as fp64 scalars: keep fp32 arithmetic
    pid = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)   # flattened batch-head; int64: a full mask's offsets pass 2^31
    Xh, Yh, Mh = X + bh * Nx * D, Y + bh * Ny * D, MASK + (bh // H) * sm_b + (bh % H) * sm_h
    offs_x = pid * BLOCK_X + tl.arange(0, BLOCK_X)
    offs_d = tl.arange(0, BLOCK_D)
    x = _load_rows(Xh, offs_x, Nx, offs_d, D)
    xp = _load_vec(XP + bh * Nx, offs_x, Nx, 0.0) * LOG2E
    a2 = A * LOG2E
    acc = tl.zeros([BLOCK_X], tl.float32)
    for y0 in range(0, Ny, BLOCK_Y):
        offs_y = y0 + tl.arange(0, BLOCK_Y)
        y = _load_rows(Yh, offs_y, Ny, offs_d, D)
        yp = _load_vec(YP + bh * Ny, offs_y, Ny, float("-inf")) * LOG2E
        w = _load_vec(W + bh * Ny, offs_y, Ny, 0.0)
        t = mm(x, tl.trans(y), UPCAST, PRECISION) * a2 + yp[None, :]
        t = _apply_mask(t, Mh, offs_x, offs_y, Nx, Ny, sm_x, sm_y, MASK_KIND, MASK_SHAPE)
        acc += tl.sum(tl.exp2(t + xp[:, None]) * w[None, :], 1)
    tl.store(OUT + bh * Nx + offs_x, acc, mask=offs_x < Nx)


@triton.jit
def _attend_kernel(X, Y, V, G, OUT, LSE, MASK, H, Nx, Ny, D, DV, A,
                   sm_b, sm_h, sm_x, sm_y, tune_nx, tune_ny,
                   MASK_KIND: tl.constexpr, MASK_SHAPE: tl.constexpr,
                BLOCK_X: tl.constexpr, BLOCK_Y: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_DV: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """The final row pass, X = q, Y = k: OUT_x = sum_y softmax_y(A x.y + G_y) V_y (online softmax,
    FlashAttention's forward with a per-key bias) and LSE_x of that softmax; zeros for an empty row."""
    A = tl.cast(A, tl.float32)  # inductor hands Python floats over as fp64 scalars: keep fp32 arithmetic
    pid = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)   # flattened batch-head; int64: a full mask's offsets pass 2^31
    Xh, Yh, Mh = X + bh * Nx * D, Y + bh * Ny * D, MASK + (bh // H) * sm_b + (bh % H) * sm_h
    Vh = V + bh * Ny * DV
    offs_x = pid * BLOCK_X + tl.arange(0, BLOCK_X)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    x = _load_rows(Xh, offs_x, Nx, offs_d, D)
    a2 = A * LOG2E
    m = tl.full([BLOCK_X], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_X], tl.float32)
    acc = tl.zeros([BLOCK_X, BLOCK_DV], tl.float32)
    for y0 in range(0, Ny, BLOCK_Y):
        offs_y = y0 + tl.arange(0, BLOCK_Y)
        y = _load_rows(Yh, offs_y, Ny, offs_d, D)
        g = _load_vec(G + bh * Ny, offs_y, Ny, float("-inf")) * LOG2E
        t = mm(x, tl.trans(y), UPCAST, PRECISION) * a2 + g[None, :]
        t = _apply_mask(t, Mh, offs_x, offs_y, Nx, Ny, sm_x, sm_y, MASK_KIND, MASK_SHAPE)
        m_new = tl.maximum(m, tl.max(t, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(t - m_safe[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = _load_rows(Vh, offs_y, Ny, offs_dv, DV)
        acc = acc * alpha[:, None] + mm(p.to(v.dtype), v, UPCAST, PRECISION)
        m = m_new
    nonempty = l != 0  # a NaN l (a NaN logit) stays NaN, it is not an empty row
    l_safe = tl.where(nonempty, l, 1.0)
    out = acc / l_safe[:, None]
    tl.store(LSE + bh * Nx + offs_x, tl.where(nonempty, (m + tl.log2(l_safe)) * LN2, 0.0), mask=offs_x < Nx)
    tl.store(OUT + bh * Nx * DV + offs_x[:, None] * DV + offs_dv[None, :], out.to(OUT.dtype.element_ty),
             mask=(offs_x[:, None] < Nx) & (offs_dv[None, :] < DV))


@triton.jit
def _row_dot_kernel(A, B, OUT, R, D, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """OUT_r = sum_d A_rd B_rd in float32 over R rows of width D (dout.out for the backward, |k|^2)."""
    offs_r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    a = _load_rows(A, offs_r, R, offs_d, D).to(tl.float32)
    b = _load_rows(B, offs_r, R, offs_d, D).to(tl.float32)
    tl.store(OUT + offs_r, tl.sum(a * b, 1), mask=offs_r < R)


@triton.jit
def _grad_v_kernel(X, Y, V, DO, G, LSE, DELTA, DVOUT, DG, MASK, H, Nx, Ny, D, DV, A,
                   sm_b, sm_h, sm_x, sm_y, tune_nx, tune_ny,
                   MASK_KIND: tl.constexpr, MASK_SHAPE: tl.constexpr,
                BLOCK_X: tl.constexpr, BLOCK_Y: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_DV: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """X = k (this program's keys), Y = q streamed. With the final plan P_yx = exp(A x.y + G_x - LSE_y):
    DVOUT_x = sum_y P_yx dout_y (in V's dtype) and DG_x = sum_y dS_yx = v_x . dV_x - sum_y P_yx DELTA_y,
    the adjoint of the last column potential (dS = P (dout.v - DELTA) summed over queries)."""
    A = tl.cast(A, tl.float32)  # inductor hands Python floats over as fp64 scalars: keep fp32 arithmetic
    pid = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)   # flattened batch-head; int64: a full mask's offsets pass 2^31
    Xh, Yh, Mh = X + bh * Nx * D, Y + bh * Ny * D, MASK + (bh // H) * sm_b + (bh % H) * sm_h
    offs_x = pid * BLOCK_X + tl.arange(0, BLOCK_X)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    x = _load_rows(Xh, offs_x, Nx, offs_d, D)
    g = _load_vec(G + bh * Nx, offs_x, Nx, float("-inf")) * LOG2E
    a2 = A * LOG2E
    dv = tl.zeros([BLOCK_X, BLOCK_DV], tl.float32)
    pd = tl.zeros([BLOCK_X], tl.float32)
    for y0 in range(0, Ny, BLOCK_Y):
        offs_y = y0 + tl.arange(0, BLOCK_Y)
        y = _load_rows(Yh, offs_y, Ny, offs_d, D)
        lse = _load_vec(LSE + bh * Ny, offs_y, Ny, float("inf")) * LOG2E
        t = mm(x, tl.trans(y), UPCAST, PRECISION) * a2 - lse[None, :]
        t = _apply_mask(t, Mh, offs_x, offs_y, Nx, Ny, sm_x, sm_y, MASK_KIND, MASK_SHAPE)
        p = tl.exp2(t + g[:, None])
        do = _load_rows(DO + bh * Ny * DV, offs_y, Ny, offs_dv, DV)
        dv += mm(p.to(do.dtype), do, UPCAST, PRECISION)
        pd += tl.sum(p * _load_vec(DELTA + bh * Ny, offs_y, Ny, 0.0)[None, :], 1)
    v = _load_rows(V + bh * Nx * DV, offs_x, Nx, offs_dv, DV).to(tl.float32)
    tl.store(DG + bh * Nx + offs_x, tl.sum(v * dv, 1) - pd, mask=offs_x < Nx)
    tl.store(DVOUT + bh * Nx * DV + offs_x[:, None] * DV + offs_dv[None, :], dv.to(DVOUT.dtype.element_ty),
             mask=(offs_x[:, None] < Nx) & (offs_dv[None, :] < DV))


@triton.jit
def _grad_qk_kernel(X, Y, V, DO, G, LSE, DELTA, FQ, HK, U, RHO, DF, T, DQ, DK, MASK, H, Nx, Ny, D, DV, A,
                    sm_b, sm_h, sm_x, sm_y, tune_nx, tune_ny,
                    L2: tl.constexpr, MASK_KIND: tl.constexpr, MASK_SHAPE: tl.constexpr,
                    BLOCK_X: tl.constexpr, BLOCK_Y: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """X = k (this program's keys), Y = q streamed (FlashAttention-2's backward layout). Per tile

        dL_yx = P_yx (dout_y . v_x - DELTA_y) - sum_t E^t_yx (U^t_x + RHO^t_x DF^t_y),
        E^t_yx = exp(A x.y + HK^t_x + FQ^t_y)

    (the unrolled adjoint's C^t dg^t + R^t df^t with one exponential per term: the host folds the
    larger of C^t and R^t into HK^t and the ratio, <= 1, into U^t / RHO^t); then
    DK_x = A (sum_y dL_yx q_y - [l2] k_x sum_y dL_yx)   (in K's dtype) and
    DQ_y += sum_x dL_yx k_x over all key blocks (float32 atomics; the host multiplies by A). The
    l2 term of dq, -q_y sum_x dL_yx, is omitted: every row of dL sums to zero (the outputs do not
    change when a constant is added to a row of logits), while the column sums are the adjoint
    of g^0 = -a|k|^2 and stay."""
    A = tl.cast(A, tl.float32)  # inductor hands Python floats over as fp64 scalars: keep fp32 arithmetic
    pid = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)   # flattened batch-head; int64: a full mask's offsets pass 2^31
    Xh, Yh, Mh = X + bh * Nx * D, Y + bh * Ny * D, MASK + (bh // H) * sm_b + (bh % H) * sm_h
    BH = tl.num_programs(1)
    offs_x = pid * BLOCK_X + tl.arange(0, BLOCK_X)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    x = _load_rows(Xh, offs_x, Nx, offs_d, D)
    v = _load_rows(V + bh * Nx * DV, offs_x, Nx, offs_dv, DV)
    g = _load_vec(G + bh * Nx, offs_x, Nx, float("-inf")) * LOG2E
    a2 = A * LOG2E
    dk = tl.zeros([BLOCK_X, BLOCK_D], tl.float32)
    colsum = tl.zeros([BLOCK_X], tl.float32)
    for y0 in range(0, Ny, BLOCK_Y):
        offs_y = y0 + tl.arange(0, BLOCK_Y)
        y = _load_rows(Yh, offs_y, Ny, offs_d, D)
        t = mm(x, tl.trans(y), UPCAST, PRECISION) * a2
        t = _apply_mask(t, Mh, offs_x, offs_y, Nx, Ny, sm_x, sm_y, MASK_KIND, MASK_SHAPE)
        lse = _load_vec(LSE + bh * Ny, offs_y, Ny, float("inf")) * LOG2E
        p = tl.exp2(t + g[:, None] - lse[None, :])
        do = _load_rows(DO + bh * Ny * DV, offs_y, Ny, offs_dv, DV)
        dp = mm(v, tl.trans(do), UPCAST, PRECISION)
        dl = p * (dp - _load_vec(DELTA + bh * Ny, offs_y, Ny, 0.0)[None, :])
        for it in range(T):
            ry = it * BH * Ny + bh * Ny
            rx = it * BH * Nx + bh * Nx
            fq = _load_vec(FQ + ry, offs_y, Ny, float("-inf")) * LOG2E
            hk = _load_vec(HK + rx, offs_x, Nx, float("-inf")) * LOG2E
            e = tl.exp2(t + hk[:, None] + fq[None, :])
            w = _load_vec(U + rx, offs_x, Nx, 0.0)[:, None] + \
                _load_vec(RHO + rx, offs_x, Nx, 0.0)[:, None] * _load_vec(DF + ry, offs_y, Ny, 0.0)[None, :]
            dl -= e * w
        dk += mm(dl.to(y.dtype), y, UPCAST, PRECISION)
        if L2:
            colsum += tl.sum(dl, 1)
        dq = mm(tl.trans(dl).to(x.dtype), x, UPCAST, PRECISION)
        tl.atomic_add(DQ + bh * Ny * D + offs_y[:, None] * D + offs_d[None, :], dq,
                      mask=(offs_y[:, None] < Ny) & (offs_d[None, :] < D), sem="relaxed")
    if L2:
        dk = A * (dk - x.to(tl.float32) * colsum[:, None])
    else:
        dk = A * dk
    tl.store(DK + bh * Nx * D + offs_x[:, None] * D + offs_d[None, :], dk.to(DK.dtype.element_ty),
             mask=(offs_x[:, None] < Nx) & (offs_d[None, :] < D))
