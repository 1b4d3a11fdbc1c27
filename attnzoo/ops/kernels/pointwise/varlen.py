"""The pointwise Triton kernels (sigmoid, relu) on packed sequences (varlen).

Packed q (T_q, H, D), k (T_k, H_kv, D), v (T_k, H_kv, Dv) with ``cu_q`` / ``cu_k`` offsets (a tensor on
q's device) and ``max_q`` / ``max_k`` (Python ints), as kernels/flash_softmax/varlen.py: the kernels of
triton_kernels.py run with their VARLEN flag (grid (cdiv(max_q, BLOCK_M), N * H); each program reads
its sequence's start and lengths from the offsets at its entry and returns at once past its
sequence). The key count n_i is counted inside the sequence, so relu's 1 / n_i and sigmoid's default
bias -log n_i are per sequence, as each sequence run alone. n_i is kept in per-sequence (H, n) blocks
and the gradients gathered back to packed order (ops/triton_packed.py).

Softcap and a sliding window are fused as in the dense kernels (triton.py ``logit_extras``): the band's
bounds are offsets from each sequence's own bottom-right diagonal, an unbounded side passed as a bound
past every key of the longest sequence (max_q + max_k), is_causal folded in; n_i counts the keys in the
sequence's band. Sinks have no meaning here (no normaliser over keys): the variants refuse them.

Not here (ops/varlen_triton.py declines them): dropout, attn_mask, a tensor sigmoid bias (its
(B, H, Nq, 1) layout has no packed meaning); a float bias is taken.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ... import triton_tuning as tuning
from ...triton_packed import packed_sizes, packed_strides, unblock
from ...triton_utils import HAVE_TRITON, kernel_op, stand_in, tracing_only
from .triton import _launch_flags, _window, logit_extras, sigmoid_impl
from .triton_kernels import BIAS_DEFAULT, BIAS_SCALAR

if HAVE_TRITON:
    import triton

    from .triton import TUNING_KEY
    from .triton_kernels import pointwise_bwd_dkdv_kernel, pointwise_bwd_dq_kernel, pointwise_fwd_kernel

    # autotuners and frozen choices of their own: the key's length buckets are those of max_q / max_k
    FORWARD = tuning.TunedKernel(pointwise_fwd_kernel, tuning.FORWARD, tuning.FORWARD_DROPOUT, TUNING_KEY)
    KEYS_BACKWARD = tuning.TunedKernel(pointwise_bwd_dkdv_kernel, tuning.KEYS_BACKWARD,
                                       tuning.KEYS_BACKWARD_DROPOUT, TUNING_KEY)
    QUERIES_BACKWARD = tuning.TunedKernel(pointwise_bwd_dq_kernel, tuning.QUERIES_BACKWARD,
                                          tuning.QUERIES_BACKWARD_DROPOUT, TUNING_KEY)


def _meta(q, v, sigmoid, bias_mode, is_causal, softcap, window_left, window_right, max_q, max_k):
    """(the launches' constexprs, the window's (left, right) kernel scalars): the dense host's
    ``logit_extras`` with the maxima for Nq / Nk (an unbounded side past every key of every sequence)."""
    is_causal, (cap, window), bounds = logit_extras(softcap, _window(window_left, window_right), is_causal, max_q,
                                                    max_k)
    meta = _launch_flags(q.shape[2], v.shape[2], bool(sigmoid), sigmoid_impl(q.dtype) if sigmoid else 0,
                         int(bias_mode), 0, 0, bool(is_causal), False, q.dtype,
                         q.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32, cap, window)
    return meta, bounds


def _run(tuned, grid, args, meta, sizes, cu_q, cu_k, dtype):
    shape_key = (sizes[3], sizes[4], sizes[6], sizes[7], tuple(meta.values()), "varlen")
    tuned.run(grid, args, {**meta, "CU_Q": cu_q, "CU_K": cu_k, "VARLEN": True}, dtype=dtype,
              block_d=meta["BLOCK_D"], block_dv=meta["BLOCK_DV"], shape_key=shape_key)


if HAVE_TRITON:
    @kernel_op("attnzoo::pointwise_varlen_fwd", mutates_args=())
    def pointwise_varlen_fwd(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int,
                             bias_scalar: float, bias_mode: int, scale: float, is_causal: bool,
                             sigmoid: bool, softcap: float = 0.0, window_left: int = -1,
                             window_right: int = -1) -> tuple[Tensor, Tensor]:
        """(out (T_q, H, Dv) in q's dtype, n (H * T_q,) fp32 in per-sequence (H, n) blocks: the keys
        taking part per row). ``softcap`` > 0 caps the logits; ``window_left`` / ``window_right`` >= 0:
        the band, per sequence. One launch."""
        T_q, H, _ = q.shape
        out = torch.empty((T_q, H, v.shape[2]), dtype=q.dtype, device=q.device)
        n_rows = torch.empty((H * T_q,), dtype=torch.float32, device=q.device)
        meta, (left, right) = _meta(q, v, sigmoid, bias_mode, is_causal, softcap, window_left, window_right, max_q,
                                    max_k)
        if tracing_only(q):
            return out, n_rows
        sizes = packed_sizes(q, k, v, max_q, max_k)
        n_seq, absent = cu_q.shape[0] - 1, stand_in(q, torch.float32)
        _run(FORWARD, lambda META: (triton.cdiv(max_q, META["BLOCK_M"]), n_seq * H),
             (q, k, v, out, n_rows, stand_in(q, torch.uint8), absent, absent,
              *packed_strides(q), *packed_strides(k), *packed_strides(v), *packed_strides(out),
              0, 0, 0, 0, 0, 0, 0, *sizes, scale, bias_scalar, left, right, 0.0), meta, sizes, cu_q, cu_k, q.dtype)
        return out, n_rows

    @kernel_op("attnzoo::pointwise_varlen_bwd", mutates_args=())
    def pointwise_varlen_bwd(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, n_rows: Tensor, cu_q: Tensor,
                             cu_k: Tensor, max_q: int, max_k: int, bias_scalar: float, bias_mode: int, scale: float,
                             is_causal: bool, sigmoid: bool, softcap: float = 0.0, window_left: int = -1,
                             window_right: int = -1) -> tuple[Tensor, Tensor, Tensor]:
        """(dq, dk, dv) packed like q, k, v: the dK/dV and dQ launches, then the gather to packed order."""
        T_q, H, D = q.shape
        T_k, H_kv, DV = k.shape[0], k.shape[1], v.shape[2]
        if tracing_only(q):
            return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        dq = torch.empty((H * T_q, D), dtype=q.dtype, device=q.device)
        dk = torch.empty((H_kv * T_k, D), dtype=k.dtype, device=q.device)
        dv = torch.empty((H_kv * T_k, DV), dtype=v.dtype, device=q.device)
        meta, (left, right) = _meta(q, v, sigmoid, bias_mode, is_causal, softcap, window_left, window_right, max_q,
                                    max_k)
        sizes = packed_sizes(q, k, v, max_q, max_k)
        n_seq, absent, mask = cu_q.shape[0] - 1, stand_in(q, torch.float32), stand_in(q, torch.uint8)
        strides = (*packed_strides(q), *packed_strides(k), *packed_strides(v), *packed_strides(grad_out),
                   0, 0, 0, 0, 0, 0, 0)
        scalars = (scale, bias_scalar, left, right, 0.0)   # no dropout (the route declines it)
        _run(KEYS_BACKWARD, lambda META: (triton.cdiv(max_k, META["BLOCK_N"]), n_seq * H_kv),
             (q, k, v, grad_out, n_rows, mask, absent, dk, dv, mask, *strides, *sizes, *scalars), meta, sizes,
             cu_q, cu_k, q.dtype)
        _run(QUERIES_BACKWARD, lambda META: (triton.cdiv(max_q, META["BLOCK_M"]), n_seq * H),
             (q, k, v, grad_out, n_rows, mask, absent, dq, absent, mask, *strides, *sizes, *scalars), meta, sizes,
             cu_q, cu_k, q.dtype)
        return unblock(dq, cu_q, T_q, H), unblock(dk, cu_k, T_k, H_kv), unblock(dv, cu_k, T_k, H_kv)

    def _setup_context(ctx, inputs, output):
        q, k, v, cu_q, cu_k, *config = inputs
        ctx.save_for_backward(q, k, v, output[1], cu_q, cu_k)
        ctx.config = tuple(config)

    def _backward(ctx, grad_out, grad_n):
        q, k, v, n_rows, cu_q, cu_k = ctx.saved_tensors
        dq, dk, dv = pointwise_varlen_bwd(grad_out, q, k, v, n_rows, cu_q, cu_k, *ctx.config)
        return (dq, dk, dv) + (None,) * 12

    pointwise_varlen_fwd.register_autograd(_backward, setup_context=_setup_context)


def attention(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int, *,
              scale: float, is_causal: bool = False, sigmoid: bool, bias: float | None = None,
              softcap: float | None = None, window_size: tuple[int, int] | None = None) -> Tensor:
    """Packed q (T_q, H, D), k (T_k, H_kv, D), v (T_k, H_kv, Dv) -> (T_q, H, Dv): each sequence's
    sum_j sigmoid(s_ij + b) v_j (``sigmoid``; b = ``bias``, or -log n_i of the sequence) or
    sum_j relu(s_ij) v_j / n_i, s = cap(scale q_i.k_j) (cap(s) = softcap tanh(s / softcap) with
    ``softcap``), over the keys of the causal diagonal and the ``window_size`` band, both bottom-right
    inside each sequence (n_i counts them). The caller (ops/varlen_triton.py) has checked the call."""
    mode, scalar = (BIAS_DEFAULT, 0.0) if bias is None else (BIAS_SCALAR, float(bias))
    left, right = window_size if window_size is not None else (-1, -1)
    out, _ = pointwise_varlen_fwd(q, k, v, cu_q, cu_k, int(max_q), int(max_k), scalar, mode, float(scale),
                                  bool(is_causal), bool(sigmoid), float(softcap or 0.0), int(left), int(right))
    return out


__all__ = ["attention"]
