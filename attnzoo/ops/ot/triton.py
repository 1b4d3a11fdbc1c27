"""OT attention (paper 004 eq 22) on the GPU in matmul form: the host side of triton_kernels.py.

``ot_attention_triton(q, k, v, ...)`` runs two torch custom ops, ``attnzoo::ot_gemm_fwd`` and
``attnzoo::ot_gemm_bwd`` (``torch.library.triton_op``s on a GPU, so torch.compile traces their
launches; opaque custom ops under the interpreter: triton_utils.kernel_op). They take q, k, the
template keys/values a_k = [k; templates_k], a_v = [v; templates_v] flattened to (B*H, N, .), the
log-preference lu (B*H, Nk) fp32 (zeros: uniform u) and the user's mask as it came (broadcast by
strides, read tile by tile in the kernels, never expanded in memory).

Work and memory. The forward is 4 Nq Nk |A| flops in tensor-core matmuls (S = EC EG^T, then
R EG), the backward 12 Nq Nk |A|, less where a mask or causal empties whole tiles (skipped, see
triton_kernels.py); nothing is saved but the inputs. The per-(batch, head)
temporaries (EC, EG, R, flags; in the backward also EDW, RG, dC, dG: about
(Nq + Nk) |A| + Nq Nk elements each) are made for ``CHUNK_BYTES`` worth of (batch, head) pairs at a
time, so the extra memory stays near CHUNK_BYTES whatever B * H is. dq, dk, d a_k are cuBLAS matmuls
of dC, dG (in the input dtype, like FlashAttention's dS) with a_k, q, k.

Precision: logits from input-dtype operands with fp32 accumulation, fp32 maxima / normalisers /
accumulators everywhere, exponentials and R in bfloat16 for bfloat16 inputs, float32 on TF32 tensor
cores for float16 inputs (R needs float32's range), float32 for float32 inputs (exact fp32 products
unless the user allowed TF32). float64 is refused (use backend='cpu').
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..triton_utils import (HAVE_TRITON, INTERPRETED, MAX_HEAD_DIM, device_reason, dot_precision, kernel_mask,
                            kernel_op, launcher, tracing_only)

if HAVE_TRITON:
    import triton

    from . import triton_kernels as kern

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# A pair (i, j) whose shifted normaliser S_ij falls to this or below goes to the exact fallback:
# above it every term within 2^-24 of S_ij is a normal float32 (2^-114 > 2^-126).
SAFE_NORMALISER = 2.0 ** -90
# Temporaries of one chunk of (batch, head) pairs, bytes (read at every call; tests lower it). 768 MiB:
# the extra peak is this plus O(B H N D) buffers (measured 1 GiB + 85 MB on an H200 at 1 GiB), under
# issue 21's 1 GB; each chunk still holds ~35 (backward) to ~100 (forward) pairs at N = |A| = 1024,
# thousands of programs per launch.
CHUNK_BYTES = 768 << 20


def supports_ot_triton(q, k, v, attn_mask=None, dropout_p=0.0, **kw):
    """None, or why the Triton OT backend cannot run the call."""
    why = device_reason(q)
    if why is not None:
        return why
    if dropout_p > 0:
        return "dropout on the weights is only implemented by backend='reference'"
    if q.dtype not in KERNEL_DTYPES:
        return (f"the Triton OT kernels compute in float32 and take float16, bfloat16 or float32 inputs, "
                f"got {q.dtype} (backend='cpu' runs float64 on any device)")
    if q.shape[-1] > MAX_HEAD_DIM or v.shape[-1] > MAX_HEAD_DIM:
        return f"head dims above {MAX_HEAD_DIM} are not supported (q D={q.shape[-1]}, v Dv={v.shape[-1]})"
    if attn_mask is not None and attn_mask.dtype != torch.bool and attn_mask.requires_grad:
        return "a float attn_mask that requires grad: the kernels give no gradient to attn_mask"
    return None


def _operand_dtype(dtype):
    """The dtype of the exponentials and R, RG, EDW as matmul operands. R = u / S reaches 2^90, past
    float16's range: bfloat16 inputs use bfloat16 operands (their own precision), float16 inputs
    float32 operands on TF32 tensor cores (float16's 10-bit mantissa with float32's range)."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32


def _config(q, dv):
    """Tile sizes per kernel and launch options. The interpreter uses 16-wide tiles everywhere so the
    tiny test shapes cross several tiles on every axis. GPU tiles (untuned, chosen for Hopper):
    128 x 128 pair tiles with 64-deep template steps (32 for fp32 operands, whose shared-memory
    stages are twice as large), two accumulators halve the pair tile in the backward."""
    d = q.shape[-1]
    bd, bdv = max(16, triton.next_power_of_2(d)), max(16, triton.next_power_of_2(dv))
    cfg = dict(BD=bd, BDV=bdv, UPCAST=INTERPRETED, PRECISION=dot_precision(q.dtype))
    if INTERPRETED:
        t = 16
        return cfg, dict(exp=(t, t), pair=(t, t, t), pair_bwd=(t, t, t), out=(t, t, t), dc=(t, t, t),
                         dg=(t, t, t), fallback=(16, 16)), {k: {} for k in ("exp", "pair", "out", "dc", "dg", "fb")}
    wide = max(bd, bdv) >= 128
    if _operand_dtype(q.dtype) == torch.float32:   # fp32 operands: half the tile of the 16-bit path's registers
        tiles = dict(exp=(32, 32), pair=(64, 64, 16), pair_bwd=(64, 32, 16), out=(32, 32, 32),
                     dc=(32, 32, 32), dg=(64, 32, 32), fallback=(16, 16))
        stages = 2
    else:
        tiles = dict(exp=(64, 64), pair=(128, 128, 64), pair_bwd=(128, 64, 64),
                     out=(128, 64, 128) if bdv <= 64 else (64, 64, 64), dc=(64, 64, 128 if bdv <= 64 else 64),
                     dg=(128, 64, 64), fallback=(16, 16))
        stages = 3
    launch = dict(exp=dict(num_warps=8 if wide else 4, num_stages=2),
                  pair=dict(num_warps=8, num_stages=stages),
                  out=dict(num_warps=8 if tiles["out"][0] == 128 or wide else 4, num_stages=2),
                  dc=dict(num_warps=8, num_stages=2),
                  dg=dict(num_warps=8, num_stages=2),
                  fb=dict(num_warps=8 if wide else 4, num_stages=1))
    return cfg, tiles, launch


def pair_bytes(nq, nk, na, d, dv, dtype, backward, need_dlu=True):
    """Bytes of temporaries per (batch, head) pair: EC, EG, R, flags, key ranges, lz, fp32 out
    (forward); EDW, RG, UG (only when log u needs a gradient), dC, dG, delta and the fp32 gradient
    buffers on top (backward)."""
    op = _operand_dtype(dtype).itemsize
    el = torch.finfo(dtype).bits // 8
    per = (nq + nk) * na * op + nq * nk * (op + 1) + nq * dv * 4 + nq * 12
    if backward:
        per += (nq * na * op + nq * nk * (op + (4 if need_dlu else 0)) + (nq + nk) * na * el + nq * 4
                + (nq + nk + na) * d * 4 + na * dv * 4)
    return per


def _chunk_size(bh, nq, nk, na, d, dv, dtype, backward, need_dlu=True):
    """(batch, head) pairs per chunk: as many as fit CHUNK_BYTES of temporaries (at least one)."""
    return max(1, min(bh, CHUNK_BYTES // pair_bytes(nq, nk, na, d, dv, dtype, backward, need_dlu)))


def _unused(device):
    """The pointer handed for an argument the launch's constexprs never touch (one per launch, so no
    written tensor is ever aliased by another argument)."""
    return torch.empty((1,), dtype=torch.float32, device=device)


def _skips(kind, causal):
    """Whether the kernels skip template and source tiles outside each row block's key range: only a
    mask or causal removes keys (without them every range is [0, Nk) and the plain loops run)."""
    return kind != 0 or bool(causal)


def _key_ranges(n, nq, skip, unused):
    """(lo, hi) int32 (n, Nq): the first and one past the last key each query keeps, which _exp_kernel
    writes and the other kernels read (kernels._key_range); ``unused`` stand-ins when not skipping."""
    if not skip:
        return unused, unused
    return (torch.empty((n, nq), dtype=torch.int32, device=unused.device),
            torch.empty((n, nq), dtype=torch.int32, device=unused.device))


def _mask_args(mask, bh, heads, nq, nk, device):
    m, kind, (s_b, s_h, s_m, s_n) = kernel_mask(mask, bh // heads, heads, nq, nk)
    if m is None:
        m = torch.zeros(1, dtype=torch.uint8, device=device)
    return m, kind, (s_b, s_h, s_m, s_n)


def _varlen_args(offsets):
    """The kernels' packed-sequence arguments: none for a dense call, else the (cu_q, cu_k) offsets."""
    return {} if offsets is None else dict(CU_Q=offsets[0], CU_K=offsets[1], VARLEN=True)


def _forward_chunk(q, k, ak, av, lu, m, kind, ms, b0, heads, causal, sc, sg, cfg, tiles, launch, offsets=None):
    """out (n, Nq, Dv) fp32 for the (batch, head) pairs b0 .. b0 + n of the chunk. ``offsets``: a
    packed call's (cu_q, cu_k) (ops/ot/varlen.py: pairs are (sequence, head), the sizes the maxima); the
    rows past a sequence's end are left unwritten."""
    n, nq, d = q.shape
    nk, na, dv = k.shape[1], ak.shape[1], av.shape[2]
    dev, op = q.device, _operand_dtype(q.dtype)
    ec = torch.empty((n, nq, na), dtype=op, device=dev)
    eg = torch.empty((n, nk, na), dtype=op, device=dev)
    lz = torch.empty((n, nq), dtype=torch.float32, device=dev)
    skip = _skips(kind, causal)
    unused = _unused(dev)
    lo, hi = _key_ranges(n, nq, skip, unused)
    flags = dict(MASK_KIND=kind, CAUSAL=causal)
    vl = _varlen_args(offsets)
    ebm, ebt = tiles["exp"]
    common = (nq, nk, na, d, av.shape[2])
    launcher(kern._exp_kernel)[(n * triton.cdiv(nq, ebm),)](
        q, ak, m, lu, ec, lz, lo, hi, unused, unused, unused, unused, unused, nq, *common, sc, b0, heads, *ms,
        IS_QUERY=True, HAS_DOUT=False, SKIP=skip, BM=ebm, BT=ebt, **flags, **cfg, **launch["exp"], **vl)
    launcher(kern._exp_kernel)[(n * triton.cdiv(nk, ebm),)](
        k, ak, unused, unused, eg, unused, unused, unused, unused, unused, unused, unused, unused, nk, *common, sg, b0,
        heads, *ms, IS_QUERY=False, HAS_DOUT=False, SKIP=False, BM=ebm, BT=ebt, MASK_KIND=0, CAUSAL=False, **cfg,
        **launch["exp"], **vl)
    pbm, pbn, pbk = tiles["pair"]
    r = torch.empty((n, nq, nk), dtype=op, device=dev)
    bad = torch.empty((n, nq, nk), dtype=torch.uint8, device=dev)
    tbad = torch.empty((n, triton.cdiv(nq, pbm), triton.cdiv(nk, pbn)), dtype=torch.int32, device=dev)
    grid = (tbad.numel(),)      # flat, (batch, head) slowest: one program per entry of tbad
    small = {k_: v_ for k_, v_ in cfg.items() if k_ in ("UPCAST", "PRECISION")}
    launcher(kern._pair_kernel)[grid](
        ec, eg, unused, lu, lz, lo, hi, m, r, unused, unused, bad, tbad, nq, nk, na, SAFE_NORMALISER, b0, heads,
        *ms, BACKWARD=False, NEED_UG=False, SKIP=skip, BM=pbm, BN=pbn, BK=pbk, **flags, **small, **launch["pair"],
        **vl)
    out = torch.empty((n, nq, dv), dtype=torch.float32, device=dev)
    obm, obn, obt = tiles["out"]
    launcher(kern._out_kernel)[(n * triton.cdiv(nq, obm),)](
        ec, eg, r, av, lo, hi, out, nq, nk, na, dv, SKIP=skip, BM=obm, BN=obn, BT=obt, BDV=cfg["BDV"], **small,
        **launch["out"], BH0=b0, H=heads, **vl)
    fb, fbt = tiles["fallback"]
    launcher(kern._fallback_fwd_kernel)[grid](
        q, k, ak, av, m, lu, lz, bad, tbad, out, nq, nk, na, d, dv, sc, sg, b0, heads, *ms,
        CBM=pbm, CBN=pbn, FB=fb, BT=fbt, **flags, **cfg, **launch["fb"], **vl)
    return out.to(q.dtype)


def _backward_chunk(dout, out, q, k, ak, av, lu, m, kind, ms, b0, heads, causal, sc, sg, need_dlu, cfg, tiles,
                    launch, offsets=None):
    """(dq, dk, d a_k, d a_v) of one chunk in their inputs' dtypes, d lu fp32 or None; _exp_kernel writes
    delta = dout . out (n, Nq) fp32, which shifts dW (_dc_kernel). ``offsets``: as _forward_chunk; the
    gradient rows past a sequence's end are then garbage (dC and dG start at zero there, so the matmuls
    below carry nothing from them into the rows inside)."""
    n, nq, d = q.shape
    nk, na, dv = k.shape[1], ak.shape[1], av.shape[2]
    dev, op = q.device, _operand_dtype(q.dtype)
    ec = torch.empty((n, nq, na), dtype=op, device=dev)
    edw = torch.empty((n, nq, na), dtype=op, device=dev)
    eg = torch.empty((n, nk, na), dtype=op, device=dev)
    lz = torch.empty((n, nq), dtype=torch.float32, device=dev)
    delta = torch.empty((n, nq), dtype=torch.float32, device=dev)
    skip = _skips(kind, causal)
    unused = _unused(dev)
    lo, hi = _key_ranges(n, nq, skip, unused)
    flags = dict(MASK_KIND=kind, CAUSAL=causal)
    vl = _varlen_args(offsets)
    small = {k_: v_ for k_, v_ in cfg.items() if k_ in ("UPCAST", "PRECISION")}
    ebm, ebt = tiles["exp"]
    common = (nq, nk, na, d, dv)
    launcher(kern._exp_kernel)[(n * triton.cdiv(nq, ebm),)](
        q, ak, m, lu, ec, lz, lo, hi, dout, out, av, delta, edw, nq, *common, sc, b0, heads, *ms, IS_QUERY=True,
        HAS_DOUT=True, SKIP=skip, BM=ebm, BT=ebt, **flags, **cfg, **launch["exp"], **vl)
    launcher(kern._exp_kernel)[(n * triton.cdiv(nk, ebm),)](
        k, ak, unused, unused, eg, unused, unused, unused, unused, unused, unused, unused, unused, nk, *common, sg, b0,
        heads, *ms, IS_QUERY=False, HAS_DOUT=False, SKIP=False, BM=ebm, BT=ebt, MASK_KIND=0, CAUSAL=False, **cfg,
        **launch["exp"], **vl)
    pbm, pbn, pbk = tiles["pair_bwd"]
    r = torch.empty((n, nq, nk), dtype=op, device=dev)
    rg = torch.empty((n, nq, nk), dtype=op, device=dev)
    ug = torch.empty((n, nq, nk), dtype=torch.float32, device=dev) if need_dlu else unused
    bad = torch.empty((n, nq, nk), dtype=torch.uint8, device=dev)
    tbad = torch.empty((n, triton.cdiv(nq, pbm), triton.cdiv(nk, pbn)), dtype=torch.int32, device=dev)
    grid = (tbad.numel(),)
    launcher(kern._pair_kernel)[grid](
        ec, eg, edw, lu, lz, lo, hi, m, r, rg, ug, bad, tbad, nq, nk, na, SAFE_NORMALISER, b0, heads, *ms,
        BACKWARD=True, NEED_UG=need_dlu, SKIP=skip, BM=pbm, BN=pbn, BK=pbk, **flags, **small, **launch["pair"], **vl)
    blank = torch.empty if offsets is None else torch.zeros
    dc = blank((n, nq, na), dtype=q.dtype, device=dev)
    dav = torch.empty((n, na, dv), dtype=torch.float32, device=dev)
    cbm, cbn, cbt = tiles["dc"]
    launcher(kern._dc_kernel)[(n * triton.cdiv(na, cbt),)](
        ec, eg, r, rg, av, dout, delta, lo, hi, dc, dav, nq, nk, na, dv, sc, SKIP=skip, BM=cbm, BN=cbn, BT=cbt,
        BDV=cfg["BDV"], **small, **launch["dc"], BH0=b0, H=heads, **vl)
    dg = blank((n, nk, na), dtype=q.dtype, device=dev)
    gbn, gbt, gbm = tiles["dg"]
    launcher(kern._dg_kernel)[(n * triton.cdiv(nk, gbn) * triton.cdiv(na, gbt),)](
        ec, eg, r, rg, edw, lo, hi, dg, nq, nk, na, sg, SKIP=skip, BM=gbm, BN=gbn, BT=gbt, **small, **launch["dg"],
        BH0=b0, H=heads, **vl)
    dq_fb = torch.zeros((n, nq, d), dtype=torch.float32, device=dev)
    dk_fb = torch.zeros((n, nk, d), dtype=torch.float32, device=dev)
    dak_fb = torch.zeros((n, na, d), dtype=torch.float32, device=dev)
    fb, fbt = tiles["fallback"]
    launcher(kern._fallback_bwd_kernel)[grid](
        q, k, ak, av, dout, delta, m, lu, lz, bad, tbad, ug, dav, dq_fb, dk_fb, dak_fb, nq, nk, na, d, dv, sc, sg,
        b0, heads, *ms, NEED_UG=need_dlu, CBM=pbm, CBN=pbn, FB=fb, BT=fbt, **flags, **cfg, **launch["fb"], **vl)
    with torch.autocast(dev.type, enabled=False):   # the input dtype, whatever autocast says
        dq = torch.bmm(dc, ak).float() + dq_fb
        dk = torch.bmm(dg, ak).float() + dk_fb
        dak = (torch.bmm(dc.transpose(1, 2), q).float() + torch.bmm(dg.transpose(1, 2), k).float()) + dak_fb
    dlu = None
    if need_dlu:
        row_sums = ug.sum(-1).contiguous()
        dlu = torch.empty((n, nk), dtype=torch.float32, device=dev)
        t = 16 if INTERPRETED else 64
        launcher(kern._dlu_kernel)[(n * triton.cdiv(nk, t),)](
            ug, row_sums, lu, lz, m, dlu, nq, nk, b0, heads, *ms, BM=t, BN=t, **flags)
    return dq.to(q.dtype), dk.to(k.dtype), dak.to(ak.dtype), dav.to(av.dtype), dlu


def forward_chunks(q, k, ak, av, lu, mask, heads, causal, sc, sg, offsets=None):
    """out (n, Nq, Dv) in q's dtype of the flattened pairs (q (n, Nq, D), ...), CHUNK_BYTES of
    temporaries at a time; ``offsets`` as _forward_chunk (ot_gemm_fwd, and varlen.py's packed op)."""
    bh, nq, _ = q.shape
    nk, na, dv = k.shape[1], ak.shape[1], av.shape[2]
    m, kind, ms = _mask_args(mask, bh, heads, nq, nk, q.device)
    cfg, tiles, launch = _config(q, dv)
    step = _chunk_size(bh, nq, nk, na, q.shape[2], dv, q.dtype, backward=False)
    outs = [_forward_chunk(q[b0:b0 + step], k[b0:b0 + step], ak[b0:b0 + step], av[b0:b0 + step],
                           lu[b0:b0 + step], m, kind, ms, b0, heads, causal, sc, sg, cfg, tiles, launch, offsets)
            for b0 in range(0, bh, step)]
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def backward_chunks(dout, out, q, k, ak, av, lu, mask, heads, causal, sc, sg, need_dlu, offsets=None):
    """(dq, dk, d ak, d av, d lu) of forward_chunks, chunk by chunk as it; d lu is empty unless need_dlu."""
    bh, nq, d = q.shape
    nk, na, dv = k.shape[1], ak.shape[1], av.shape[2]
    dtypes = (q.dtype, k.dtype, ak.dtype, av.dtype, torch.float32)
    m, kind, ms = _mask_args(mask, bh, heads, nq, nk, q.device)
    cfg, tiles, launch = _config(q, dv)
    step = _chunk_size(bh, nq, nk, na, d, dv, q.dtype, backward=True, need_dlu=need_dlu)
    out = out.contiguous()      # read by rows in _exp_kernel (delta); a no-op for the saved output
    parts = [_backward_chunk(dout[b0:b0 + step], out[b0:b0 + step], q[b0:b0 + step], k[b0:b0 + step],
                             ak[b0:b0 + step], av[b0:b0 + step], lu[b0:b0 + step], m, kind, ms, b0, heads, causal, sc,
                             sg, need_dlu, cfg, tiles, launch, offsets)
             for b0 in range(0, bh, step)]
    grads = []
    for i, dtype in enumerate(dtypes):
        if i == 4 and not need_dlu:
            grads.append(torch.empty((0,), dtype=dtype, device=q.device))
            continue
        pieces = [p[i] for p in parts]
        grads.append((pieces[0] if len(pieces) == 1 else torch.cat(pieces)).to(dtype))
    return tuple(grads)


if HAVE_TRITON:
    @kernel_op("attnzoo::ot_gemm_fwd", mutates_args=())
    def ot_gemm_fwd(q: Tensor, k: Tensor, ak: Tensor, av: Tensor, lu: Tensor, mask: Optional[Tensor], heads: int,
                    causal: bool, sc: float, sg: float, need_dlu: bool) -> Tensor:
        """out (B*H, Nq, Dv) in q's dtype. q (B*H, Nq, D), k (B*H, Nk, D), ak (B*H, |A|, D),
        av (B*H, |A|, Dv) share one dtype; lu (B*H, Nk) fp32; mask broadcastable to (B, H, Nq, Nk)."""
        bh, nq, _ = q.shape
        nk, na, dv = k.shape[1], ak.shape[1], av.shape[2]
        if tracing_only(q):
            return torch.empty((bh, nq, dv), dtype=q.dtype, device=q.device)
        return forward_chunks(q, k, ak, av, lu, mask, heads, causal, sc, sg)

    @kernel_op("attnzoo::ot_gemm_bwd", mutates_args=())
    def ot_gemm_bwd(dout: Tensor, out: Tensor, q: Tensor, k: Tensor, ak: Tensor, av: Tensor, lu: Tensor,
                    mask: Optional[Tensor], heads: int, causal: bool, sc: float, sg: float,
                    need_dlu: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """(dq, dk, d ak, d av, d lu); d lu is empty unless need_dlu. ``out`` is the forward's output
        (any per-query shift of dW is exact; out . dout is the one that centres it)."""
        bh, nq, d = q.shape
        nk, na, dv = k.shape[1], ak.shape[1], av.shape[2]
        shapes = [((bh, nq, d), q.dtype), ((bh, nk, d), k.dtype), ((bh, na, d), ak.dtype), ((bh, na, dv), av.dtype),
                  ((bh, nk) if need_dlu else (0,), torch.float32)]
        if tracing_only(q):
            return tuple(torch.empty(s, dtype=t, device=q.device) for s, t in shapes)
        return backward_chunks(dout, out, q, k, ak, av, lu, mask, heads, causal, sc, sg, need_dlu)

    def _setup_context(ctx, inputs, output):
        q, k, ak, av, lu, mask, heads, causal, sc, sg, need_dlu = inputs
        ctx.save_for_backward(output, q, k, ak, av, lu, mask)
        ctx.args = (heads, causal, sc, sg, need_dlu)

    def _backward(ctx, dout):
        out, q, k, ak, av, lu, mask = ctx.saved_tensors
        heads, causal, sc, sg, need_dlu = ctx.args
        dq, dk, dak, dav, dlu = ot_gemm_bwd(dout.contiguous().to(out.dtype), out, q, k, ak, av, lu, mask, heads,
                                            causal, sc, sg, need_dlu)
        return dq, dk, dak, dav, (dlu if need_dlu else None), None, None, None, None, None, None

    ot_gemm_fwd.register_autograd(_backward, setup_context=_setup_context)


def ot_attention_triton(q, k, v, *, attn_mask=None, is_causal=False, scale, alpha=1.0, gamma=None, log_u=None,
                        templates_k=None, templates_v=None, dropout_p=0.0):
    """Eq (22) with M = -a.b + C on CUDA tensors (CPU tensors under TRITON_INTERPRET=1)."""
    gamma = 1.0 / scale if gamma is None else gamma
    B, H, nq, _ = q.shape
    nk, dv = k.shape[2], v.shape[3]
    ak = k if templates_k is None else torch.cat([k, templates_k.to(k.dtype)], 2)
    av = v if templates_v is None else torch.cat([v, templates_v.to(v.dtype)], 2)
    if log_u is None:
        lu = torch.zeros((B * H, nk), dtype=torch.float32, device=q.device)
    else:
        lu = log_u.float().expand(B, H, nk).reshape(B * H, nk).contiguous()

    def flat(x):
        return x.reshape((B * H,) + x.shape[2:]).contiguous()
    need_dlu = log_u is not None and log_u.requires_grad and torch.is_grad_enabled()
    out = ot_gemm_fwd(flat(q), flat(k), flat(ak), flat(av), lu, attn_mask, H, bool(is_causal),
                      float(alpha / gamma), float(1.0 / gamma), need_dlu)
    return out.reshape(B, H, nq, dv)
