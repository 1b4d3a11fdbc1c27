"""The online-softmax Triton kernels on packed sequences (varlen): softmax, l2 and Fenchel first order.

q (T_q, H, D), k (T_k, H_kv, D), v (T_k, H_kv, Dv) hold N sequences back to back (``varlen_attn``'s
layout); ``cu_q`` / ``cu_k`` (N + 1 int offsets, a tensor on q's device) say where each starts;
``max_q`` / ``max_k`` (Python ints) bound the lengths. The kernels of triton_kernels.py run with
their VARLEN flag, as FlashAttention's varlen kernels do: the grid is (cdiv(max_q, BLOCK_M),
N * H) (key blocks x N * H_kv for dK/dV), a program's "batch" index is its sequence, and at its
entry the program reads its sequence's start and length from the offsets, moves its base pointers
there and returns at once when its block lies past its sequence. Everything after the entry is the
dense kernel with that sequence's Nq and Nk, so causality (bottom-right inside each sequence),
grouped-query heads and the tiles' skipping are per sequence: the work is the sum over sequences of
n_q n_k, no tile crosses a boundary, and the offsets are never read on the host (torch.compile takes
them as tensors, max_q / max_k as ints).

Layouts: the output is written packed (T_q, H, Dv) straight from the kernel (its row stride is a
kernel argument). The log-sum-exp and the backward's delta are kept in per-sequence blocks, sequence
s's (H, n_s) rows starting at H * cu_q[s] (what the dense kernels' ``pid_bh * Nq`` indexing becomes
with the base moved to the sequence), and so are the kernels' dQ, dK, dV (the dense kernels store
them contiguous per head); one gather puts the gradients back in packed order (ops/triton_packed.py):
an extra pass over dq, dk and dv, O(T H D) against the attention's O(sum n^2 H D).

Softcap, sinks and a sliding window are fused as in the dense kernels (triton.py ``extras_args``): the
window's bounds are offsets from each sequence's own bottom-right diagonal (the kernels compare them with
the sequence's Nq / Nk), so the band is per sequence; an unbounded side is passed as a bound past every
key of the longest sequence (max_q + max_k), with is_causal folded in, as the dense host does. The
sinks' gradient is reduced on the device from the per-sequence lse / delta blocks (``_sinks_grad``).

Not here (the packed route, ops/varlen_triton.py, declines them and the sequences run per length):
dropout, attn_mask, a per-key preference (log_u), T5 tables.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ... import triton_tuning as tuning
from ...triton_packed import blocked_rows, packed_sizes, packed_strides, unblock
from ...triton_utils import HAVE_TRITON, INTERPRETED, kernel_op, launcher, stand_in, tracing_only

if HAVE_TRITON:
    import triton

    from .triton import DELTA_ROWS, TUNING_KEY, _flags, extras_args
    from .triton_kernels import (softmax_bwd_delta_kernel, softmax_bwd_dkdv_kernel, softmax_bwd_dq_kernel,
                                 softmax_fwd_kernel)

    # the classic kernels (the Hopper variants take no packed sequences), with autotuners and frozen
    # choices of their own: the key's length buckets are those of max_q / max_k here
    FORWARD = tuning.TunedKernel(softmax_fwd_kernel, tuning.FORWARD, tuning.FORWARD_DROPOUT, TUNING_KEY)
    KEYS_BACKWARD = tuning.TunedKernel(softmax_bwd_dkdv_kernel, tuning.KEYS_BACKWARD,
                                       tuning.KEYS_BACKWARD_DROPOUT, TUNING_KEY)
    QUERIES_BACKWARD = tuning.TunedKernel(softmax_bwd_dq_kernel, tuning.QUERIES_BACKWARD,
                                          tuning.QUERIES_BACKWARD_DROPOUT, TUNING_KEY)

# the flavour constexprs a packed launch never sets (the kernels static_assert them off)
_PLAIN = dict(MASK_KIND=0, MASK_SHAPE=0, HAS_PREF=False, HAS_T5=False)


def _shape_key(meta, flags, sizes):
    return (sizes[3], sizes[4], sizes[6], sizes[7], meta["L2"], meta["CAUSAL"], meta["PRECISION"],
            flags["SOFTCAP"], flags["HAS_SINKS"], flags["WINDOW"], "varlen")


def _extras(q, sinks, softcap, window_left, window_right, is_causal, max_q, max_k):
    """(the kernels' SINKS, softcap, left, right arguments, their flags, the causal flag to launch with):
    the dense host's ``extras_args`` with the maxima for Nq / Nk, so an unbounded side of the window is a
    bound past every key of every sequence (the kernels measure the band from each sequence's own
    diagonal)."""
    return extras_args(q, sinks, softcap, window_left, window_right, is_causal, max_q, max_k)


def _sinks_grad(sinks: Tensor, lse: Tensor, delta: Tensor, cu_q: Tensor, T_q: int) -> Tensor:
    """d loss / d sinks[h] = -sum over every packed row i of head h of exp(sink_h - lse_i) delta_i (the
    dense ``sinks_grad``), with lse (base 2) and delta in per-sequence (H, n) blocks: both gathered to
    packed (T_q, H) order by device ops (no host read of the offsets)."""
    rows = blocked_rows(cu_q, T_q, sinks.shape[0])
    lse_rows, delta_rows = lse[rows], delta[rows]
    p_sink = torch.exp2(sinks.to(torch.float32)[None, :] * 1.4426950408889634 - lse_rows)
    return -(p_sink * delta_rows).sum(0)


if HAVE_TRITON:
    @kernel_op("attnzoo::softmax_family_varlen_fwd", mutates_args=())
    def softmax_family_varlen_fwd(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int,
                                  max_k: int, scale: float, is_causal: bool, l2: bool, sinks: Optional[Tensor] = None,
                                  softcap: float = 0.0, window_left: int = -1,
                                  window_right: int = -1) -> tuple[Tensor, Tensor]:
        """(out (T_q, H, Dv) in q's dtype, lse (H * T_q,) fp32 base 2 in per-sequence (H, n) blocks, the
        sink included with ``sinks``). ``sinks`` (H,), ``softcap`` > 0 and ``window_left`` /
        ``window_right`` >= 0 as in the dense op (triton.py ``softmax_family_fwd``), per sequence. One
        launch."""
        T_q, H, _ = q.shape
        out = torch.empty((T_q, H, v.shape[2]), dtype=q.dtype, device=q.device)
        lse = torch.empty((H * T_q,), dtype=torch.float32, device=q.device)
        extras, flags, is_causal = _extras(q, sinks, softcap, window_left, window_right, is_causal, max_q, max_k)
        meta = _flags(q, v, is_causal, l2, False)
        if tracing_only(q):
            return out, lse
        sizes = packed_sizes(q, k, v, max_q, max_k)
        n_seq, f32, i32 = cu_q.shape[0] - 1, stand_in(q, torch.float32), stand_in(q, torch.int32)
        FORWARD.run(lambda META: (triton.cdiv(max_q, META["BLOCK_M"]), n_seq * H),
                    (q, k, v, out, lse, out, stand_in(q, torch.uint8), f32, f32, i32, i32,
                     *packed_strides(q), *packed_strides(k), *packed_strides(v), *packed_strides(out),
                     0, 0, 0, 0, 0, 0, 0, 0, 0, *sizes, scale, 0.0, *extras),
                    {**meta, **_PLAIN, **flags, "CU_Q": cu_q, "CU_K": cu_k, "VARLEN": True}, dtype=q.dtype,
                    block_d=meta["BLOCK_D"], block_dv=meta["BLOCK_DV"], shape_key=_shape_key(meta, flags, sizes))
        return out, lse

    @kernel_op("attnzoo::softmax_family_varlen_bwd", mutates_args=())
    def softmax_family_varlen_bwd(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                                  cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int, scale: float, is_causal: bool,
                                  l2: bool, sinks: Optional[Tensor] = None, softcap: float = 0.0,
                                  window_left: int = -1,
                                  window_right: int = -1) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(dq, dk, dv packed like q, k, v; dsinks (H,) fp32, or empty without sinks). Three launches
        (delta = rowsum(dO * O), dK/dV, dQ), then the gather of the per-sequence blocks into packed
        order and, with sinks, their gradient's reduction."""
        T_q, H, D = q.shape
        T_k, H_kv, DV = k.shape[0], k.shape[1], v.shape[2]
        dsinks = torch.empty((H,) if sinks is not None else (0,), dtype=torch.float32, device=q.device)
        if tracing_only(q):
            return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dsinks
        delta = torch.empty((H * T_q,), dtype=torch.float32, device=q.device)
        dq = torch.empty((H * T_q, D), dtype=q.dtype, device=q.device)
        dk = torch.empty((H_kv * T_k, D), dtype=k.dtype, device=q.device)
        dv = torch.empty((H_kv * T_k, DV), dtype=v.dtype, device=q.device)
        extras, flags, is_causal = _extras(q, sinks, softcap, window_left, window_right, is_causal, max_q, max_k)
        meta = _flags(q, v, is_causal, l2, False)
        n_seq, f32, i32 = cu_q.shape[0] - 1, stand_in(q, torch.float32), stand_in(q, torch.int32)
        rows = 16 if INTERPRETED else DELTA_ROWS
        launcher(softmax_bwd_delta_kernel)[(triton.cdiv(max_q, rows), n_seq * H)](
            out, out, grad_out, delta, *packed_strides(out), *packed_strides(grad_out), H, max_q, DV,
            BLOCK_M=rows, BLOCK_DV=meta["BLOCK_DV"], RESIDUAL=False, CU_Q=cu_q, VARLEN=True)
        sizes = packed_sizes(q, k, v, max_q, max_k)
        common = (*packed_strides(q), *packed_strides(k), *packed_strides(v), *packed_strides(grad_out),
                  0, 0, 0, 0, 0, 0, 0, 0, 0, *sizes, scale, 0.0, *extras)
        consts = {**meta, **_PLAIN, **flags, "CU_Q": cu_q, "CU_K": cu_k, "VARLEN": True}
        tiles = dict(dtype=q.dtype, block_d=meta["BLOCK_D"], block_dv=meta["BLOCK_DV"],
                     shape_key=_shape_key(meta, flags, sizes))
        mask = stand_in(q, torch.uint8)
        KEYS_BACKWARD.run(lambda META: (triton.cdiv(max_k, META["BLOCK_N"]), n_seq * H_kv),
                          (q, k, v, grad_out, lse, delta, dk, dv, f32, f32, mask, f32, f32, i32, i32, *common),
                          {**consts, "BUCKETS": 1}, **tiles)
        QUERIES_BACKWARD.run(lambda META: (triton.cdiv(max_q, META["BLOCK_M"]), n_seq * H),
                             (q, k, v, grad_out, lse, delta, dq, mask, f32, f32, i32, i32, *common), consts, **tiles)
        if sinks is not None:
            dsinks = _sinks_grad(sinks, lse, delta, cu_q, T_q)
        return unblock(dq, cu_q, T_q, H), unblock(dk, cu_k, T_k, H_kv), unblock(dv, cu_k, T_k, H_kv), dsinks

    def _setup_context(ctx, inputs, output):
        q, k, v, cu_q, cu_k, max_q, max_k, scale, is_causal, l2, sinks, softcap, window_left, window_right = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, sinks)
        ctx.config = (max_q, max_k, scale, is_causal, l2)
        ctx.extras = (softcap, window_left, window_right)

    def _backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse, cu_q, cu_k, sinks = ctx.saved_tensors
        dq, dk, dv, dsinks = softmax_family_varlen_bwd(grad_out, q, k, v, out, lse, cu_q, cu_k, *ctx.config, sinks,
                                                       *ctx.extras)
        g_sinks = dsinks.to(sinks.dtype) if sinks is not None else None
        return dq, dk, dv, None, None, None, None, None, None, None, g_sinks, None, None, None

    softmax_family_varlen_fwd.register_autograd(_backward, setup_context=_setup_context)


def attention(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int, *,
              scale: float, is_causal: bool = False, l2: bool = False, softcap: Optional[float] = None,
              sinks: Optional[Tensor] = None, window_size: Optional[tuple[int, int]] = None) -> Tensor:
    """Packed q (T_q, H, D), k (T_k, H_kv, D), v (T_k, H_kv, Dv) -> (T_q, H, Dv): each sequence's
    softmax_j(cap(l_ij)) v_j with l = scale q.k (``l2``: -scale ||q - k||^2), cap(s) = softcap tanh(s /
    softcap) with ``softcap``, each head's sink logit in the normaliser with ``sinks`` (H,), causal and a
    ``window_size`` (left, right) band bottom-right inside each sequence. The caller
    (ops/varlen_triton.py) has checked the call: offsets, heads, device, dtype, extras."""
    left, right = window_size if window_size is not None else (-1, -1)
    out, _ = softmax_family_varlen_fwd(q, k, v, cu_q, cu_k, int(max_q), int(max_k), float(scale), bool(is_causal),
                                       bool(l2), sinks, float(softcap or 0.0), int(left), int(right))
    return out


__all__ = ["attention"]
