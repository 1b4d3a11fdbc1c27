"""Triton kernels of the softmax family (FlashAttention-2 tiling): forward, dK/dV, dQ.

One kernel computes softmax_j(l_ij) v_j for the logits
    l_ij = scale * q_i . k_j                                   (plain, Fenchel first order with scale*alpha)
    l_ij = 2 scale q_i . k_j - scale ||k_j||^2                  (L2 = True)
plus, chosen by constexpr flags, a float attn_mask, a per-key log-preference g_j (B, H, Nk) and a
T5 relative-position bias table[bucket(j - i), h]. The L2 logits are -scale ||q_i - k_j||^2 without
the row constant -scale ||q_i||^2, which cancels in the softmax: the output and every gradient are
exactly those of the L2 formula, without subtracting a large ||q||^2 in fp32. Keys that do not take
part (bounds, causal, bool mask, -inf in the float mask or in g) get -inf; a row with no key left
outputs zeros and stores lse = +inf so the backward sees p = 0 there (never NaN).

Base 2 (FlashAttention-2 / the Triton tutorial): the kernels work on log2(e) * l, i.e. scale * log2(e)
is folded into the one multiply of q.k, the mask / preference / bias terms are multiplied by log2(e),
and exp2 replaces exp. The stored LSE is in the same units, lse2_i = log2 sum_j 2^(log2(e) l_ij), so the
backward recomputes P = exp2(log2(e) l - lse2) exactly as the forward normalised it.

Loops run in stages (the tutorial's two-stage loop): whole, in-bounds key blocks below the causal
diagonal run without any masking arithmetic or masked loads; only the diagonal blocks and the
partial last block apply the causal / bounds masks. The dK/dV kernel works on transposed tiles
(keys x queries: S^T = K Q^T), so P^T and dS^T feed dV += P^T dO and dK += dS^T Q straight from
registers, with no transpose of a register tile.

Backward (FlashAttention-2): with delta_i = dO_i . O_i precomputed,
dV = P^T dO, dS = P * (dO V^T - delta), and dS flows into
    dq_i = scale * sum_j dS_ij k_j             dk_j = scale * sum_i dS_ij q_i          (plain)
    dq_i = 2 scale sum_j dS_ij k_j             dk_j = 2 scale (sum_i dS_ij q_i - k_j sum_i dS_ij)   (L2)
    dg_j = sum_i dS_ij,      dtable[b, h] = sum over (i, j) with bucket(j - i) = b of dS_ij.
T5 (HAS_T5): the kernels read bias[h, r] = table[bucket(r), h] over the offset indices r = j - i + Nq - 1
(gathered on the host) and an int32 (2, Nq + Nk - 1) LUT: each offset's bucket and the end of its run
of equal buckets. A tile whose offsets lie in one run adds one scalar bias and, in the backward, one
tile sum of dS to its bucket; the others (near the diagonal) add one bias and sum dS once per run
they span (no per-score gather: its tile of addresses cost registers). The dK/dV program keeps its per-bucket sums in registers and stores one row per key
block and query head; the host adds the rows (no atomics, deterministic).
Dropout (DROPOUT flag, FlashAttention's way): P and lse are the undropped softmax; the forward
accumulates out = sum_j Z_ij P_ij v_j / (1 - p) with Z regenerated per tile from (seed, offset) by
ops/triton_dropout.py, and the backward regenerates the same Z:
    dV = (Z * P / (1 - p))^T dO,   dP = Z * (dO V^T) / (1 - p),   dS = P * (dP - delta).
delta_i = dO_i . O_i still holds: the softmax backward needs sum_k P_ik dP_ik, and
    sum_k P_ik Z_ik (dO_i . v_k) / (1 - p) = dO_i . sum_k (Z_ik P_ik / (1 - p)) v_k = dO_i . O_i
because O_i is exactly that dropped, rescaled sum. With DROPOUT False no random number is drawn.
Softcap, sinks and windows (SOFTCAP, HAS_SINKS, WINDOW; docs/kernels_softmax_family.md): the cap
cap2 tanh(s / cap2), cap2 = softcap * log2(e), acts on the log2-unit q.k term before the preference,
T5 bias and mask, and the backward multiplies the dS reaching q.k by 1 - tanh^2; each head's sink joins
the final normaliser and lse (a row with no key: zeros, lse = the sink), dsinks is reduced on the host
from lse and delta; L2 with either keeps its row constant -scale ||q||^2 (FULL_L2) and dQ its gradient.
The window's band (left, right; the host folds is_causal into right and passes CAUSAL False) bounds the
key loops per query block (band_keys) and the query loop per key block (band_queries): blocks outside
it are never visited, whole blocks inside it run unmasked, the edge blocks are masked.
Packed sequences (VARLEN, the arguments at the end of each signature; kernels/flash_softmax/varlen.py
launches them): a program's batch index is its sequence; at its entry it reads the sequence's start and
Nq / Nk from the cu_seq offsets, moves its base pointers there (lse, delta and the gradients to the
sequence's (H, Nq) block) and returns when its block lies past the sequence; the rest is unchanged.
The readable eager version of each formula is ops/softmax/reference.py, ops/l2/reference.py,
ops/fenchel/reference.py and ops/fenchel/t5_reference.py.
"""
from __future__ import annotations

from ...triton_utils import HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from ...triton_dropout import dropout_args, dropout_scale_at
    from ...triton_logit_extras import band_keys, band_queries, softcap_tile
    from ...triton_utils import (key_block, load_rows, load_tile, mm, mma, packed_sequence, query_block, store_tile,
                                tile_logits, visible_keys, visible_queries)

    LOG2E = tl.constexpr(1.4426950408889634)

    @triton.jit
    def key_terms(k, offs_n, Nk, pref_ptr, stride_pn, qk_scale,
                  L2: tl.constexpr, HAS_PREF: tl.constexpr, BOUND: tl.constexpr):
        """Per-key part of the log2-unit logits: -scale log2(e) ||k_j||^2 (L2) + log2(e) g_j (preference);
        -inf past Nk when BOUND."""
        t = tl.zeros([k.shape[0]], tl.float32)
        if L2:
            kf = k.to(tl.float32)
            t = t - qk_scale * tl.sum(kf * kf, 1)
        if HAS_PREF:
            if BOUND:
                g = tl.load(pref_ptr + offs_n * stride_pn, mask=offs_n < Nk, other=float("-inf"))
            else:
                g = tl.load(pref_ptr + offs_n * stride_pn)
            t = t + g.to(tl.float32) * LOG2E
        if BOUND:
            t = tl.where(offs_n < Nk, t, float("-inf"))
        return t

    @triton.jit
    def cap_logits(s, cap2, SOFTCAP: tl.constexpr):
        """(cap2 tanh(s / cap2), d/ds of it = 1 - tanh^2) on log2-unit logits: with cap2 = softcap * log2(e)
        this is log2(e) * softcap * tanh(l / softcap) of the natural logits l (s = log2(e) l), Gemma 2's cap
        in the kernels' units (ops/triton_logit_extras.softcap_tile)."""
        if SOFTCAP:
            return softcap_tile(s, cap2)
        else:
            return s, 1.0

    @triton.jit
    def band(s, qi, kj, Nq, Nk, left, right):
        """-inf outside the sliding window: key j takes part for query i iff
        i + (Nk - Nq) - left <= j <= i + (Nk - Nq) + right (bottom-right aligned; the host passes an
        unbounded side as a bound past every key, and folds is_causal into ``right``). The bounds are per
        query (a vector), compared with the key indices by broadcasting: no int tile of offsets is built."""
        first = qi + (Nk - Nq - left)
        last = qi + (Nk - Nq + right)
        return tl.where((kj >= first) & (kj <= last), s, float("-inf"))

    @triton.jit
    def offset_range(qi_at, kj_at, Nq, Nk, CAUSAL_MASK: tl.constexpr):
        """LUT indices (j - i + Nq - 1) of the smallest and largest offset of a tile, from its (clamped)
        query and key indices; with the causal mask, offsets past the diagonal (j - i > Nk - Nq) are
        hidden and left out. Every index of the tile lies in [r_lo, r_hi] except hidden ones."""
        r_lo = tl.min(kj_at, 0) - tl.max(qi_at, 0) + (Nq - 1)
        r_hi = tl.max(kj_at, 0) - tl.min(qi_at, 0) + (Nq - 1)
        if CAUSAL_MASK:
            r_hi = tl.minimum(r_hi, Nk - 1)
        return r_lo, r_hi

    @triton.jit
    def offsets(qi_at, kj_at, Nq, KEYS_FIRST: tl.constexpr):
        """The tile of LUT indices j - i + Nq - 1, (queries, keys) or, KEYS_FIRST, (keys, queries). Computed
        only where a tile needs it and again where it is used, so no int tile stays live across the
        tile's products (registers)."""
        if KEYS_FIRST:
            rel = kj_at[:, None] - qi_at[None, :] + (Nq - 1)
        else:
            rel = kj_at[None, :] - qi_at[:, None] + (Nq - 1)
        return rel

    @triton.jit
    def add_t5_bias(s, qi_at, kj_at, Nq, r_lo, r_hi, one_run, bias_ptr, lut_ptr, lut_rows,
                    KEYS_FIRST: tl.constexpr):
        """s + log2(e) * bias[j - i + Nq - 1] (bias: this head's (Nq + Nk - 1,) vector table[bucket(r), h]).
        A tile whose offsets form one run of equal buckets (``one_run``; far from the diagonal nearly
        every tile) adds one scalar. The others add one scalar per run they span, where the offset falls
        in the run: a few runs per near-diagonal tile, and no per-score gather, whose tile of 64-bit
        addresses made the forward spill registers (benchmarks/compile_triton_kernels.py)."""
        if one_run:
            s = s + tl.load(bias_ptr + r_lo).to(tl.float32) * LOG2E
        else:
            r = r_lo
            while r <= r_hi:
                end = tl.minimum(tl.load(lut_ptr + lut_rows + r), r_hi)
                rel = offsets(qi_at, kj_at, Nq, KEYS_FIRST)
                s = s + tl.where((rel >= r) & (rel <= end), tl.load(bias_ptr + r).to(tl.float32) * LOG2E, 0.0)
                r = end + 1
        return s

    @triton.jit
    def t5_table_grad(dtab, ds, qi_at, kj_at, Nq, r_lo, r_hi, one_run, lut_ptr, lut_rows, BUCKETS: tl.constexpr):
        """dtab (BUCKETS,) += the tile's dS summed per bucket, without atomics.

        LUT row 0 holds the bucket of each offset index, row 1 (``lut_rows`` further) the last index of
        the run of equal buckets it belongs to. A one-run tile adds its whole sum to one bucket; a tile
        that spans several runs (near the diagonal) walks them: one masked tile sum per run, on the
        offsets [r, run end] of the run. dS is exactly 0 at pairs that do not take part (p = 0), so no
        `keep` mask enters the sums. Each bucket's sum lands in a register of this program; the kernel
        stores the vector once per head (no address ever derives from a load or a mask)."""
        every = tl.arange(0, BUCKETS)
        if one_run:
            dtab = tl.where(every == tl.load(lut_ptr + r_lo), dtab + tl.sum(tl.sum(ds, 1), 0), dtab)
        else:
            rel = offsets(qi_at, kj_at, Nq, True)
            r = r_lo
            while r <= r_hi:
                end = tl.minimum(tl.load(lut_ptr + lut_rows + r), r_hi)
                part = tl.sum(tl.sum(tl.where((rel >= r) & (rel <= end), ds, 0.0), 1), 0)
                dtab = tl.where(every == tl.load(lut_ptr + r), dtab + part, dtab)
                r = end + 1
        return dtab

    @triton.jit
    def scores(q, k, offs_m, offs_n, qi_at, Nq, Nk, qk_scale,
               mask_ptr, stride_mm, stride_mn, pref_ptr, stride_pn, bias_ptr, lut_rows, lut_ptr,
               q_term, cap2, left, right,
               L2: tl.constexpr, MASK_KIND: tl.constexpr, MASK_SHAPE: tl.constexpr, HAS_PREF: tl.constexpr,
               HAS_T5: tl.constexpr,
               CAUSAL: tl.constexpr, EDGE: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
               SOFTCAP: tl.constexpr, FULL_L2: tl.constexpr, WINDOW: tl.constexpr):
        """((BLOCK_M, BLOCK_N) log2-unit logits of queries offs_m against keys offs_n, d cap / d logit);
        EDGE applies the key bounds, the causal diagonal and the window's band (edge and partial blocks
        only). FULL_L2: the L2 logits with the row constant (``q_term`` = -scale log2(e) ||q_i||^2), which
        softcap's tanh and a sink's comparison with the keys need; the cap comes before the preference,
        the T5 bias and the mask."""
        if L2:
            s = mm(q, tl.trans(k), UPCAST, PRECISION) * (2.0 * qk_scale)
        else:
            s = mm(q, tl.trans(k), UPCAST, PRECISION) * qk_scale
        if FULL_L2:
            s = s + key_terms(k, offs_n, Nk, pref_ptr, stride_pn, qk_scale, True, False, False)[None, :] \
                + q_term[:, None]
        s, dcap = cap_logits(s, cap2, SOFTCAP)
        if (L2 and not FULL_L2) or HAS_PREF:
            s = s + key_terms(k, offs_n, Nk, pref_ptr, stride_pn, qk_scale, L2 and not FULL_L2, HAS_PREF,
                              EDGE)[None, :]
        if EDGE:
            kj_at = tl.minimum(offs_n, Nk - 1)
        else:
            kj_at = offs_n
        if HAS_T5:  # bias_ptr: this head's bias vector; lut_ptr + lut_rows: the LUT's run-end row
            r_lo, r_hi = offset_range(qi_at, kj_at, Nq, Nk, CAUSAL and EDGE)
            one_run = tl.load(lut_ptr + lut_rows + r_lo) >= r_hi
            s = add_t5_bias(s, qi_at, kj_at, Nq, r_lo, r_hi, one_run, bias_ptr, lut_ptr, lut_rows, False)
        s = tile_logits(s, offs_m[:, None], offs_n[None, :], qi_at[:, None], kj_at[None, :], Nq, Nk,
                        mask_ptr, stride_mm, stride_mn, LOG2E, MASK_KIND, MASK_SHAPE, CAUSAL and EDGE, EDGE)
        if WINDOW and EDGE:
            s = band(s, offs_m[:, None], offs_n[None, :], Nq, Nk, left, right)
        return s, dcap

    @triton.jit
    def row_term(q, qk_scale, FULL_L2: tl.constexpr):
        """-scale log2(e) ||q_i||^2 per row (the L2 logits' row constant) when FULL_L2, else 0."""
        if FULL_L2:
            qf = q.to(tl.float32)
            return -qk_scale * tl.sum(qf * qf, 1)
        else:
            return 0.0

    @triton.jit
    def fwd_stage(acc, l_i, m_i, q, K, V, skn, skd, svn, svd, offs_m, qi_at, offs_d, offs_dv, lo, hi,
                  Nq, Nk, D, DV, qk_scale, MASK, smm, smn, PREF, spn, BIAS, slut, LUT, seed, pid_bh, dropout_p,
                  q_term, cap2, left, right,
                  BLOCK_N: tl.constexpr, L2: tl.constexpr, MASK_KIND: tl.constexpr, MASK_SHAPE: tl.constexpr,
                  HAS_PREF: tl.constexpr,
                  HAS_T5: tl.constexpr, CAUSAL: tl.constexpr, HEAD_MASK: tl.constexpr, UPCAST: tl.constexpr,
                  PRECISION: tl.constexpr, DROPOUT: tl.constexpr, EDGE: tl.constexpr,
                  SOFTCAP: tl.constexpr, FULL_L2: tl.constexpr, WINDOW: tl.constexpr):
        """Online softmax over the key blocks [lo, hi) (FlashAttention-2's inner loop, base 2)."""
        for start_n in range(lo, hi, BLOCK_N):
            start_n = tl.multiple_of(start_n, BLOCK_N)
            offs_n = start_n + tl.arange(0, BLOCK_N)
            k = load_tile(K, offs_n, offs_d, skn, skd, Nk, D, EDGE, HEAD_MASK)
            v = load_tile(V, offs_n, offs_dv, svn, svd, Nk, DV, EDGE, HEAD_MASK)
            s, _ = scores(q, k, offs_m, offs_n, qi_at, Nq, Nk, qk_scale, MASK, smm, smn, PREF, spn, BIAS, slut,
                          LUT, q_term, cap2, left, right, L2, MASK_KIND, MASK_SHAPE, HAS_PREF, HAS_T5, CAUSAL, EDGE,
                          UPCAST, PRECISION, SOFTCAP, FULL_L2, WINDOW)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet: exp2(-inf) = 0
            p = tl.math.exp2(s - m_safe[:, None])
            alpha = tl.math.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)  # the normaliser sums the undropped weights
            if DROPOUT:
                p = p * dropout_scale_at(seed, pid_bh, offs_m[:, None], offs_n[None, :], Nq, Nk, dropout_p)
            acc = mma(p.to(v.dtype), v, acc * alpha[:, None], UPCAST, PRECISION)
            m_i = m_new
        return acc, l_i, m_i

    @triton.jit
    def softmax_fwd_kernel(
            Q, K, V, O, LSE, ORES, MASK, PREF, BIAS, LUT, SEED,
            sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod,
            smb, smh, smm, smn, spb, sph, spn, slut, sbh,
            H, Nq, Nk, D, DV, GROUP, tune_nq, tune_nk, scale, dropout_p, SINKS, softcap, win_left, win_right,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
            L2: tl.constexpr, MASK_KIND: tl.constexpr, MASK_SHAPE: tl.constexpr, HAS_PREF: tl.constexpr,
            HAS_T5: tl.constexpr,
            CAUSAL: tl.constexpr, HEAD_MASK: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
            DROPOUT: tl.constexpr, SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr, WINDOW: tl.constexpr,
            CU_Q=None, CU_K=None, VARLEN: tl.constexpr = False):
        # SINKS (H,) fp32: each head's sink logit (HAS_SINKS); softcap: the cap (SOFTCAP); win_left /
        # win_right: the window's band (WINDOW; unbounded sides as bounds past every key, is_causal folded
        # into win_right and CAUSAL False): extras.py's host side.
        # tune_nq / tune_nk: the autotuning key's length buckets (ops/triton_tuning.py), unused here.
        # VARLEN (packed sequences, kernels/flash_softmax/varlen.py): see the module docstring.
        # inductor passes Python floats as fp64 scalars: keep the fp32 loop-carried types
        scale = tl.cast(scale, tl.float32)
        qk_scale = scale * LOG2E
        seed, dropout_p = dropout_args(SEED, dropout_p, DROPOUT)
        pid_bh, b, h, start_m, offs_m, qi_at, offs_d, offs_dv = query_block(H, Nq, BLOCK_M, BLOCK_D, BLOCK_DV)
        if VARLEN:  # b is the packed sequence: its own rows, lengths and lse block
            tl.static_assert(MASK_KIND == 0 and not HAS_PREF and not HAS_T5 and not DROPOUT)
            start_q, Nq, start_k, Nk = packed_sequence(CU_Q, CU_K, b)
            if start_m >= Nq:
                return
            qi_at = tl.minimum(offs_m, Nq - 1)
            Q += start_q * sqm
            K += start_k * skn
            V += start_k * svn
            O += start_q * som
            LSE += H * start_q - b * H * Nq  # + pid_bh * Nq below: the sequence's (H, Nq) block
        Q += b * sqb + h * sqh
        K += b * skb + (h // GROUP) * skh  # grouped-query attention: GROUP query heads share a key/value head
        V += b * svb + (h // GROUP) * svh
        MASK += b * smb + h * smh
        PREF += b * spb + h * sph
        BIAS += h * sbh

        q = load_tile(Q, offs_m, offs_d, sqm, sqd, Nq, D, True, HEAD_MASK)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
        cap2 = tl.cast(softcap, tl.float32) * LOG2E
        q_term = row_term(q, qk_scale, L2 and (SOFTCAP or HAS_SINKS))
        if WINDOW:  # key blocks outside the band are never visited; whole blocks inside it run unmasked
            k_lo, k_in, k_out, k_hi = band_keys(start_m, Nq, Nk, win_left, win_right, BLOCK_M, BLOCK_N)
            acc, l_i, m_i = fwd_stage(acc, l_i, m_i, q, K, V, skn, skd, svn, svd, offs_m, qi_at, offs_d, offs_dv, k_lo,
                                      k_in, Nq, Nk, D, DV, qk_scale, MASK, smm, smn, PREF, spn, BIAS, slut, LUT, seed,
                                      pid_bh, dropout_p, q_term, cap2, win_left, win_right, BLOCK_N, L2, MASK_KIND,
                                      MASK_SHAPE, HAS_PREF, HAS_T5, False, HEAD_MASK, UPCAST, PRECISION, DROPOUT, True,
                                      SOFTCAP, L2 and (SOFTCAP or HAS_SINKS), True)
            acc, l_i, m_i = fwd_stage(acc, l_i, m_i, q, K, V, skn, skd, svn, svd, offs_m, qi_at, offs_d, offs_dv, k_in,
                                      k_out, Nq, Nk, D, DV, qk_scale, MASK, smm, smn, PREF, spn, BIAS, slut, LUT, seed,
                                      pid_bh, dropout_p, q_term, cap2, win_left, win_right, BLOCK_N, L2, MASK_KIND,
                                      MASK_SHAPE, HAS_PREF, HAS_T5, False, HEAD_MASK, UPCAST, PRECISION, DROPOUT,
                                      False, SOFTCAP, L2 and (SOFTCAP or HAS_SINKS), True)
            acc, l_i, m_i = fwd_stage(acc, l_i, m_i, q, K, V, skn, skd, svn, svd, offs_m, qi_at, offs_d, offs_dv, k_out,
                                      k_hi, Nq, Nk, D, DV, qk_scale, MASK, smm, smn, PREF, spn, BIAS, slut, LUT, seed,
                                      pid_bh, dropout_p, q_term, cap2, win_left, win_right, BLOCK_N, L2, MASK_KIND,
                                      MASK_SHAPE, HAS_PREF, HAS_T5, False, HEAD_MASK, UPCAST, PRECISION, DROPOUT, True,
                                      SOFTCAP, L2 and (SOFTCAP or HAS_SINKS), True)
        else:
            lo, hi = visible_keys(start_m, Nq, Nk, BLOCK_M, BLOCK_N, CAUSAL)  # keys from hi on are skipped
            acc, l_i, m_i = fwd_stage(acc, l_i, m_i, q, K, V, skn, skd, svn, svd, offs_m, qi_at, offs_d, offs_dv, 0,
                                      lo, Nq, Nk, D, DV, qk_scale, MASK, smm, smn, PREF, spn, BIAS, slut, LUT, seed,
                                      pid_bh, dropout_p, q_term, cap2, win_left, win_right, BLOCK_N, L2, MASK_KIND,
                                      MASK_SHAPE, HAS_PREF, HAS_T5, CAUSAL, HEAD_MASK, UPCAST, PRECISION, DROPOUT,
                                      False, SOFTCAP, L2 and (SOFTCAP or HAS_SINKS), False)
            acc, l_i, m_i = fwd_stage(acc, l_i, m_i, q, K, V, skn, skd, svn, svd, offs_m, qi_at, offs_d, offs_dv, lo,
                                      hi, Nq, Nk, D, DV, qk_scale, MASK, smm, smn, PREF, spn, BIAS, slut, LUT, seed,
                                      pid_bh, dropout_p, q_term, cap2, win_left, win_right, BLOCK_N, L2, MASK_KIND,
                                      MASK_SHAPE, HAS_PREF, HAS_T5, CAUSAL, HEAD_MASK, UPCAST, PRECISION, DROPOUT,
                                      True, SOFTCAP, L2 and (SOFTCAP or HAS_SINKS), False)
        if HAS_SINKS:
            # the head's sink joins the normaliser as one more logit with no value: lse = log2(sum_j 2^s_j +
            # 2^sink); a row with no key left outputs zeros and stores lse = the sink (finite: p = 0 after)
            sink2 = tl.load(SINKS + h).to(tl.float32) * LOG2E
            m_fin = tl.maximum(m_i, sink2)
            alpha = tl.math.exp2(m_i - m_fin)  # 0 for rows with no key (m_i = -inf)
            l_fin = l_i * alpha + tl.math.exp2(sink2 - m_fin)
            out = acc * (alpha / l_fin)[:, None]
            lse2 = m_fin + tl.math.log2(l_fin)
        else:
            nonempty = l_i > 0.0
            out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
            lse2 = tl.where(nonempty, m_i + tl.math.log2(tl.where(nonempty, l_i, 1.0)), float("inf"))
        rounded = out.to(O.dtype.element_ty)
        if HAS_T5 and (O.dtype.element_ty == tl.float16 or O.dtype.element_ty == tl.bfloat16):
            # half inputs, T5: also the rounding residual out - rounded (in the dtype, O's strides), from
            # which the backward's delta = dO . out is exact to ~2^-16 of it. The table gradient sums dS
            # over many pairs per bucket, and sum_j dS_ij = 0, so delta's rounding error came out in it
            # (docs/kernels_softmax_family.md, "Precision"). Stored first, so the fp32 tile is dead by
            # the time the output's pointer tile is live (registers).
            ORES += b * sob + h * soh
            store_tile(ORES, offs_m, offs_dv, som, sod, Nq, DV, out - rounded.to(tl.float32))
        O += b * sob + h * soh
        store_tile(O, offs_m, offs_dv, som, sod, Nq, DV, rounded)
        tl.store(LSE + pid_bh * Nq + offs_m, lse2, mask=offs_m < Nq)

    @triton.jit
    def dkdv_stage(dk, dv, ds_colsum, dtab, k, v, key_bias, Q, DO, LSE, DELTA,
                   sqm, sqd, sdom, sdod, offs_n, kj_at, offs_d, offs_dv, lo, hi,
                   Nq, Nk, D, DV, qk_scale, MASK, smm, smn, BIAS, slut, LUT, seed, pid_bh, dropout_p,
                   key_pre, cap2, left, right,
                   BLOCK_M: tl.constexpr, L2: tl.constexpr, MASK_KIND: tl.constexpr, MASK_SHAPE: tl.constexpr,
                   HAS_PREF: tl.constexpr,
                   HAS_T5: tl.constexpr, HEAD_MASK: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                   DROPOUT: tl.constexpr, CAUSAL_MASK: tl.constexpr, QUERY_BOUND: tl.constexpr,
                   BUCKETS: tl.constexpr, SOFTCAP: tl.constexpr, FULL_L2: tl.constexpr, WINDOW_MASK: tl.constexpr):
        """dK, dV (and column sums of dS, the T5 table gradient per bucket in ``dtab``) over the query
        blocks [lo, hi), on transposed (keys x queries) tiles. With SOFTCAP, dS reaches the q.k product
        through the cap's derivative (1 - tanh^2); the preference and T5 bias, added after the cap, take
        dS itself. FULL_L2: ``key_pre`` (the keys' -scale log2(e) ||k||^2) and the queries' row constant
        enter before the cap; ``key_bias`` holds what comes after it."""
        for start_m in range(lo, hi, BLOCK_M):
            start_m = tl.multiple_of(start_m, BLOCK_M)
            offs_m = start_m + tl.arange(0, BLOCK_M)
            q = load_tile(Q, offs_m, offs_d, sqm, sqd, Nq, D, QUERY_BOUND, HEAD_MASK)
            do = load_tile(DO, offs_m, offs_dv, sdom, sdod, Nq, DV, QUERY_BOUND, HEAD_MASK)
            lse2 = load_rows(LSE, offs_m, Nq, float("inf"), QUERY_BOUND)  # +inf: p = 0 for absent rows
            delta = load_rows(DELTA, offs_m, Nq, 0.0, QUERY_BOUND)
            if QUERY_BOUND:
                qi_at = tl.minimum(offs_m, Nq - 1)
            else:
                qi_at = offs_m
            if L2:
                s = mm(k, tl.trans(q), UPCAST, PRECISION) * (2.0 * qk_scale)
            else:
                s = mm(k, tl.trans(q), UPCAST, PRECISION) * qk_scale
            if FULL_L2:
                s = s + key_pre[:, None] + row_term(q, qk_scale, True)[None, :]
            s, dcap = cap_logits(s, cap2, SOFTCAP)
            if (L2 and not FULL_L2) or HAS_PREF or HAS_T5:
                s = s + key_bias[:, None]  # also -inf for keys past Nk
            if HAS_T5:
                r_lo, r_hi = offset_range(qi_at, kj_at, Nq, Nk, CAUSAL_MASK)
                one_run = tl.load(LUT + slut + r_lo) >= r_hi
                s = add_t5_bias(s, qi_at, kj_at, Nq, r_lo, r_hi, one_run, BIAS, LUT, slut, True)
            s = tile_logits(s, offs_m[None, :], offs_n[:, None], qi_at[None, :], kj_at[:, None], Nq, Nk,
                            MASK, smm, smn, LOG2E, MASK_KIND, MASK_SHAPE, CAUSAL_MASK, False)
            if WINDOW_MASK:
                s = band(s, offs_m[None, :], offs_n[:, None], Nq, Nk, left, right)
            p = tl.math.exp2(s - lse2[None, :])  # -inf logits and +inf lse (empty rows) both give 0
            dp = mm(v, tl.trans(do), UPCAST, PRECISION)
            if DROPOUT:  # the same Z as the forward: same seed, same (b, h, i, j) offsets
                z = dropout_scale_at(seed, pid_bh, offs_m[None, :], offs_n[:, None], Nq, Nk, dropout_p)
                dv = mma((p * z).to(do.dtype), do, dv, UPCAST, PRECISION)
                dp = dp * z
            else:
                dv = mma(p.to(do.dtype), do, dv, UPCAST, PRECISION)
            ds = p * (dp - delta[None, :])
            if SOFTCAP:
                ds_pre = ds * dcap  # through the tanh: what reaches q.k (and L2's norms)
            else:
                ds_pre = ds
            dk = mma(ds_pre.to(q.dtype), q, dk, UPCAST, PRECISION)
            if L2:  # L2's dK term (the host refuses L2 with a preference and a cap: two different sums)
                ds_colsum += tl.sum(ds_pre, 1)
            elif HAS_PREF:
                ds_colsum += tl.sum(ds, 1)
            if HAS_T5:
                # No atomics and no address derived from `keep` (p > 0): inductor's mutation analysis
                # follows a store's or atomic's address back through everything it is computed from,
                # and an address derived from `keep` made it mark the table, LUT, MASK and PREF as written
                # (saved inputs of the backward, the table a parameter; tests/mutation_probe.py). The
                # per-bucket sums stay in registers; the kernel stores them at addresses made of
                # program ids alone.
                dtab = t5_table_grad(dtab, ds, qi_at, kj_at, Nq, r_lo, r_hi, one_run, LUT, slut, BUCKETS)
        return dk, dv, ds_colsum, dtab

    @triton.jit
    def softmax_bwd_dkdv_kernel(
            Q, K, V, DO, LSE, DELTA, DK, DV_OUT, DPREF, DTABLE, MASK, PREF, BIAS, LUT, SEED,
            sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sdob, sdoh, sdom, sdod,
            smb, smh, smm, smn, spb, sph, spn, slut, sbh,
            H, Nq, Nk, D, DV, GROUP, tune_nq, tune_nk, scale, dropout_p, SINKS, softcap, win_left, win_right,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
            L2: tl.constexpr, MASK_KIND: tl.constexpr, MASK_SHAPE: tl.constexpr, HAS_PREF: tl.constexpr,
            HAS_T5: tl.constexpr,
            CAUSAL: tl.constexpr, HEAD_MASK: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
            DROPOUT: tl.constexpr, BUCKETS: tl.constexpr, SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
            WINDOW: tl.constexpr, CU_Q=None, CU_K=None,
            VARLEN: tl.constexpr = False):
        # One program per key block of one key/value head; it walks the GROUP query heads that share the
        # head (grouped-query attention; GROUP = 1 otherwise) and accumulates their dK, dV in registers.
        # T5 (BIAS: the per-head bias vectors, LUT: offset -> bucket and run end, slut apart): each query
        # head's table gradient, summed per bucket over this key block, is stored in DTABLE
        # (cdiv(Nk, BLOCK_N), B, BUCKETS, H) fp32, one row per program and head; the host sums the rows
        # (a fixed order: deterministic, and no atomics).
        scale = tl.cast(scale, tl.float32)
        qk_scale = scale * LOG2E
        seed, dropout_p = dropout_args(SEED, dropout_p, DROPOUT)
        H_kv = H // GROUP
        pid_bkv, b, h_kv, start_n, offs_n, kj_at, offs_d, offs_dv = key_block(H_kv, Nk, BLOCK_N, BLOCK_D, BLOCK_DV)
        if VARLEN:  # b is the packed sequence: its own rows and lengths; lse, delta, dK, dV in per-sequence blocks
            tl.static_assert(MASK_KIND == 0 and not HAS_PREF and not HAS_T5 and not DROPOUT)
            start_q, Nq, start_k, Nk = packed_sequence(CU_Q, CU_K, b)
            if start_n >= Nk:
                return
            kj_at = tl.minimum(offs_n, Nk - 1)
            Q += start_q * sqm
            DO += start_q * sdom
            K += start_k * skn
            V += start_k * svn
            LSE += H * start_q - b * H * Nq  # + pid_bh * Nq below: the sequence's (H, Nq) block
            DELTA += H * start_q - b * H * Nq
            DK += (H_kv * start_k - b * H_kv * Nk) * D  # + pid_bkv * Nk * D below: a (H_kv, Nk, D) block
            DV_OUT += (H_kv * start_k - b * H_kv * Nk) * DV
        K += b * skb + h_kv * skh
        V += b * svb + h_kv * svh
        k = load_tile(K, offs_n, offs_d, skn, skd, Nk, D, True, HEAD_MASK)
        v = load_tile(V, offs_n, offs_dv, svn, svd, Nk, DV, True, HEAD_MASK)
        dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
        colsum = tl.zeros([BLOCK_N], tl.float32)  # sum of dS over every query of the group (L2's dK term)
        if WINDOW:
            first, q_in, q_out, q_hi = band_queries(start_n, Nq, Nk, win_left, win_right, BLOCK_M, BLOCK_N)
        else:
            first, mid, full = visible_queries(start_n, Nq, Nk, BLOCK_M, BLOCK_N, CAUSAL)
        cap2 = tl.cast(softcap, tl.float32) * LOG2E
        if L2 and (SOFTCAP or HAS_SINKS):  # the L2 norms enter before the cap (row constant included)
            key_pre = key_terms(k, offs_n, Nk, PREF, spn, qk_scale, True, False, False)
        else:
            key_pre = 0.0
        for g in range(0, GROUP):
            h = h_kv * GROUP + g
            pid_bh = b * H + h
            Qh = Q + b * sqb + h * sqh
            DOh = DO + b * sdob + h * sdoh
            MASKh = MASK + b * smb + h * smh
            PREFh = PREF + b * spb + h * sph
            BIASh = BIAS + h * sbh
            LSEh = LSE + pid_bh * Nq
            DELTAh = DELTA + pid_bh * Nq
            # per-key logit terms, hoisted out of the query loop; -inf past Nk makes dS exactly 0 for those
            # keys, which keeps them out of the T5 table sums (other flavours let them compute gradients
            # that are never stored)
            key_bias = key_terms(k, offs_n, Nk, PREFh, spn, qk_scale, L2 and not (SOFTCAP or HAS_SINKS), HAS_PREF,
                                 True)
            ds_colsum = tl.zeros([BLOCK_N], tl.float32)
            dtab = tl.zeros([BUCKETS], tl.float32)
            if WINDOW:  # query blocks outside the band never visited; whole blocks inside it unmasked
                dk, dv, ds_colsum, dtab = dkdv_stage(
                    dk, dv, ds_colsum, dtab, k, v, key_bias, Qh, DOh, LSEh, DELTAh, sqm, sqd, sdom, sdod, offs_n,
                    kj_at, offs_d, offs_dv, first, q_in, Nq, Nk, D, DV, qk_scale, MASKh, smm, smn, BIASh, slut, LUT,
                    seed, pid_bh, dropout_p, key_pre, cap2, win_left, win_right, BLOCK_M, L2, MASK_KIND, MASK_SHAPE,
                    HAS_PREF, HAS_T5, HEAD_MASK, UPCAST, PRECISION, DROPOUT, False, True, BUCKETS, SOFTCAP, L2 and
                    (SOFTCAP or HAS_SINKS), True)
                dk, dv, ds_colsum, dtab = dkdv_stage(
                    dk, dv, ds_colsum, dtab, k, v, key_bias, Qh, DOh, LSEh, DELTAh, sqm, sqd, sdom, sdod, offs_n,
                    kj_at, offs_d, offs_dv, q_in, q_out, Nq, Nk, D, DV, qk_scale, MASKh, smm, smn, BIASh, slut, LUT,
                    seed, pid_bh, dropout_p, key_pre, cap2, win_left, win_right, BLOCK_M, L2, MASK_KIND, MASK_SHAPE,
                    HAS_PREF, HAS_T5, HEAD_MASK, UPCAST, PRECISION, DROPOUT, False, False, BUCKETS, SOFTCAP, L2 and
                    (SOFTCAP or HAS_SINKS), False)
                dk, dv, ds_colsum, dtab = dkdv_stage(
                    dk, dv, ds_colsum, dtab, k, v, key_bias, Qh, DOh, LSEh, DELTAh, sqm, sqd, sdom, sdod, offs_n,
                    kj_at, offs_d, offs_dv, q_out, q_hi, Nq, Nk, D, DV, qk_scale, MASKh, smm, smn, BIASh, slut, LUT,
                    seed, pid_bh, dropout_p, key_pre, cap2, win_left, win_right, BLOCK_M, L2, MASK_KIND, MASK_SHAPE,
                    HAS_PREF, HAS_T5, HEAD_MASK, UPCAST, PRECISION, DROPOUT, False, True, BUCKETS, SOFTCAP, L2 and
                    (SOFTCAP or HAS_SINKS), True)
            else:
                if CAUSAL:  # diagonal blocks: causal masking
                    dk, dv, ds_colsum, dtab = dkdv_stage(
                        dk, dv, ds_colsum, dtab, k, v, key_bias, Qh, DOh, LSEh, DELTAh, sqm, sqd, sdom, sdod, offs_n,
                        kj_at, offs_d, offs_dv, first, mid, Nq, Nk, D, DV, qk_scale, MASKh, smm, smn, BIASh, slut,
                        LUT, seed, pid_bh, dropout_p, key_pre, cap2, win_left, win_right, BLOCK_M, L2, MASK_KIND,
                        MASK_SHAPE, HAS_PREF, HAS_T5, HEAD_MASK, UPCAST, PRECISION, DROPOUT, True, False, BUCKETS,
                        SOFTCAP, L2 and (SOFTCAP or HAS_SINKS), False)
                # whole query blocks that see every key of the block
                dk, dv, ds_colsum, dtab = dkdv_stage(
                    dk, dv, ds_colsum, dtab, k, v, key_bias, Qh, DOh, LSEh, DELTAh, sqm, sqd, sdom, sdod, offs_n,
                    kj_at, offs_d, offs_dv, mid, full, Nq, Nk, D, DV, qk_scale, MASKh, smm, smn, BIASh, slut, LUT,
                    seed, pid_bh, dropout_p, key_pre, cap2, win_left, win_right, BLOCK_M, L2, MASK_KIND, MASK_SHAPE,
                    HAS_PREF, HAS_T5, HEAD_MASK, UPCAST, PRECISION, DROPOUT, False, False, BUCKETS, SOFTCAP, L2 and
                    (SOFTCAP or HAS_SINKS), False)
                # the partial last query block
                dk, dv, ds_colsum, dtab = dkdv_stage(
                    dk, dv, ds_colsum, dtab, k, v, key_bias, Qh, DOh, LSEh, DELTAh, sqm, sqd, sdom, sdod, offs_n,
                    kj_at, offs_d, offs_dv, full, Nq, Nq, Nk, D, DV, qk_scale, MASKh, smm, smn, BIASh, slut, LUT,
                    seed, pid_bh, dropout_p, key_pre, cap2, win_left, win_right, BLOCK_M, L2, MASK_KIND, MASK_SHAPE,
                    HAS_PREF, HAS_T5, HEAD_MASK, UPCAST, PRECISION, DROPOUT, CAUSAL, True, BUCKETS, SOFTCAP, L2 and
                    (SOFTCAP or HAS_SINKS), False)
            if HAS_PREF:  # the preference is the query head's own: its gradient too
                tl.store(DPREF + pid_bh * Nk + offs_n, ds_colsum, mask=offs_n < Nk)
            if HAS_T5:
                B = tl.num_programs(1) // H_kv
                every = tl.arange(0, BUCKETS)
                tl.store(DTABLE + ((tl.program_id(0) * B + b) * BUCKETS + every) * H + h, dtab)
            colsum += ds_colsum
        if L2:
            dk = 2.0 * scale * (dk - k.to(tl.float32) * colsum[:, None])
        else:
            dk = scale * dk
        # gradients are written contiguous (B, H_kv, N, D)
        DK += pid_bkv * Nk * D
        DV_OUT += pid_bkv * Nk * DV
        store_tile(DK, offs_n, offs_d, D, 1, Nk, D, dk)
        store_tile(DV_OUT, offs_n, offs_dv, DV, 1, Nk, DV, dv)

    @triton.jit
    def dq_stage(dq, rowsum, q, do, lse2, delta, K, V, skn, skd, svn, svd, offs_m, qi_at, offs_d, offs_dv, lo, hi,
                 Nq, Nk, D, DV, qk_scale, MASK, smm, smn, PREF, spn, BIAS, slut, LUT, seed, pid_bh, dropout_p,
                 q_term, cap2, left, right,
                 BLOCK_N: tl.constexpr, L2: tl.constexpr, MASK_KIND: tl.constexpr, MASK_SHAPE: tl.constexpr,
                 HAS_PREF: tl.constexpr,
                 HAS_T5: tl.constexpr, CAUSAL: tl.constexpr, HEAD_MASK: tl.constexpr, UPCAST: tl.constexpr,
                 PRECISION: tl.constexpr, DROPOUT: tl.constexpr, EDGE: tl.constexpr,
                 SOFTCAP: tl.constexpr, FULL_L2: tl.constexpr, WINDOW: tl.constexpr):
        """dQ (unscaled: sum_j dS_ij k_j, dS through the cap's derivative with SOFTCAP) over the key blocks
        [lo, hi); FULL_L2 also sums dS per row in ``rowsum`` (the row constant's gradient: with a cap or
        a sink, a row's dS no longer sums to 0)."""
        for start_n in range(lo, hi, BLOCK_N):
            start_n = tl.multiple_of(start_n, BLOCK_N)
            offs_n = start_n + tl.arange(0, BLOCK_N)
            k = load_tile(K, offs_n, offs_d, skn, skd, Nk, D, EDGE, HEAD_MASK)
            v = load_tile(V, offs_n, offs_dv, svn, svd, Nk, DV, EDGE, HEAD_MASK)
            s, dcap = scores(q, k, offs_m, offs_n, qi_at, Nq, Nk, qk_scale, MASK, smm, smn, PREF, spn, BIAS, slut,
                             LUT, q_term, cap2, left, right, L2, MASK_KIND, MASK_SHAPE, HAS_PREF, HAS_T5, CAUSAL,
                             EDGE, UPCAST, PRECISION, SOFTCAP, FULL_L2, WINDOW)
            p = tl.math.exp2(s - lse2[:, None])
            dp = mm(do, tl.trans(v), UPCAST, PRECISION)
            if DROPOUT:
                dp = dp * dropout_scale_at(seed, pid_bh, offs_m[:, None], offs_n[None, :], Nq, Nk, dropout_p)
            ds = p * (dp - delta[:, None])
            if SOFTCAP:
                ds = ds * dcap
            dq = mma(ds.to(k.dtype), k, dq, UPCAST, PRECISION)
            if FULL_L2:
                rowsum += tl.sum(ds, 1)
        return dq, rowsum

    @triton.jit
    def softmax_bwd_dq_kernel(
            Q, K, V, DO, LSE, DELTA, DQ, MASK, PREF, BIAS, LUT, SEED,
            sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sdob, sdoh, sdom, sdod,
            smb, smh, smm, smn, spb, sph, spn, slut, sbh,
            H, Nq, Nk, D, DV, GROUP, tune_nq, tune_nk, scale, dropout_p, SINKS, softcap, win_left, win_right,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
            L2: tl.constexpr, MASK_KIND: tl.constexpr, MASK_SHAPE: tl.constexpr, HAS_PREF: tl.constexpr,
            HAS_T5: tl.constexpr,
            CAUSAL: tl.constexpr, HEAD_MASK: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
            DROPOUT: tl.constexpr, SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr, WINDOW: tl.constexpr,
            CU_Q=None, CU_K=None, VARLEN: tl.constexpr = False):
        scale = tl.cast(scale, tl.float32)
        qk_scale = scale * LOG2E
        seed, dropout_p = dropout_args(SEED, dropout_p, DROPOUT)
        pid_bh, b, h, start_m, offs_m, qi_at, offs_d, offs_dv = query_block(H, Nq, BLOCK_M, BLOCK_D, BLOCK_DV)
        if VARLEN:  # b is the packed sequence: its own rows and lengths; lse, delta, dQ in per-sequence blocks
            tl.static_assert(MASK_KIND == 0 and not HAS_PREF and not HAS_T5 and not DROPOUT)
            start_q, Nq, start_k, Nk = packed_sequence(CU_Q, CU_K, b)
            if start_m >= Nq:
                return
            qi_at = tl.minimum(offs_m, Nq - 1)
            Q += start_q * sqm
            DO += start_q * sdom
            K += start_k * skn
            V += start_k * svn
            LSE += H * start_q - b * H * Nq  # + pid_bh * Nq below: the sequence's (H, Nq) block
            DELTA += H * start_q - b * H * Nq
            DQ += (H * start_q - b * H * Nq) * D  # + pid_bh * Nq * D below: a (H, Nq, D) block
        Q += b * sqb + h * sqh
        K += b * skb + (h // GROUP) * skh  # grouped-query attention: GROUP query heads share a key/value head
        V += b * svb + (h // GROUP) * svh
        DO += b * sdob + h * sdoh
        MASK += b * smb + h * smh
        PREF += b * spb + h * sph
        BIAS += h * sbh

        q = load_tile(Q, offs_m, offs_d, sqm, sqd, Nq, D, True, HEAD_MASK)
        do = load_tile(DO, offs_m, offs_dv, sdom, sdod, Nq, DV, True, HEAD_MASK)
        lse2 = load_rows(LSE + pid_bh * Nq, offs_m, Nq, float("inf"), True)
        delta = load_rows(DELTA + pid_bh * Nq, offs_m, Nq, 0.0, True)
        dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        rowsum = tl.zeros([BLOCK_M], tl.float32)
        cap2 = tl.cast(softcap, tl.float32) * LOG2E
        q_term = row_term(q, qk_scale, L2 and (SOFTCAP or HAS_SINKS))
        if WINDOW:  # the forward's key blocks: outside the band never visited, inside it unmasked
            k_lo, k_in, k_out, k_hi = band_keys(start_m, Nq, Nk, win_left, win_right, BLOCK_M, BLOCK_N)
            dq, rowsum = dq_stage(
                dq, rowsum, q, do, lse2, delta, K, V, skn, skd, svn, svd, offs_m, qi_at, offs_d, offs_dv, k_lo, k_in,
                Nq, Nk, D, DV, qk_scale, MASK, smm, smn, PREF, spn, BIAS, slut, LUT, seed, pid_bh, dropout_p, q_term,
                cap2, win_left, win_right, BLOCK_N, L2, MASK_KIND, MASK_SHAPE, HAS_PREF, HAS_T5, False, HEAD_MASK,
                UPCAST, PRECISION, DROPOUT, True, SOFTCAP, L2 and (SOFTCAP or HAS_SINKS), True)
            dq, rowsum = dq_stage(
                dq, rowsum, q, do, lse2, delta, K, V, skn, skd, svn, svd, offs_m, qi_at, offs_d, offs_dv, k_in, k_out,
                Nq, Nk, D, DV, qk_scale, MASK, smm, smn, PREF, spn, BIAS, slut, LUT, seed, pid_bh, dropout_p, q_term,
                cap2, win_left, win_right, BLOCK_N, L2, MASK_KIND, MASK_SHAPE, HAS_PREF, HAS_T5, False, HEAD_MASK,
                UPCAST, PRECISION, DROPOUT, False, SOFTCAP, L2 and (SOFTCAP or HAS_SINKS), True)
            dq, rowsum = dq_stage(
                dq, rowsum, q, do, lse2, delta, K, V, skn, skd, svn, svd, offs_m, qi_at, offs_d, offs_dv, k_out, k_hi,
                Nq, Nk, D, DV, qk_scale, MASK, smm, smn, PREF, spn, BIAS, slut, LUT, seed, pid_bh, dropout_p, q_term,
                cap2, win_left, win_right, BLOCK_N, L2, MASK_KIND, MASK_SHAPE, HAS_PREF, HAS_T5, False, HEAD_MASK,
                UPCAST, PRECISION, DROPOUT, True, SOFTCAP, L2 and (SOFTCAP or HAS_SINKS), True)
        else:
            lo, hi = visible_keys(start_m, Nq, Nk, BLOCK_M, BLOCK_N, CAUSAL)
            dq, rowsum = dq_stage(
                dq, rowsum, q, do, lse2, delta, K, V, skn, skd, svn, svd, offs_m, qi_at, offs_d, offs_dv, 0, lo, Nq,
                Nk, D, DV, qk_scale, MASK, smm, smn, PREF, spn, BIAS, slut, LUT, seed, pid_bh, dropout_p, q_term,
                cap2, win_left, win_right, BLOCK_N, L2, MASK_KIND, MASK_SHAPE, HAS_PREF, HAS_T5, CAUSAL, HEAD_MASK,
                UPCAST, PRECISION, DROPOUT, False, SOFTCAP, L2 and (SOFTCAP or HAS_SINKS), False)
            dq, rowsum = dq_stage(
                dq, rowsum, q, do, lse2, delta, K, V, skn, skd, svn, svd, offs_m, qi_at, offs_d, offs_dv, lo, hi, Nq,
                Nk, D, DV, qk_scale, MASK, smm, smn, PREF, spn, BIAS, slut, LUT, seed, pid_bh, dropout_p, q_term,
                cap2, win_left, win_right, BLOCK_N, L2, MASK_KIND, MASK_SHAPE, HAS_PREF, HAS_T5, CAUSAL, HEAD_MASK,
                UPCAST, PRECISION, DROPOUT, True, SOFTCAP, L2 and (SOFTCAP or HAS_SINKS), False)
        if L2 and (SOFTCAP or HAS_SINKS):  # the row constant -scale ||q_i||^2's gradient: -2 scale q_i sum_j dS_ij
            dq = dq - q.to(tl.float32) * rowsum[:, None]
        if L2:
            dq = (2.0 * scale) * dq
        else:
            dq = scale * dq
        DQ += pid_bh * Nq * D  # contiguous (B, H, Nq, D)
        store_tile(DQ, offs_m, offs_d, D, 1, Nq, D, dq)

    @triton.jit
    def softmax_bwd_delta_kernel(O, ORES, DO, DELTA, sob, soh, som, sod, sdob, sdoh, sdom, sdod, H, Nq, DV,
                                 BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr, RESIDUAL: tl.constexpr,
                                 CU_Q=None, VARLEN: tl.constexpr = False):
        """DELTA (B, H, Nq) fp32 contiguous = sum_d dO * O per row: the backward's first launch (one
        instead of the casts, product and row sum in eager ops). RESIDUAL: O is the rounded output and
        ORES (O's strides) its rounding residual, added back (the T5 forward of half inputs writes it)."""
        pid_bh = tl.program_id(1).to(tl.int64)
        b = pid_bh // H
        h = pid_bh % H
        if VARLEN:  # b is the packed sequence; DELTA in per-sequence (H, Nq) blocks, as the lse
            start_q, Nq, _, _ = packed_sequence(CU_Q, CU_Q, b)
            if tl.program_id(0) * BLOCK_M >= Nq:
                return
            O += start_q * som
            ORES += start_q * som
            DO += start_q * sdom
            DELTA += H * start_q - b * H * Nq
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_DV)
        inside = (offs_m[:, None] < Nq) & (offs_d[None, :] < DV)
        o_at = b * sob + h * soh + offs_m[:, None] * som + offs_d[None, :] * sod
        o = tl.load(O + o_at, mask=inside, other=0.0).to(tl.float32)
        if RESIDUAL:
            o += tl.load(ORES + o_at, mask=inside, other=0.0).to(tl.float32)
        do = tl.load(DO + b * sdob + h * sdoh + offs_m[:, None] * sdom + offs_d[None, :] * sdod, mask=inside,
                     other=0.0)
        tl.store(DELTA + pid_bh * Nq + offs_m, tl.sum(o * do.to(tl.float32), 1), mask=offs_m < Nq)
