"""Triton kernels of OT attention (paper 004 eq 22) in matmul form; the host code is triton.py.

Per (batch, head), with A = keys + extra templates, C_it = sc q_i.a_t + mask_it (-inf for a removed
template), G_jt = sg k_j.a_t, and u_ij = keep_ij exp(lu_j - lz_i) (lz_i: logsumexp of lu over the
keys query i keeps):

    EC = exp(C - max_t C)   EG = exp(G - max_t G)            (_exp_kernel; fp32 maxima, 0 <= E <= 1)
    S  = EC @ EG^T          R = u / S                        (_pair_kernel: the normalisers Z_ij up to
                                                              the row shifts)
    W  = EC * (R @ EG)      out = W @ a_v                    (_out_kernel)

so eq (22)'s inner softmax over A never exists as a (Nq, Nk, |A|) tensor and all the work is in
tensor-core matmuls (4 Nq Nk |A| flops forward). The backward, with dW = dout a_v^T, EDW = EC * dW,
g_ij = sum_t P_ijt dW_it (= the gradient of u_ij) and RG = R * g:

    S, T = EC @ EG^T, EDW @ EG^T;  R = u / S, g = T / S      (_pair_kernel, BACKWARD)
    dC = EC * (dW * (R @ EG) - RG @ EG),  d a_v = W^T dout   (_dc_kernel)
    dG = EG * (R^T @ EDW - RG^T @ EC)                        (_dg_kernel)

and dq, dk, d a_k are matmuls of dC, dG on the host. Every accumulator, maximum and normaliser is
float32 whatever the input dtype; the exponentials and R, RG (values in [0, 1] times u / S) are
matmul operands in bfloat16 for 16-bit inputs, as FlashAttention rounds P before P V.

Every grid is one flat axis with (batch, head) slowest (_grid1, _grid2), so the tiles running side by
side share one pair's EC, EG, R rows through L2. With a mask or causal (SKIP), _exp_kernel also writes
each query's range [lo, hi) of kept keys; as a removed key is both an inactive template (C = -inf,
EC = 0) and a source with u = 0, the other kernels visit only the template and source blocks of
their row block's range plus the extra templates, by loop bounds (_key_range).

Exact where the shift underflows: S_ij >= exp(max_t (C_it + G_jt) - max C_i - max G_j), which is tiny
when the best template of pair (i, j) scores far below both row maxima (logits of ~90 and more).
Pairs with S_ij <= SAFE (and u_ij > 0) are flagged ``bad`` (R_ij = 0) and recomputed by the
_fallback kernels with a per-pair streaming logsumexp over A (C and G tiles recomputed from q, k, a_k),
adding their share to out (forward) or to d a_v, dq, dk, d a_k and g (backward) with atomics. Each
fallback program reads one flag per pair tile and returns when it holds no bad pair, so without
any the fallback costs one scalar load per tile.

Packed sequences (VARLEN, CU_Q / CU_K and the flag at the end of each signature but _dlu_kernel's, whose
log u a packed call declines; ops/ot/varlen.py launches them): a pair index is a (sequence, head) pair, sequence (BH0 + bh) // H. The size arguments
NQ, NK, NA are then the maxima over the sequences, the extents of every per-pair block (inputs and
temporaries alike are laid out max_q x max_A per pair: the strides, written SQ, SK, SA below); at its
entry a program reads its sequence's n_q, n_k from the offsets (|A| = n_k + the NA - NK extra templates),
binds NQ, NK, NA to them, and returns when its tile lies past them. Everything after the entry is the
dense kernel on that sequence, so causality (bottom-right) and the tile skipping are per sequence, and
no tile crossing a sequence's end is computed. Without VARLEN, SQ, SK, SA are NQ, NK, NA.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..triton_utils import mask_tile, mm, packed_sequence


@triton.jit
def _grid2(N1, N2):
    """(bh, p1, p2) of this program on a flat grid of (B*H) x N1 x N2 tiles, bh varying slowest: the
    programs resident at once are the tiles of one or a few (batch, head) pairs, so the EC, EG and R
    rows that neighbouring tiles share come from L2 (with bh fastest, every resident program read its
    own pair's rows from HBM). One grid axis takes up to 2^31 - 1 programs; bh is int64 because
    bh * N * |A| passes 2^31."""
    pid = tl.program_id(0).to(tl.int64)
    per = N1 * N2
    bh = pid // per
    rest = (pid % per).to(tl.int32)
    return bh, rest // N2, rest % N2


@triton.jit
def _grid1(N1):
    """(bh, p) on a flat grid of (B*H) x N1 tiles, bh varying slowest (see _grid2)."""
    pid = tl.program_id(0).to(tl.int64)
    return pid // N1, (pid % N1).to(tl.int32)


@triton.jit
def _pair_lengths(CU_Q, CU_K, pair, H, NK, NA):
    """(n_q, n_k, |A|) of (sequence, head) pair ``pair`` of a packed call: its sequence's lengths read
    from the offsets; |A| adds the NA - NK extra templates every sequence shares."""
    _, n_q, _, n_k = packed_sequence(CU_Q, CU_K, pair // H)
    return n_q, n_k, n_k + (NA - NK)


@triton.jit
def _key_range(LO, HI, ri, NQ, NK, SKIP: tl.constexpr):
    """[lo, hi): the keys that some row of ri keeps (lo >= hi: none). Every active key template
    (C > -inf) and every source with u > 0 of these rows lies inside, so tiles outside it are zero
    and never loaded. Without a mask or causal (SKIP off) every row keeps every key: [0, NK)."""
    if SKIP:
        lo = tl.min(tl.load(LO + ri, mask=ri < NQ, other=NK))
        hi = tl.max(tl.load(HI + ri, mask=ri < NQ, other=0))
    else:
        lo = 0
        hi = NK
    return lo, hi


@triton.jit
def _load2(ptr, rows, cols, n_rows, n_cols, s_row, other):
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    return tl.load(ptr + rows[:, None] * s_row + cols[None, :], mask=mask, other=other)


@triton.jit
def _store2(ptr, rows, cols, n_rows, n_cols, s_row, value):
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    tl.store(ptr + rows[:, None] * s_row + cols[None, :], value.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _mask_base(MASK, bh, BH0, H, s_mb, s_mh):
    """The (Nq, Nk) mask slice of this program's (batch, head); bh counts from the chunk start BH0."""
    g = BH0 + bh
    return MASK + (g // H) * s_mb + (g % H) * s_mh


@triton.jit
def _c_logits(x, AK, ri, rt, NQ, NK, NA, D, sc, mask_ptr, s_mm, s_mn,
              BD: tl.constexpr, MASK_KIND: tl.constexpr, CAUSAL: tl.constexpr,
              UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """(C tile (rows ri, templates rt) fp32 with -inf for removed templates, keep of the keys t < NK).
    x: the rows' q (len(ri), BD). Extra templates (NK <= t < NA) are never removed."""
    ak = _load2(AK, rt, tl.arange(0, BD), NA, D, D, 0.0)
    s = mm(x, tl.trans(ak), UPCAST, PRECISION) * sc
    s, keep = mask_tile(s, ri, rt, NQ, NK, mask_ptr, s_mm, s_mn, MASK_KIND, CAUSAL)
    templ = keep | ((rt >= NK) & (rt < NA))[None, :]
    return tl.where(templ, s, float("-inf")), keep


@triton.jit
def _g_logits(x, AK, rt, NA, D, sg, BD: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """G tile (rows of x = keys, templates rt) fp32, -inf past NA."""
    ak = _load2(AK, rt, tl.arange(0, BD), NA, D, D, 0.0)
    s = mm(x, tl.trans(ak), UPCAST, PRECISION) * sg
    return tl.where((rt < NA)[None, :], s, float("-inf"))


@triton.jit
def _u_tile(LU, LZ, mask_ptr, ri, rj, NQ, NK, s_mm, s_mn, MASK_KIND: tl.constexpr, CAUSAL: tl.constexpr):
    """u_ij = keep_ij exp(lu_j - lz_i), 0 outside (fp32)."""
    zero = (ri[:, None] * 0 + rj[None, :] * 0).to(tl.float32)
    _, keep = mask_tile(zero, ri, rj, NQ, NK, mask_ptr, s_mm, s_mn, MASK_KIND, CAUSAL)
    lu = tl.load(LU + rj, mask=rj < NK, other=float("-inf")).to(tl.float32)
    lz = tl.load(LZ + ri, mask=ri < NQ, other=0.0)
    live = keep & (lu > float("-inf"))[None, :]
    shifted = tl.where(live, lu[None, :], 0.0) - tl.where(live, lz[:, None], 0.0)   # no inf - inf
    return tl.where(live, tl.exp(shifted), 0.0)


# --- the matmul path -------------------------------------------------------------------------------

@triton.jit
def _exp_kernel(X, AK, MASK, LU, E, LZ, LO, HI, DOUT, OUTP, AV, DELTA, EDW,
                NR, NQ, NK, NA, D, DV, sc, BH0, H, s_mb, s_mh, s_mm, s_mn,
                IS_QUERY: tl.constexpr, HAS_DOUT: tl.constexpr, MASK_KIND: tl.constexpr, CAUSAL: tl.constexpr,
                SKIP: tl.constexpr, BM: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
                UPCAST: tl.constexpr, PRECISION: tl.constexpr, CU_Q=None, CU_K=None, VARLEN: tl.constexpr = False):
    """E = exp(L - max_t L) for the logits L = C (IS_QUERY: rows are queries, with the mask) or G (rows
    are keys). Queries also get lz (logsumexp of lu over kept keys), with SKIP the range [LO, HI) of
    the keys each row keeps (_key_range), and with HAS_DOUT delta_i = dout_i . out_i (fp32, written
    for the later kernels; the host made two fp32 copies of dout and out for it) and EDW = E * dW,
    dW_it = dout_i . a_v_t - delta_i (see _dc_kernel for the shift). The row max, lz and the range are
    one pass over A (lz by an online rescale); the second pass recomputes the logit tile to write E,
    since the shift must be the final max before a 16-bit E is rounded."""
    sc = tl.cast(sc, tl.float32)  # inductor hands Python floats over as fp64 scalars
    bh, pi = _grid1(tl.cdiv(NR, BM))
    SR, SQ, SK, SA = NR, NQ, NK, NA
    if VARLEN:
        NQ, NK, NA = _pair_lengths(CU_Q, CU_K, BH0 + bh, H, NK, NA)
        if IS_QUERY:
            NR = NQ
        else:
            NR = NK
        if pi * BM >= NR:
            return
    ri, rd = pi * BM + tl.arange(0, BM), tl.arange(0, BD)
    X, AK, E = X + bh * SR * D, AK + bh * SA * D, E + bh * SR * SA
    mask_ptr = _mask_base(MASK, bh, BH0, H, s_mb, s_mh)
    x = _load2(X, ri, rd, NR, D, D, 0.0)
    m = tl.full((BM,), float("-inf"), tl.float32)
    lm = tl.full((BM,), float("-inf"), tl.float32)
    ls = tl.zeros((BM,), tl.float32)
    lo = tl.full((BM,), NK, tl.int32)
    hi = tl.zeros((BM,), tl.int32)
    for t0 in range(0, NA, BT):
        rt = t0 + tl.arange(0, BT)
        if IS_QUERY:
            s, keep = _c_logits(x, AK, ri, rt, NQ, NK, NA, D, sc, mask_ptr, s_mm, s_mn, BD, MASK_KIND, CAUSAL,
                                UPCAST, PRECISION)
            lu = tl.load(LU + bh * SK + rt, mask=rt < NK, other=float("-inf")).to(tl.float32)
            val = tl.where(keep, lu[None, :], float("-inf"))
            lm_new = tl.maximum(lm, tl.max(val, 1))
            lm_safe = tl.where(lm_new == float("-inf"), 0.0, lm_new)
            ls = ls * tl.exp(lm - lm_safe) + tl.sum(tl.exp(val - lm_safe[:, None]), 1)
            lm = lm_new
            if SKIP:
                lo = tl.minimum(lo, tl.min(tl.where(keep, rt[None, :], NK), 1))
                hi = tl.maximum(hi, tl.max(tl.where(keep, rt[None, :] + 1, 0), 1))
        else:
            s = _g_logits(x, AK, rt, NA, D, sc, BD, UPCAST, PRECISION)
        m = tl.maximum(m, tl.max(s, 1))
    if IS_QUERY:
        lm_safe = tl.where(lm == float("-inf"), 0.0, lm)
        lz = tl.where(ls > 0, lm_safe + tl.log(tl.where(ls > 0, ls, 1.0)), float("-inf"))
        tl.store(LZ + bh * SQ + ri, lz, mask=ri < NQ)
        if SKIP:
            tl.store(LO + bh * SQ + ri, lo, mask=ri < NQ)
            tl.store(HI + bh * SQ + ri, hi, mask=ri < NQ)
    m_safe = tl.where(m == float("-inf"), 0.0, m)   # a query without templates: E = 0
    if HAS_DOUT:
        rdv = tl.arange(0, BDV)
        dout = _load2(DOUT + bh * SQ * DV, ri, rdv, NQ, DV, DV, 0.0)
        fwd_out = _load2(OUTP + bh * SQ * DV, ri, rdv, NQ, DV, DV, 0.0)
        delta = tl.sum(dout.to(tl.float32) * fwd_out.to(tl.float32), 1)
        tl.store(DELTA + bh * SQ + ri, delta, mask=ri < NQ)
    for t0 in range(0, NA, BT):
        rt = t0 + tl.arange(0, BT)
        if IS_QUERY:
            s, _ = _c_logits(x, AK, ri, rt, NQ, NK, NA, D, sc, mask_ptr, s_mm, s_mn, BD, MASK_KIND, CAUSAL,
                             UPCAST, PRECISION)
        else:
            s = _g_logits(x, AK, rt, NA, D, sc, BD, UPCAST, PRECISION)
        e = tl.exp(s - m_safe[:, None])
        _store2(E, ri, rt, NR, NA, SA, e)
        if HAS_DOUT:
            av = _load2(AV + bh * SA * DV, rt, rdv, NA, DV, DV, 0.0)
            dw = mm(dout, tl.trans(av), UPCAST, PRECISION) - delta[:, None]
            _store2(EDW + bh * SR * SA, ri, rt, NR, NA, SA, e * dw)


@triton.jit
def _pair_steps(acc, acc_t, EC, EG, EDW, ri, rj, t_lo, t_hi, t_bound, NQ, NK, SA,
                BACKWARD: tl.constexpr, BK: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """acc += EC[:, t] @ EG[:, t]^T (and acc_t += EDW[:, t] @ EG[:, t]^T) over the template blocks from
    t_lo to t_hi, loads cut at t_bound (NK or NA: a bound the JIT knows to be a multiple of 16 keeps
    the loads vectorised and pipelined; EC is zero between a row block's hi and NK anyway); SA: the
    rows' stride."""
    rk = tl.arange(0, BK)
    for t0 in range(t_lo, t_hi, BK):
        ec = _load2(EC, ri, t0 + rk, NQ, t_bound, SA, 0.0)
        eg_t = tl.trans(_load2(EG, rj, t0 + rk, NK, t_bound, SA, 0.0))
        acc += mm(ec, eg_t, UPCAST, PRECISION)
        if BACKWARD:
            edw = _load2(EDW, ri, t0 + rk, NQ, t_bound, SA, 0.0)
            acc_t += mm(edw, eg_t, UPCAST, PRECISION)
    return acc, acc_t


@triton.jit
def _pair_kernel(EC, EG, EDW, LU, LZ, LO, HI, MASK, R, RG, UG, BAD, TBAD,
                 NQ, NK, NA, SAFE, BH0, H, s_mb, s_mh, s_mm, s_mn,
                 BACKWARD: tl.constexpr, NEED_UG: tl.constexpr, MASK_KIND: tl.constexpr, CAUSAL: tl.constexpr,
                 SKIP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 UPCAST: tl.constexpr, PRECISION: tl.constexpr, CU_Q=None, CU_K=None, VARLEN: tl.constexpr = False):
    """R = u / S per (query, source) pair, S = EC @ EG^T; bad pairs (S <= SAFE, u > 0) get R = 0,
    BAD = 1 and count in TBAD (one int per tile). BACKWARD: also T = EDW @ EG^T, g = T / S,
    RG = R * g and (NEED_UG) UG = u * g. SKIP: the sum runs over the rows' key range [lo, hi) (from
    the aligned block holding lo) and the extra templates only, and a tile whose sources all lie
    outside [lo, hi) (u = 0: causal's upper triangle, padding) does no matmul at all."""
    SAFE = tl.cast(SAFE, tl.float32)  # inductor hands Python floats over as fp64 scalars
    bh, pi, pj = _grid2(tl.cdiv(NQ, BM), tl.cdiv(NK, BN))
    SQ, SK, SA = NQ, NK, NA
    if VARLEN:
        NQ, NK, NA = _pair_lengths(CU_Q, CU_K, BH0 + bh, H, NK, NA)
        if (pi * BM >= NQ) | (pj * BN >= NK):    # its TBAD entry is never read (the fallbacks return too)
            return
    ri, rj = pi * BM + tl.arange(0, BM), pj * BN + tl.arange(0, BN)
    EC, EG, EDW = EC + bh * SQ * SA, EG + bh * SK * SA, EDW + bh * SQ * SA
    acc = tl.zeros((BM, BN), tl.float32)
    acc_t = tl.zeros((BM, BN), tl.float32)
    if SKIP:
        lo, hi = _key_range(LO + bh * SQ, HI + bh * SQ, ri, NQ, NK, SKIP)
        dead = (pj * BN >= hi) | (pj * BN + BN <= lo)
        start = (lo // BK) * BK
        acc, acc_t = _pair_steps(acc, acc_t, EC, EG, EDW, ri, rj, start, tl.where(dead, start, hi), NK, NQ, NK,
                                 SA, BACKWARD, BK, UPCAST, PRECISION)
        acc, acc_t = _pair_steps(acc, acc_t, EC, EG, EDW, ri, rj, NK, tl.where(dead, NK, NA), NA, NQ, NK, SA,
                                 BACKWARD, BK, UPCAST, PRECISION)
    else:
        acc, acc_t = _pair_steps(acc, acc_t, EC, EG, EDW, ri, rj, 0, NA, NA, NQ, NK, SA, BACKWARD, BK, UPCAST,
                                 PRECISION)
    mask_ptr = _mask_base(MASK, bh, BH0, H, s_mb, s_mh)
    u = _u_tile(LU + bh * SK, LZ + bh * SQ, mask_ptr, ri, rj, NQ, NK, s_mm, s_mn, MASK_KIND, CAUSAL)
    live = u > 0
    bad = live & (acc <= SAFE)
    ok = live & (acc > SAFE)
    inv = tl.where(ok, 1.0 / tl.where(ok, acc, 1.0), 0.0)
    r = u * inv
    pair = bh * SQ * SK
    _store2(R + pair, ri, rj, NQ, NK, SK, r)
    _store2(BAD + pair, ri, rj, NQ, NK, SK, bad.to(tl.uint8))
    tl.store(TBAD + tl.program_id(0), tl.sum(bad.to(tl.int32)))
    if BACKWARD:
        g = acc_t * inv
        _store2(RG + pair, ri, rj, NQ, NK, SK, r * g)
        if NEED_UG:
            _store2(UG + pair, ri, rj, NQ, NK, SK, u * g)


@triton.jit
def _template_blocks(lo, hi, NK, NA, BT: tl.constexpr, SKIP: tl.constexpr):
    """(first block start, bound of the first part, blocks in the first part, number of blocks) of
    the template blocks a row block visits: SKIP, the blocks of [lo, hi) (aligned, cut at NK: EC is
    zero from hi to NK) then those of the extras [NK, NA); otherwise the blocks of [0, NA), all in
    the first part. Block b < n_first starts at first + b BT, a later one at NK + (b - n_first) BT
    (cut at NA)."""
    if SKIP:
        first = (lo // BT) * BT
        n_first = tl.cdiv(tl.maximum(hi, first) - first, BT)
        return first, NK, n_first, n_first + tl.cdiv(NA - NK, BT)
    else:
        return 0, NA, tl.cdiv(NA, BT), tl.cdiv(NA, BT)


@triton.jit
def _block_at(b, first, first_bound, n_first, NK, NA, BT: tl.constexpr):
    """(start, bound) of template block b (see _template_blocks)."""
    in_first = b < n_first
    return tl.where(in_first, first + b * BT, NK + (b - n_first) * BT), tl.where(in_first, first_bound, NA)


@triton.jit
def _out_kernel(EC, EG, R, AV, LO, HI, OUT, NQ, NK, NA, DV,
                SKIP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BT: tl.constexpr, BDV: tl.constexpr,
                UPCAST: tl.constexpr, PRECISION: tl.constexpr, BH0=0, H=1, CU_Q=None, CU_K=None,
                VARLEN: tl.constexpr = False):
    """out = (EC * (R @ EG)) @ a_v for BM queries, template block by template block (fp32 out). SKIP:
    only the template blocks of the rows' key range and the extras, and R's columns in that range.
    BH0, H: the chunk's first pair and the heads, read with VARLEN only (the sequence of a pair)."""
    bh, pi = _grid1(tl.cdiv(NQ, BM))
    SQ, SK, SA = NQ, NK, NA
    if VARLEN:
        NQ, NK, NA = _pair_lengths(CU_Q, CU_K, BH0 + bh, H, NK, NA)
        if pi * BM >= NQ:
            return
    ri, rdv = pi * BM + tl.arange(0, BM), tl.arange(0, BDV)
    EC, EG, R, AV = EC + bh * SQ * SA, EG + bh * SK * SA, R + bh * SQ * SK, AV + bh * SA * DV
    lo, hi = _key_range(LO + bh * SQ, HI + bh * SQ, ri, NQ, NK, SKIP)
    j_first = (lo // BN) * BN
    first, first_bound, n_first, n_all = _template_blocks(lo, hi, NK, NA, BT, SKIP)
    out = tl.zeros((BM, BDV), tl.float32)
    for b in range(0, n_all):
        t0, t_end = _block_at(b, first, first_bound, n_first, NK, NA, BT)
        rt = t0 + tl.arange(0, BT)
        acc = tl.zeros((BM, BT), tl.float32)
        for j0 in range(j_first, hi, BN):
            rj = j0 + tl.arange(0, BN)
            # EG cut at NA only: columns past t_end meet EC = 0 below
            acc += mm(_load2(R, ri, rj, NQ, NK, SK, 0.0), _load2(EG, rj, rt, NK, NA, SA, 0.0), UPCAST, PRECISION)
        w = _load2(EC, ri, rt, NQ, t_end, SA, 0.0).to(tl.float32) * acc
        av = _load2(AV, rt, rdv, t_end, DV, DV, 0.0)
        out += mm(w.to(av.dtype), av, UPCAST, PRECISION)
    _store2(OUT + bh * SQ * DV, ri, rdv, NQ, DV, DV, out)


@triton.jit
def _block_active(t0, lo, hi, NK, BT: tl.constexpr):
    """Whether template block [t0, t0 + BT) holds a template active for a row with key range [lo, hi)."""
    return ((t0 < hi) & (t0 + BT > lo)) | (t0 + BT > NK)


@triton.jit
def _dc_kernel(EC, EG, R, RG, AV, DOUT, DELTA, LO, HI, DC, DAV, NQ, NK, NA, DV, sc,
               SKIP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BT: tl.constexpr, BDV: tl.constexpr,
               UPCAST: tl.constexpr, PRECISION: tl.constexpr, BH0=0, H=1, CU_Q=None, CU_K=None,
               VARLEN: tl.constexpr = False):
    """For BT templates: sc * dC = sc * EC * (dW * (R @ EG) - RG @ EG) for every query block, and
    d a_v = W^T dout accumulated over them (fp32), with W = EC * (R @ EG) and dW = dout a_v^T - delta.
    SKIP: a query block for which the template block is inactive writes dC = 0 without its matmuls,
    and the sums over sources run over the block's key range only.

    dC_it = sum_j u_ij P_ijt (dW_it - g_ij) is the difference of two sums over j, which cancel where
    P is peaked. Any per-query shift of dW leaves it unchanged (sum_t P_ijt = 1 moves g_ij by the same
    amount) and so does the gradient of u (softmax over j per query); shifting by
    delta_i = dout_i . out_i = sum_t W_it dW_it, FlashAttention's delta, centres dW and makes the
    cancellation relative to |dW - delta| instead of |dW|."""
    sc = tl.cast(sc, tl.float32)  # inductor hands Python floats over as fp64 scalars
    bh, pt = _grid1(tl.cdiv(NA, BT))
    SQ, SK, SA = NQ, NK, NA
    if VARLEN:
        NQ, NK, NA = _pair_lengths(CU_Q, CU_K, BH0 + bh, H, NK, NA)
        if pt * BT >= NA:
            return
    rt, rdv = pt * BT + tl.arange(0, BT), tl.arange(0, BDV)
    EC, EG, R, RG = EC + bh * SQ * SA, EG + bh * SK * SA, R + bh * SQ * SK, RG + bh * SQ * SK
    DOUT = DOUT + bh * SQ * DV
    av = _load2(AV + bh * SA * DV, rt, rdv, NA, DV, DV, 0.0)
    dav = tl.zeros((BT, BDV), tl.float32)
    for i0 in range(0, NQ, BM):
        ri = i0 + tl.arange(0, BM)
        lo, hi = _key_range(LO + bh * SQ, HI + bh * SQ, ri, NQ, NK, SKIP)
        j_first = (lo // BN) * BN
        j_end = hi
        if SKIP:
            j_end = tl.where(_block_active(pt * BT, lo, hi, NK, BT), hi, j_first)
        acc1 = tl.zeros((BM, BT), tl.float32)
        acc2 = tl.zeros((BM, BT), tl.float32)
        for j0 in range(j_first, j_end, BN):
            rj = j0 + tl.arange(0, BN)
            eg = _load2(EG, rj, rt, NK, NA, SA, 0.0)
            acc1 += mm(_load2(R, ri, rj, NQ, NK, SK, 0.0), eg, UPCAST, PRECISION)
            acc2 += mm(_load2(RG, ri, rj, NQ, NK, SK, 0.0), eg, UPCAST, PRECISION)
        ec = _load2(EC, ri, rt, NQ, NA, SA, 0.0).to(tl.float32)
        dout = _load2(DOUT, ri, rdv, NQ, DV, DV, 0.0)
        delta = tl.load(DELTA + bh * SQ + ri, mask=ri < NQ, other=0.0)
        dw = mm(dout, tl.trans(av), UPCAST, PRECISION) - delta[:, None]
        w = ec * acc1
        _store2(DC + bh * SQ * SA, ri, rt, NQ, NA, SA, (sc * ec) * (dw * acc1 - acc2))
        dav += mm(tl.trans(w.to(dout.dtype)), dout, UPCAST, PRECISION)
    _store2(DAV + bh * SA * DV, rt, rdv, NA, DV, DV, dav)


@triton.jit
def _dg_kernel(EC, EG, R, RG, EDW, LO, HI, DG, NQ, NK, NA, sg,
               SKIP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BT: tl.constexpr,
               UPCAST: tl.constexpr, PRECISION: tl.constexpr, BH0=0, H=1, CU_Q=None, CU_K=None,
               VARLEN: tl.constexpr = False):
    """sg * dG = sg * EG * (R^T @ EDW - RG^T @ EC) for BN sources x BT templates. SKIP: the loop runs
    from the first to the last query block that uses these sources and templates (its key range
    meets the sources, R = RG = 0 otherwise, and the template block is active, EC = EDW = 0
    otherwise), found by a scan of the rows' ranges first: loop bounds, not a branch per block, so
    the loop stays software-pipelined (a branch around its loads stopped that, 40 KB of shared
    memory instead of 96 KB in the sm_90 build)."""
    sg = tl.cast(sg, tl.float32)  # inductor hands Python floats over as fp64 scalars
    bh, pj, pt = _grid2(tl.cdiv(NK, BN), tl.cdiv(NA, BT))
    SQ, SK, SA = NQ, NK, NA
    if VARLEN:
        NQ, NK, NA = _pair_lengths(CU_Q, CU_K, BH0 + bh, H, NK, NA)
        if (pj * BN >= NK) | (pt * BT >= NA):
            return
    rj, rt = pj * BN + tl.arange(0, BN), pt * BT + tl.arange(0, BT)
    EC, EDW = EC + bh * SQ * SA, EDW + bh * SQ * SA
    R, RG = R + bh * SQ * SK, RG + bh * SQ * SK
    acc3 = tl.zeros((BN, BT), tl.float32)
    acc4 = tl.zeros((BN, BT), tl.float32)
    i_first = 0
    i_end = NQ
    if SKIP:
        i_first = NQ
        i_end = NQ * 0
        for i0 in range(0, NQ, BM):
            lo, hi = _key_range(LO + bh * SQ, HI + bh * SQ, i0 + tl.arange(0, BM), NQ, NK, SKIP)
            use = (pj * BN < hi) & (pj * BN + BN > lo) & _block_active(pt * BT, lo, hi, NK, BT)
            i_first = tl.where(use, tl.minimum(i_first, i0), i_first)
            i_end = tl.where(use, i0 + BM, i_end)
    for i0 in range(i_first, i_end, BM):
        ri = i0 + tl.arange(0, BM)
        r_t = tl.trans(_load2(R, ri, rj, NQ, NK, SK, 0.0))
        rg_t = tl.trans(_load2(RG, ri, rj, NQ, NK, SK, 0.0))
        acc3 += mm(r_t, _load2(EDW, ri, rt, NQ, NA, SA, 0.0), UPCAST, PRECISION)
        acc4 += mm(rg_t, _load2(EC, ri, rt, NQ, NA, SA, 0.0), UPCAST, PRECISION)
    eg = _load2(EG + bh * SK * SA, rj, rt, NK, NA, SA, 0.0).to(tl.float32)
    _store2(DG + bh * SK * SA, rj, rt, NK, NA, SA, (sg * eg) * (acc3 - acc4))


@triton.jit
def _dlu_kernel(UG, DELTA, LU, LZ, MASK, DLU, NQ, NK, BH0, H, s_mb, s_mh, s_mm, s_mn,
                MASK_KIND: tl.constexpr, CAUSAL: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """d lu_j = sum_i (u_ij g_ij - u_ij delta_i), delta_i = sum_j u_ij g_ij: softmax's backward for
    u_ij = softmax over the kept keys of lu, summed over the queries."""
    bh, pj = _grid1(tl.cdiv(NK, BN))
    rj = pj * BN + tl.arange(0, BN)
    mask_ptr = _mask_base(MASK, bh, BH0, H, s_mb, s_mh)
    acc = tl.zeros((BN,), tl.float32)
    for i0 in range(0, NQ, BM):
        ri = i0 + tl.arange(0, BM)
        u = _u_tile(LU + bh * NK, LZ + bh * NQ, mask_ptr, ri, rj, NQ, NK, s_mm, s_mn, MASK_KIND, CAUSAL)
        ug = _load2(UG + bh * NQ * NK, ri, rj, NQ, NK, NK, 0.0)
        delta = tl.load(DELTA + bh * NQ + ri, mask=ri < NQ, other=0.0)
        acc += tl.sum(ug - u * delta[:, None], 0)
    tl.store(DLU + bh * NK + rj, acc, mask=rj < NK)


# --- exact fallback for the pairs the matmul path cannot resolve ----------------------------------

@triton.jit
def _mm32(a, b):
    """a @ b in full fp32 (the rare fallback favours accuracy over tensor-core speed)."""
    return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")


@triton.jit
def _pair_probs(xq, xk, AK, ri, rt, lse, NQ, NK, NA, D, sc, sg, mask_ptr, s_mm, s_mn,
                BD: tl.constexpr, MASK_KIND: tl.constexpr, CAUSAL: tl.constexpr,
                UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """P_ijt = exp(C_it + G_jt - lse_ij) on a (FB, FB, BT) cube tile."""
    c, _ = _c_logits(xq, AK, ri, rt, NQ, NK, NA, D, sc, mask_ptr, s_mm, s_mn, BD, MASK_KIND, CAUSAL,
                     UPCAST, PRECISION)
    g = _g_logits(xk, AK, rt, NA, D, sg, BD, UPCAST, PRECISION)
    return tl.exp(c[:, None, :] + g[None, :, :] - lse[:, :, None])


@triton.jit
def _pair_lse(xq, xk, AK, ri, NQ, NK, NA, D, sc, sg, mask_ptr, s_mm, s_mn,
              FB: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, MASK_KIND: tl.constexpr,
              CAUSAL: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """lse_ij = logsumexp_t (C_it + G_jt) streamed over A (online max); +inf without templates."""
    m = tl.full((FB, FB), float("-inf"), tl.float32)
    s = tl.zeros((FB, FB), tl.float32)
    for t0 in range(0, NA, BT):
        rt = t0 + tl.arange(0, BT)
        c, _ = _c_logits(xq, AK, ri, rt, NQ, NK, NA, D, sc, mask_ptr, s_mm, s_mn, BD, MASK_KIND, CAUSAL,
                         UPCAST, PRECISION)
        g = _g_logits(xk, AK, rt, NA, D, sg, BD, UPCAST, PRECISION)
        logit = c[:, None, :] + g[None, :, :]
        m_new = tl.maximum(m, tl.max(logit, 2))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(logit - m_safe[:, :, None]), 2)
        m = m_new
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    return tl.where(s > 0, m_safe + tl.log(tl.where(s > 0, s, 1.0)), float("inf"))


@triton.jit
def _fallback_fwd_kernel(Q, K, AK, AV, MASK, LU, LZ, BAD, TBAD, OUT,
                         NQ, NK, NA, D, DV, sc, sg, BH0, H, s_mb, s_mh, s_mm, s_mn,
                         CBM: tl.constexpr, CBN: tl.constexpr, FB: tl.constexpr, BT: tl.constexpr,
                         BD: tl.constexpr, BDV: tl.constexpr, MASK_KIND: tl.constexpr, CAUSAL: tl.constexpr,
                         UPCAST: tl.constexpr, PRECISION: tl.constexpr, CU_Q=None, CU_K=None,
                         VARLEN: tl.constexpr = False):
    """out_i += sum_{j bad} u_ij sum_t softmax_t(C_it + G_jt) a_v_t for the pair tile (CBM x CBN) of
    _pair_kernel on grid axes 1, 2, in (FB x FB) sub-tiles holding a bad pair."""
    sc = tl.cast(sc, tl.float32)
    sg = tl.cast(sg, tl.float32)  # inductor hands Python floats over as fp64 scalars
    bh, pi, pj = _grid2(tl.cdiv(NQ, CBM), tl.cdiv(NK, CBN))
    SQ, SK, SA = NQ, NK, NA
    if VARLEN:
        NQ, NK, NA = _pair_lengths(CU_Q, CU_K, BH0 + bh, H, NK, NA)
        if (pi * CBM >= NQ) | (pj * CBN >= NK):     # _pair_kernel left this tile's TBAD entry unwritten
            return
    n_bad = tl.load(TBAD + tl.program_id(0))
    if n_bad > 0:
        Q, K, AK, AV = Q + bh * SQ * D, K + bh * SK * D, AK + bh * SA * D, AV + bh * SA * DV
        mask_ptr = _mask_base(MASK, bh, BH0, H, s_mb, s_mh)
        rd, rdv = tl.arange(0, BD), tl.arange(0, BDV)
        for si in range(0, CBM, FB):
            for sj in range(0, CBN, FB):
                ri, rj = pi * CBM + si + tl.arange(0, FB), pj * CBN + sj + tl.arange(0, FB)
                bad = _load2(BAD + bh * SQ * SK, ri, rj, NQ, NK, SK, 0) != 0
                if tl.sum(bad.to(tl.int32)) > 0:
                    u = tl.where(bad, _u_tile(LU + bh * SK, LZ + bh * SQ, mask_ptr, ri, rj, NQ, NK, s_mm, s_mn,
                                              MASK_KIND, CAUSAL), 0.0)
                    xq, xk = _load2(Q, ri, rd, NQ, D, D, 0.0), _load2(K, rj, rd, NK, D, D, 0.0)
                    lse = _pair_lse(xq, xk, AK, ri, NQ, NK, NA, D, sc, sg, mask_ptr, s_mm, s_mn, FB, BT, BD,
                                    MASK_KIND, CAUSAL, UPCAST, PRECISION)
                    out = tl.zeros((FB, BDV), tl.float32)
                    for t0 in range(0, NA, BT):
                        rt = t0 + tl.arange(0, BT)
                        p = _pair_probs(xq, xk, AK, ri, rt, lse, NQ, NK, NA, D, sc, sg, mask_ptr, s_mm, s_mn,
                                        BD, MASK_KIND, CAUSAL, UPCAST, PRECISION)
                        w = tl.sum(u[:, :, None] * p, 1)
                        out += _mm32(w, _load2(AV, rt, rdv, NA, DV, DV, 0.0))
                    optr = OUT + bh * SQ * DV + ri[:, None] * DV + rdv[None, :]
                    tl.atomic_add(optr, out, mask=(ri[:, None] < NQ) & (rdv[None, :] < DV))


@triton.jit
def _fallback_bwd_kernel(Q, K, AK, AV, DOUT, DELTA, MASK, LU, LZ, BAD, TBAD, UG, DAV, DQ, DK, DAK,
                         NQ, NK, NA, D, DV, sc, sg, BH0, H, s_mb, s_mh, s_mm, s_mn,
                         NEED_UG: tl.constexpr, CBM: tl.constexpr, CBN: tl.constexpr, FB: tl.constexpr,
                         BT: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, MASK_KIND: tl.constexpr,
                         CAUSAL: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, CU_Q=None,
                         CU_K=None, VARLEN: tl.constexpr = False):
    """The bad pairs' share of the backward, per pair P_ijt with dL_ijt = u_ij P_ijt (dW_it - g_ij)
    (dW shifted by delta as in _dc_kernel, so that g, hence UG, matches the matmul path's):
    d a_v_t += sum W_it dout_i, dq_i += sc sum dL a_t, dk_j += sg sum dL a_t,
    d a_t += sc sum dL q_i + sg sum dL k_j (atomics, fp32), and UG_ij = u_ij g_ij."""
    sc = tl.cast(sc, tl.float32)
    sg = tl.cast(sg, tl.float32)  # inductor hands Python floats over as fp64 scalars
    bh, pi, pj = _grid2(tl.cdiv(NQ, CBM), tl.cdiv(NK, CBN))
    SQ, SK, SA = NQ, NK, NA
    if VARLEN:
        NQ, NK, NA = _pair_lengths(CU_Q, CU_K, BH0 + bh, H, NK, NA)
        if (pi * CBM >= NQ) | (pj * CBN >= NK):     # _pair_kernel left this tile's TBAD entry unwritten
            return
    n_bad = tl.load(TBAD + tl.program_id(0))
    if n_bad > 0:
        Q, K, AK, AV = Q + bh * SQ * D, K + bh * SK * D, AK + bh * SA * D, AV + bh * SA * DV
        DOUT, DAV, DAK = DOUT + bh * SQ * DV, DAV + bh * SA * DV, DAK + bh * SA * D
        mask_ptr = _mask_base(MASK, bh, BH0, H, s_mb, s_mh)
        rd, rdv = tl.arange(0, BD), tl.arange(0, BDV)
        for si in range(0, CBM, FB):
            for sj in range(0, CBN, FB):
                ri, rj = pi * CBM + si + tl.arange(0, FB), pj * CBN + sj + tl.arange(0, FB)
                bad = _load2(BAD + bh * SQ * SK, ri, rj, NQ, NK, SK, 0) != 0
                if tl.sum(bad.to(tl.int32)) > 0:
                    u = tl.where(bad, _u_tile(LU + bh * SK, LZ + bh * SQ, mask_ptr, ri, rj, NQ, NK, s_mm, s_mn,
                                              MASK_KIND, CAUSAL), 0.0)
                    xq, xk = _load2(Q, ri, rd, NQ, D, D, 0.0), _load2(K, rj, rd, NK, D, D, 0.0)
                    dout = _load2(DOUT, ri, rdv, NQ, DV, DV, 0.0)
                    delta = tl.load(DELTA + bh * SQ + ri, mask=ri < NQ, other=0.0)
                    lse = _pair_lse(xq, xk, AK, ri, NQ, NK, NA, D, sc, sg, mask_ptr, s_mm, s_mn, FB, BT, BD,
                                    MASK_KIND, CAUSAL, UPCAST, PRECISION)
                    g = tl.zeros((FB, FB), tl.float32)
                    for t0 in range(0, NA, BT):
                        rt = t0 + tl.arange(0, BT)
                        p = _pair_probs(xq, xk, AK, ri, rt, lse, NQ, NK, NA, D, sc, sg, mask_ptr, s_mm, s_mn,
                                        BD, MASK_KIND, CAUSAL, UPCAST, PRECISION)
                        dw = _mm32(dout, tl.trans(_load2(AV, rt, rdv, NA, DV, DV, 0.0))) - delta[:, None]
                        g += tl.sum(p * dw[:, None, :], 2)
                    if NEED_UG:
                        uptr = UG + bh * SQ * SK + ri[:, None] * SK + rj[None, :]
                        tl.store(uptr, u * g, mask=bad & (ri[:, None] < NQ) & (rj[None, :] < NK))
                    dq = tl.zeros((FB, BD), tl.float32)
                    dk = tl.zeros((FB, BD), tl.float32)
                    for t0 in range(0, NA, BT):
                        rt = t0 + tl.arange(0, BT)
                        p = _pair_probs(xq, xk, AK, ri, rt, lse, NQ, NK, NA, D, sc, sg, mask_ptr, s_mm, s_mn,
                                        BD, MASK_KIND, CAUSAL, UPCAST, PRECISION)
                        av = _load2(AV, rt, rdv, NA, DV, DV, 0.0)
                        ak = _load2(AK, rt, rd, NA, D, D, 0.0)
                        dw = _mm32(dout, tl.trans(av)) - delta[:, None]
                        up = u[:, :, None] * p
                        dl = up * (dw[:, None, :] - g[:, :, None])
                        dc, dg = tl.sum(dl, 1), tl.sum(dl, 0)                  # (FB, BT) each
                        dq += _mm32(dc, ak)
                        dk += _mm32(dg, ak)
                        dak = _mm32(tl.trans(dc), xq) * sc + _mm32(tl.trans(dg), xk) * sg
                        in_a = rt[:, None] < NA
                        tl.atomic_add(DAK + rt[:, None] * D + rd[None, :], dak, mask=in_a & (rd[None, :] < D))
                        dav = _mm32(tl.trans(tl.sum(up, 1)), dout)
                        tl.atomic_add(DAV + rt[:, None] * DV + rdv[None, :], dav, mask=in_a & (rdv[None, :] < DV))
                    tl.atomic_add(DQ + bh * SQ * D + ri[:, None] * D + rd[None, :], dq * sc,
                                  mask=(ri[:, None] < NQ) & (rd[None, :] < D))
                    tl.atomic_add(DK + bh * SK * D + rj[:, None] * D + rd[None, :], dk * sg,
                                  mask=(rj[:, None] < NK) & (rd[None, :] < D))
