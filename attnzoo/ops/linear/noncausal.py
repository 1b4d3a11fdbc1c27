"""Non-causal linear attention in Triton (kernels and their formulas: noncausal_kernels.py).

Non-causal linear attention is two products of cost O(N D Dv): the keys' state S = sum_j phi(k_j) v_j^T
(and the normaliser's z = sum_j phi(k_j)), then out_i = phi(q_i)^T S / (phi(q_i) . z + eps). Both are
fused with everything the reference does around them: the feature map and scale, a key-only mask (bool,
or float as the log-weight exp(m_j), its gradient included), the identity map's 1/n, the normaliser;
Nq != Nk needs nothing special. The kernels read q, k, v (and dO, out) in their own dtype and keep every
sum in fp32: no fp32 copies of the inputs, no (N, D, Dv) or N x N tensor; what the forward keeps for
the backward is S, z (D x Dv + D floats per head) and r_i (one float per query).

Launches (forward; backward):
- ``_keys_state_kernel`` reduces the keys, split into ``n_splits`` ranges when batch x heads alone would
  leave most SMs idle (B*H = 128 at N = 4096 fills an H100's 132 SMs once, B*H = 16 at N = 16384 an
  eighth of them); ``_sum_splits_kernel`` adds the splits' partial states (only when there are several);
  ``_queries_output_kernel`` writes out;
- ``_queries_grad_kernel`` reduces dS, dz over the queries (split likewise) and writes dq in the same pass;
  ``_sum_splits_kernel`` again when split; ``_keys_grad_kernel`` writes dk, dv (and the float mask's gradient).
So 2 launches forward and 2 backward when unsplit, 3 and 3 when split.

Forward and backward are the torch custom ops ``attnzoo::linear_noncausal_fwd`` / ``_bwd``
(triton_utils.kernel_op tied by register_autograd, as the causal ops in triton.py).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .triton_kernels import FEATURE_NONE
from .factorised import key_only_mask
from .launch import FEATURES, accumulator_dtype, bhn, device_index, flags, pow2, unit_columns
from ..triton_utils import (HAVE_TRITON, INTERPRETED, MASK_BOOL, MASK_FLOAT, MASK_NONE, kernel_op, launcher,
                            stand_in, tracing_only)

if HAVE_TRITON:
    import triton

    from . import noncausal_kernels as nk

# Grid sizing (fixed numbers, no device query, so a shape always gets the same launches):
# - a reduction (S or dS) is split over row ranges until batch x heads x head-dim tiles x splits reaches
#   STATE_PROGRAMS (about two programs per SM of an H100 or H200, each streaming its rows through a
#   pipelined loop), never into ranges under MIN_SPLIT_ROWS rows: each split writes a D x Dv fp32
#   partial (and the sum reads it back), which at D = Dv = 64 costs as much traffic as 128 rows of
#   k and v, so a range of 1024 rows pays ~12% on top of its reads;
# - the output and dk/dv kernels walk up to MAX_CHUNKS_PER_PROGRAM chunks per program (the state read
#   once per program instead of once per chunk) while keeping about OUTPUT_PROGRAMS programs.
STATE_PROGRAMS = 256
MIN_SPLIT_ROWS = 1024
OUTPUT_PROGRAMS = 1024
MAX_CHUNKS_PER_PROGRAM = 8
SUM_BLOCK = 1024
# Under the interpreter: 16-row chunks and 16-wide head-dim tiles, splits of 2 chunks and programs of
# 2 chunks, so the tiny test shapes cross chunks, splits, programs and (from D = 17 on) head-dim tiles.
INTERPRETER_TILE = 16


def launch_config(d, dv, dtype):
    """Tiles and launch options per kernel (fixed, chosen by the reasoning below; the sm_90 build check,
    benchmarks/compile_triton_kernels.py, compiles exactly these).

    - BV covers the whole Dv (the dS pass needs all of dO_i . out_i per row, the output and dk/dv
      kernels a whole output row); BK tiles D;
    - half inputs: 64-row chunks (the reductions' tensor-core products take K = 64); BK such that the
      fp32 tiles a program holds fit: the key reduction's (BK, BV) state <= 128 x 128 (64 registers a
      thread at 8 warps); the dS pass holds dS and S^T (BK, BV) plus dq, so BK * BV <= 64 x 128 (at
      128 x 128 it spilled 680 B); the output and dk / dv kernels hold a (64, BV) accumulator and the
      (BK, BV) state, BK <= 32 at Dv = 256 (64 spilled). D = Dv = 64: one tile everywhere; 128: one
      tile but in the dS pass (two); 4 warps for 64 x 64 tiles, 8 above; 3 stages for the streaming key
      reduction, 2 for the rest; VC = BV (products with S^T over all of Dv at once) but in the dS pass at
      Dv = 256, which takes S g_i 128 columns at a time (a whole widened 64 x 256 dO tile spilled ~3 KB);
      8 warps for the fp16 dS pass, whose dS product takes fp32 operands (WIDE_ROWS; 4 spilled 164 B);
    - fp32 / fp64 inputs take exact products on the CUDA cores (unless TF32 is allowed), whose dot
      operands hold all of K in each thread: every product keeps K <= 32 (32-row chunks; BK 32 for the
      key reduction, 16 where S or dS is the right operand; VC = 32 columns of Dv at a time for S g_i and
      dS v_j). With K = 64 the output and dS kernels spilled 8-15 KB (sm_90 build check).
    - Under the interpreter: 16 everywhere (VC too, so Dv > 16 takes the chunked products).
    """
    bv = pow2(dv)
    if INTERPRETED:
        t = INTERPRETER_TILE
        tiles = dict(BK=t, BV=bv)
        return {"state": dict(tiles, BLOCK_N=t), "output": dict(tiles, BLOCK_M=t),
                "dstate": dict(tiles, BLOCK_M=t, VC=min(t, bv)), "dkv": dict(tiles, BLOCK_N=t, VC=min(t, bv))}
    if dtype in (torch.float16, torch.bfloat16):
        bk = min(pow2(d), max(16, 16384 // bv), 128)
        bk_grad = min(pow2(d), max(16, 8192 // bv))
        bk_out = min(pow2(d), 128 if bv <= 128 else 32)
        out_warps = 4 if bv <= 64 else 8
        grad_warps = 4 if bk_grad * bv <= 64 * 64 and dtype != torch.float16 else 8
        return {
            "state": dict(BLOCK_N=64, BK=bk, BV=bv, num_warps=4 if bk * bv <= 64 * 64 else 8, num_stages=3),
            "dstate": dict(BLOCK_M=64, BK=bk_grad, BV=bv, VC=min(bv, 128), num_warps=grad_warps, num_stages=2),
            "output": dict(BLOCK_M=64, BK=bk_out, BV=bv, num_warps=out_warps, num_stages=2),
            "dkv": dict(BLOCK_N=64, BK=bk_out, BV=bv, VC=bv, num_warps=out_warps, num_stages=2),
        }
    narrow = min(pow2(d), 16)
    warps = 4 if bv <= 64 else 8
    return {
        "state": dict(BLOCK_N=32, BK=min(pow2(d), 32), BV=bv, num_warps=warps, num_stages=2),
        "dstate": dict(BLOCK_M=32, BK=narrow, BV=bv, VC=min(bv, 32), num_warps=warps, num_stages=2),
        "output": dict(BLOCK_M=32, BK=narrow, BV=bv, num_warps=warps, num_stages=2),
        "dkv": dict(BLOCK_N=32, BK=narrow, BV=bv, VC=min(bv, 32), num_warps=warps, num_stages=2),
    }


def _splits(n_rows, programs, rows):
    """(n_splits, split_rows): ranges of whole chunks for a reduction over n_rows rows."""
    if INTERPRETED:
        split_rows = 2 * rows
    else:
        want = max(1, min(triton.cdiv(STATE_PROGRAMS, programs), triton.cdiv(n_rows, MIN_SPLIT_ROWS)))
        split_rows = triton.cdiv(triton.cdiv(n_rows, want), rows) * rows
    return triton.cdiv(n_rows, split_rows), split_rows


def _block_rows(n_rows, bh, rows, single_k):
    """Rows one output / dk-dv program walks (several chunks only when the state is loop-invariant)."""
    if not single_k:
        return rows
    if INTERPRETED:
        return 2 * rows
    chunks = (bh * triton.cdiv(n_rows, rows)) // OUTPUT_PROGRAMS
    return rows * max(1, min(MAX_CHUNKS_PER_PROGRAM, chunks))


def _width(d, dv, normalised, count, shift):
    """Floats per head of a state buffer: S (D * Dv), then z (D, normalised) or n (1, COUNT), then the
    float mask's shift (1)."""
    return d * dv + (d if normalised else (1 if count else 0)) + (1 if shift else 0)


def _reduce(kernel, args, consts, bh, d, width, rows_total, cfg, acc, device):
    """Launch a split reduction (``_keys_state_kernel`` or ``_queries_grad_kernel``) and, with several splits,
    ``_sum_splits_kernel``: the (B * H, width) result."""
    n_k = triton.cdiv(d, cfg["BK"])
    n_splits, split_rows = _splits(rows_total, bh * n_k, cfg.get("BLOCK_N", cfg.get("BLOCK_M")))
    total = torch.empty(bh, width, dtype=acc, device=device)
    part = total if n_splits == 1 else torch.empty(bh, n_splits, width, dtype=acc, device=device)
    launcher(kernel)[(bh * n_k * n_splits,)](*args(part), n_splits, split_rows, width, *consts, **cfg)
    if n_splits > 1:
        launcher(nk._sum_splits_kernel)[(bh, triton.cdiv(width, SUM_BLOCK))](
            part, total, width, n_splits, BLOCK=SUM_BLOCK, FP64=acc == torch.float64)
    return total


# The ops. q, k, v: (B, H, N, .) with unit column stride; mask: a key mask as (B, H, Nk) (any strides:
# broadcasts stay stride-0 views), bool viewed as uint8 (MASK_BOOL) or float (MASK_FLOAT), or None;
# ``scale`` reaches the kernels as a Python float (inductor types it fp64; the kernels cast it). An
# absent input or output (mask, r of the identity map, the mask's gradient) is the one uint8 stand-in:
# its flag compiles its loads and stores out.
def _layout(q, v, feature, mask_kind):
    """What both ops derive from their arguments: (launch config, flags, accumulator dtype, normalised,
    count, the state's width)."""
    D, DV = q.shape[-1], v.shape[-1]
    normalised = feature != FEATURE_NONE
    count = not normalised and mask_kind != MASK_NONE
    return (launch_config(D, DV, q.dtype), flags(q.dtype), accumulator_dtype(q.dtype), normalised, count,
            _width(D, DV, normalised, count, mask_kind == MASK_FLOAT))


if HAVE_TRITON:
    @kernel_op("attnzoo::linear_noncausal_fwd", mutates_args=())
    def linear_noncausal_fwd(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], scale: float, feature: int,
                             mask_kind: int) -> tuple[Tensor, Tensor, Tensor]:
        """(out (B, H, Nq, Dv) in q's dtype, r (B * H, Nq) (normalised maps; else (B * H, 0)) and the
        state (B * H, width): S, then z or n, then a float mask's shift, both in the accumulator dtype)."""
        B, H, NQ, D = q.shape
        NK, DV = k.shape[2], v.shape[-1]
        cfg, fl, acc, normalised, count, width = _layout(q, v, feature, mask_kind)
        out = torch.empty(B, H, NQ, DV, dtype=q.dtype, device=q.device)
        rden = torch.empty(B * H, NQ if normalised else 0, dtype=acc, device=q.device)
        if tracing_only(q):
            return out, rden, torch.empty(B * H, width, dtype=acc, device=q.device)
        m = stand_in(q, torch.uint8) if mask is None else mask
        mask_strides = (0, 0, 0) if mask is None else m.stride()
        with torch.cuda.device(device_index(q)):   # launch on q's GPU, not the current one
            state = _reduce(nk._keys_state_kernel,
                            lambda part: (k, v, m, part, NK, D, DV, H),
                            (*bhn(k), *bhn(v), *mask_strides), B * H, D, width, NK, {
                                **cfg["state"], "FEATURE": feature, "NORMALISED": normalised,
                                "MASK_KIND": mask_kind, "COUNT": count, **fl}, acc, q.device)
            c = cfg["output"]
            single_k = D <= c["BK"]
            block_rows = _block_rows(NQ, B * H, c["BLOCK_M"], single_k)
            launcher(nk._queries_output_kernel)[(B * H * triton.cdiv(NQ, block_rows),)](
                q, state, out, rden if normalised else stand_in(q, torch.uint8), NQ, NK, D, DV, H, scale,
                block_rows, width, *bhn(q), FEATURE=feature, NORMALISED=normalised,
                MASK_KIND=mask_kind, COUNT=count, SINGLE_K=single_k, **fl, **c)
        return out, rden, state

    @kernel_op("attnzoo::linear_noncausal_bwd", mutates_args=())
    def linear_noncausal_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], out: Tensor,
                             rden: Tensor, state: Tensor, scale: float, feature: int, mask_kind: int,
                             mask_grad: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(dq, dk, dv, dmask) for ``do`` (B, H, Nq, Dv) contiguous in q's dtype; dmask (B, H, Nk) in the
        accumulator dtype when ``mask_grad`` (a float mask that needs its gradient), else empty."""
        B, H, NQ, D = q.shape
        NK, DV = k.shape[2], v.shape[-1]
        cfg, fl, acc, normalised, count, width = _layout(q, v, feature, mask_kind)
        dwidth = _width(D, DV, normalised, False, False)
        dq = torch.empty(B, H, NQ, D, dtype=q.dtype, device=q.device)
        dk = torch.empty(B, H, NK, D, dtype=q.dtype, device=q.device)
        dv = torch.empty(B, H, NK, DV, dtype=q.dtype, device=q.device)
        dmask = torch.empty((B, H, NK) if mask_grad else (0,), dtype=acc, device=q.device)
        if tracing_only(q):
            return dq, dk, dv, dmask
        m = stand_in(q, torch.uint8) if mask is None else mask
        mask_strides = (0, 0, 0) if mask is None else m.stride()
        rden_arg = rden if normalised else stand_in(q, torch.uint8)
        with torch.cuda.device(device_index(q)):
            dstate = _reduce(nk._queries_grad_kernel,
                             lambda part: (q, do, out if normalised else do, rden_arg, state, part, dq,
                                           NQ, NK, D, DV, H, scale, width),
                             bhn(q), B * H, D, dwidth, NQ, {
                                 **cfg["dstate"], "FEATURE": feature, "NORMALISED": normalised,
                                 "MASK_KIND": mask_kind, "COUNT": count, "WIDE_ROWS": q.dtype == torch.float16,
                                 **fl}, acc, q.device)
            c = cfg["dkv"]
            single_k = D <= c["BK"]
            block_rows = _block_rows(NK, B * H, c["BLOCK_N"], single_k)
            launcher(nk._keys_grad_kernel)[(B * H * triton.cdiv(NK, block_rows),)](
                k, v, m, state, dstate, dk, dv, dmask if mask_grad else stand_in(q, torch.uint8), NK, D, DV, H,
                block_rows, width, dwidth, *bhn(k), *bhn(v), *mask_strides, FEATURE=feature,
                NORMALISED=normalised, MASK_KIND=mask_kind, COUNT=count, MASK_GRAD=mask_grad, SINGLE_K=single_k,
                **fl, **c)
        return dq, dk, dv, dmask

    def _setup_context(ctx, inputs, output):
        q, k, v, mask, scale, feature, mask_kind = inputs
        out, rden, state = output
        ctx.save_for_backward(q, k, v, mask, out, rden, state)
        ctx.args = (scale, feature, mask_kind)

    def _backward(ctx, dout, _drden, _dstate):
        q, k, v, mask, out, rden, state = ctx.saved_tensors
        scale, feature, mask_kind = ctx.args
        mask_grad = mask_kind == MASK_FLOAT and ctx.needs_input_grad[3]
        if dout.dtype != q.dtype:   # (a no-op .to() is still an op dispatched per call)
            dout = dout.to(q.dtype)
        if not dout.is_contiguous():
            dout = dout.contiguous()
        dq, dk, dv, dmask = linear_noncausal_bwd(dout, q, k, v, mask, out, rden, state, scale, feature, mask_kind,
                                                 mask_grad)
        return dq, dk, dv, (dmask.to(mask.dtype) if mask_grad else None), None, None, None

    linear_noncausal_fwd.register_autograd(_backward, setup_context=_setup_context)


def _key_mask(attn_mask, B, H, nk, dtype):
    """(mask as (B, H, Nk) by strides, MASK_KIND) of a key-only mask; bool as its uint8 bytes. A float
    mask stays a differentiable view of the user's tensor (its gradient flows back through it).
    fp64 kernels take a bool mask as its float form (0 kept, -inf removed): Triton sizes an MMA operand
    by the narrowest type it derives from, and its fp64 MMA rejects one derived from 8-bit mask loads."""
    if attn_mask is None:
        return None, MASK_NONE
    m = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))[..., 0, :]
    if m.dtype == torch.bool and dtype == torch.float64:
        m = torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(~m, float("-inf"))
    m = m.expand(B, H, nk)
    if m.dtype == torch.bool:
        return m.view(torch.uint8), MASK_BOOL
    return m, MASK_FLOAT


def linear_noncausal(q, k, v, attn_mask, scale, feature_map):
    """out (B, H, Nq, Dv) of the reference's non-causal forms; ``attn_mask`` a key-only mask or None."""
    assert key_only_mask(attn_mask), "the backend's supports() refuses query-dependent masks"
    if q.dtype == torch.float64 and scale != 1.0:
        q, scale = q * scale, 1.0          # the kernels take scale as an fp32 scalar
    B, H = q.shape[:2]
    mask, kind = _key_mask(attn_mask, B, H, k.shape[2], q.dtype)
    q, k, v = (unit_columns(t) for t in (q, k, v))
    out, *_ = linear_noncausal_fwd(q, k, v, mask, float(scale), FEATURES[feature_map], kind)
    return out
