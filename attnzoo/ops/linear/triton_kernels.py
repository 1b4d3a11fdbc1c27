"""Triton kernels of causal linear attention in the chunked parallel form (host code: triton.py).

With phi the feature map (applied in the kernels to scale * q and to k), rows cut into chunks of C,
H_c = s0 + sum of phi(k_j) v_j^T over the keys before chunk c (fp32 sums) and z_c the same sum of phi(k_j):

    num_i = phi(q_i) H_c + sum_{j in c, j <= i} (phi(q_i) . phi(k_j)) v_j           (i in chunk c)
    out_i = num_i * r_i,  r_i = 1 / (phi(q_i) . z_c + sum_{j in c, j <= i} phi(q_i) . phi(k_j) + eps)    (MODE 2)
                          r_i = 1 / (i + count_offset)                                           (MODE 1)
                          r_i = 1                                                                 (MODE 0)

Forward: ``_states_kernel`` scans the chunks of one (batch, head) and writes every H_c (and z_c);
``_output_kernel`` then runs one program per (chunk, column tile, batch x head): the intra-chunk
quadratic part and phi(q) H_c are matmuls on the tensor cores. The backward mirrors it:
``_reverse_states_kernel`` writes dH_c = sum over later chunks of (r phi(q))^T dO (and dz_c, the
normaliser's), ``_dv_kernel`` and ``_dqk_kernel`` are parallel over chunks again. With
c_i = -r_i (dO_i . out_i) (``_normaliser_grad_kernel``, MODE 2), the gradient of the intra-chunk
weights is dA_ij = r_i dO_i . v_j + c_i for j <= i, and

    dphi(q)_c = dA phi(k)_c + r (dO H_c^T) + c z_c^T,     dphi(k)_c = dA^T phi(q)_c + v dH_c^T + 1 dz_c^T,
    dv_c = (r-scaled tril(phi(q) phi(k)^T))^T dO + phi(k) dH_c.

Packed sequences (VARLEN, host code: varlen.py): the batch index of a program is a sequence of packed
q (T_q, H, D), k, v (T_k, H_kv, .), whose first tokens and lengths it loads from CU_Q / CU_K at its
entry. Sequence s is one causal square of L = max(n_q, n_k) positions, bottom-right aligned: query i at
position i + max(n_k - n_q, 0), key j at j + max(n_q - n_k, 0), so a position sees the positions up to
its own; rows before a sequence's first query (key) are no rows of q (k) and read as padding
(``_from``). Its states take chunks [(q_0 + k_0) // CHUNK + s, + cdiv(L, CHUNK)) of an (H, CT, D, Dv)
buffer; the per-token buffers (out, r, dq, dk, dv) are (H, T, .); k and v's head is h // GROUP.

Precision: operands go to tl.dot in the input dtype (bf16/fp16 on the tensor cores), every
accumulator and carried state is fp32 (fp64 for fp64 inputs, FP64), built from explicit dtypes and
never from a pointer's element type (bf16 pointers under autocast must not make bf16 loop variables).
"""
from __future__ import annotations

from ..triton_utils import HAVE_TRITON

FEATURE_NONE, FEATURE_ELU, FEATURE_RELU = 0, 1, 2
MODE_PLAIN, MODE_COUNT, MODE_NORMALISED = 0, 1, 2

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from ..triton_utils import mm

    @triton.jit
    def _scalar(x, FP64: tl.constexpr):
        """A float scalar argument in the accumulator dtype (tl.cast: under the interpreter it is a
        Python float)."""
        if FP64:
            y = tl.cast(x, tl.float64)
        else:
            y = tl.cast(x, tl.float32)
        return y

    @triton.jit
    def _wide(x, FP64: tl.constexpr):
        """x in the accumulator dtype."""
        if FP64:
            y = x.to(tl.float64)
        else:
            y = x.to(tl.float32)
        return y

    @triton.jit
    def _scan_ids(D, DV, BK: tl.constexpr, BV: tl.constexpr):
        """(batch x head, state row tile, state column tile) of a scan program: one grid axis
        (B*H*tiles, beyond the 65535 limit of axes 1 and 2), column tile fastest."""
        pid = tl.program_id(0).to(tl.int64)
        n_k, n_v = tl.cdiv(D, BK), tl.cdiv(DV, BV)
        return pid // (n_k * n_v), (pid // n_v) % n_k, pid % n_v

    @triton.jit
    def _chunk_ids(width, BW: tl.constexpr):
        """(batch x head, column tile, chunk) of a per-chunk program: axis 0 is B*H*tiles with the
        tile fastest, so the tiles of one chunk run side by side and share its loads in L2."""
        pid = tl.program_id(0).to(tl.int64)
        n_tiles = tl.cdiv(width, BW)
        return pid // n_tiles, pid % n_tiles, tl.program_id(1)

    @triton.jit
    def _rows_before(c, CHUNK: tl.constexpr, prefix_rows, FP64: tl.constexpr):
        """How many keys the state before chunk c sums (at least 1): MEAN_STATE stores H_c divided by it."""
        return _wide(tl.maximum(c * CHUNK + prefix_rows, 1), FP64)

    @triton.jit
    def _packed_sequence(CU_Q, CU_K, s, CHUNK: tl.constexpr):
        """Sequence s of a packed call as the positions p in [0, L) of one causal square (see the module
        docstring): (token of q at position 0, token of k at position 0, L, q_lo, k_lo, its first state
        chunk). Tokens before position q_lo (k_lo) are not the sequence's: their rows read as padding."""
        q0 = tl.load(CU_Q + s).to(tl.int64)
        nq = tl.load(CU_Q + s + 1).to(tl.int64) - q0
        k0 = tl.load(CU_K + s).to(tl.int64)
        nk = tl.load(CU_K + s + 1).to(tl.int64) - k0
        q_lo = tl.maximum(nk - nq, 0)
        k_lo = tl.maximum(nq - nk, 0)
        # chunks [chunk0, chunk0 + cdiv(L, CHUNK)) are this sequence's alone: the next sequence's
        # (q0 + k0) grows by nq + nk >= L tokens and s by one
        chunk0 = (q0 + k0) // CHUNK + s
        return q0 - q_lo, k0 - k_lo, (nq + q_lo).to(tl.int32), q_lo.to(tl.int32), k_lo.to(tl.int32), chunk0

    @triton.jit
    def _from(rows, lo, N, VARLEN: tl.constexpr):
        """rows, those below ``lo`` moved to N (out of bounds) in a packed call: positions before a
        sequence's first query (key) are no rows of q (k)."""
        if VARLEN:
            rows = tl.where(rows >= lo, rows, N)
        return rows

    @triton.jit
    def _load(ptr, rows, cols, n_rows, n_cols, row_stride):
        """(rows, cols) tile of a row-major matrix (unit column stride); zeros out of bounds."""
        mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
        return tl.load(ptr + rows[:, None] * row_stride + cols[None, :], mask=mask, other=0.0)

    @triton.jit
    def _load_t(ptr, rows, cols, n_rows, n_cols, row_stride):
        """The transposed (cols, rows) tile of the same matrix."""
        mask = (rows[None, :] < n_rows) & (cols[:, None] < n_cols)
        return tl.load(ptr + rows[None, :] * row_stride + cols[:, None], mask=mask, other=0.0)

    @triton.jit
    def _features(x, valid, scale, FEATURE: tl.constexpr, FP64: tl.constexpr):
        """phi(scale * x) in the accumulator dtype, exactly 0 off ``valid`` (padding: elu's phi(0) = 1
        would otherwise add phantom keys and head dims). A NaN stays NaN, as in torch's elu and relu
        (tl.minimum / tl.maximum would return the other operand; NaN > 0 is False, so elu's exp branch
        takes it)."""
        x = _wide(x, FP64) * scale
        if FEATURE == 1:
            f = tl.where(x > 0, x + 1.0, tl.exp(tl.where(x > 0, 0.0, x)))
        elif FEATURE == 2:
            f = tl.where(x < 0, 0.0, x)
        else:
            f = x
        return tl.where(valid, f, 0.0)

    @triton.jit
    def _feature_slope(x, scale, FEATURE: tl.constexpr, FP64: tl.constexpr):
        """d phi(scale * x) / dx."""
        x = _wide(x, FP64) * scale
        if FEATURE == 1:
            s = tl.where(x > 0, 1.0, tl.exp(tl.where(x > 0, 0.0, x)))
        elif FEATURE == 2:
            s = tl.where(x > 0, 1.0, 0.0)
        else:
            s = x * 0.0 + 1.0
        return s * scale

    @triton.jit
    def _row_scale(RDEN, rows, N, count_offset, MODE: tl.constexpr, FP64: tl.constexpr):
        """r_i per query row (see the module docstring); 0 on padding rows."""
        valid = rows < N
        if MODE == 2:
            r = _wide(tl.load(RDEN + rows, mask=valid, other=0.0), FP64)
        elif MODE == 1:
            r = 1.0 / _wide(tl.maximum(rows + count_offset, 1), FP64)
        else:
            r = _wide(rows * 0 + 1, FP64)
        return tl.where(valid, r, 0.0)

    @triton.jit
    def _states_kernel(K, V, S0, Z0, HS, ZS, N, D, DV, H, scale, prefix_rows,
                       stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
                       CHUNK: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, FEATURE: tl.constexpr,
                       NORMALISED: tl.constexpr, HAS_S0: tl.constexpr, MEAN_STATE: tl.constexpr,
                       FP64: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
                       CU_Q=None, CU_K=None, CT=0, GROUP=1, VARLEN: tl.constexpr = False):
        """HS[bh, c] = H_c (the (BK, BV) tile of this program), ZS[bh, c] = z_c: a scan over the chunks.
        MEAN_STATE (fp16 states): H_c / (keys it sums) is stored, which cannot pass fp16's 65504 where
        the sum would (a v with a mean over a long sequence); its readers multiply the count back."""
        scale = _scalar(scale, FP64)  # inductor hands Python floats over as fp64 scalars
        bh, pk, pv = _scan_ids(D, DV, BK, BV)
        b, h = bh // H, bh % H
        if VARLEN:   # b: the sequence; k, v (T_k, H_kv, D) shared by GROUP query heads
            q_pos, k_pos, N, q_lo, k_lo, chunk0 = _packed_sequence(CU_Q, CU_K, b, CHUNK)
            K += k_pos * stride_kn + (h // GROUP) * stride_kh
            V += k_pos * stride_vn + (h // GROUP) * stride_vh
            prefix_rows = -k_lo
            first = h * CT + chunk0
        else:
            K += b * stride_kb + h * stride_kh
            V += b * stride_vb + h * stride_vh
            k_lo = 0
            first = bh * tl.cdiv(N, CHUNK)
        rk, rv, rc = pk * BK + tl.arange(0, BK), pv * BV + tl.arange(0, BV), tl.arange(0, CHUNK)
        state = _wide(tl.zeros((BK, BV), dtype=tl.float32), FP64)
        zsum = _wide(tl.zeros((BK,), dtype=tl.float32), FP64)
        if HAS_S0:
            state += _wide(_load(S0 + bh * D * DV, rk, rv, D, DV, DV), FP64)
            if NORMALISED:
                zsum += _wide(tl.load(Z0 + bh * D + rk, mask=rk < D, other=0.0), FP64)
        n_chunks = tl.cdiv(N, CHUNK)
        HS += first * D * DV
        ZS += first * D
        state_mask = (rk[:, None] < D) & (rv[None, :] < DV)
        for c in range(0, n_chunks):
            if MEAN_STATE:
                stored = state / _rows_before(c, CHUNK, prefix_rows, FP64)
            else:
                stored = state
            tl.store(HS + c * D * DV + rk[:, None] * DV + rv[None, :], stored.to(HS.dtype.element_ty),
                     mask=state_mask)
            if NORMALISED:   # every column tile carries z; the first one writes it
                tl.store(ZS + c * D + rk, zsum, mask=(rk < D) & (pv == 0))
            rows = _from(c * CHUNK + rc, k_lo, N, VARLEN)
            kt = _load_t(K, rows, rk, N, D, stride_kn)                                # (BK, CHUNK)
            fkt = _features(kt, (rows[None, :] < N) & (rk[:, None] < D), 1.0, FEATURE, FP64)
            v = _load(V, rows, rv, N, DV, stride_vn)                                  # (CHUNK, BV)
            state += mm(fkt.to(v.dtype), v, UPCAST, PREC)
            if NORMALISED:
                zsum += tl.sum(fkt, 1)

    @triton.jit
    def _output_kernel(Q, K, V, HS, ZS, O, O32, RDEN, EPS_BH, N, D, DV, H, scale, count_offset, prefix_rows,
                       stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                       stride_vb, stride_vh, stride_vn,
                       CHUNK: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, FEATURE: tl.constexpr,
                       MODE: tl.constexpr, EPS_PER_HEAD: tl.constexpr, MEAN_STATE: tl.constexpr,
                       STORE_EXACT: tl.constexpr, FP64: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
                       CU_Q=None, CU_K=None, CT=0, GROUP=1, TQ=0, VARLEN: tl.constexpr = False):
        """out for one chunk and one (CHUNK, BV) column tile; RDEN (MODE 2) gets r for the backward.
        EPS_PER_HEAD: the normaliser's 1e-6 comes per batch x head from EPS_BH (a float key mask's
        weights are exp(mask - shift), so its epsilon is 1e-6 exp(-shift)). STORE_EXACT (MODE 2, half
        inputs): O32 gets out before its rounding to the dtype, for the backward's c_i (see
        _normaliser_grad_kernel)."""
        scale = _scalar(scale, FP64)  # inductor hands Python floats over as fp64 scalars
        bh, pv, c = _chunk_ids(DV, BV)
        b, h = bh // H, bh % H
        if VARLEN:   # b: the sequence; out, RDEN (H, T_q, .): q_row is position 0's row
            q_pos, k_pos, N, q_lo, k_lo, chunk0 = _packed_sequence(CU_Q, CU_K, b, CHUNK)
            if c * CHUNK >= N:   # a chunk past this sequence's end
                return
            Q += q_pos * stride_qn + h * stride_qh
            K += k_pos * stride_kn + (h // GROUP) * stride_kh
            V += k_pos * stride_vn + (h // GROUP) * stride_vh
            count_offset = 1 - k_lo
            prefix_rows = -k_lo
            at = h * CT + chunk0 + c
            q_row = h * TQ + q_pos
        else:
            Q += b * stride_qb + h * stride_qh
            K += b * stride_kb + h * stride_kh
            V += b * stride_vb + h * stride_vh
            q_lo, k_lo = 0, 0
            at = bh * tl.cdiv(N, CHUNK) + c
            q_row = bh * N
        HS += at * D * DV
        ZS += at * D
        rc, rv = tl.arange(0, CHUNK), pv * BV + tl.arange(0, BV)
        rows = _from(c * CHUNK + rc, q_lo, N, VARLEN)       # query rows
        rows_k = _from(c * CHUNK + rc, k_lo, N, VARLEN)     # key rows
        acc = _wide(tl.zeros((CHUNK, BV), dtype=tl.float32), FP64)
        scores = _wide(tl.zeros((CHUNK, CHUNK), dtype=tl.float32), FP64)
        den = _wide(tl.zeros((CHUNK,), dtype=tl.float32), FP64)
        for d0 in range(0, D, BK):
            rk = d0 + tl.arange(0, BK)
            q = _load(Q, rows, rk, N, D, stride_qn)
            fq = _features(q, (rows[:, None] < N) & (rk[None, :] < D), scale, FEATURE, FP64)
            kt = _load_t(K, rows_k, rk, N, D, stride_kn)
            fkt = _features(kt, (rows_k[None, :] < N) & (rk[:, None] < D), 1.0, FEATURE, FP64)
            state = _load(HS, rk, rv, D, DV, DV)
            fq_op = fq.to(q.dtype)
            acc += mm(fq_op, state.to(q.dtype), UPCAST, PREC)
            scores += mm(fq_op, fkt.to(q.dtype), UPCAST, PREC)
            if MODE == 2:
                z = _wide(tl.load(ZS + rk, mask=rk < D, other=0.0), FP64)
                den += tl.sum(fq * z[None, :], 1)
        if MEAN_STATE:
            acc = acc * _rows_before(c, CHUNK, prefix_rows, FP64)
        v = _load(V, rows_k, rv, N, DV, stride_vn)
        # the weights as the tensor cores see them; the normaliser sums the same rounded weights
        weights = tl.where(rc[:, None] >= rc[None, :], scores, 0.0).to(v.dtype)
        acc += mm(weights, v, UPCAST, PREC)
        if MODE == 2:
            if EPS_PER_HEAD:
                eps = _wide(tl.load(EPS_BH + bh), FP64)
            else:
                eps = 1e-6
            den += tl.sum(_wide(weights, FP64), 1)
            # den == 0 (features are >= 0): every weight of the row is 0, so out_i = 0 and every
            # gradient reaching q or k through the row is 0 (a zero feature, a masked key's weight or
            # a zero feature slope multiplies it); r = 0 says so, where 1 / eps ~ 1e6 made dA and
            # dphi(k) overflow fp16 on their way to a half tl.dot operand or to dk (inf * 0 = NaN)
            r = tl.where(den == 0.0, 0.0, 1.0 / (den + eps))
            tl.store(RDEN + q_row + rows, r, mask=(rows < N) & (pv == 0))
        else:
            r = _row_scale(RDEN, rows, N, count_offset, MODE, FP64)
        out = acc * r[:, None]
        tl.store(O + q_row * DV + rows[:, None] * DV + rv[None, :], out.to(O.dtype.element_ty),
                 mask=(rows[:, None] < N) & (rv[None, :] < DV))
        if STORE_EXACT:
            tl.store(O32 + q_row * DV + rows[:, None] * DV + rv[None, :], out,
                     mask=(rows[:, None] < N) & (rv[None, :] < DV))

    @triton.jit
    def _normaliser_grad_kernel(DO, O, RDEN, CG, N, DV,
                                CHUNK: tl.constexpr, BV: tl.constexpr, FP64: tl.constexpr):
        """CG_i = c_i = -r_i (dO_i . out_i): the gradient reaching the normaliser of row i (MODE 2). O is
        the unrounded (fp32) output for half inputs: c_i z_c and c_i's share of dA cancel most of
        r dO H_c^T and of the intra-chunk dA phi(k) in dphi(q), so an out rounded to bf16 (2^-9) here
        left dq 10.6x the reference's error in the causal elu 37 x 37 test (5.6x from fp32 out)."""
        bh, c = tl.program_id(0).to(tl.int64), tl.program_id(1)
        rows = c * CHUNK + tl.arange(0, CHUNK)
        DO += bh * N * DV
        O += bh * N * DV
        dot = _wide(tl.zeros((CHUNK,), dtype=tl.float32), FP64)
        for v0 in range(0, DV, BV):
            rv = v0 + tl.arange(0, BV)
            do = _wide(_load(DO, rows, rv, N, DV, DV), FP64)
            o = _wide(_load(O, rows, rv, N, DV, DV), FP64)
            dot += tl.sum(do * o, 1)
        r = _wide(tl.load(RDEN + bh * N + rows, mask=rows < N, other=0.0), FP64)
        tl.store(CG + bh * N + rows, -dot * r, mask=rows < N)

    @triton.jit
    def _reverse_states_kernel(Q, DO, RDEN, CG, DHS, DZS, DS0, DZ0, N, D, DV, H, scale, count_offset,
                               stride_qb, stride_qh, stride_qn,
                               CHUNK: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, FEATURE: tl.constexpr,
                               MODE: tl.constexpr, HAS_S0: tl.constexpr, FP64: tl.constexpr,
                               UPCAST: tl.constexpr, PREC: tl.constexpr,
                               CU_Q=None, CU_K=None, CT=0, TQ=0, VARLEN: tl.constexpr = False):
        """DHS[bh, c] = dH_c, DZS[bh, c] = dz_c (sums over the chunks after c): a scan from the last chunk;
        DS0 / DZ0 get the sums over every chunk (the gradient of the initial state)."""
        scale = _scalar(scale, FP64)  # inductor hands Python floats over as fp64 scalars
        bh, pk, pv = _scan_ids(D, DV, BK, BV)
        b, h = bh // H, bh % H
        if VARLEN:
            q_pos, k_pos, N, q_lo, k_lo, chunk0 = _packed_sequence(CU_Q, CU_K, b, CHUNK)
            Q += q_pos * stride_qn + h * stride_qh
            count_offset = 1 - k_lo
            first = h * CT + chunk0
            q_row = h * TQ + q_pos
        else:
            Q += b * stride_qb + h * stride_qh
            q_lo = 0
            first = bh * tl.cdiv(N, CHUNK)
            q_row = bh * N
        DO += q_row * DV
        rk, rv, rc = pk * BK + tl.arange(0, BK), pv * BV + tl.arange(0, BV), tl.arange(0, CHUNK)
        dstate = _wide(tl.zeros((BK, BV), dtype=tl.float32), FP64)
        dz = _wide(tl.zeros((BK,), dtype=tl.float32), FP64)
        n_chunks = tl.cdiv(N, CHUNK)
        DHS += first * D * DV
        DZS += first * D
        state_mask = (rk[:, None] < D) & (rv[None, :] < DV)
        for i in range(0, n_chunks):
            c = n_chunks - 1 - i
            tl.store(DHS + c * D * DV + rk[:, None] * DV + rv[None, :], dstate.to(DHS.dtype.element_ty),
                     mask=state_mask)
            if MODE == 2:
                tl.store(DZS + c * D + rk, dz, mask=(rk < D) & (pv == 0))
            rows = _from(c * CHUNK + rc, q_lo, N, VARLEN)
            qt = _load_t(Q, rows, rk, N, D, stride_qn)                                # (BK, CHUNK)
            fqt = _features(qt, (rows[None, :] < N) & (rk[:, None] < D), scale, FEATURE, FP64)
            r = _row_scale(RDEN + q_row, rows, N, count_offset, MODE, FP64)
            do = _load(DO, rows, rv, N, DV, DV)
            dstate += mm((fqt * r[None, :]).to(do.dtype), do, UPCAST, PREC)
            if MODE == 2:
                cg = _wide(tl.load(CG + q_row + rows, mask=rows < N, other=0.0), FP64)
                dz += tl.sum(fqt * cg[None, :], 1)
        if HAS_S0:
            tl.store(DS0 + bh * D * DV + rk[:, None] * DV + rv[None, :], dstate, mask=state_mask)
            if MODE == 2:
                tl.store(DZ0 + bh * D + rk, dz, mask=(rk < D) & (pv == 0))

    @triton.jit
    def _dv_kernel(Q, K, DO, DHS, RDEN, DV_OUT, N, D, DV, H, scale, count_offset,
                   stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                   CHUNK: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, FEATURE: tl.constexpr,
                   MODE: tl.constexpr, FP64: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
                   CU_Q=None, CU_K=None, CT=0, GROUP=1, TQ=0, TK=0, VARLEN: tl.constexpr = False):
        """dv for one chunk and one column tile: (r-scaled causal weights)^T dO + phi(k) dH_c. A packed
        call's DV_OUT is (H, T_k, Dv): per query head (the host sums a group's)."""
        scale = _scalar(scale, FP64)  # inductor hands Python floats over as fp64 scalars
        bh, pv, c = _chunk_ids(DV, BV)
        b, h = bh // H, bh % H
        if VARLEN:
            q_pos, k_pos, N, q_lo, k_lo, chunk0 = _packed_sequence(CU_Q, CU_K, b, CHUNK)
            if c * CHUNK >= N:
                return
            Q += q_pos * stride_qn + h * stride_qh
            K += k_pos * stride_kn + (h // GROUP) * stride_kh
            count_offset = 1 - k_lo
            at = h * CT + chunk0 + c
            q_row, k_row = h * TQ + q_pos, h * TK + k_pos
        else:
            Q += b * stride_qb + h * stride_qh
            K += b * stride_kb + h * stride_kh
            q_lo, k_lo = 0, 0
            at = bh * tl.cdiv(N, CHUNK) + c
            q_row, k_row = bh * N, bh * N
        DHS += at * D * DV
        rc, rv = tl.arange(0, CHUNK), pv * BV + tl.arange(0, BV)
        rows = _from(c * CHUNK + rc, q_lo, N, VARLEN)       # query rows
        rows_k = _from(c * CHUNK + rc, k_lo, N, VARLEN)     # key rows
        acc = _wide(tl.zeros((CHUNK, BV), dtype=tl.float32), FP64)
        scores_t = _wide(tl.zeros((CHUNK, CHUNK), dtype=tl.float32), FP64)   # [j, i] = phi(k_j) . phi(q_i)
        for d0 in range(0, D, BK):
            rk = d0 + tl.arange(0, BK)
            k = _load(K, rows_k, rk, N, D, stride_kn)
            fk = _features(k, (rows_k[:, None] < N) & (rk[None, :] < D), 1.0, FEATURE, FP64).to(k.dtype)
            qt = _load_t(Q, rows, rk, N, D, stride_qn)
            fqt = _features(qt, (rows[None, :] < N) & (rk[:, None] < D), scale, FEATURE, FP64)
            dstate = _load(DHS, rk, rv, D, DV, DV)
            acc += mm(fk, dstate.to(k.dtype), UPCAST, PREC)
            scores_t += mm(fk, fqt.to(k.dtype), UPCAST, PREC)
        r = _row_scale(RDEN + q_row, rows, N, count_offset, MODE, FP64)
        do = _load(DO + q_row * DV, rows, rv, N, DV, DV)
        weights_t = tl.where(rc[None, :] >= rc[:, None], scores_t * r[None, :], 0.0)
        acc += mm(weights_t.to(do.dtype), do, UPCAST, PREC)
        tl.store(DV_OUT + k_row * DV + rows_k[:, None] * DV + rv[None, :], acc.to(DV_OUT.dtype.element_ty),
                 mask=(rows_k[:, None] < N) & (rv[None, :] < DV))

    @triton.jit
    def _dqk_kernel(Q, K, V, DO, HS, ZS, DHS, DZS, RDEN, CG, DQ, DK, N, D, DV, H, scale, count_offset, prefix_rows,
                    stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                    stride_vb, stride_vh, stride_vn,
                    CHUNK: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, FEATURE: tl.constexpr,
                    MODE: tl.constexpr, MEAN_STATE: tl.constexpr, FP64: tl.constexpr, UPCAST: tl.constexpr,
                    PREC: tl.constexpr,
                    CU_Q=None, CU_K=None, CT=0, GROUP=1, TQ=0, TK=0, VARLEN: tl.constexpr = False):
        """dq and dk for one chunk and one (CHUNK, BK) head-dim tile. A packed call's DQ is (H, T_q, D),
        its DK (H, T_k, D): per query head (the host sums a group's)."""
        scale = _scalar(scale, FP64)  # inductor hands Python floats over as fp64 scalars
        bh, pk, c = _chunk_ids(D, BK)
        b, h = bh // H, bh % H
        if VARLEN:
            q_pos, k_pos, N, q_lo, k_lo, chunk0 = _packed_sequence(CU_Q, CU_K, b, CHUNK)
            if c * CHUNK >= N:
                return
            Q += q_pos * stride_qn + h * stride_qh
            K += k_pos * stride_kn + (h // GROUP) * stride_kh
            V += k_pos * stride_vn + (h // GROUP) * stride_vh
            count_offset = 1 - k_lo
            prefix_rows = -k_lo
            at = h * CT + chunk0 + c
            q_row, k_row = h * TQ + q_pos, h * TK + k_pos
        else:
            Q += b * stride_qb + h * stride_qh
            K += b * stride_kb + h * stride_kh
            V += b * stride_vb + h * stride_vh
            q_lo, k_lo = 0, 0
            at = bh * tl.cdiv(N, CHUNK) + c
            q_row, k_row = bh * N, bh * N
        DO += q_row * DV
        HS += at * D * DV
        DHS += at * D * DV
        rc, rk = tl.arange(0, CHUNK), pk * BK + tl.arange(0, BK)
        rows = _from(c * CHUNK + rc, q_lo, N, VARLEN)       # query rows
        rows_k = _from(c * CHUNK + rc, k_lo, N, VARLEN)     # key rows
        dfq = _wide(tl.zeros((CHUNK, BK), dtype=tl.float32), FP64)
        dfk = _wide(tl.zeros((CHUNK, BK), dtype=tl.float32), FP64)
        dscores = _wide(tl.zeros((CHUNK, CHUNK), dtype=tl.float32), FP64)   # [i, j] = dO_i . v_j
        for v0 in range(0, DV, BV):
            rv = v0 + tl.arange(0, BV)
            do = _load(DO, rows, rv, N, DV, DV)
            v = _load(V, rows_k, rv, N, DV, stride_vn)
            state_t = _load_t(HS, rk, rv, D, DV, DV)                             # (BV, BK) = H_c^T
            dstate_t = _load_t(DHS, rk, rv, D, DV, DV)
            dscores += mm(do, tl.trans(v).to(do.dtype), UPCAST, PREC)
            dfq += mm(do, state_t.to(do.dtype), UPCAST, PREC)
            dfk += mm(v.to(do.dtype), dstate_t.to(do.dtype), UPCAST, PREC)
        if MEAN_STATE:
            dfq = dfq * _rows_before(c, CHUNK, prefix_rows, FP64)
        r = _row_scale(RDEN + q_row, rows, N, count_offset, MODE, FP64)
        dscores = dscores * r[:, None]
        dfq = dfq * r[:, None]
        if MODE == 2:
            cg = _wide(tl.load(CG + q_row + rows, mask=rows < N, other=0.0), FP64)
            dscores += cg[:, None]
            z = _wide(tl.load(ZS + at * D + rk, mask=rk < D, other=0.0), FP64)
            dz = _wide(tl.load(DZS + at * D + rk, mask=rk < D, other=0.0), FP64)
            dfq += cg[:, None] * z[None, :]
            dfk += dz[None, :]
        dscores = tl.where((rc[:, None] >= rc[None, :]) & (rows[:, None] < N), dscores, 0.0)
        valid = (rows[:, None] < N) & (rk[None, :] < D)
        valid_k = (rows_k[:, None] < N) & (rk[None, :] < D)
        q = _load(Q, rows, rk, N, D, stride_qn)
        k = _load(K, rows_k, rk, N, D, stride_kn)
        fq = _features(q, valid, scale, FEATURE, FP64).to(q.dtype)
        fk = _features(k, valid_k, 1.0, FEATURE, FP64).to(k.dtype)
        ds_op = dscores.to(q.dtype)
        dfq += mm(ds_op, fk, UPCAST, PREC)
        dfk += mm(tl.trans(ds_op), fq, UPCAST, PREC)
        dq = dfq * _feature_slope(q, scale, FEATURE, FP64)
        dk = dfk * _feature_slope(k, 1.0, FEATURE, FP64)
        tl.store(DQ + q_row * D + rows[:, None] * D + rk[None, :], dq.to(DQ.dtype.element_ty), mask=valid)
        tl.store(DK + k_row * D + rows_k[:, None] * D + rk[None, :], dk.to(DK.dtype.element_ty), mask=valid_k)
