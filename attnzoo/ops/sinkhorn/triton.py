"""Sinkhorn attention with the streaming passes as Triton kernels (the "triton" backend).

Same semantics and same algorithm as ``cpu.py`` (both are driven by ``streaming.py``); here each
pass is one kernel launch over a (blocks, B*H) grid. Inputs fp16/bf16/fp32, potentials and every
reduction float32. Causal attention runs the prefix loop of ``streaming.causal_by_prefix`` (exact,
O(N) memory, O(n_iters N^3) work: one set of launches per query row).
"""
from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from ..masking import split_mask
from . import triton_kernels as K
from .cpu import check_options
from .streaming import Problem, causal_by_prefix, streaming_sinkhorn

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_TL = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# Largest head dim (D and Dv) the kernels are built for: up to it every launch below fits an H100's
# 227 KB of shared memory per block (benchmarks/compile_triton_kernels.py compiles them all for sm_90
# without a GPU; benchmarks/results/gpu/ptx_build_check.md). Above it the backward would not.
MAX_HEAD_DIM = 256


def launch_config(d: int, dv: int, dtype) -> dict:
    """Tile size (BLOCK_M = BLOCK_N) and launch options for head dims d, dv and input dtype.

    Interpreted runs use 16 x 16 tiles, so tiny test shapes still cross several blocks. On a GPU the
    shared memory a launch needs grows with tile x padded head dim (the q/k/v/dout tiles, staged
    num_stages times by the software pipeline) and the backward's fp32 dq / dk / dv accumulators.
    Compiled for sm_90 (limit 232448 bytes), 64 x 64 tiles with 4 warps and 3 stages needed 254464
    bytes in _grad_v_kernel at fp32 D = 128 with a float mask, and at fp32 D = 256 _grad_q_kernel
    needed 262144 even with 8 warps and 1 stage. Wide heads therefore get 8 warps (half the registers
    per thread), 2 stages, and 32-row tiles in fp32 (4-byte operands) or at D = 256. The math is the
    same for any tile size; only the order of the float32 sums changes.
    """
    if interpreting():
        return dict(block=16, num_warps=4, num_stages=1)
    width = max(16, triton.next_power_of_2(max(d, dv)))
    wide = width >= 128
    block = 32 if width >= 256 or (wide and dtype == torch.float32) else 64
    return dict(block=block, num_warps=8 if wide else 4, num_stages=2 if wide else 3)


class TritonEngine:
    """The passes of streaming.py as launches of the kernels in triton_kernels.py."""

    def __init__(self, block_m: int | None = None, block_n: int | None = None):
        self.block_m, self.block_n = block_m, block_n   # None: from launch_config

    @staticmethod
    def acc_dtype(p: Problem):
        return torch.float32

    def _common(self, p: Problem):
        B, H, nq, D = p.q.shape
        nk = p.k.shape[-2]
        dummy = p.q.new_zeros(1)
        keep = dummy if p.keep is None else p.keep
        if keep.dtype == torch.bool:
            keep = keep.view(torch.uint8)  # same item size: a view, strides (0 on broadcast dims) kept
        bias = dummy if p.bias is None else p.bias
        sk = keep.stride() if p.keep is not None else (0, 0, 0, 0)
        sb = bias.stride() if p.bias is not None else (0, 0, 0, 0)
        half = p.q.dtype in (torch.float16, torch.bfloat16)
        cdt = tl.float32 if (interpreting() or not half) else _TL[p.q.dtype]
        args = (H, nq, nk, D)
        config = launch_config(D, p.v.shape[-1], p.q.dtype)
        meta = dict(COST_L2=p.cost == "l2", HAS_KEEP=p.keep is not None, HAS_BIAS=p.bias is not None,
                    BLOCK_M=self.block_m or config["block"], BLOCK_N=self.block_n or config["block"],
                    BLOCK_D=max(16, triton.next_power_of_2(D)), CDT=cdt,
                    PREC="ieee" if cdt == tl.float32 else "tf32")
        if not interpreting():   # launch options; the interpreter takes none
            meta.update(num_warps=config["num_warps"], num_stages=config["num_stages"])
        return keep, bias, (*sk, *sb), args, meta, B * H

    def _grid(self, n, block, bh):
        return (triton.cdiv(n, block), bh)

    def _vec(self, p, n):
        return torch.empty(p.q.shape[0], p.q.shape[1], n, dtype=torch.float32, device=p.q.device)

    def _lse(self, p, other, rows):
        keep, bias, strides, (H, nq, nk, D), meta, bh = self._common(p)
        out = self._vec(p, nq if rows else nk)
        grid = self._grid(nq if rows else nk, meta["BLOCK_M"] if rows else meta["BLOCK_N"], bh)
        K._lse_kernel[grid](p.q, p.k, keep, bias, other.contiguous(), out, H, nq, nk, D, p.logit_scale,
                            *strides, ROWS=rows, **meta)
        return out

    def lse_rows(self, p, g):
        return self._lse(p, g, True)

    def lse_cols(self, p, f):
        return self._lse(p, f, False)

    def _wsum(self, p, a, b, w, rows):
        keep, bias, strides, (H, nq, nk, D), meta, bh = self._common(p)
        out = self._vec(p, nq if rows else nk)
        grid = self._grid(nq if rows else nk, meta["BLOCK_M"] if rows else meta["BLOCK_N"], bh)
        K._wsum_kernel[grid](p.q, p.k, keep, bias, a.contiguous(), b.contiguous(), w.contiguous(), out,
                             H, nq, nk, D, p.logit_scale, *strides, ROWS=rows, **meta)
        return out

    def wsum_rows(self, p, a, b, w):
        return self._wsum(p, a, b, w, True)

    def wsum_cols(self, p, a, b, w):
        return self._wsum(p, a, b, w, False)

    def attend(self, p, g):
        keep, bias, strides, (H, nq, nk, D), meta, bh = self._common(p)
        dv = p.v.shape[-1]
        out = torch.empty(p.q.shape[:-1] + (dv,), dtype=p.q.dtype, device=p.q.device)
        lse = self._vec(p, nq)
        K._attend_kernel[self._grid(nq, meta["BLOCK_M"], bh)](
            p.q, p.k, p.v, keep, bias, g.contiguous(), out, lse, H, nq, nk, D, dv, p.logit_scale, *strides,
            BLOCK_DV=max(16, triton.next_power_of_2(dv)), **meta)
        return out, lse

    def grad_v_and_bias(self, p, g, lse, dout, delta):
        keep, bias, strides, (H, nq, nk, D), meta, bh = self._common(p)
        dv_dim = p.v.shape[-1]
        dv = torch.empty(p.v.shape, dtype=torch.float32, device=p.v.device)
        dg = self._vec(p, nk)
        K._grad_v_kernel[self._grid(nk, meta["BLOCK_N"], bh)](
            p.q, p.k, p.v, keep, bias, g.contiguous(), lse, dout, delta.contiguous(), dv, dg,
            H, nq, nk, D, dv_dim, p.logit_scale, *strides,
            BLOCK_DV=max(16, triton.next_power_of_2(dv_dim)), **meta)
        return dv, dg

    def grad_qk(self, p, g, lse, dout, delta, terms):
        keep, bias, strides, (H, nq, nk, D), meta, bh = self._common(p)
        dv_dim = p.v.shape[-1]
        if terms is None:
            zq, zk = self._vec(p, nq)[None], self._vec(p, nk)[None]
            terms, T = (zq, zk, zk, zk, zq), 0
        else:
            T = terms[0].shape[0]
        FT, GC, GR, DG, DF = (t.contiguous() for t in terms)
        dq = torch.empty(p.q.shape, dtype=torch.float32, device=p.q.device)
        dk = torch.empty(p.k.shape, dtype=torch.float32, device=p.k.device)
        common = (p.q, p.k, p.v, keep, bias, g.contiguous(), lse, dout, delta.contiguous(), FT, GC, GR, DG, DF, T)
        tail = (H, nq, nk, D, dv_dim, p.logit_scale, *strides)
        meta = dict(meta, BLOCK_DV=max(16, triton.next_power_of_2(dv_dim)))
        K._grad_q_kernel[self._grid(nq, meta["BLOCK_M"], bh)](*common, dq, *tail, **meta)
        K._grad_k_kernel[self._grid(nk, meta["BLOCK_N"], bh)](*common, dk, *tail, **meta)
        return dq, dk


def unsupported_reason(q, attn_mask=None, dropout_p=0.0, v=None) -> str | None:
    if q.dtype not in DTYPES:
        return f"the Triton kernels take float16, bfloat16 or float32 inputs, got {q.dtype}"
    dv = 0 if v is None else v.shape[-1]
    if max(q.shape[-1], dv) > MAX_HEAD_DIM:
        return (f"head dims above {MAX_HEAD_DIM} are not supported by the Triton kernels (q D={q.shape[-1]}"
                f"{'' if v is None else f', v Dv={dv}'}): use backend='cpu'")
    if q.device.type != "cuda" and not interpreting():
        return "Triton kernels need a CUDA device (or TRITON_INTERPRET=1 for CPU tensors, for testing)"
    if dropout_p > 0:
        return "dropout on the transport plan needs the N x N weights (use backend='reference')"
    if attn_mask is not None and attn_mask.requires_grad:
        return "no gradient is computed for a float attn_mask (use backend='reference')"
    return None


def sinkhorn_attention(q, k, v, *, attn_mask=None, is_causal=False, scale=None, n_iters=3, eps=1.0,
                       cost="l2", dropout_p=0.0, grad_mode="unrolled", block_m=None, block_n=None):
    """Same semantics as ``reference.sinkhorn_attention``, on Triton kernels (see ``cpu.py``)."""
    check_options(dropout_p, grad_mode)
    why = unsupported_reason(q, attn_mask, dropout_p, v=v)
    if why is not None:
        raise ValueError(why)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    keep, bias = split_mask(attn_mask, False, q.shape[-2], k.shape[-2], q.device)
    kw = dict(scale=scale, eps=eps, cost=cost, n_iters=n_iters, grad_mode=grad_mode)
    run = causal_by_prefix if is_causal else streaming_sinkhorn
    return run(TritonEngine(block_m, block_n), q, k, v, keep, bias, **kw)
