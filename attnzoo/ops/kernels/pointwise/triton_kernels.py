"""Triton kernels of pointwise attention (FlashSigmoid's idea: no row statistics at all).

out_i = sum_j w_ij v_j with, for the keys taking part (mask, causal) and s_ij = scale q_i.k_j + mask_ij,
    sigmoid: w_ij = sigmoid(s_ij + b_i),  b_i = -log max(n_i, 1) (default), a scalar, or a per-row
             tensor (per head, or -log n + a learned per-head shift) with gradient db_i = sum_j dS_ij;
    relu:    w_ij = relu(s_ij) / max(n_i, 1),
and n_i the number of keys taking part in row i (counted in the kernel; stored for the backward).
Keys that do not take part get s = -inf, which both weights map to w = 0 and dw/ds = 0.
Backward: dV = W^T dO, dW = dO V^T, dS = dW * f'(s), dq = scale dS K, dk = scale dS^T Q.
Dropout (DROPOUT flag): W becomes Z * W / (1 - p) with Z regenerated per tile from (seed, offset) by
ops/triton_dropout.py in every kernel, so dV = (Z * W / (1 - p))^T dO and dS = Z * (dO V^T) f'(s) / (1 - p)
(the bias gradient db_i = sum_j dS_ij included); n_i and b_i do not depend on Z. With DROPOUT False no
random number is drawn.

The sigmoid (SIGMOID_IMPL) is the throughput limit of these kernels: one transcendental per weight
against two small dots. Three evaluations, all overflow-free at logits of +-1e4:
    0 exact:  e = exp(-|x|), w = 1 / (1 + e) or e / (1 + e) (IEEE division); fp32 inputs and the interpreter;
    1 tanh:   w = 0.5 tanh(0.5 x) + 0.5 on the hardware tanh (PTX tanh.approx.f32, FlashSigmoid's trick):
              one MUFU op and two FMAs, max relative error of tanh 2^-10.987 (PTX ISA), i.e. an absolute
              error of up to ~2.4e-4 in w, large next to w itself where sigmoid(x) << 1;
    2 exp2:   e = exp2(-|x| log2(e)) (one MUFU op), 1 / (1 + e) by two Newton steps from a linear guess
              on [1, 2] (FMAs only, relative error < 2e-5), w = r or e r: accurate for small w too.
VARLEN (packed sequences, kernels/pointwise/varlen.py): as in the softmax-family kernels, the program's
batch index is its sequence, whose start and lengths it reads from the offsets at its entry; n_i is then
counted within the sequence, so relu's 1/n and sigmoid's -log n are per sequence.
Loops run in stages as in the softmax-family kernels: whole, in-bounds blocks below the causal
diagonal without masking arithmetic; the dK/dV kernel works on transposed (keys x queries) tiles.
Softcap (SOFTCAP, the cap as a constexpr, 0.0 none): s = softcap tanh(scale q.k / softcap) + mask, and
dS is multiplied by the slope 1 - tanh^2 on its way to dq, dk (after the bias gradient, which sees the
capped logit).
Window (WINDOW, ops/triton_logit_extras.py): the band's offsets (left, right; causality folded in by
the host as right <= 0) replace CAUSAL; a query block walks only the key blocks that meet its rows'
bands (``band_keys``), a key block of the dK/dV kernel only the query blocks whose bands meet it
(``band_queries``), and only the band's edge blocks are masked; n_i counts the keys in the band.
The eager version is ops/kernels/pointwise/reference.py.
"""
from __future__ import annotations

from ...triton_utils import HAVE_TRITON

BIAS_DEFAULT, BIAS_SCALAR, BIAS_ROWS = 0, 1, 2
SIGMOID_EXACT, SIGMOID_TANH, SIGMOID_EXP2 = 0, 1, 2

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from ...triton_dropout import dropout_args, dropout_scale_at
    from ...triton_logit_extras import band_keys, band_queries, in_band, softcap_tile
    from ...triton_utils import (causal_end, key_block, load_rows, load_tile, mask_tile, mm, mma, packed_sequence,
                                query_block, store_tile, tile_logits, visible_keys, visible_queries)

    LOG2E = tl.constexpr(1.4426950408889634)

    @triton.jit
    def key_count(offs_m, Nq, Nk, mask_ptr, stride_mm, stride_mn, start_n, end_n, left, right,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASK_KIND: tl.constexpr, CAUSAL: tl.constexpr,
                  WINDOW: tl.constexpr):
        """n_i: keys taking part in each row of the block (a pass over the mask's blocks [start_n, end_n)
        only when there is one; under a window, the keys of the band)."""
        if MASK_KIND == 0:
            if WINDOW:
                diag = offs_m + (Nk - Nq)
                n = tl.maximum(tl.minimum(diag + right, Nk - 1) - tl.maximum(diag - left, 0) + 1, 0)
            elif CAUSAL:
                n = tl.minimum(tl.maximum(offs_m + (Nk - Nq) + 1, 0), Nk)
            else:
                n = tl.zeros([BLOCK_M], tl.int32) + Nk
            return n.to(tl.float32)
        n = tl.zeros([BLOCK_M], tl.float32)
        for block_n in range(start_n, end_n, BLOCK_N):
            offs_n = block_n + tl.arange(0, BLOCK_N)
            _, keep = mask_tile(tl.zeros([BLOCK_M, BLOCK_N], tl.float32), offs_m, offs_n, Nq, Nk,
                                mask_ptr, stride_mm, stride_mn, MASK_KIND, CAUSAL)
            if WINDOW:
                keep = keep & in_band(offs_m[:, None], offs_n[None, :], Nq, Nk, left, right)
            n += tl.sum(keep.to(tl.float32), 1)
        return n

    @triton.jit
    def fast_tanh(x):
        """tanh on the SFU (PTX tanh.approx.f32, sm_75+)."""
        return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)

    @triton.jit
    def sigmoid(x, IMPL: tl.constexpr):
        """sigmoid(x) in fp32 by the evaluation IMPL (module docstring); 0 at x = -inf."""
        if IMPL == 1:
            w = 0.5 * fast_tanh(0.5 * x) + 0.5
        elif IMPL == 2:
            e = tl.math.exp2(-tl.abs(x) * LOG2E)  # in [0, 1]
            d = 1.0 + e  # in [1, 2]
            r = 1.411764705882353 - 0.47058823529411764 * d  # 24/17 - 8/17 d: 1/d within 1/17
            r = r + r * (1.0 - d * r)  # each Newton step squares the relative error
            r = r + r * (1.0 - d * r)
            w = tl.where(x >= 0.0, r, e * r)
        else:
            e = tl.exp(-tl.abs(x))  # never overflows, unlike 1 / (1 + exp(-x)) at x = -1e4
            w = tl.where(x >= 0.0, 1.0 / (1.0 + e), e / (1.0 + e))
        return w

    @triton.jit
    def weights(s, bias, inv_n, SIGMOID: tl.constexpr, SIGMOID_IMPL: tl.constexpr):
        """(w, dw/ds) of one tile from scores s (-inf for keys that do not take part: w = dw = 0) and
        per-row bias / 1/n broadcast to the tile."""
        if SIGMOID:
            w = sigmoid(s + bias, SIGMOID_IMPL)
            dw = w * (1.0 - w)
        else:
            # relu that keeps NaN (tl.maximum(NaN, 0) is 0): a NaN score reaches its row, as in torch
            w = tl.where(s > 0.0, s, tl.where(s == s, 0.0, s)) * inv_n
            dw = tl.where(s > 0.0, inv_n, 0.0)
        return w, dw

    @triton.jit
    def row_bias(n, BIAS, b, h, offs_m, Nq, sbb, sbh, sbm, bias_scalar, BIAS_MODE: tl.constexpr,
                 BOUND: tl.constexpr):
        """(b_i, 1/max(n_i, 1)) for the rows of the block from their key counts n_i."""
        n = tl.maximum(n, 1.0)
        if BIAS_MODE == 0:
            bias = -tl.log(n)
        elif BIAS_MODE == 1:
            bias = tl.zeros_like(n) + bias_scalar
        else:
            rows = BIAS + b * sbb + h * sbh + offs_m * sbm
            if BOUND:
                bias = tl.load(rows, mask=offs_m < Nq, other=0.0).to(tl.float32)
            else:
                bias = tl.load(rows).to(tl.float32)
        return bias, 1.0 / n

    @triton.jit
    def key_tile_scores(q, k, offs_m, offs_n, qi_at, Nq, Nk, scale, mask_ptr, stride_mm, stride_mn, softcap, left,
                        right, MASK_KIND: tl.constexpr, MASK_SHAPE: tl.constexpr, CAUSAL: tl.constexpr,
                        EDGE: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, SOFTCAP: tl.constexpr,
                        BAND: tl.constexpr):
        """((BLOCK_M, BLOCK_N) scores s = cap(scale q.k) + mask, -inf where the key does not take part
        (BAND: outside the window's band too), the cap's slope (1.0 without SOFTCAP))."""
        s = mm(q, tl.trans(k), UPCAST, PRECISION) * scale
        if SOFTCAP > 0:
            s, slope = softcap_tile(s, softcap)
        else:
            slope = 1.0
        if EDGE:
            kj_at = tl.minimum(offs_n, Nk - 1)
        else:
            kj_at = offs_n
        s = tile_logits(s, offs_m[:, None], offs_n[None, :], qi_at[:, None], kj_at[None, :], Nq, Nk,
                        mask_ptr, stride_mm, stride_mn, 1.0, MASK_KIND, MASK_SHAPE, CAUSAL and EDGE, EDGE)
        if BAND:
            s = tl.where(in_band(offs_m[:, None], offs_n[None, :], Nq, Nk, left, right), s, float("-inf"))
        return s, slope

    @triton.jit
    def fwd_stage(acc, q, bias, inv_n, K, V, skn, skd, svn, svd, offs_m, qi_at, offs_d, offs_dv, lo, hi, gap_at, gap,
                  Nq, Nk, D, DV, scale, MASK, smm, smn, seed, pid_bh, dropout_p, softcap, left, right,
                  BLOCK_N: tl.constexpr, SIGMOID: tl.constexpr, SIGMOID_IMPL: tl.constexpr, MASK_KIND: tl.constexpr,
                  MASK_SHAPE: tl.constexpr,
                  CAUSAL: tl.constexpr, HEAD_MASK: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                  DROPOUT: tl.constexpr, EDGE: tl.constexpr, SOFTCAP: tl.constexpr, BAND: tl.constexpr):
        for start_n in range(lo, hi - gap, BLOCK_N):
            if BAND:  # the band's two edges in one loop: from gap_at on, blocks jump over the inside
                start_n = tl.where(start_n < gap_at, start_n, start_n + gap)
            start_n = tl.multiple_of(start_n, BLOCK_N)
            offs_n = start_n + tl.arange(0, BLOCK_N)
            k = load_tile(K, offs_n, offs_d, skn, skd, Nk, D, EDGE, HEAD_MASK)
            v = load_tile(V, offs_n, offs_dv, svn, svd, Nk, DV, EDGE, HEAD_MASK)
            s, _ = key_tile_scores(q, k, offs_m, offs_n, qi_at, Nq, Nk, scale, MASK, smm, smn, softcap, left, right,
                                   MASK_KIND, MASK_SHAPE, CAUSAL, EDGE, UPCAST, PRECISION, SOFTCAP, BAND)
            w, _ = weights(s, bias[:, None], inv_n[:, None], SIGMOID, SIGMOID_IMPL)
            if DROPOUT:
                w = w * dropout_scale_at(seed, pid_bh, offs_m[:, None], offs_n[None, :], Nq, Nk, dropout_p)
            acc = mma(w.to(v.dtype), v, acc, UPCAST, PRECISION)
        return acc

    @triton.jit
    def pointwise_fwd_kernel(
            Q, K, V, O, N_ROWS, MASK, BIAS, SEED,
            sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod,
            smb, smh, smm, smn, sbb, sbh, sbm, H, Nq, Nk, D, DV, GROUP, tune_nq, tune_nk, scale, bias_scalar,
            window_left, window_right,
            dropout_p,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
            SIGMOID: tl.constexpr, SIGMOID_IMPL: tl.constexpr, BIAS_MODE: tl.constexpr, MASK_KIND: tl.constexpr,
            MASK_SHAPE: tl.constexpr,
            SOFTCAP: tl.constexpr, WINDOW: tl.constexpr,
            CAUSAL: tl.constexpr, HEAD_MASK: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
            DROPOUT: tl.constexpr, CU_Q=None, CU_K=None, VARLEN: tl.constexpr = False):
        # tune_nq / tune_nk: the autotuning key's length buckets (ops/triton_tuning.py), unused here.
        # inductor passes Python floats as fp64 scalars: keep the fp32 loop-carried types
        scale = tl.cast(scale, tl.float32)
        bias_scalar = tl.cast(bias_scalar, tl.float32)
        softcap = SOFTCAP  # a constexpr (one model has one cap); 0.0: none
        seed, dropout_p = dropout_args(SEED, dropout_p, DROPOUT)
        pid_bh, b, h, start_m, offs_m, qi_at, offs_d, offs_dv = query_block(H, Nq, BLOCK_M, BLOCK_D, BLOCK_DV)
        if VARLEN:  # b is the packed sequence (kernels/pointwise/varlen.py): its own rows, lengths and n block
            tl.static_assert(MASK_KIND == 0 and BIAS_MODE != 2 and not DROPOUT)
            start_q, Nq, start_k, Nk = packed_sequence(CU_Q, CU_K, b)
            if start_m >= Nq:
                return
            qi_at = tl.minimum(offs_m, Nq - 1)
            Q += start_q * sqm
            K += start_k * skn
            V += start_k * svn
            O += start_q * som
            N_ROWS += H * start_q - b * H * Nq  # + pid_bh * Nq below: the sequence's (H, Nq) block
        Q += b * sqb + h * sqh
        K += b * skb + (h // GROUP) * skh  # grouped-query attention: GROUP query heads share a key/value head
        V += b * svb + (h // GROUP) * svh
        MASK += b * smb + h * smh

        # key blocks [inner, outer): whole, in bounds, visible to every row (no masking). The others are masked:
        # [outer, end), the diagonal and partial blocks (causal); or, under a window, the band's two edges
        # [first, inner) and [outer, end), walked as one loop (gap: the inside it jumps over)
        if WINDOW:
            first, inner, outer, end = band_keys(start_m, Nq, Nk, window_left, window_right, BLOCK_M, BLOCK_N)
            edge_lo = first
            gap = outer - inner
        else:
            first = 0
            inner = 0
            outer, end = visible_keys(start_m, Nq, Nk, BLOCK_M, BLOCK_N, CAUSAL)
            edge_lo = outer
            gap = 0
        n = key_count(offs_m, Nq, Nk, MASK, smm, smn, first, end, window_left, window_right, BLOCK_M, BLOCK_N,
                      MASK_KIND, CAUSAL, WINDOW)
        tl.store(N_ROWS + pid_bh * Nq + offs_m, n, mask=offs_m < Nq)
        bias, inv_n = row_bias(n, BIAS, b, h, offs_m, Nq, sbb, sbh, sbm, bias_scalar, BIAS_MODE, True)
        q = load_tile(Q, offs_m, offs_d, sqm, sqd, Nq, D, True, HEAD_MASK)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
        acc = fwd_stage(acc, q, bias, inv_n, K, V, skn, skd, svn, svd, offs_m, qi_at, offs_d, offs_dv, inner, outer,
                        0, 0, Nq, Nk, D, DV, scale, MASK, smm, smn, seed, pid_bh, dropout_p, softcap, window_left,
                        window_right, BLOCK_N, SIGMOID, SIGMOID_IMPL, MASK_KIND, MASK_SHAPE, CAUSAL, HEAD_MASK, UPCAST,
                        PRECISION, DROPOUT, False, SOFTCAP, False)
        acc = fwd_stage(acc, q, bias, inv_n, K, V, skn, skd, svn, svd, offs_m, qi_at, offs_d, offs_dv, edge_lo, end,
                        inner, gap, Nq, Nk, D, DV, scale, MASK, smm, smn, seed, pid_bh, dropout_p, softcap,
                        window_left, window_right, BLOCK_N, SIGMOID, SIGMOID_IMPL, MASK_KIND, MASK_SHAPE, CAUSAL,
                        HEAD_MASK, UPCAST, PRECISION, DROPOUT, True, SOFTCAP, WINDOW)
        O += b * sob + h * soh
        store_tile(O, offs_m, offs_dv, som, sod, Nq, DV, acc)

    @triton.jit
    def dkdv_stage(dk, dv, k, v, Q, DO, N_ROWS, BIAS, sqm, sqd, sdom, sdod, sbb, sbh, sbm, b, h, bias_scalar,
                   offs_n, kj_at, offs_d, offs_dv, lo, hi, gap_at, gap, Nq, Nk, D, DV, scale, MASK, smm, smn, seed,
                   pid_bh,
                   dropout_p, softcap, left, right, BLOCK_M: tl.constexpr, SIGMOID: tl.constexpr,
                   SIGMOID_IMPL: tl.constexpr, BIAS_MODE: tl.constexpr, MASK_KIND: tl.constexpr,
                   MASK_SHAPE: tl.constexpr, HEAD_MASK: tl.constexpr, UPCAST: tl.constexpr,
                   PRECISION: tl.constexpr, DROPOUT: tl.constexpr, CAUSAL_MASK: tl.constexpr,
                   QUERY_BOUND: tl.constexpr, SOFTCAP: tl.constexpr, BAND: tl.constexpr):
        """dK (unscaled), dV over the query blocks [lo, hi) on transposed (keys x queries) tiles."""
        for start_m in range(lo, hi - gap, BLOCK_M):
            if BAND:  # the band's two edges in one loop: from gap_at on, blocks jump over the inside
                start_m = tl.where(start_m < gap_at, start_m, start_m + gap)
            start_m = tl.multiple_of(start_m, BLOCK_M)
            offs_m = start_m + tl.arange(0, BLOCK_M)
            q = load_tile(Q, offs_m, offs_d, sqm, sqd, Nq, D, QUERY_BOUND, HEAD_MASK)
            do = load_tile(DO, offs_m, offs_dv, sdom, sdod, Nq, DV, QUERY_BOUND, HEAD_MASK)
            n = load_rows(N_ROWS + pid_bh * Nq, offs_m, Nq, 1.0, QUERY_BOUND)
            bias, inv_n = row_bias(n, BIAS, b, h, offs_m, Nq, sbb, sbh, sbm, bias_scalar, BIAS_MODE, QUERY_BOUND)
            if QUERY_BOUND:
                qi_at = tl.minimum(offs_m, Nq - 1)
            else:
                qi_at = offs_m
            s = mm(k, tl.trans(q), UPCAST, PRECISION) * scale
            if SOFTCAP > 0:
                s, slope = softcap_tile(s, softcap)
            # keys past Nk (a partial last key block) compute gradients that are never stored
            s = tile_logits(s, offs_m[None, :], offs_n[:, None], qi_at[None, :], kj_at[:, None], Nq, Nk,
                            MASK, smm, smn, 1.0, MASK_KIND, MASK_SHAPE, CAUSAL_MASK, False)
            if BAND:
                s = tl.where(in_band(offs_m[None, :], offs_n[:, None], Nq, Nk, left, right), s, float("-inf"))
            w, dw = weights(s, bias[None, :], inv_n[None, :], SIGMOID, SIGMOID_IMPL)
            if SOFTCAP > 0:  # through the cap: dS_raw = dS * (1 - tanh^2)
                dw = dw * slope
            # rows past Nq (QUERY_BOUND) have finite w and zero dO: they add nothing to dV or dK
            if DROPOUT:  # the same Z as the forward: same seed, same (b, h, i, j) offsets
                z = dropout_scale_at(seed, pid_bh, offs_m[None, :], offs_n[:, None], Nq, Nk, dropout_p)
                w = w * z
                dw = dw * z
            dv = mma(w.to(do.dtype), do, dv, UPCAST, PRECISION)
            ds = mm(v, tl.trans(do), UPCAST, PRECISION) * dw
            dk = mma(ds.to(q.dtype), q, dk, UPCAST, PRECISION)
        return dk, dv

    @triton.jit
    def pointwise_bwd_dkdv_kernel(
            Q, K, V, DO, N_ROWS, MASK, BIAS, DK, DV_OUT, SEED,
            sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sdob, sdoh, sdom, sdod,
            smb, smh, smm, smn, sbb, sbh, sbm, H, Nq, Nk, D, DV, GROUP, tune_nq, tune_nk, scale, bias_scalar,
            window_left, window_right,
            dropout_p,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
            SIGMOID: tl.constexpr, SIGMOID_IMPL: tl.constexpr, BIAS_MODE: tl.constexpr, MASK_KIND: tl.constexpr,
            MASK_SHAPE: tl.constexpr,
            SOFTCAP: tl.constexpr, WINDOW: tl.constexpr,
            CAUSAL: tl.constexpr, HEAD_MASK: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
            DROPOUT: tl.constexpr, CU_Q=None, CU_K=None, VARLEN: tl.constexpr = False):
        # One program per key block of one key/value head; it walks the GROUP query heads that share the
        # head (grouped-query attention; GROUP = 1 otherwise) and accumulates their dK, dV in registers.
        scale = tl.cast(scale, tl.float32)
        bias_scalar = tl.cast(bias_scalar, tl.float32)
        softcap = SOFTCAP  # a constexpr (one model has one cap); 0.0: none
        seed, dropout_p = dropout_args(SEED, dropout_p, DROPOUT)
        H_kv = H // GROUP
        pid_bkv, b, h_kv, start_n, offs_n, kj_at, offs_d, offs_dv = key_block(H_kv, Nk, BLOCK_N, BLOCK_D, BLOCK_DV)
        if VARLEN:  # b is the packed sequence: its own rows and lengths; n, dK, dV in per-sequence blocks
            tl.static_assert(MASK_KIND == 0 and BIAS_MODE != 2 and not DROPOUT)
            start_q, Nq, start_k, Nk = packed_sequence(CU_Q, CU_K, b)
            if start_n >= Nk:
                return
            kj_at = tl.minimum(offs_n, Nk - 1)
            Q += start_q * sqm
            DO += start_q * sdom
            K += start_k * skn
            V += start_k * svn
            N_ROWS += H * start_q - b * H * Nq  # + pid_bh * Nq in the stages: the sequence's (H, Nq) block
            DK += (H_kv * start_k - b * H_kv * Nk) * D  # + pid_bkv * Nk * D below: a (H_kv, Nk, D) block
            DV_OUT += (H_kv * start_k - b * H_kv * Nk) * DV
        K += b * skb + h_kv * skh
        V += b * svb + h_kv * svh
        k = load_tile(K, offs_n, offs_d, skn, skd, Nk, D, True, HEAD_MASK)
        v = load_tile(V, offs_n, offs_dv, svn, svd, Nk, DV, True, HEAD_MASK)
        dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
        if WINDOW:  # query blocks [first, mid) and [full, end) are the band's edges, [mid, full) inside it
            first, mid, full, end = band_queries(start_n, Nq, Nk, window_left, window_right, BLOCK_M, BLOCK_N)
        else:
            first, mid, full = visible_queries(start_n, Nq, Nk, BLOCK_M, BLOCK_N, CAUSAL)
            end = Nq
        for g in range(0, GROUP):
            h = h_kv * GROUP + g
            pid_bh = b * H + h
            Qh = Q + b * sqb + h * sqh
            DOh = DO + b * sdob + h * sdoh
            MASKh = MASK + b * smb + h * smh
            if CAUSAL:  # diagonal blocks: causal masking
                dk, dv = dkdv_stage(dk, dv, k, v, Qh, DOh, N_ROWS, BIAS, sqm, sqd, sdom, sdod, sbb, sbh, sbm, b, h,
                                    bias_scalar, offs_n, kj_at, offs_d, offs_dv, first, mid, 0, 0, Nq, Nk, D, DV,
                                    scale, MASKh, smm, smn, seed, pid_bh, dropout_p, softcap, window_left,
                                    window_right, BLOCK_M, SIGMOID, SIGMOID_IMPL, BIAS_MODE, MASK_KIND, MASK_SHAPE,
                                    HEAD_MASK, UPCAST, PRECISION, DROPOUT, True, False, SOFTCAP, False)
            dk, dv = dkdv_stage(dk, dv, k, v, Qh, DOh, N_ROWS, BIAS, sqm, sqd, sdom, sdod, sbb, sbh, sbm, b, h,
                                bias_scalar, offs_n, kj_at, offs_d, offs_dv, mid, full, 0, 0, Nq, Nk, D, DV, scale,
                                MASKh, smm, smn, seed, pid_bh, dropout_p, softcap, window_left, window_right, BLOCK_M,
                                SIGMOID, SIGMOID_IMPL, BIAS_MODE, MASK_KIND, MASK_SHAPE, HEAD_MASK, UPCAST, PRECISION,
                                DROPOUT, False, False, SOFTCAP, False)
            if WINDOW:  # the band's two edges as one loop, jumping over the inside [mid, full)
                dk, dv = dkdv_stage(dk, dv, k, v, Qh, DOh, N_ROWS, BIAS, sqm, sqd, sdom, sdod, sbb, sbh, sbm, b, h,
                                    bias_scalar, offs_n, kj_at, offs_d, offs_dv, first, end, mid, full - mid, Nq, Nk,
                                    D, DV, scale, MASKh, smm, smn, seed, pid_bh, dropout_p, softcap, window_left,
                                    window_right, BLOCK_M, SIGMOID, SIGMOID_IMPL, BIAS_MODE, MASK_KIND, MASK_SHAPE,
                                    HEAD_MASK, UPCAST, PRECISION, DROPOUT, False, True, SOFTCAP, True)
            else:  # the partial last query block
                dk, dv = dkdv_stage(dk, dv, k, v, Qh, DOh, N_ROWS, BIAS, sqm, sqd, sdom, sdod, sbb, sbh, sbm, b, h,
                                    bias_scalar, offs_n, kj_at, offs_d, offs_dv, full, end, 0, 0, Nq, Nk, D, DV,
                                    scale, MASKh, smm, smn, seed, pid_bh, dropout_p, softcap, window_left,
                                    window_right, BLOCK_M, SIGMOID, SIGMOID_IMPL, BIAS_MODE, MASK_KIND, MASK_SHAPE,
                                    HEAD_MASK, UPCAST, PRECISION, DROPOUT, CAUSAL, True, SOFTCAP, False)
        dk = scale * dk
        DK += pid_bkv * Nk * D  # gradients are written contiguous (B, H_kv, N, D)
        DV_OUT += pid_bkv * Nk * DV
        store_tile(DK, offs_n, offs_d, D, 1, Nk, D, dk)
        store_tile(DV_OUT, offs_n, offs_dv, DV, 1, Nk, DV, dv)

    @triton.jit
    def dq_stage(dq, dbias, q, do, bias, inv_n, K, V, skn, skd, svn, svd, offs_m, qi_at, offs_d, offs_dv, lo, hi,
                 gap_at, gap,
                 Nq, Nk, D, DV, scale, MASK, smm, smn, seed, pid_bh, dropout_p, softcap, left, right,
                 BLOCK_N: tl.constexpr, SIGMOID: tl.constexpr, SIGMOID_IMPL: tl.constexpr, BIAS_MODE: tl.constexpr,
                 MASK_KIND: tl.constexpr, MASK_SHAPE: tl.constexpr, CAUSAL: tl.constexpr, HEAD_MASK: tl.constexpr,
                 UPCAST: tl.constexpr, PRECISION: tl.constexpr, DROPOUT: tl.constexpr, EDGE: tl.constexpr,
                 SOFTCAP: tl.constexpr, BAND: tl.constexpr):
        for start_n in range(lo, hi - gap, BLOCK_N):
            if BAND:  # the band's two edges in one loop: from gap_at on, blocks jump over the inside
                start_n = tl.where(start_n < gap_at, start_n, start_n + gap)
            start_n = tl.multiple_of(start_n, BLOCK_N)
            offs_n = start_n + tl.arange(0, BLOCK_N)
            k = load_tile(K, offs_n, offs_d, skn, skd, Nk, D, EDGE, HEAD_MASK)
            v = load_tile(V, offs_n, offs_dv, svn, svd, Nk, DV, EDGE, HEAD_MASK)
            s, slope = key_tile_scores(q, k, offs_m, offs_n, qi_at, Nq, Nk, scale, MASK, smm, smn, softcap, left,
                                       right, MASK_KIND, MASK_SHAPE, CAUSAL, EDGE, UPCAST, PRECISION, SOFTCAP, BAND)
            _, dw = weights(s, bias[:, None], inv_n[:, None], SIGMOID, SIGMOID_IMPL)
            if DROPOUT:
                dw = dw * dropout_scale_at(seed, pid_bh, offs_m[:, None], offs_n[None, :], Nq, Nk, dropout_p)
            ds = mm(do, tl.trans(v), UPCAST, PRECISION) * dw
            if BIAS_MODE == 2:  # the bias is added after the cap: its gradient is dS before the slope
                dbias += tl.sum(ds, 1)
            if SOFTCAP > 0:
                ds = ds * slope
            dq = mma(ds.to(k.dtype), k, dq, UPCAST, PRECISION)
        return dq, dbias

    @triton.jit
    def pointwise_bwd_dq_kernel(
            Q, K, V, DO, N_ROWS, MASK, BIAS, DQ, DBIAS, SEED,
            sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sdob, sdoh, sdom, sdod,
            smb, smh, smm, smn, sbb, sbh, sbm, H, Nq, Nk, D, DV, GROUP, tune_nq, tune_nk, scale, bias_scalar,
            window_left, window_right,
            dropout_p,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
            SIGMOID: tl.constexpr, SIGMOID_IMPL: tl.constexpr, BIAS_MODE: tl.constexpr, MASK_KIND: tl.constexpr,
            MASK_SHAPE: tl.constexpr,
            SOFTCAP: tl.constexpr, WINDOW: tl.constexpr,
            CAUSAL: tl.constexpr, HEAD_MASK: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
            DROPOUT: tl.constexpr, CU_Q=None, CU_K=None, VARLEN: tl.constexpr = False):
        scale = tl.cast(scale, tl.float32)
        bias_scalar = tl.cast(bias_scalar, tl.float32)
        softcap = SOFTCAP  # a constexpr (one model has one cap); 0.0: none
        seed, dropout_p = dropout_args(SEED, dropout_p, DROPOUT)
        pid_bh, b, h, start_m, offs_m, qi_at, offs_d, offs_dv = query_block(H, Nq, BLOCK_M, BLOCK_D, BLOCK_DV)
        if VARLEN:  # b is the packed sequence: its own rows and lengths; n and dQ in per-sequence blocks
            tl.static_assert(MASK_KIND == 0 and BIAS_MODE != 2 and not DROPOUT)
            start_q, Nq, start_k, Nk = packed_sequence(CU_Q, CU_K, b)
            if start_m >= Nq:
                return
            qi_at = tl.minimum(offs_m, Nq - 1)
            Q += start_q * sqm
            DO += start_q * sdom
            K += start_k * skn
            V += start_k * svn
            N_ROWS += H * start_q - b * H * Nq  # + pid_bh * Nq below: the sequence's (H, Nq) block
            DQ += (H * start_q - b * H * Nq) * D  # + pid_bh * Nq * D below: a (H, Nq, D) block
        Q += b * sqb + h * sqh
        K += b * skb + (h // GROUP) * skh  # grouped-query attention: GROUP query heads share a key/value head
        V += b * svb + (h // GROUP) * svh
        DO += b * sdob + h * sdoh
        MASK += b * smb + h * smh
        q = load_tile(Q, offs_m, offs_d, sqm, sqd, Nq, D, True, HEAD_MASK)
        do = load_tile(DO, offs_m, offs_dv, sdom, sdod, Nq, DV, True, HEAD_MASK)
        n = load_rows(N_ROWS + pid_bh * Nq, offs_m, Nq, 1.0, True)
        bias, inv_n = row_bias(n, BIAS, b, h, offs_m, Nq, sbb, sbh, sbm, bias_scalar, BIAS_MODE, True)
        dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        dbias = tl.zeros([BLOCK_M], tl.float32)
        if WINDOW:  # the key blocks of the forward's stages (pointwise_fwd_kernel)
            first, inner, outer, end = band_keys(start_m, Nq, Nk, window_left, window_right, BLOCK_M, BLOCK_N)
            edge_lo = first
            gap = outer - inner
        else:
            inner = 0
            outer, end = visible_keys(start_m, Nq, Nk, BLOCK_M, BLOCK_N, CAUSAL)
            edge_lo = outer
            gap = 0
        dq, dbias = dq_stage(dq, dbias, q, do, bias, inv_n, K, V, skn, skd, svn, svd, offs_m, qi_at, offs_d, offs_dv,
                             inner, outer, 0, 0, Nq, Nk, D, DV, scale, MASK, smm, smn, seed, pid_bh, dropout_p, softcap,
                             window_left, window_right, BLOCK_N, SIGMOID, SIGMOID_IMPL, BIAS_MODE, MASK_KIND,
                             MASK_SHAPE, CAUSAL, HEAD_MASK, UPCAST, PRECISION, DROPOUT, False, SOFTCAP, False)
        dq, dbias = dq_stage(dq, dbias, q, do, bias, inv_n, K, V, skn, skd, svn, svd, offs_m, qi_at, offs_d, offs_dv,
                             edge_lo, end, inner, gap, Nq, Nk, D, DV, scale, MASK, smm, smn, seed, pid_bh,
                             dropout_p, softcap, window_left, window_right, BLOCK_N, SIGMOID, SIGMOID_IMPL, BIAS_MODE,
                             MASK_KIND, MASK_SHAPE, CAUSAL, HEAD_MASK, UPCAST, PRECISION, DROPOUT, True, SOFTCAP,
                             WINDOW)
        dq = scale * dq
        DQ += pid_bh * Nq * D  # contiguous (B, H, Nq, D)
        store_tile(DQ, offs_m, offs_d, D, 1, Nq, D, dq)
        if BIAS_MODE == 2:
            tl.store(DBIAS + pid_bh * Nq + offs_m, dbias, mask=offs_m < Nq)
