"""Triton kernels of the softmax family (FlashAttention-2 tiling): forward, dK/dV, dQ.

One kernel computes softmax_j(l_ij) v_j for the logits
    l_ij = scale * q_i . k_j                                   (plain, Fenchel first order with scale*alpha)
    l_ij = -scale * ||q_i - k_j||^2                             (L2 = True, via row and column norms)
plus, chosen by constexpr flags, a float attn_mask, a per-key log-preference g_j (B, H, Nk) and a
T5 relative-position bias table[bucket(j - i), h]. Keys that do not take part (bounds, causal,
bool mask, -inf in the float mask or in g) get -inf; a row with no key left outputs zeros and
stores lse = +inf so the backward sees p = 0 there (never NaN).

Backward (FlashAttention-2): with P = exp(l - lse) recomputed per tile and delta_i = dO_i . O_i,
dV = P^T dO, dS = P * (dO V^T - delta), and dS flows into
    dq_i = scale * sum_j dS_ij k_j             dk_j = scale * sum_i dS_ij q_i          (plain)
    dq_i = 2 scale (sum_j dS_ij k_j - q_i sum_j dS_ij)
    dk_j = 2 scale (sum_i dS_ij q_i - k_j sum_i dS_ij)                                (L2)
    dg_j = sum_i dS_ij,      dtable[b, h] = sum over (i, j) with bucket(j - i) = b of dS_ij.
Dropout (DROPOUT flag, FlashAttention's way): P and lse are the undropped softmax; the forward
accumulates out = sum_j Z_ij P_ij v_j / (1 - p) with Z regenerated per tile from (seed, offset) by
ops/triton_dropout.py, and the backward regenerates the same Z:
    dV = (Z * P / (1 - p))^T dO,   dP = Z * (dO V^T) / (1 - p),   dS = P * (dP - delta).
delta_i = dO_i . O_i still holds: the softmax backward needs sum_k P_ik dP_ik, and
    sum_k P_ik Z_ik (dO_i . v_k) / (1 - p) = dO_i . sum_k (Z_ik P_ik / (1 - p)) v_k = dO_i . O_i
because O_i is exactly that dropped, rescaled sum. With DROPOUT False no random number is drawn.
The readable eager version of each formula is ops/softmax/reference.py, ops/l2/reference.py,
ops/fenchel/reference.py and ops/fenchel/t5_reference.py.
"""
from __future__ import annotations

from ..triton_utils import HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from ..triton_dropout import dropout_args, dropout_scale
    from ..triton_utils import causal_end, causal_start, mask_tile, mm

    @triton.jit
    def logits_tile(qk, q_sq, k_sq, offs_m, offs_n, Nq, Nk, scale,
                    mask_ptr, stride_mm, stride_mn, pref_ptr, stride_pn, table_ptr, stride_tb, lut_ptr,
                    L2: tl.constexpr, MASK_KIND: tl.constexpr, HAS_PREF: tl.constexpr,
                    HAS_T5: tl.constexpr, CAUSAL: tl.constexpr):
        """Logits of one tile with -inf where the key does not take part."""
        if L2:
            s = scale * (2.0 * qk - q_sq[:, None] - k_sq[None, :])
        else:
            s = scale * qk
        s, keep = mask_tile(s, offs_m, offs_n, Nq, Nk, mask_ptr, stride_mm, stride_mn, MASK_KIND, CAUSAL)
        if HAS_PREF:
            g = tl.load(pref_ptr + offs_n * stride_pn, mask=offs_n < Nk, other=0.0).to(tl.float32)
            keep = keep & (g > float("-inf"))[None, :]
            s = s + tl.where(keep, g[None, :], 0.0)
        if HAS_T5:
            # offset j - i with the bottom-right shift, as an index into the (Nq + Nk - 1) bucket LUT
            rel = offs_n[None, :] - offs_m[:, None] + (Nq - 1)
            bucket = tl.load(lut_ptr + rel, mask=keep, other=0)
            s = s + tl.load(table_ptr + bucket * stride_tb, mask=keep, other=0.0).to(tl.float32)
        return tl.where(keep, s, float("-inf"))

    @triton.jit
    def softmax_fwd_kernel(
            Q, K, V, O, LSE, MASK, PREF, TABLE, LUT, SEED,
            sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod,
            smb, smh, smm, smn, spb, sph, spn, stb, sth,
            H, Nq, Nk, D, DV, scale, dropout_p,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
            L2: tl.constexpr, MASK_KIND: tl.constexpr, HAS_PREF: tl.constexpr, HAS_T5: tl.constexpr,
            CAUSAL: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, DROPOUT: tl.constexpr):
        # inductor passes Python floats as fp64 scalars: keep the fp32 loop-carried types
        scale = tl.cast(scale, tl.float32)
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
        PREF += b * spb + h * sph
        TABLE += h * sth

        q = tl.load(Q + offs_m[:, None] * sqm + offs_d[None, :] * sqd,
                    mask=(offs_m[:, None] < Nq) & (offs_d[None, :] < D), other=0.0)
        q_sq = tl.sum(q.to(tl.float32) * q.to(tl.float32), 1)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
        end_n = causal_end(start_m, Nq, Nk, BLOCK_M, CAUSAL)  # block skipping above the diagonal
        for start_n in range(0, end_n, BLOCK_N):
            offs_n = start_n + offs_n0
            k = tl.load(K + offs_n[:, None] * skn + offs_d[None, :] * skd,
                        mask=(offs_n[:, None] < Nk) & (offs_d[None, :] < D), other=0.0)
            v = tl.load(V + offs_n[:, None] * svn + offs_dv[None, :] * svd,
                        mask=(offs_n[:, None] < Nk) & (offs_dv[None, :] < DV), other=0.0)
            k_sq = tl.sum(k.to(tl.float32) * k.to(tl.float32), 1)
            qk = mm(q, tl.trans(k), UPCAST, PRECISION)
            s = logits_tile(qk, q_sq, k_sq, offs_m, offs_n, Nq, Nk, scale, MASK, smm, smn, PREF, spn,
                            TABLE, stb, LUT, L2, MASK_KIND, HAS_PREF, HAS_T5, CAUSAL)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet: exp(-inf) = 0
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)  # the normaliser sums the undropped weights
            if DROPOUT:
                p = p * dropout_scale(seed, pid_bh, offs_m, offs_n, Nq, Nk, dropout_p)
            acc = acc * alpha[:, None] + mm(p.to(v.dtype), v, UPCAST, PRECISION)
            m_i = m_new
        nonempty = l_i > 0.0
        out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
        lse = tl.where(nonempty, m_i + tl.log(tl.where(nonempty, l_i, 1.0)), float("inf"))
        O += b * sob + h * soh
        tl.store(O + offs_m[:, None] * som + offs_dv[None, :] * sod, out.to(O.dtype.element_ty),
                 mask=(offs_m[:, None] < Nq) & (offs_dv[None, :] < DV))
        tl.store(LSE + pid_bh * Nq + offs_m, lse, mask=offs_m < Nq)

    @triton.jit
    def softmax_bwd_dkdv_kernel(
            Q, K, V, DO, LSE, DELTA, DK, DV_OUT, DPREF, DTABLE, MASK, PREF, TABLE, LUT, SEED,
            sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sdob, sdoh, sdom, sdod,
            smb, smh, smm, smn, spb, sph, spn, stb, sth,
            H, Nq, Nk, D, DV, scale, dropout_p,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
            L2: tl.constexpr, MASK_KIND: tl.constexpr, HAS_PREF: tl.constexpr, HAS_T5: tl.constexpr,
            CAUSAL: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, DROPOUT: tl.constexpr):
        # inductor passes Python floats as fp64 scalars: keep the fp32 loop-carried types
        scale = tl.cast(scale, tl.float32)
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
        PREF += b * spb + h * sph
        TABLE += h * sth
        DTABLE += h * sth
        LSE += pid_bh * Nq
        DELTA += pid_bh * Nq

        k = tl.load(K + offs_n[:, None] * skn + offs_d[None, :] * skd,
                    mask=(offs_n[:, None] < Nk) & (offs_d[None, :] < D), other=0.0)
        v = tl.load(V + offs_n[:, None] * svn + offs_dv[None, :] * svd,
                    mask=(offs_n[:, None] < Nk) & (offs_dv[None, :] < DV), other=0.0)
        k_sq = tl.sum(k.to(tl.float32) * k.to(tl.float32), 1)
        dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
        ds_colsum = tl.zeros([BLOCK_N], tl.float32)
        for start_m in range(causal_start(start_n, Nq, Nk, BLOCK_M, CAUSAL), Nq, BLOCK_M):
            offs_m = start_m + offs_m0
            q = tl.load(Q + offs_m[:, None] * sqm + offs_d[None, :] * sqd,
                        mask=(offs_m[:, None] < Nq) & (offs_d[None, :] < D), other=0.0)
            do = tl.load(DO + offs_m[:, None] * sdom + offs_dv[None, :] * sdod,
                         mask=(offs_m[:, None] < Nq) & (offs_dv[None, :] < DV), other=0.0)
            lse = tl.load(LSE + offs_m, mask=offs_m < Nq, other=float("inf"))
            delta = tl.load(DELTA + offs_m, mask=offs_m < Nq, other=0.0)
            q_sq = tl.sum(q.to(tl.float32) * q.to(tl.float32), 1)
            qk = mm(q, tl.trans(k), UPCAST, PRECISION)
            s = logits_tile(qk, q_sq, k_sq, offs_m, offs_n, Nq, Nk, scale, MASK, smm, smn, PREF, spn,
                            TABLE, stb, LUT, L2, MASK_KIND, HAS_PREF, HAS_T5, CAUSAL)
            p = tl.exp(s - lse[:, None])  # -inf logits and +inf lse (empty rows) both give 0
            dp = mm(do, tl.trans(v), UPCAST, PRECISION)
            if DROPOUT:  # the same Z as the forward: same seed, same (b, h, i, j) offsets
                z = dropout_scale(seed, pid_bh, offs_m, offs_n, Nq, Nk, dropout_p)
                dv += mm(tl.trans((p * z).to(do.dtype)), do, UPCAST, PRECISION)
                dp = dp * z
            else:
                dv += mm(tl.trans(p.to(do.dtype)), do, UPCAST, PRECISION)
            ds = p * (dp - delta[:, None])
            dk += mm(tl.trans(ds.to(q.dtype)), q, UPCAST, PRECISION)
            ds_colsum += tl.sum(ds, 0)
            if HAS_T5:
                keep = s > float("-inf")
                rel = offs_n[None, :] - offs_m[:, None] + (Nq - 1)
                # Every atomic address is computed from the LUT load alone, not from `keep`: inductor's
                # mutation analysis follows an atomic's address back through everything it is computed
                # from, and an address derived from `keep` made it mark TABLE, LUT, MASK and PREF as
                # written (saved inputs of the backward, the table a parameter). The load's sentinel
                # (`other`) marks the keys that do not take part, so the tile's bucket range needs no `keep`.
                loaded = tl.load(LUT + rel, mask=keep, other=2147483647)
                absent = loaded == 2147483647
                bucket = tl.where(absent, 0, loaded)
                lo = tl.min(loaded)
                hi = tl.max(tl.where(absent, -1, loaded))
                if lo == hi:  # far from the diagonal the whole tile is one bucket: one atomic
                    tl.atomic_add(DTABLE + lo * stb, tl.sum(tl.sum(ds, 1), 0))
                elif lo <= hi:
                    tl.atomic_add(DTABLE + bucket * stb, ds, mask=keep)
        if L2:
            dk = 2.0 * scale * (dk - k.to(tl.float32) * ds_colsum[:, None])
        else:
            dk = scale * dk
        # gradients are written contiguous (B, H, N, D)
        DK += pid_bh * Nk * D
        DV_OUT += pid_bh * Nk * DV
        tl.store(DK + offs_n[:, None] * D + offs_d[None, :], dk.to(DK.dtype.element_ty),
                 mask=(offs_n[:, None] < Nk) & (offs_d[None, :] < D))
        tl.store(DV_OUT + offs_n[:, None] * DV + offs_dv[None, :], dv.to(DV_OUT.dtype.element_ty),
                 mask=(offs_n[:, None] < Nk) & (offs_dv[None, :] < DV))
        if HAS_PREF:
            tl.store(DPREF + pid_bh * Nk + offs_n, ds_colsum, mask=offs_n < Nk)

    @triton.jit
    def softmax_bwd_dq_kernel(
            Q, K, V, DO, LSE, DELTA, DQ, MASK, PREF, TABLE, LUT, SEED,
            sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sdob, sdoh, sdom, sdod,
            smb, smh, smm, smn, spb, sph, spn, stb, sth,
            H, Nq, Nk, D, DV, scale, dropout_p,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
            L2: tl.constexpr, MASK_KIND: tl.constexpr, HAS_PREF: tl.constexpr, HAS_T5: tl.constexpr,
            CAUSAL: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, DROPOUT: tl.constexpr):
        # inductor passes Python floats as fp64 scalars: keep the fp32 loop-carried types
        scale = tl.cast(scale, tl.float32)
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
        PREF += b * spb + h * sph
        TABLE += h * sth

        q = tl.load(Q + offs_m[:, None] * sqm + offs_d[None, :] * sqd,
                    mask=(offs_m[:, None] < Nq) & (offs_d[None, :] < D), other=0.0)
        do = tl.load(DO + offs_m[:, None] * sdom + offs_dv[None, :] * sdod,
                     mask=(offs_m[:, None] < Nq) & (offs_dv[None, :] < DV), other=0.0)
        lse = tl.load(LSE + pid_bh * Nq + offs_m, mask=offs_m < Nq, other=float("inf"))
        delta = tl.load(DELTA + pid_bh * Nq + offs_m, mask=offs_m < Nq, other=0.0)
        q_sq = tl.sum(q.to(tl.float32) * q.to(tl.float32), 1)
        dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        ds_rowsum = tl.zeros([BLOCK_M], tl.float32)
        for start_n in range(0, causal_end(start_m, Nq, Nk, BLOCK_M, CAUSAL), BLOCK_N):
            offs_n = start_n + offs_n0
            k = tl.load(K + offs_n[:, None] * skn + offs_d[None, :] * skd,
                        mask=(offs_n[:, None] < Nk) & (offs_d[None, :] < D), other=0.0)
            v = tl.load(V + offs_n[:, None] * svn + offs_dv[None, :] * svd,
                        mask=(offs_n[:, None] < Nk) & (offs_dv[None, :] < DV), other=0.0)
            k_sq = tl.sum(k.to(tl.float32) * k.to(tl.float32), 1)
            qk = mm(q, tl.trans(k), UPCAST, PRECISION)
            s = logits_tile(qk, q_sq, k_sq, offs_m, offs_n, Nq, Nk, scale, MASK, smm, smn, PREF, spn,
                            TABLE, stb, LUT, L2, MASK_KIND, HAS_PREF, HAS_T5, CAUSAL)
            p = tl.exp(s - lse[:, None])
            dp = mm(do, tl.trans(v), UPCAST, PRECISION)
            if DROPOUT:
                dp = dp * dropout_scale(seed, pid_bh, offs_m, offs_n, Nq, Nk, dropout_p)
            ds = p * (dp - delta[:, None])
            dq += mm(ds.to(k.dtype), k, UPCAST, PRECISION)
            ds_rowsum += tl.sum(ds, 1)
        if L2:  # the -scale ||q||^2 term: its gradient is -2 scale q sum_j dS_ij (zero up to rounding)
            dq = 2.0 * scale * (dq - q.to(tl.float32) * ds_rowsum[:, None])
        else:
            dq = scale * dq
        DQ += pid_bh * Nq * D  # contiguous (B, H, Nq, D)
        tl.store(DQ + offs_m[:, None] * D + offs_d[None, :], dq.to(DQ.dtype.element_ty),
                 mask=(offs_m[:, None] < Nq) & (offs_d[None, :] < D))
