"""Make Triton's interpreter round fp32 -> bf16 casts to nearest even, as a GPU does.

The interpreter (Triton 3.x, ``InterpreterBuilder.cast_impl``) converts fp32 to bf16 by cutting the
mantissa: an error of up to a whole ulp, always toward zero. A GPU rounds to nearest even
(``cvt.rn.bf16.f32``). The bf16 kernels round their P / dS / state tiles to bf16 before each tile
product, so under truncation those errors add up instead of averaging out: the Triton linear and OT
kernels' gradients came out 9-60x the reference backend's error where round-to-nearest gives 1-2.4x
(FlashAttention's rule, tests/flash_rule.py, allows 2x). fp16 casts go through numpy's ``astype``,
which already rounds to nearest.

``install`` (called by tests/conftest.py under TRITON_INTERPRET=1) replaces that one conversion with
torch's, which rounds to nearest even; tests/test_triton_interpreter_rounding.py checks it is in force.
"""
from __future__ import annotations

import numpy as np
import torch


def install() -> bool:
    """Patch the interpreter's fp32 -> bf16 cast; False when this Triton has no such hook."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover - no triton
        return False
    builder = getattr(interpreter, "InterpreterBuilder", None)
    handle = getattr(interpreter, "TensorHandle", None)
    if builder is None or handle is None or not hasattr(builder, "cast_impl"):
        return False
    if getattr(builder.cast_impl, "rounds_to_nearest", False):
        return True
    truncating = builder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            values = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32))
            return handle(values.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16), dst_type.scalar)
        return truncating(self, src, dst_type)

    cast_impl.rounds_to_nearest = True
    builder.cast_impl = cast_impl
    return True
