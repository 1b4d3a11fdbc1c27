"""What the causal (triton.py) and non-causal (noncausal.py) linear host code share: the dtypes
the kernels take, their precision flags, strides and the device a launch runs on."""
from __future__ import annotations

import torch

from . import triton_kernels as ck
from ..triton_utils import HAVE_TRITON, INTERPRETED, dot_precision

if HAVE_TRITON:
    import triton

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
FEATURES = {"elu": ck.FEATURE_ELU, "relu": ck.FEATURE_RELU, "identity": ck.FEATURE_NONE}


def dtype_reason(q, k, v, **kw):
    if q.dtype not in KERNEL_DTYPES:
        return f"the Triton linear kernels take float16, bfloat16, float32 or float64 inputs, got {q.dtype}"
    return None


def pow2(n):
    """n rounded up to a power of two, at least 16 (tl.dot's smallest tile side)."""
    return max(16, triton.next_power_of_2(n))


def accumulator_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def flags(dtype):
    """Constexprs shared by the kernels: fp64 accumulators, the interpreter's fp32 upcast of half
    operands (its bf16 dot is wrong), the tl.dot precision for fp32 operands."""
    half = dtype in (torch.float16, torch.bfloat16)
    prec = "ieee" if dtype == torch.float64 else dot_precision(dtype)
    return dict(FP64=dtype == torch.float64, UPCAST=INTERPRETED and half, PREC=prec)


def bhn(t):
    """(batch, head, row) strides of a (B, H, N, D) tensor; the kernels need unit column stride."""
    return t.stride(0), t.stride(1), t.stride(2)


def device_index(t):
    """For torch.cuda.device (a context dynamo traces; -1 for CPU tensors: no device change)."""
    return t.device.index if t.is_cuda else -1


def unit_columns(t):
    return t if t.stride(-1) == 1 else t.contiguous()
