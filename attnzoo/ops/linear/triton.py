"""Chunked causal linear attention in Triton, forward and backward (readable twin: cpu.py).

One program per (batch, head) walks the sequence in chunks of CHUNK rows, keeping the state
S = s0 + sum of earlier chunks' k^T v in fp32 registers (D x Dv; a wide v is split into column slices
that fit, see ``causal_product``):
    forward   o_c  = tril(q_c k_c^T) v_c + q_c S;                 S  += k_c^T v_c
    backward  dq_c = tril(dO_c v_c^T) k_c + dO_c S^T               (forward walk, S as above)
              dk_c = tril(dO_c v_c^T)^T q_c + v_c dS^T;
              dv_c = tril(q_c k_c^T)^T dO_c + k_c dS;  dS += q_c^T dO_c   (backward walk, dS from later chunks)
and ds0 is the final dS. Masks, feature maps, normalisation and Nq != Nk live in factorised.py.
"""
from __future__ import annotations

import os

import torch

from .factorised import linear_attention_factorised

try:
    import triton
    import triton.language as tl
    HAVE_TRITON = True
except ImportError:  # pragma: no cover
    HAVE_TRITON = False

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
CHUNK = 32


def device_reason(q):
    """None when the kernels can run on q's device, else why not."""
    if not HAVE_TRITON:
        return "triton is not installed"
    if q.device.type == "cpu" and not INTERPRETED:
        return "CPU tensors run the Triton kernels only under TRITON_INTERPRET=1 (set before importing attnzoo)"
    if q.device.type == "cuda" and INTERPRETED:
        return "TRITON_INTERPRET=1 is set: the kernels are interpreted and take CPU tensors only"
    if q.device.type not in ("cpu", "cuda"):
        return f"Triton kernels run on CUDA tensors (or CPU under TRITON_INTERPRET=1), got {q.device.type}"
    return None


if HAVE_TRITON:
    @triton.jit
    def _tile(ptr, rows, cols, n_rows, n_cols, row_stride):
        mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
        return tl.load(ptr + rows[:, None] * row_stride + cols[None, :], mask=mask, other=0.0)

    @triton.jit
    def _fwd_kernel(Q, K, V, S0, O, N, D, DV,
                    CHUNK: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr, ACC: tl.constexpr):
        bh = tl.program_id(0).to(tl.int64)   # bh * N * D can pass 2^31 elements
        rc, rd, rv = tl.arange(0, CHUNK), tl.arange(0, BD), tl.arange(0, BV)
        Q, K, V, O = Q + bh * N * D, K + bh * N * D, V + bh * N * DV, O + bh * N * DV
        s = _tile(S0 + bh * D * DV, rd, rv, D, DV, DV).to(ACC)
        causal = rc[:, None] >= rc[None, :]
        for c0 in range(0, N, CHUNK):
            rows = c0 + rc
            q = _tile(Q, rows, rd, N, D, D)
            k = _tile(K, rows, rd, N, D, D)
            v = _tile(V, rows, rv, N, DV, DV)
            a = tl.where(causal, tl.dot(q, tl.trans(k), input_precision=PREC), 0.0)
            o = tl.dot(a.to(v.dtype), v, input_precision=PREC) + tl.dot(q, s.to(q.dtype), input_precision=PREC)
            omask = (rows[:, None] < N) & (rv[None, :] < DV)
            tl.store(O + rows[:, None] * DV + rv[None, :], o.to(O.dtype.element_ty), mask=omask)
            s += tl.dot(tl.trans(k), v, input_precision=PREC)

    @triton.jit
    def _dq_kernel(Q, K, V, S0, DO, DQ, N, D, DV,
                   CHUNK: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr, ACC: tl.constexpr):
        bh = tl.program_id(0).to(tl.int64)   # bh * N * D can pass 2^31 elements
        rc, rd, rv = tl.arange(0, CHUNK), tl.arange(0, BD), tl.arange(0, BV)
        K, V, DO, DQ = K + bh * N * D, V + bh * N * DV, DO + bh * N * DV, DQ + bh * N * D
        s = _tile(S0 + bh * D * DV, rd, rv, D, DV, DV).to(ACC)
        causal = rc[:, None] >= rc[None, :]
        for c0 in range(0, N, CHUNK):
            rows = c0 + rc
            k = _tile(K, rows, rd, N, D, D)
            v = _tile(V, rows, rv, N, DV, DV)
            do = _tile(DO, rows, rv, N, DV, DV)
            da = tl.where(causal, tl.dot(do, tl.trans(v), input_precision=PREC), 0.0)
            dq = tl.dot(da.to(k.dtype), k, input_precision=PREC) + tl.dot(do, tl.trans(s.to(do.dtype)), input_precision=PREC)
            tl.store(DQ + rows[:, None] * D + rd[None, :], dq.to(DQ.dtype.element_ty),
                     mask=(rows[:, None] < N) & (rd[None, :] < D))
            s += tl.dot(tl.trans(k), v, input_precision=PREC)

    @triton.jit
    def _dkv_kernel(Q, K, V, DO, DK, DV_, DS0, N, D, DV,
                    CHUNK: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr, ACC: tl.constexpr):
        bh = tl.program_id(0).to(tl.int64)   # bh * N * D can pass 2^31 elements
        rc, rd, rv = tl.arange(0, CHUNK), tl.arange(0, BD), tl.arange(0, BV)
        Q, K, V, DO = Q + bh * N * D, K + bh * N * D, V + bh * N * DV, DO + bh * N * DV
        DK, DV_ = DK + bh * N * D, DV_ + bh * N * DV
        ds = tl.zeros((BD, BV), dtype=ACC)
        causal = rc[:, None] >= rc[None, :]
        n_chunks = tl.cdiv(N, CHUNK)
        for idx in range(0, n_chunks):
            rows = (n_chunks - 1 - idx) * CHUNK + rc
            q = _tile(Q, rows, rd, N, D, D)
            k = _tile(K, rows, rd, N, D, D)
            v = _tile(V, rows, rv, N, DV, DV)
            do = _tile(DO, rows, rv, N, DV, DV)
            a = tl.where(causal, tl.dot(q, tl.trans(k), input_precision=PREC), 0.0)
            da = tl.where(causal, tl.dot(do, tl.trans(v), input_precision=PREC), 0.0)
            dk = tl.dot(tl.trans(da).to(q.dtype), q, input_precision=PREC) + tl.dot(v, tl.trans(ds.to(v.dtype)), input_precision=PREC)
            dv = tl.dot(tl.trans(a).to(do.dtype), do, input_precision=PREC) + tl.dot(k, ds.to(k.dtype), input_precision=PREC)
            tl.store(DK + rows[:, None] * D + rd[None, :], dk.to(DK.dtype.element_ty),
                     mask=(rows[:, None] < N) & (rd[None, :] < D))
            tl.store(DV_ + rows[:, None] * DV + rv[None, :], dv.to(DV_.dtype.element_ty),
                     mask=(rows[:, None] < N) & (rv[None, :] < DV))
            ds += tl.dot(tl.trans(q), do, input_precision=PREC)
        tl.store(DS0 + bh * D * DV + rd[:, None] * DV + rv[None, :], ds.to(DS0.dtype.element_ty),
                 mask=(rd[:, None] < D) & (rv[None, :] < DV))


# shared memory for the pipelined chunk loads; the state's own trip into tl.dot (up to 64 KB, see
# STATE_ELEMENTS) and the dot operands come on top (an H100 SM has 227 KB, an A100 163 KB)
SHARED_BYTES = 64 * 1024


def _meta(d, dv, dtype, d_tiles, v_tiles):
    """Kernel constants and launch options. One loop step loads ``d_tiles`` (CHUNK, BD) tiles and
    ``v_tiles`` (CHUNK, BV) tiles (fwd: q, k | v; dq: k | v, dO; dkv: q, k | v, dO)."""
    bd = max(16, triton.next_power_of_2(d))
    bv = max(16, triton.next_power_of_2(dv))
    # the factorised driver hands fp32 (or fp64) operands: IEEE products keep fp32 accuracy (no TF32)
    # the state is fp32 (fp64 for fp64 inputs): summing N outer products in half precision drifts
    acc = tl.float64 if dtype == torch.float64 else tl.float32
    meta = dict(CHUNK=CHUNK, BD=bd, BV=bv, PREC="ieee", ACC=acc)
    if INTERPRETED:
        return meta
    # On a GPU the (BD, BV) state lives in registers: 4 warps hold 64 x 128 (D = 64, Dv = 64 plus the
    # normaliser's ones column); above that 8 warps halve it per thread. The software pipeline keeps
    # num_stages copies of each step's loads in shared memory, beside the state's own trip through
    # shared memory on its way into tl.dot: fewer copies for wide tiles.
    per_stage = CHUNK * (d_tiles * bd + v_tiles * bv) * torch.finfo(dtype).bits // 8
    meta["num_warps"] = 4 if bd * bv <= 64 * 128 else 8
    meta["num_stages"] = max(1, min(3, SHARED_BYTES // per_stage))
    return meta


class _CausalProductTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, s0):
        lead, n, d, dv = q.shape[:-2], q.shape[-2], q.shape[-1], v.shape[-1]
        qf, kf, vf = (t.reshape((-1,) + t.shape[-2:]).contiguous() for t in (q, k, v))
        sf = s0.reshape((-1, d, dv)).contiguous()
        out = torch.empty(qf.shape[:-1] + (dv,), dtype=q.dtype, device=q.device)
        with torch.cuda.device_of(qf):   # launch on q's GPU, not the current one
            _fwd_kernel[(qf.shape[0],)](qf, kf, vf, sf, out, n, d, dv,
                                        **_meta(d, dv, qf.dtype, d_tiles=2, v_tiles=1))
        ctx.save_for_backward(qf, kf, vf, sf)
        ctx.shapes = (lead, n, d, dv)
        return out.reshape(lead + (n, dv))

    @staticmethod
    def backward(ctx, dout):
        qf, kf, vf, sf = ctx.saved_tensors
        lead, n, d, dv = ctx.shapes
        do = dout.reshape(qf.shape[:-1] + (dv,)).contiguous().to(qf.dtype)
        dq, dk, dvv, ds0 = torch.empty_like(qf), torch.empty_like(kf), torch.empty_like(vf), torch.empty_like(sf)
        grid = (qf.shape[0],)
        with torch.cuda.device_of(qf):
            _dq_kernel[grid](qf, kf, vf, sf, do, dq, n, d, dv, **_meta(d, dv, qf.dtype, d_tiles=1, v_tiles=2))
            _dkv_kernel[grid](qf, kf, vf, do, dk, dvv, ds0, n, d, dv, **_meta(d, dv, qf.dtype, d_tiles=2, v_tiles=2))
        return (dq.reshape(lead + (n, d)), dk.reshape(lead + (n, d)), dvv.reshape(lead + (n, dv)),
                ds0.reshape(lead + (d, dv)))


# Elements of the padded (BD, BV) fp32 state one program keeps. On a GPU the state sits in registers and
# passes through shared memory on its way into tl.dot: 128 x 128 (64 KB) fits everywhere, whereas
# D = Dv = 128 plus the normaliser's ones column would pad to 128 x 256 and 256 x 256 would not fit at all.
# An fp64 state (fp64 inputs) gets the same bytes, half the elements: with a full 128 x 128 fp64 state
# the backward's _dkv_kernel needed 237568 bytes of shared memory, over sm_90's 232448 (compiled for
# sm_90 by benchmarks/compile_triton_kernels.py, benchmarks/results/gpu/ptx_build_check.md).
STATE_ELEMENTS = 128 * 128


def value_columns(d, dv, itemsize=4):
    """How many columns of v one kernel launch takes: all of them when the padded state of
    ``itemsize``-byte elements fits in STATE_ELEMENTS fp32 elements' bytes (read per call), else a
    power of two that does."""
    budget = STATE_ELEMENTS * 4 // itemsize
    bd = max(16, triton.next_power_of_2(d))
    if bd * max(16, triton.next_power_of_2(dv)) <= budget:
        return dv
    return max(16, budget // bd)


def causal_product(q, k, v, s0):
    """q_i^T (s0 + sum_{j <= i} k_j v_j^T), the Triton twin of ``cpu.causal_product``. The product is
    linear in the columns of v and s0, so a wide v runs as several launches on column slices (each
    with its own state), concatenated; autograd sums their q and k gradients."""
    s0 = s0.expand(q.shape[:-2] + s0.shape[-2:])
    dv = v.shape[-1]
    state_itemsize = 8 if q.dtype == torch.float64 else 4   # the ACC dtype of _meta
    width = value_columns(q.shape[-1], dv, itemsize=state_itemsize)
    if width >= dv:
        return _CausalProductTriton.apply(q, k, v, s0)
    return torch.cat([_CausalProductTriton.apply(q, k, v[..., c:c + width], s0[..., c:c + width])
                      for c in range(0, dv, width)], dim=-1)


def linear_attention_triton(q, k, v, *, attn_mask=None, is_causal=False, scale=1.0, feature_map="elu",
                            dropout_p=0.0):
    return linear_attention_factorised(causal_product, q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                                       scale=scale, feature_map=feature_map)
