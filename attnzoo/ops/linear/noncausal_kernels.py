"""Triton kernels of non-causal linear attention (host code: noncausal.py).

Per (batch, head), with phi the feature map (applied in the kernels to scale * q and to k) and the key
weights w_j of a key-only mask (bool: keep_j; float: keep_j exp(m_j - shift), shift = the largest
finite m_j of the head, so exp never overflows; none: 1), fk_j = w_j phi(k_j), fq_i = phi(scale q_i):

    S = sum_j fk_j v_j^T  (D x Dv),   z = sum_j fk_j  (D),   n = sum_j keep_j
    out_i = r_i S^T fq_i,   r_i = 1 / (fq_i . z + eps)           (elu, relu: NORMALISED)
                            r_i = rho = e^shift / max(n, 1)      (identity: the reference's 1 / n_i)

with eps = max(1e-6 e^-shift, sqrt(tiny)) (1e-6 without a float mask): the shifted weights scale
numerator and denominator alike, and the floor keeps a head whose keys are all masked at 0 / eps.

Gradients (g_i = dL/dout_i; c_i = dL/dden_i = -r_i g_i . out_i, 0 for the identity map):

    dL/dfq_i = r_i S g_i + c_i z                    dS = sum_i r_i fq_i g_i^T,   dz = sum_i c_i fq_i
    dL/dfk_j = dS v_j + dz                          dL/dv_j = dS^T fk_j
    dq_i = scale phi'(scale q_i) * dL/dfq_i          dk_j = w_j phi'(k_j) * dL/dfk_j
    dL/dm_j = fk_j . dL/dfk_j                       (float mask: dw_j / dm_j = w_j; shift is a constant)

Kernels, each a 1-D grid over batch x head x (tiles):
- ``_keys_state_kernel``: S, z (and n) of one key split and one BK-row tile of S, a reduction over key
  chunks (tensor-core products of input-dtype fk and v, fp32 sums); a float mask's shift is found first
  (one pass over the head's mask row) and stored after them. A head's state is one flat fp32 row:
  S (D * Dv), then z (D; normalised) or n (1; identity with a mask), then the shift (1; float mask);
- ``_sum_splits_kernel``: the sum of the splits' partial states (launched only with several splits);
- ``_queries_output_kernel``: out = r S^T fq over query chunks, S read once per program (fp32 operands: TF32 on
  the tensor cores for half inputs, so S never takes fp16's range), r kept for the backward;
- ``_queries_grad_kernel``: dS, dz (a reduction over query chunks, as ``_keys_state_kernel``) and, in the same
  pass, dq from S and z: the chunk's q, dO and out are read once;
- ``_keys_grad_kernel``: dk, dv (and the float mask's gradient) per key chunk from dS and dz.

Packed sequences (VARLEN, host code: varlen.py): a program's batch index is a sequence of packed q
(T_q, H, D), k, v (T_k, H_kv, .), its first token and length loaded from CU_Q / CU_K; the reductions'
splits and the row grids cover the longest sequence (a split or program past its sequence's end loops
zero times), the per-token buffers are (H, T, .) and k and v's head is h // GROUP.

Masked keys take part in nothing: their fk and v are zeroed with where (not multiplied), so a NaN in a
masked key's k or v stays out of the sums, as in the reference's masked_fill. Accumulators are fp32
(fp64 for fp64 inputs), their dtypes written out, never taken from a pointer.
"""
from __future__ import annotations

from ..triton_utils import HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .triton_kernels import _feature_slope, _features, _load, _load_t, _scalar, _wide
    from ..triton_utils import mm

    @triton.jit
    def _split_ids(D, n_splits, BK: tl.constexpr):
        """(batch x head, BK-row tile of the state, split) of a reduction program, split fastest."""
        pid = tl.program_id(0).to(tl.int64)
        n_k = tl.cdiv(D, BK)
        return pid // (n_k * n_splits), (pid // n_splits) % n_k, pid % n_splits

    @triton.jit
    def _block_ids(N, block_rows):
        """(batch x head, first row) of a program that walks ``block_rows`` rows."""
        pid = tl.program_id(0).to(tl.int64)
        n_blocks = tl.cdiv(N, block_rows)
        return pid // n_blocks, (pid % n_blocks) * block_rows

    @triton.jit
    def _packed_rows(CU, s):
        """(first token, length) of sequence s of a packed call."""
        first = tl.load(CU + s)
        return first.to(tl.int64), tl.load(CU + s + 1) - first

    @triton.jit
    def _mask_shift(M, NK, stride_mn, BLOCK: tl.constexpr, FP64: tl.constexpr):
        """The largest finite entry of a float mask row (0 when every key is masked)."""
        top = _wide(tl.full((BLOCK,), float("-inf"), tl.float32), FP64)
        for j0 in range(0, NK, BLOCK):
            rows = j0 + tl.arange(0, BLOCK)
            m = _wide(tl.load(M + rows * stride_mn, mask=rows < NK, other=float("-inf")), FP64)
            top = tl.maximum(top, m)
        best = tl.max(top, 0)
        return tl.where(best > float("-inf"), best, 0.0)

    @triton.jit
    def _indicator(cond, FP64: tl.constexpr):
        """1 where cond, else 0, made in the accumulator dtype (an fp32 one widened to fp64 next to an
        fp64 dot operand trips Triton's fp64 MMA lowering)."""
        return tl.where(cond, _scalar(1.0, FP64), _scalar(0.0, FP64))

    @triton.jit
    def _key_weights(M, rows, valid, stride_mn, shift, MASK_KIND: tl.constexpr, FP64: tl.constexpr):
        """(keep, w) of key rows: a bool mask keeps (w = 1), a float one weighs exp(m - shift)."""
        if MASK_KIND == 1:
            m = tl.load(M + rows * stride_mn, mask=valid, other=0)
            keep = valid & (m != 0)
            w = _indicator(keep, FP64)
        else:
            m = _wide(tl.load(M + rows * stride_mn, mask=valid, other=float("-inf")), FP64)
            keep = valid & (m > float("-inf"))
            w = tl.where(keep, tl.exp(tl.where(keep, m, shift) - shift), 0.0)
        return keep, w

    @triton.jit
    def _eps(shift, MASK_KIND: tl.constexpr, FP64: tl.constexpr):
        """The normaliser's 1e-6 in the units of the shifted weights, floored at sqrt(tiny)."""
        if MASK_KIND == 2:
            if FP64:
                eps = tl.maximum(1e-6 * tl.exp(-shift), 1.4916681462400413e-154)
            else:
                eps = tl.maximum(1e-6 * tl.exp(-shift), 1.0842021724855044e-19)
        else:
            eps = _scalar(1e-6, FP64)
        return eps

    @triton.jit
    def _identity_scale(STATE, D, DV, NK, shift, MASK_KIND: tl.constexpr, COUNT: tl.constexpr,
                        FP64: tl.constexpr):
        """rho = e^shift / max(n, 1), n the kept keys (stored after S and z when COUNT, else NK)."""
        if COUNT:
            n = _wide(tl.load(STATE + D * DV), FP64)
        else:
            n = _scalar(NK, FP64)
        rho = 1.0 / tl.maximum(n, 1.0)
        if MASK_KIND == 2:
            rho = rho * tl.exp(shift)
        return rho

    @triton.jit
    def _load_z(STATE, rk, D, DV, NORMALISED: tl.constexpr, FP64: tl.constexpr):
        """z (or dz) of the head-dim tile ``rk``, stored after S; zeros for the identity map."""
        if NORMALISED:
            z = _wide(tl.load(STATE + D * DV + rk, mask=rk < D, other=0.0), FP64)
        else:
            z = _wide(tl.zeros((rk.shape[0],), dtype=tl.float32), FP64)
        return z

    @triton.jit
    def _shift_at(D, DV, NORMALISED: tl.constexpr, COUNT: tl.constexpr):
        """Where a head's state holds the float mask's shift: after S and z (or n)."""
        if NORMALISED:
            at = D * DV + D
        elif COUNT:
            at = D * DV + 1
        else:
            at = D * DV
        return at

    @triton.jit
    def _load_shift(STATE, D, DV, NORMALISED: tl.constexpr, COUNT: tl.constexpr, MASK_KIND: tl.constexpr,
                    FP64: tl.constexpr):
        """The float mask's shift from a head's state (0 without one)."""
        if MASK_KIND == 2:
            shift = _wide(tl.load(STATE + _shift_at(D, DV, NORMALISED, COUNT)), FP64)
        else:
            shift = _scalar(0.0, FP64)
        return shift

    @triton.jit
    def _times_state_t(X, rows, keep, end, stride_xn, STATE, rk, D, DV, BLOCK: tl.constexpr, BK: tl.constexpr,
                       VC: tl.constexpr, FP64: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr):
        """X[rows] S[rk]^T (X: rows of Dv; S: a state's D x Dv) with the product over Dv taken VC columns
        at a time: exact fp32 / fp64 products run on the CUDA cores, whose dot operands hold all of K
        in each thread (a 64-wide K spilled), so their K stays small. Rows off ``keep`` read as 0."""
        acc = _wide(tl.zeros((BLOCK, BK), dtype=tl.float32), FP64)
        for v0 in range(0, DV, VC):
            rvc = v0 + tl.arange(0, VC)
            x = _wide(_load(X, rows, rvc, end, DV, stride_xn), FP64)
            x = tl.where(keep[:, None], x, 0.0)
            acc += mm(x, _wide(_load_t(STATE, rk, rvc, D, DV, DV), FP64), UPCAST, PREC)
        return acc

    @triton.jit
    def _row_dots(A, B, rows, end, DV, BLOCK: tl.constexpr, VC: tl.constexpr, FP64: tl.constexpr):
        """A_i . B_i for rows of two contiguous (N, DV) matrices, VC columns at a time."""
        acc = _wide(tl.zeros((BLOCK,), dtype=tl.float32), FP64)
        for v0 in range(0, DV, VC):
            rvc = v0 + tl.arange(0, VC)
            a = _wide(_load(A, rows, rvc, end, DV, DV), FP64)
            acc += tl.sum(a * _wide(_load(B, rows, rvc, end, DV, DV), FP64), 1)
        return acc

    @triton.jit
    def _keys_state_kernel(K, V, M, PART, NK, D, DV, H, n_splits, split_rows, width,
                         stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
                         stride_mb, stride_mh, stride_mn,
                         BLOCK_N: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, FEATURE: tl.constexpr,
                         NORMALISED: tl.constexpr, MASK_KIND: tl.constexpr, COUNT: tl.constexpr,
                         FP64: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
                         CU_K=None, GROUP=1, VARLEN: tl.constexpr = False):
        """PART[bh, split] = (S tile rows, z or n, shift) of the keys [split * split_rows, + split_rows).
        The float mask's shift is stored by split 0 and 0 by the others, so the sum of the splits is it.
        VARLEN: b is sequence b of packed k, v (T_k, H_kv, .), whose head h // GROUP query head h reads."""
        bh, pk, sp = _split_ids(D, n_splits, BK)
        b, h = bh // H, bh % H
        if VARLEN:
            k_pos, NK = _packed_rows(CU_K, b)
            K += k_pos * stride_kn + (h // GROUP) * stride_kh
            V += k_pos * stride_vn + (h // GROUP) * stride_vh
        else:
            K += b * stride_kb + h * stride_kh
            V += b * stride_vb + h * stride_vh
        M += b * stride_mb + h * stride_mh
        rk, rv = pk * BK + tl.arange(0, BK), tl.arange(0, BV)
        shift = _scalar(0.0, FP64)
        if MASK_KIND == 2:
            shift = _mask_shift(M, NK, stride_mn, BLOCK_N, FP64)
        state = _wide(tl.zeros((BK, BV), dtype=tl.float32), FP64)
        zsum = _wide(tl.zeros((BK,), dtype=tl.float32), FP64)
        kept = _wide(tl.zeros((BLOCK_N,), dtype=tl.float32), FP64)
        start = sp * split_rows
        end = tl.minimum(start + split_rows, NK)
        for j0 in range(start, end, BLOCK_N):
            rows = j0 + tl.arange(0, BLOCK_N)
            valid = rows < end
            kt = _load_t(K, rows, rk, end, D, stride_kn)                                 # (BK, BLOCK_N)
            fkt = _features(kt, valid[None, :] & (rk[:, None] < D), 1.0, FEATURE, FP64)
            v = _load(V, rows, rv, end, DV, stride_vn)                                   # (BLOCK_N, BV)
            if MASK_KIND != 0:
                keep, w = _key_weights(M, rows, valid, stride_mn, shift, MASK_KIND, FP64)
                fkt = tl.where(keep[None, :], fkt * w[None, :], 0.0)
                v = tl.where(keep[:, None], v, tl.zeros_like(v))
                if COUNT:
                    kept += _indicator(keep, FP64)
            state += mm(fkt.to(v.dtype), v, UPCAST, PREC)
            if NORMALISED:
                zsum += tl.sum(fkt, 1)
        PART += (bh * n_splits + sp) * width
        tl.store(PART + rk[:, None] * DV + rv[None, :], state, mask=(rk[:, None] < D) & (rv[None, :] < DV))
        if NORMALISED:
            tl.store(PART + D * DV + rk, zsum, mask=rk < D)
        if COUNT:
            if pk == 0:
                tl.store(PART + D * DV, tl.sum(kept, 0))
        if MASK_KIND == 2:
            if pk == 0:
                tl.store(PART + _shift_at(D, DV, NORMALISED, COUNT), tl.where(sp == 0, shift, 0.0))

    @triton.jit
    def _sum_splits_kernel(PART, OUT, width, n_splits, BLOCK: tl.constexpr, FP64: tl.constexpr):
        """OUT[bh] = sum over the splits of PART[bh, split] (flat (width,) rows)."""
        bh = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < width
        PART += bh * n_splits * width
        total = _wide(tl.zeros((BLOCK,), dtype=tl.float32), FP64)
        for s in range(0, n_splits):
            total += _wide(tl.load(PART + s * width + cols, mask=inside, other=0.0), FP64)
        tl.store(OUT + bh * width + cols, total, mask=inside)

    @triton.jit
    def _output_rows(Q, rows, rk, end, D, stride_qn, scale, state, z, acc, den, FEATURE: tl.constexpr,
                     NORMALISED: tl.constexpr, FP64: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr):
        """acc += phi(scale q) S (one BK tile of the head dim), den += phi(scale q) . z."""
        q = _load(Q, rows, rk, end, D, stride_qn)
        fq = _features(q, (rows[:, None] < end) & (rk[None, :] < D), scale, FEATURE, FP64)
        acc += mm(fq, state, UPCAST, PREC)
        if NORMALISED:
            den += tl.sum(fq * z[None, :], 1)
        return acc, den

    @triton.jit
    def _queries_output_kernel(Q, STATE, O, RDEN, NQ, NK, D, DV, H, scale, block_rows, width,
                       stride_qb, stride_qh, stride_qn,
                       BLOCK_M: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, FEATURE: tl.constexpr,
                       NORMALISED: tl.constexpr, MASK_KIND: tl.constexpr, COUNT: tl.constexpr,
                       SINGLE_K: tl.constexpr, FP64: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
                       CU_Q=None, CU_K=None, TQ=0, VARLEN: tl.constexpr = False):
        """out for ``block_rows`` query rows; RDEN gets r (NORMALISED). SINGLE_K (D <= BK): the state
        is read once, before the row loop. VARLEN: NQ is the longest sequence (the grid's blocks per
        sequence), b the sequence; out and RDEN are (H, T_q, .)."""
        scale = _scalar(scale, FP64)  # inductor hands Python floats over as fp64 scalars
        bh, start = _block_ids(NQ, block_rows)
        b, h = bh // H, bh % H
        if VARLEN:
            q_pos, NQ = _packed_rows(CU_Q, b)
            k_pos, NK = _packed_rows(CU_K, b)
            Q += q_pos * stride_qn + h * stride_qh
            q_row = h * TQ + q_pos
        else:
            Q += b * stride_qb + h * stride_qh
            q_row = bh * NQ
        STATE += bh * width
        O += q_row * DV
        end = tl.minimum(start + block_rows, NQ)
        rv = tl.arange(0, BV)
        shift = _load_shift(STATE, D, DV, NORMALISED, COUNT, MASK_KIND, FP64)
        if NORMALISED:
            eps = _eps(shift, MASK_KIND, FP64)
        else:
            rho = _identity_scale(STATE, D, DV, NK, shift, MASK_KIND, COUNT, FP64)
        rk0 = tl.arange(0, BK)
        if SINGLE_K:
            state0 = _wide(_load(STATE, rk0, rv, D, DV, DV), FP64)
            z0 = _load_z(STATE, rk0, D, DV, NORMALISED, FP64)
        for i0 in range(start, end, BLOCK_M):
            rows = i0 + tl.arange(0, BLOCK_M)
            acc = _wide(tl.zeros((BLOCK_M, BV), dtype=tl.float32), FP64)
            den = _wide(tl.zeros((BLOCK_M,), dtype=tl.float32), FP64)
            if SINGLE_K:
                acc, den = _output_rows(Q, rows, rk0, end, D, stride_qn, scale, state0, z0, acc, den,
                                        FEATURE, NORMALISED, FP64, UPCAST, PREC)
            else:
                for d0 in range(0, D, BK):
                    rk = d0 + rk0
                    state = _wide(_load(STATE, rk, rv, D, DV, DV), FP64)
                    z = _load_z(STATE, rk, D, DV, NORMALISED, FP64)
                    acc, den = _output_rows(Q, rows, rk, end, D, stride_qn, scale, state, z, acc, den,
                                            FEATURE, NORMALISED, FP64, UPCAST, PREC)
            valid = rows < end
            if NORMALISED:
                r = 1.0 / (den + eps)
                tl.store(RDEN + q_row + rows, r, mask=valid)
                out = acc * r[:, None]
            else:
                out = acc * rho
            tl.store(O + rows[:, None] * DV + rv[None, :], out.to(O.dtype.element_ty),
                     mask=valid[:, None] & (rv[None, :] < DV))

    @triton.jit
    def _queries_grad_kernel(Q, DO, O, RDEN, STATE, PART, DQ, NQ, NK, D, DV, H, scale, state_width, n_splits,
                             split_rows, width, stride_qb, stride_qh, stride_qn,
                             BLOCK_M: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, VC: tl.constexpr,
                             FEATURE: tl.constexpr, NORMALISED: tl.constexpr, MASK_KIND: tl.constexpr,
                             COUNT: tl.constexpr, WIDE_ROWS: tl.constexpr, FP64: tl.constexpr, UPCAST: tl.constexpr,
                             PREC: tl.constexpr, CU_Q=None, CU_K=None, TQ=0, VARLEN: tl.constexpr = False):
        """PART[bh, split] = (dS tile rows, dz) of the queries [split * split_rows, + split_rows), and dq
        (this program's BK columns) of those queries. dO, out: (B, H, NQ, DV) contiguous. WIDE_ROWS
        (fp16): r phi(q) enters the dS product in fp32 (r reaches 1e6 where the normaliser is ~0,
        past fp16's range). VC < BV: S g_i and dO_i . out_i are taken VC columns of Dv at a time."""
        scale = _scalar(scale, FP64)  # inductor hands Python floats over as fp64 scalars
        bh, pk, sp = _split_ids(D, n_splits, BK)
        b, h = bh // H, bh % H
        if VARLEN:   # b: the sequence; dO, out, DQ and RDEN are (H, T_q, .)
            q_pos, NQ = _packed_rows(CU_Q, b)
            k_pos, NK = _packed_rows(CU_K, b)
            Q += q_pos * stride_qn + h * stride_qh
            q_row = h * TQ + q_pos
        else:
            Q += b * stride_qb + h * stride_qh
            q_row = bh * NQ
        DO += q_row * DV
        O += q_row * DV
        DQ += q_row * D
        STATE += bh * state_width
        rk, rv = pk * BK + tl.arange(0, BK), tl.arange(0, BV)
        if VC == BV:
            state_t = _wide(_load_t(STATE, rk, rv, D, DV, DV), FP64)                    # (BV, BK) = S^T
        shift = _load_shift(STATE, D, DV, NORMALISED, COUNT, MASK_KIND, FP64)
        if NORMALISED:
            z = _wide(tl.load(STATE + D * DV + rk, mask=rk < D, other=0.0), FP64)
        else:
            rho = _identity_scale(STATE, D, DV, NK, shift, MASK_KIND, COUNT, FP64)
        dstate = _wide(tl.zeros((BK, BV), dtype=tl.float32), FP64)
        dz = _wide(tl.zeros((BK,), dtype=tl.float32), FP64)
        start = sp * split_rows
        end = tl.minimum(start + split_rows, NQ)
        for i0 in range(start, end, BLOCK_M):
            rows = i0 + tl.arange(0, BLOCK_M)
            valid = rows < end
            in_cols = valid[:, None] & (rk[None, :] < D)
            q = _load(Q, rows, rk, end, D, stride_qn)
            fq = _features(q, in_cols, scale, FEATURE, FP64)
            g = _load(DO, rows, rv, end, DV, DV)
            if NORMALISED:
                r = _wide(tl.load(RDEN + q_row + rows, mask=valid, other=0.0), FP64)
                if VC == BV:
                    dot = tl.sum(_wide(g, FP64) * _wide(_load(O, rows, rv, end, DV, DV), FP64), 1)
                else:
                    dot = _row_dots(DO, O, rows, end, DV, BLOCK_M, VC, FP64)
                c = -r * dot
                dz += tl.sum(fq * c[:, None], 0)
            else:
                r = tl.where(valid, rho, 0.0)
            rfq = fq * r[:, None]
            if WIDE_ROWS:
                dstate += mm(tl.trans(rfq), _wide(g, FP64), UPCAST, PREC)
            else:
                dstate += mm(tl.trans(rfq.to(g.dtype)), g, UPCAST, PREC)
            if VC == BV:
                dfq = mm(_wide(g, FP64), state_t, UPCAST, PREC)
            else:
                dfq = _times_state_t(DO, rows, valid, end, DV, STATE, rk, D, DV, BLOCK_M, BK, VC, FP64, UPCAST, PREC)
            dfq = dfq * r[:, None]
            if NORMALISED:
                dfq += c[:, None] * z[None, :]
            dq = dfq * _feature_slope(q, scale, FEATURE, FP64)
            tl.store(DQ + rows[:, None] * D + rk[None, :], dq.to(DQ.dtype.element_ty), mask=in_cols)
        PART += (bh * n_splits + sp) * width
        tl.store(PART + rk[:, None] * DV + rv[None, :], dstate, mask=(rk[:, None] < D) & (rv[None, :] < DV))
        if NORMALISED:
            tl.store(PART + D * DV + rk, dz, mask=rk < D)

    @triton.jit
    def _dkv_rows(K, DK, rows, rk, end, D, DV, stride_kn, V, stride_vn, DSTATE, v, keep, w, dstate, dz, dv_acc,
                  dm, BLOCK_N: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, VC: tl.constexpr,
                  FEATURE: tl.constexpr, NORMALISED: tl.constexpr, MASK_KIND: tl.constexpr,
                  MASK_GRAD: tl.constexpr, FP64: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr):
        """dk of one BK tile of the head dim (stored), its share of dv and of the mask gradient. VC == BV:
        v is the loaded (masked) value tile; else dS v_j is taken VC columns at a time from V."""
        k = _load(K, rows, rk, end, D, stride_kn)
        in_cols = (rows[:, None] < end) & (rk[None, :] < D)
        fk = _features(k, in_cols, 1.0, FEATURE, FP64)
        if VC == BV:
            dfk = mm(v, tl.trans(dstate), UPCAST, PREC)                               # (BLOCK_N, BK)
        else:
            dfk = _times_state_t(V, rows, keep, end, stride_vn, DSTATE, rk, D, DV, BLOCK_N, BK, VC, FP64, UPCAST,
                                 PREC)
        if NORMALISED:
            dfk += dz[None, :]
        dk = dfk * _feature_slope(k, 1.0, FEATURE, FP64)
        if MASK_KIND != 0:
            fk = tl.where(keep[:, None], fk * w[:, None], 0.0)
            dk = tl.where(keep[:, None], dk * w[:, None], 0.0)
        tl.store(DK + rows[:, None] * D + rk[None, :], dk.to(DK.dtype.element_ty), mask=in_cols)
        dv_acc += mm(fk, dstate, UPCAST, PREC)
        if MASK_GRAD:
            dm += tl.sum(fk * dfk, 1)
        return dv_acc, dm

    @triton.jit
    def _keys_grad_kernel(K, V, M, STATE, DSTATE, DK, DV_OUT, DM, NK, D, DV, H, block_rows, state_width, width,
                    stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
                    stride_mb, stride_mh, stride_mn,
                    BLOCK_N: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, VC: tl.constexpr,
                    FEATURE: tl.constexpr, NORMALISED: tl.constexpr, MASK_KIND: tl.constexpr, COUNT: tl.constexpr,
                    MASK_GRAD: tl.constexpr,
                    SINGLE_K: tl.constexpr, FP64: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
                    CU_K=None, GROUP=1, TK=0, VARLEN: tl.constexpr = False):
        """dk, dv (B, H, NK, .) and DM (B * H, NK), the float mask's gradient (MASK_GRAD), for
        ``block_rows`` keys from dS, dz (DSTATE; the shift from the forward's STATE). SINGLE_K: dS is read
        once, before the row loop. VARLEN: NK is the longest sequence, b the sequence; dk, dv are
        (H, T_k, .), per query head (the host sums a group's)."""
        bh, start = _block_ids(NK, block_rows)
        b, h = bh // H, bh % H
        if VARLEN:
            k_pos, NK = _packed_rows(CU_K, b)
            K += k_pos * stride_kn + (h // GROUP) * stride_kh
            V += k_pos * stride_vn + (h // GROUP) * stride_vh
            k_row = h * TK + k_pos
        else:
            K += b * stride_kb + h * stride_kh
            V += b * stride_vb + h * stride_vh
            k_row = bh * NK
        M += b * stride_mb + h * stride_mh
        DSTATE += bh * width
        DK += k_row * D
        DV_OUT += k_row * DV
        end = tl.minimum(start + block_rows, NK)
        rv = tl.arange(0, BV)
        shift = _load_shift(STATE + bh * state_width, D, DV, NORMALISED, COUNT, MASK_KIND, FP64)
        rk0 = tl.arange(0, BK)
        if SINGLE_K:
            dstate0 = _wide(_load(DSTATE, rk0, rv, D, DV, DV), FP64)
            dz0 = _load_z(DSTATE, rk0, D, DV, NORMALISED, FP64)
        for j0 in range(start, end, BLOCK_N):
            rows = j0 + tl.arange(0, BLOCK_N)
            valid = rows < end
            keep = valid
            w = _indicator(valid, FP64)
            if MASK_KIND != 0:
                keep, w = _key_weights(M, rows, valid, stride_mn, shift, MASK_KIND, FP64)
            if VC == BV:
                v = tl.where(keep[:, None], _wide(_load(V, rows, rv, end, DV, stride_vn), FP64), 0.0)
            else:
                v = _scalar(0.0, FP64)   # read VC columns at a time in _dkv_rows
            dv_acc = _wide(tl.zeros((BLOCK_N, BV), dtype=tl.float32), FP64)
            dm = _wide(tl.zeros((BLOCK_N,), dtype=tl.float32), FP64)
            if SINGLE_K:
                dv_acc, dm = _dkv_rows(K, DK, rows, rk0, end, D, DV, stride_kn, V, stride_vn, DSTATE, v, keep, w,
                                       dstate0, dz0, dv_acc, dm, BLOCK_N, BK, BV, VC, FEATURE, NORMALISED,
                                       MASK_KIND, MASK_GRAD, FP64, UPCAST, PREC)
            else:
                for d0 in range(0, D, BK):
                    rk = d0 + rk0
                    dstate = _wide(_load(DSTATE, rk, rv, D, DV, DV), FP64)
                    dz = _load_z(DSTATE, rk, D, DV, NORMALISED, FP64)
                    dv_acc, dm = _dkv_rows(K, DK, rows, rk, end, D, DV, stride_kn, V, stride_vn, DSTATE, v, keep, w,
                                           dstate, dz, dv_acc, dm, BLOCK_N, BK, BV, VC, FEATURE, NORMALISED,
                                           MASK_KIND, MASK_GRAD, FP64, UPCAST, PREC)
            tl.store(DV_OUT + rows[:, None] * DV + rv[None, :], dv_acc.to(DV_OUT.dtype.element_ty),
                     mask=valid[:, None] & (rv[None, :] < DV))
            if MASK_GRAD:
                tl.store(DM + k_row + rows, tl.where(keep, dm, 0.0), mask=valid)
