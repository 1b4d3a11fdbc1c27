"""Triton kernels of pointwise attention (FlashSigmoid's idea: no row statistics at all).

out_i = sum_j w_ij v_j with, for the keys taking part (mask, causal) and s_ij = scale q_i.k_j + mask_ij,
    sigmoid: w_ij = sigmoid(s_ij + b_i),  b_i = -log max(n_i, 1) (default), a scalar, or a per-row
             tensor (per head, or -log n + a learned per-head shift) with gradient db_i = sum_j dS_ij;
    relu:    w_ij = relu(s_ij) / max(n_i, 1),
and n_i the number of keys taking part in row i (counted in the kernel; stored for the backward).
Backward: dV = W^T dO, dW = dO V^T, dS = dW * f'(s), dq = scale dS K, dk = scale dS^T Q.
Dropout (DROPOUT flag): W becomes Z * W / (1 - p) with Z regenerated per tile from (seed, offset) by
ops/triton_dropout.py in every kernel, so dV = (Z * W / (1 - p))^T dO and dS = Z * (dO V^T) f'(s) / (1 - p)
(the bias gradient db_i = sum_j dS_ij included); n_i and b_i do not depend on Z. With DROPOUT False no
random number is drawn.
The eager version is ops/pointwise/reference.py.
"""
from __future__ import annotations

from ..triton_utils import HAVE_TRITON

BIAS_DEFAULT, BIAS_SCALAR, BIAS_ROWS = 0, 1, 2

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from ..triton_dropout import dropout_args, dropout_scale
    from ..triton_utils import causal_end, causal_start, mask_tile, mm

    @triton.jit
    def key_count(offs_m, Nq, Nk, mask_ptr, stride_mm, stride_mn, end_n,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASK_KIND: tl.constexpr, CAUSAL: tl.constexpr):
        """n_i: keys taking part in each row of the block (a pass over the mask only when there is one)."""
        if MASK_KIND == 0:
            if CAUSAL:
                n = tl.minimum(tl.maximum(offs_m + (Nk - Nq) + 1, 0), Nk)
            else:
                n = tl.zeros([BLOCK_M], tl.int32) + Nk
            return n.to(tl.float32)
        n = tl.zeros([BLOCK_M], tl.float32)
        for start_n in range(0, end_n, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            _, keep = mask_tile(tl.zeros([BLOCK_M, BLOCK_N], tl.float32), offs_m, offs_n, Nq, Nk,
                                mask_ptr, stride_mm, stride_mn, MASK_KIND, CAUSAL)
            n += tl.sum(keep.to(tl.float32), 1)
        return n

    @triton.jit
    def weights_tile(s, keep, bias, inv_n, SIGMOID: tl.constexpr):
        """(w, dw/ds) of one tile; both 0 where the key does not take part."""
        if SIGMOID:
            x = s + bias[:, None]
            e = tl.exp(-tl.abs(x))  # never overflows, unlike 1 / (1 + exp(-x)) at x = -1e4
            w = tl.where(x >= 0.0, 1.0 / (1.0 + e), e / (1.0 + e))
            dw = w * (1.0 - w)
        else:
            w = tl.maximum(s, 0.0) * inv_n[:, None]
            dw = tl.where(s > 0.0, inv_n[:, None] + tl.zeros_like(s), 0.0)
        return tl.where(keep, w, 0.0), tl.where(keep, dw, 0.0)

    @triton.jit
    def row_bias(n, BIAS, b, h, offs_m, Nq, sbb, sbh, sbm, bias_scalar, BIAS_MODE: tl.constexpr):
        """(b_i, 1/max(n_i, 1)) for the rows of the block from their key counts n_i."""
        n = tl.maximum(n, 1.0)
        if BIAS_MODE == 0:
            bias = -tl.log(n)
        elif BIAS_MODE == 1:
            bias = tl.zeros_like(n) + bias_scalar
        else:
            bias = tl.load(BIAS + b * sbb + h * sbh + offs_m * sbm, mask=offs_m < Nq, other=0.0).to(tl.float32)
        return bias, 1.0 / n

    @triton.jit
    def pointwise_fwd_kernel(
            Q, K, V, O, N_ROWS, MASK, BIAS, SEED,
            sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod,
            smb, smh, smm, smn, sbb, sbh, sbm,
            H, Nq, Nk, D, DV, scale, bias_scalar, dropout_p,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
            SIGMOID: tl.constexpr, BIAS_MODE: tl.constexpr, MASK_KIND: tl.constexpr, CAUSAL: tl.constexpr,
            UPCAST: tl.constexpr, PRECISION: tl.constexpr, DROPOUT: tl.constexpr):
        # inductor passes Python floats as fp64 scalars: keep the fp32 loop-carried types
        scale = tl.cast(scale, tl.float32)
        bias_scalar = tl.cast(bias_scalar, tl.float32)
        seed, dropout_p = dropout_args(SEED, dropout_p, DROPOUT)
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1).to(tl.int64)
        b = pid_bh // H
        h = pid_bh % H
        start_m = pid_m * BLOCK_M
        offs_m = start_m + tl.arange(0, BLOCK_M)
        offs_n0 = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        Q += b * sqb + h * sqh
        K += b * skb + h * skh
        V += b * svb + h * svh
        MASK += b * smb + h * smh
        end_n = causal_end(start_m, Nq, Nk, BLOCK_M, CAUSAL)

        n = key_count(offs_m, Nq, Nk, MASK, smm, smn, end_n, BLOCK_M, BLOCK_N, MASK_KIND, CAUSAL)
        tl.store(N_ROWS + pid_bh * Nq + offs_m, n, mask=offs_m < Nq)
        bias, inv_n = row_bias(n, BIAS, b, h, offs_m, Nq, sbb, sbh, sbm, bias_scalar, BIAS_MODE)
        q = tl.load(Q + offs_m[:, None] * sqm + offs_d[None, :] * sqd,
                    mask=(offs_m[:, None] < Nq) & (offs_d[None, :] < D), other=0.0)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
        for start_n in range(0, end_n, BLOCK_N):
            offs_n = start_n + offs_n0
            k = tl.load(K + offs_n[:, None] * skn + offs_d[None, :] * skd,
                        mask=(offs_n[:, None] < Nk) & (offs_d[None, :] < D), other=0.0)
            v = tl.load(V + offs_n[:, None] * svn + offs_dv[None, :] * svd,
                        mask=(offs_n[:, None] < Nk) & (offs_dv[None, :] < DV), other=0.0)
            s = scale * mm(q, tl.trans(k), UPCAST, PRECISION)
            s, keep = mask_tile(s, offs_m, offs_n, Nq, Nk, MASK, smm, smn, MASK_KIND, CAUSAL)
            w, _ = weights_tile(s, keep, bias, inv_n, SIGMOID)
            if DROPOUT:
                w = w * dropout_scale(seed, pid_bh, offs_m, offs_n, Nq, Nk, dropout_p)
            acc += mm(w.to(v.dtype), v, UPCAST, PRECISION)
        O += b * sob + h * soh
        tl.store(O + offs_m[:, None] * som + offs_dv[None, :] * sod, acc.to(O.dtype.element_ty),
                 mask=(offs_m[:, None] < Nq) & (offs_dv[None, :] < DV))

    @triton.jit
    def pointwise_bwd_dkdv_kernel(
            Q, K, V, DO, N_ROWS, MASK, BIAS, DK, DV_OUT, SEED,
            sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sdob, sdoh, sdom, sdod,
            smb, smh, smm, smn, sbb, sbh, sbm,
            H, Nq, Nk, D, DV, scale, bias_scalar, dropout_p,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
            SIGMOID: tl.constexpr, BIAS_MODE: tl.constexpr, MASK_KIND: tl.constexpr, CAUSAL: tl.constexpr,
            UPCAST: tl.constexpr, PRECISION: tl.constexpr, DROPOUT: tl.constexpr):
        # inductor passes Python floats as fp64 scalars: keep the fp32 loop-carried types
        scale = tl.cast(scale, tl.float32)
        bias_scalar = tl.cast(bias_scalar, tl.float32)
        seed, dropout_p = dropout_args(SEED, dropout_p, DROPOUT)
        pid_n = tl.program_id(0)
        pid_bh = tl.program_id(1).to(tl.int64)
        b = pid_bh // H
        h = pid_bh % H
        start_n = pid_n * BLOCK_N
        offs_n = start_n + tl.arange(0, BLOCK_N)
        offs_m0 = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        Q += b * sqb + h * sqh
        K += b * skb + h * skh
        V += b * svb + h * svh
        DO += b * sdob + h * sdoh
        MASK += b * smb + h * smh
        k = tl.load(K + offs_n[:, None] * skn + offs_d[None, :] * skd,
                    mask=(offs_n[:, None] < Nk) & (offs_d[None, :] < D), other=0.0)
        v = tl.load(V + offs_n[:, None] * svn + offs_dv[None, :] * svd,
                    mask=(offs_n[:, None] < Nk) & (offs_dv[None, :] < DV), other=0.0)
        dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
        for start_m in range(causal_start(start_n, Nq, Nk, BLOCK_M, CAUSAL), Nq, BLOCK_M):
            offs_m = start_m + offs_m0
            q = tl.load(Q + offs_m[:, None] * sqm + offs_d[None, :] * sqd,
                        mask=(offs_m[:, None] < Nq) & (offs_d[None, :] < D), other=0.0)
            do = tl.load(DO + offs_m[:, None] * sdom + offs_dv[None, :] * sdod,
                         mask=(offs_m[:, None] < Nq) & (offs_dv[None, :] < DV), other=0.0)
            n = tl.load(N_ROWS + pid_bh * Nq + offs_m, mask=offs_m < Nq, other=1.0)
            bias, inv_n = row_bias(n, BIAS, b, h, offs_m, Nq, sbb, sbh, sbm, bias_scalar, BIAS_MODE)
            s = scale * mm(q, tl.trans(k), UPCAST, PRECISION)
            s, keep = mask_tile(s, offs_m, offs_n, Nq, Nk, MASK, smm, smn, MASK_KIND, CAUSAL)
            w, dw = weights_tile(s, keep, bias, inv_n, SIGMOID)
            if DROPOUT:  # the same Z as the forward: same seed, same (b, h, i, j) offsets
                z = dropout_scale(seed, pid_bh, offs_m, offs_n, Nq, Nk, dropout_p)
                w = w * z
                dw = dw * z
            dv += mm(tl.trans(w.to(do.dtype)), do, UPCAST, PRECISION)
            ds = mm(do, tl.trans(v), UPCAST, PRECISION) * dw
            dk += mm(tl.trans(ds.to(q.dtype)), q, UPCAST, PRECISION)
        dk = scale * dk
        DK += pid_bh * Nk * D  # gradients are written contiguous (B, H, N, D)
        DV_OUT += pid_bh * Nk * DV
        tl.store(DK + offs_n[:, None] * D + offs_d[None, :], dk.to(DK.dtype.element_ty),
                 mask=(offs_n[:, None] < Nk) & (offs_d[None, :] < D))
        tl.store(DV_OUT + offs_n[:, None] * DV + offs_dv[None, :], dv.to(DV_OUT.dtype.element_ty),
                 mask=(offs_n[:, None] < Nk) & (offs_dv[None, :] < DV))

    @triton.jit
    def pointwise_bwd_dq_kernel(
            Q, K, V, DO, N_ROWS, MASK, BIAS, DQ, DBIAS, SEED,
            sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sdob, sdoh, sdom, sdod,
            smb, smh, smm, smn, sbb, sbh, sbm,
            H, Nq, Nk, D, DV, scale, bias_scalar, dropout_p,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
            SIGMOID: tl.constexpr, BIAS_MODE: tl.constexpr, MASK_KIND: tl.constexpr, CAUSAL: tl.constexpr,
            UPCAST: tl.constexpr, PRECISION: tl.constexpr, DROPOUT: tl.constexpr):
        # inductor passes Python floats as fp64 scalars: keep the fp32 loop-carried types
        scale = tl.cast(scale, tl.float32)
        bias_scalar = tl.cast(bias_scalar, tl.float32)
        seed, dropout_p = dropout_args(SEED, dropout_p, DROPOUT)
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1).to(tl.int64)
        b = pid_bh // H
        h = pid_bh % H
        start_m = pid_m * BLOCK_M
        offs_m = start_m + tl.arange(0, BLOCK_M)
        offs_n0 = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        Q += b * sqb + h * sqh
        K += b * skb + h * skh
        V += b * svb + h * svh
        DO += b * sdob + h * sdoh
        MASK += b * smb + h * smh
        q = tl.load(Q + offs_m[:, None] * sqm + offs_d[None, :] * sqd,
                    mask=(offs_m[:, None] < Nq) & (offs_d[None, :] < D), other=0.0)
        do = tl.load(DO + offs_m[:, None] * sdom + offs_dv[None, :] * sdod,
                     mask=(offs_m[:, None] < Nq) & (offs_dv[None, :] < DV), other=0.0)
        n = tl.load(N_ROWS + pid_bh * Nq + offs_m, mask=offs_m < Nq, other=1.0)
        bias, inv_n = row_bias(n, BIAS, b, h, offs_m, Nq, sbb, sbh, sbm, bias_scalar, BIAS_MODE)
        dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        dbias = tl.zeros([BLOCK_M], tl.float32)
        for start_n in range(0, causal_end(start_m, Nq, Nk, BLOCK_M, CAUSAL), BLOCK_N):
            offs_n = start_n + offs_n0
            k = tl.load(K + offs_n[:, None] * skn + offs_d[None, :] * skd,
                        mask=(offs_n[:, None] < Nk) & (offs_d[None, :] < D), other=0.0)
            v = tl.load(V + offs_n[:, None] * svn + offs_dv[None, :] * svd,
                        mask=(offs_n[:, None] < Nk) & (offs_dv[None, :] < DV), other=0.0)
            s = scale * mm(q, tl.trans(k), UPCAST, PRECISION)
            s, keep = mask_tile(s, offs_m, offs_n, Nq, Nk, MASK, smm, smn, MASK_KIND, CAUSAL)
            _, dw = weights_tile(s, keep, bias, inv_n, SIGMOID)
            if DROPOUT:
                dw = dw * dropout_scale(seed, pid_bh, offs_m, offs_n, Nq, Nk, dropout_p)
            ds = mm(do, tl.trans(v), UPCAST, PRECISION) * dw
            dq += mm(ds.to(k.dtype), k, UPCAST, PRECISION)
            dbias += tl.sum(ds, 1)
        dq = scale * dq
        DQ += pid_bh * Nq * D  # contiguous (B, H, Nq, D)
        tl.store(DQ + offs_m[:, None] * D + offs_d[None, :], dq.to(DQ.dtype.element_ty),
                 mask=(offs_m[:, None] < Nq) & (offs_d[None, :] < D))
        if BIAS_MODE == 2:
            tl.store(DBIAS + pid_bh * Nq + offs_m, dbias, mask=offs_m < Nq)
