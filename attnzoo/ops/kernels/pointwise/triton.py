"""Pointwise attention (sigmoid, ReLU / n) Triton kernels as torch custom ops, and their entry points.

``sigmoid_attention`` / ``relu_attention`` have the references' signatures (the eager form is
ops/kernels/pointwise/reference.py) and are registered as the ``triton`` backend of the ``sigmoid``
and ``relu`` variants (ops/sigmoid, ops/relu). The sigmoid bias is the default -log n_i, a Python
float, or a tensor broadcastable to (B, H, Nq, 1) (one value per head and/or row, e.g.
SigmoidAttention's -log n + learned per-head shift), which gets its gradient.
A bias that varies with the key is refused (``bias_reason``). ``dropout_p > 0`` drops weights in the
kernels (ops/triton_dropout.py): one seed per forward call from torch's generator of q's device, the
same keep-mask regenerated in the backward; ``dropout_p == 0`` launches the kernels without dropout code.
``softcap`` (a positive float, 0: none) caps the logits in the kernels; ``window_size`` (left, right)
is taken as kernel arguments (ops/triton_logit_extras.py: causality folded into the band), and the
kernels visit only the blocks that meet the band.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from ... import triton_tuning as tuning
from ...triton_dropout import call_seed, dropout_flag
from ...triton_logit_extras import band_bounds
from ...triton_utils import (HAVE_TRITON, INTERPRETED, broadcast_rows, dot_precision, kernel_mask, kernel_op,
                            mask_shape, reduce_to_shape, stand_in, tracing_only)
from .triton_kernels import BIAS_DEFAULT, BIAS_ROWS, BIAS_SCALAR, SIGMOID_EXACT, SIGMOID_EXP2, SIGMOID_TANH

if HAVE_TRITON:
    import triton

    from .triton_kernels import pointwise_bwd_dkdv_kernel, pointwise_bwd_dq_kernel, pointwise_fwd_kernel

    # what the autotuner keys on besides the tensor dtypes, which Triton adds itself
    TUNING_KEY = ["tune_nq", "tune_nk", "D", "DV", "SIGMOID", "SIGMOID_IMPL", "BIAS_MODE", "MASK_KIND", "MASK_SHAPE",
                  "SOFTCAP", "WINDOW",
                  "CAUSAL", "DROPOUT", "PRECISION"]
    FORWARD = tuning.TunedKernel(pointwise_fwd_kernel, tuning.FORWARD, tuning.FORWARD_DROPOUT, TUNING_KEY)
    KEYS_BACKWARD = tuning.TunedKernel(pointwise_bwd_dkdv_kernel, tuning.KEYS_BACKWARD, tuning.KEYS_BACKWARD_DROPOUT,
                                       TUNING_KEY)
    QUERIES_BACKWARD = tuning.TunedKernel(pointwise_bwd_dq_kernel, tuning.QUERIES_BACKWARD,
                                          tuning.QUERIES_BACKWARD_DROPOUT, TUNING_KEY)

# How the kernels evaluate the sigmoid for fp16/bf16 inputs on a GPU (fp32 inputs and the interpreter
# always use the exact evaluation): "exp2" (one exp2 and a Newton reciprocal, accurate for small
# weights) or "tanh" (0.5 tanh(0.5 x) + 0.5 on the hardware tanh, FlashSigmoid's evaluation: fewer
# instructions, absolute error up to ~2.4e-4 per weight). Read at each call; triton_kernels.py
# describes both.
FAST_SIGMOID = "exp2"
_SIGMOID_IMPLS = {"exp2": SIGMOID_EXP2, "tanh": SIGMOID_TANH}


def sigmoid_impl(dtype) -> int:
    """The kernels' SIGMOID_IMPL for inputs of ``dtype``."""
    if INTERPRETED or dtype == torch.float32:
        return SIGMOID_EXACT
    if FAST_SIGMOID not in _SIGMOID_IMPLS:
        raise ValueError(f"FAST_SIGMOID must be one of {sorted(_SIGMOID_IMPLS)}, got {FAST_SIGMOID!r}")
    return _SIGMOID_IMPLS[FAST_SIGMOID]


@functools.lru_cache(maxsize=1024)
def _launch_flags(D, DV, sigmoid, sigmoid_impl_, bias_mode, mask_kind, mask_shape_, is_causal, dropout, dtype,
                  allow_tf32, softcap=0.0, window=False):
    """The constexprs every launch of a call shares, decided once per head dims and flavour."""
    bd, bdv = max(16, triton.next_power_of_2(D)), max(16, triton.next_power_of_2(DV))
    return dict(BLOCK_D=bd, BLOCK_DV=bdv, SIGMOID=sigmoid, SIGMOID_IMPL=sigmoid_impl_, BIAS_MODE=bias_mode,
                MASK_KIND=mask_kind, MASK_SHAPE=mask_shape_, CAUSAL=is_causal, HEAD_MASK=(bd != D or bdv != DV),
                UPCAST=INTERPRETED, PRECISION=dot_precision(dtype), DROPOUT=dropout, SOFTCAP=softcap, WINDOW=window)


def logit_extras(softcap, window_size, is_causal, nq, nk):
    """(is_causal as the kernels take it, the extras' constexprs (SOFTCAP: the cap, 0.0 none; WINDOW),
    the kernel scalars (window_left, window_right)). A window carries causality in its right offset.
    The cap is a constexpr: a model has one, and a constant folds into the tile's arithmetic."""
    if window_size is None:
        left = right = 0
    else:
        left, right = band_bounds(window_size, is_causal, nq, nk)
    flags = (float(softcap or 0.0), window_size is not None)
    return bool(is_causal) and window_size is None, flags, (left, right)


def _prepare(q, k, v, mask, bias, is_causal, sigmoid, bias_mode, dropout, extras=(0.0, False)):
    B, H, Nq, D = q.shape
    Nk, DV = k.shape[2], v.shape[3]
    m, mask_kind, mask_strides = kernel_mask(mask, B, H, Nq, Nk)
    if m is None:
        m = stand_in(q, torch.uint8)
    rows = broadcast_rows(bias, B, H, Nq)
    if rows is None:
        rows, bias_strides = stand_in(q, torch.float32), (0, 0, 0)
    else:
        bias_strides = tuple(rows.stride())
    meta = _launch_flags(D, DV, bool(sigmoid), sigmoid_impl(q.dtype) if sigmoid else 0, int(bias_mode), mask_kind,
                         mask_shape(mask_strides), bool(is_causal), bool(dropout), q.dtype,
                         q.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32, *extras)
    # H_kv = k.shape[1] may be fewer than H: query head h reads key/value head h // (H / H_kv)
    sizes = (H, Nq, Nk, D, DV, H // k.shape[1], tuning.n_bucket(Nq), tuning.n_bucket(Nk))
    return m, mask_strides, rows, bias_strides, meta, sizes


def _run(tuned, grid, args, meta, sizes, dtype, dropout):
    """Launch one of the three kernels with its configuration frozen per flavour and length buckets."""
    shape_key = (sizes[3], sizes[4], sizes[6], sizes[7], tuple(meta.values()))
    tuned.run(grid, args, meta, dtype=dtype, block_d=meta["BLOCK_D"], block_dv=meta["BLOCK_DV"], dropout=dropout,
              shape_key=shape_key)


if HAVE_TRITON:
    @kernel_op("attnzoo::pointwise_fwd", mutates_args=())
    def pointwise_fwd(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], bias: Optional[Tensor],
                      bias_scalar: float, bias_mode: int, scale: float, is_causal: bool, sigmoid: bool,
                      dropout_p: float = 0.0, seed: Optional[Tensor] = None, softcap: float = 0.0,
                      window_left: int = -1, window_right: int = -1) -> tuple[Tensor, Tensor]:
        """(out (B, H, Nq, Dv), n (B, H, Nq) fp32: keys taking part per row).
        With dropout_p > 0, ``seed`` (1-element int64) picks the keep-mask. softcap 0: none; a window
        (left, right) of (-1, -1): none."""
        B, H, Nq, D = q.shape
        Nk, DV = k.shape[2], v.shape[3]
        out = torch.empty((B, H, Nq, DV), dtype=q.dtype, device=q.device)
        n_rows = torch.empty((B, H, Nq), dtype=torch.float32, device=q.device)
        dropout = dropout_flag(dropout_p, seed)
        is_causal, flags, extras = logit_extras(softcap, _window(window_left, window_right), is_causal, Nq, Nk)
        m, ms, rows, bs, meta, sizes = _prepare(q, k, v, mask, bias, is_causal, sigmoid, bias_mode, dropout, flags)
        if tracing_only(q):
            return out, n_rows
        _run(FORWARD, lambda META: (triton.cdiv(Nq, META["BLOCK_M"]), B * H),
             (q, k, v, out, n_rows, m, rows, seed if dropout else m,
              *q.stride(), *k.stride(), *v.stride(), *out.stride(), *ms, *bs, *sizes, scale, bias_scalar, *extras,
              dropout_p), meta, sizes, q.dtype, dropout)
        return out, n_rows

    @kernel_op("attnzoo::pointwise_bwd", mutates_args=())
    def pointwise_bwd(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, n_rows: Tensor, mask: Optional[Tensor],
                      bias: Optional[Tensor], bias_scalar: float, bias_mode: int, scale: float, is_causal: bool,
                      sigmoid: bool, dropout_p: float = 0.0, seed: Optional[Tensor] = None, softcap: float = 0.0,
                      window_left: int = -1, window_right: int = -1) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(dq, dk, dv, dbias (B, H, Nq) fp32, empty unless the bias is a tensor)."""
        B, H, Nq, D = q.shape
        H_kv, Nk, DV = k.shape[1], k.shape[2], v.shape[3]
        dq = torch.empty((B, H, Nq, D), dtype=q.dtype, device=q.device)
        dk = torch.empty((B, H_kv, Nk, D), dtype=k.dtype, device=q.device)
        dv = torch.empty((B, H_kv, Nk, DV), dtype=v.dtype, device=q.device)
        has_bias = bias_mode == BIAS_ROWS
        dbias = torch.empty((B, H, Nq) if has_bias else (0,), dtype=torch.float32, device=q.device)
        dropout = dropout_flag(dropout_p, seed)
        is_causal, flags, extras = logit_extras(softcap, _window(window_left, window_right), is_causal, Nq, Nk)
        m, ms, rows, bs, meta, sizes = _prepare(q, k, v, mask, bias, is_causal, sigmoid, bias_mode, dropout, flags)
        if tracing_only(q):
            return dq, dk, dv, dbias
        seed_ptr = seed if dropout else m
        strides = (*q.stride(), *k.stride(), *v.stride(), *grad_out.stride(), *ms, *bs)
        scalars = (scale, bias_scalar, *extras, dropout_p)
        # dK/dV: one program per key block of a key/value head, walking the query heads that share it
        _run(KEYS_BACKWARD, lambda META: (triton.cdiv(Nk, META["BLOCK_N"]), B * H_kv),
             (q, k, v, grad_out, n_rows, m, rows, dk, dv, seed_ptr, *strides, *sizes, *scalars), meta, sizes,
             q.dtype, dropout)
        _run(QUERIES_BACKWARD, lambda META: (triton.cdiv(Nq, META["BLOCK_M"]), B * H),
             (q, k, v, grad_out, n_rows, m, rows, dq, dbias if has_bias else rows, seed_ptr, *strides, *sizes,
              *scalars), meta, sizes, q.dtype, dropout)
        return dq, dk, dv, dbias

    def _setup_context(ctx, inputs, output):
        (q, k, v, mask, bias, bias_scalar, bias_mode, scale, is_causal, sigmoid, dropout_p, seed, softcap,
         window_left, window_right) = inputs
        ctx.save_for_backward(q, k, v, output[1], mask, bias, seed)  # the seed regenerates Z
        ctx.args = (bias_scalar, bias_mode, scale, is_causal, sigmoid, dropout_p)
        ctx.extras = (softcap, window_left, window_right)

    def _backward(ctx, grad_out, grad_n):
        q, k, v, n_rows, mask, bias, seed = ctx.saved_tensors
        dq, dk, dv, dbias = pointwise_bwd(grad_out, q, k, v, n_rows, mask, bias, *ctx.args, seed, *ctx.extras)
        g_bias = reduce_to_shape(dbias, bias.shape).to(bias.dtype) if bias is not None else None
        return dq, dk, dv, None, g_bias, None, None, None, None, None, None, None, None, None, None

    pointwise_fwd.register_autograd(_backward, setup_context=_setup_context)


def _window(left: int, right: int):
    """The op's two window integers as the (left, right) window, or None for (-1, -1)."""
    return None if (left, right) == (-1, -1) else (left, right)


def _window_args(window_size) -> tuple[int, int]:
    return (-1, -1) if window_size is None else (int(window_size[0]), int(window_size[1]))


def bias_rows(bias, q):
    """A bias tensor broadcastable to (B, H, Nq, 1) as a (B|1, H|1, Nq|1) view, or None if it varies per key."""
    b4 = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape)) if bias.dim() < 4 else bias
    if b4.shape[-1] != 1:
        return None
    return b4[..., 0]


def bias_reason(bias, q):
    """None when the kernel takes this sigmoid bias, else why not."""
    if isinstance(bias, Tensor) and bias_rows(bias, q) is None:
        return (f"a sigmoid bias of shape {tuple(bias.shape)} varies with the key; the kernel takes a float or a "
                "tensor broadcastable to (B, H, Nq, 1) (per head / per row)")
    return None


# The backends below are reached through the dispatcher, whose ``supports`` check (common_reason,
# bias_reason) already accepted the call: they do not check again. enable_gqa: k and v may hold fewer
# heads than q; the kernels index the shared head.

def sigmoid_attention(q, k, v, *, attn_mask=None, is_causal=False, scale, bias=None, dropout_p=0.0,
                      enable_gqa=False, softcap=None, window_size=None):
    """Backend ``triton`` of ``sigmoid``: sum_j sigmoid(cap(s_ij) + b) v_j (b = -log n_i by default), over
    the keys in the window's band when ``window_size`` is given."""
    if bias is None:
        rows, scalar, mode = None, 0.0, BIAS_DEFAULT
    elif isinstance(bias, Tensor):
        rows, scalar, mode = bias_rows(bias, q), 0.0, BIAS_ROWS
    else:
        rows, scalar, mode = None, float(bias), BIAS_SCALAR
    out, _ = pointwise_fwd(q, k, v, attn_mask, rows, scalar, mode, float(scale), bool(is_causal), True,
                           float(dropout_p), call_seed(q, dropout_p), float(softcap or 0.0), *_window_args(window_size))
    return out


def relu_attention(q, k, v, *, attn_mask=None, is_causal=False, scale, dropout_p=0.0, enable_gqa=False,
                   softcap=None, window_size=None):
    """Backend ``triton`` of ``relu``: sum_j relu(cap(s_ij)) v_j / n_i (n_i: the keys in the band)."""
    out, _ = pointwise_fwd(q, k, v, attn_mask, None, 0.0, BIAS_DEFAULT, float(scale), bool(is_causal), False,
                           float(dropout_p), call_seed(q, dropout_p), float(softcap or 0.0), *_window_args(window_size))
    return out
