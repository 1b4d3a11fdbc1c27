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

Not here (the packed route, ops/varlen_triton.py, declines them and the sequences run per length):
dropout, attn_mask, a per-key preference (log_u), T5 tables.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ... import triton_tuning as tuning
from ...triton_packed import packed_sizes, packed_strides, unblock
from ...triton_utils import HAVE_TRITON, INTERPRETED, kernel_op, launcher, stand_in, tracing_only

if HAVE_TRITON:
    import triton

    from .triton import DELTA_ROWS, TUNING_KEY, _flags
    from .triton_kernels import (softmax_bwd_delta_kernel, softmax_bwd_dkdv_kernel, softmax_bwd_dq_kernel,
                                 softmax_fwd_kernel)

    # the classic kernels (the Hopper variants take no packed sequences), with autotuners and frozen
    # choices of their own: the key's length buckets are those of max_q / max_k here
    FORWARD = tuning.TunedKernel(softmax_fwd_kernel, tuning.FORWARD, tuning.FORWARD_DROPOUT, TUNING_KEY)
    KEYS_BACKWARD = tuning.TunedKernel(softmax_bwd_dkdv_kernel, tuning.KEYS_BACKWARD,
                                       tuning.KEYS_BACKWARD_DROPOUT, TUNING_KEY)
    QUERIES_BACKWARD = tuning.TunedKernel(softmax_bwd_dq_kernel, tuning.QUERIES_BACKWARD,
                                          tuning.QUERIES_BACKWARD_DROPOUT, TUNING_KEY)

# the flavour constexprs a packed launch never sets (the kernels static_assert them off); softcap, sinks
# and the window (their arguments: a stand-in sinks pointer, cap 0, band 0, 0) are declined by the route
_PLAIN = dict(MASK_KIND=0, MASK_SHAPE=0, HAS_PREF=False, HAS_T5=False, SOFTCAP=False, HAS_SINKS=False, WINDOW=False)


def _shape_key(meta, sizes):
    return (sizes[3], sizes[4], sizes[6], sizes[7], meta["L2"], meta["CAUSAL"], meta["PRECISION"], "varlen")


if HAVE_TRITON:
    @kernel_op("attnzoo::softmax_family_varlen_fwd", mutates_args=())
    def softmax_family_varlen_fwd(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int,
                                  max_k: int, scale: float, is_causal: bool, l2: bool) -> tuple[Tensor, Tensor]:
        """(out (T_q, H, Dv) in q's dtype, lse (H * T_q,) fp32 base 2 in per-sequence (H, n) blocks). One
        launch."""
        T_q, H, _ = q.shape
        out = torch.empty((T_q, H, v.shape[2]), dtype=q.dtype, device=q.device)
        lse = torch.empty((H * T_q,), dtype=torch.float32, device=q.device)
        meta = _flags(q, v, is_causal, l2, False)
        if tracing_only(q):
            return out, lse
        sizes = packed_sizes(q, k, v, max_q, max_k)
        n_seq, f32, i32 = cu_q.shape[0] - 1, stand_in(q, torch.float32), stand_in(q, torch.int32)
        FORWARD.run(lambda META: (triton.cdiv(max_q, META["BLOCK_M"]), n_seq * H),
                    (q, k, v, out, lse, out, stand_in(q, torch.uint8), f32, f32, i32, i32,
                     *packed_strides(q), *packed_strides(k), *packed_strides(v), *packed_strides(out),
                     0, 0, 0, 0, 0, 0, 0, 0, 0, *sizes, scale, 0.0, f32, 0.0, 0, 0),
                    {**meta, **_PLAIN, "CU_Q": cu_q, "CU_K": cu_k, "VARLEN": True}, dtype=q.dtype,
                    block_d=meta["BLOCK_D"], block_dv=meta["BLOCK_DV"], shape_key=_shape_key(meta, sizes))
        return out, lse

    @kernel_op("attnzoo::softmax_family_varlen_bwd", mutates_args=())
    def softmax_family_varlen_bwd(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                                  cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int, scale: float, is_causal: bool,
                                  l2: bool) -> tuple[Tensor, Tensor, Tensor]:
        """(dq, dk, dv) packed like q, k, v. Three launches (delta = rowsum(dO * O), dK/dV, dQ), then the
        gather of the per-sequence blocks into packed order."""
        T_q, H, D = q.shape
        T_k, H_kv, DV = k.shape[0], k.shape[1], v.shape[2]
        if tracing_only(q):
            return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        delta = torch.empty((H * T_q,), dtype=torch.float32, device=q.device)
        dq = torch.empty((H * T_q, D), dtype=q.dtype, device=q.device)
        dk = torch.empty((H_kv * T_k, D), dtype=k.dtype, device=q.device)
        dv = torch.empty((H_kv * T_k, DV), dtype=v.dtype, device=q.device)
        meta = _flags(q, v, is_causal, l2, False)
        n_seq, f32, i32 = cu_q.shape[0] - 1, stand_in(q, torch.float32), stand_in(q, torch.int32)
        rows = 16 if INTERPRETED else DELTA_ROWS
        launcher(softmax_bwd_delta_kernel)[(triton.cdiv(max_q, rows), n_seq * H)](
            out, out, grad_out, delta, *packed_strides(out), *packed_strides(grad_out), H, max_q, DV,
            BLOCK_M=rows, BLOCK_DV=meta["BLOCK_DV"], RESIDUAL=False, CU_Q=cu_q, VARLEN=True)
        sizes = packed_sizes(q, k, v, max_q, max_k)
        common = (*packed_strides(q), *packed_strides(k), *packed_strides(v), *packed_strides(grad_out),
                  0, 0, 0, 0, 0, 0, 0, 0, 0, *sizes, scale, 0.0, f32, 0.0, 0, 0)
        consts = {**meta, **_PLAIN, "CU_Q": cu_q, "CU_K": cu_k, "VARLEN": True}
        tiles = dict(dtype=q.dtype, block_d=meta["BLOCK_D"], block_dv=meta["BLOCK_DV"],
                     shape_key=_shape_key(meta, sizes))
        mask = stand_in(q, torch.uint8)
        KEYS_BACKWARD.run(lambda META: (triton.cdiv(max_k, META["BLOCK_N"]), n_seq * H_kv),
                          (q, k, v, grad_out, lse, delta, dk, dv, f32, f32, mask, f32, f32, i32, i32, *common),
                          {**consts, "BUCKETS": 1}, **tiles)
        QUERIES_BACKWARD.run(lambda META: (triton.cdiv(max_q, META["BLOCK_M"]), n_seq * H),
                             (q, k, v, grad_out, lse, delta, dq, mask, f32, f32, i32, i32, *common), consts, **tiles)
        return unblock(dq, cu_q, T_q, H), unblock(dk, cu_k, T_k, H_kv), unblock(dv, cu_k, T_k, H_kv)

    def _setup_context(ctx, inputs, output):
        q, k, v, cu_q, cu_k, max_q, max_k, scale, is_causal, l2 = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
        ctx.config = (max_q, max_k, scale, is_causal, l2)

    def _backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
        dq, dk, dv = softmax_family_varlen_bwd(grad_out, q, k, v, out, lse, cu_q, cu_k, *ctx.config)
        return dq, dk, dv, None, None, None, None, None, None, None

    softmax_family_varlen_fwd.register_autograd(_backward, setup_context=_setup_context)


def attention(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int, *,
              scale: float, is_causal: bool = False, l2: bool = False) -> Tensor:
    """Packed q (T_q, H, D), k (T_k, H_kv, D), v (T_k, H_kv, Dv) -> (T_q, H, Dv): each sequence's
    softmax_j(l_ij) v_j with l = scale q.k (``l2``: -scale ||q - k||^2), causal bottom-right inside each
    sequence. The caller (ops/varlen_triton.py) has checked the call: offsets, heads, device, dtype."""
    out, _ = softmax_family_varlen_fwd(q, k, v, cu_q, cu_k, int(max_q), int(max_k), float(scale), bool(is_causal),
                                       bool(l2))
    return out


__all__ = ["attention"]
