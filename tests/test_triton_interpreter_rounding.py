"""The interpreted kernels round fp32 -> bf16 to nearest even, as compiled ones do on a GPU
(tests/interpreter_rounding.py, installed by tests/conftest.py): otherwise the bf16 kernel tests
would measure the interpreter's truncation, not the kernels."""
from __future__ import annotations

import torch

from tests.common import HAVE_TRITON, needs_interpreter

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _to_bf16(src, dst, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        x = tl.load(src + offs, mask=offs < n)
        tl.store(dst + offs, x.to(tl.bfloat16), mask=offs < n)


@needs_interpreter
def test_fp32_to_bf16_rounds_to_nearest_even_under_the_interpreter():
    # 1 + 0.75 ulp (truncation gives 1), 1 + 0.5 ulp (a tie: even is 1), 1 + 1.5 ulp (tie: even is
    # 1 + 2 ulp), negatives, a carry into the exponent, and random values
    ulp = 2.0 ** -7
    x = torch.tensor([1 + 0.75 * ulp, 1 + 0.5 * ulp, 1 + 1.5 * ulp, -(1 + 0.75 * ulp), 2 - 0.25 * ulp,
                      3.14159265, -2.71828183] + torch.randn(57).tolist(), dtype=torch.float32)
    out = torch.empty(64, dtype=torch.bfloat16)
    _to_bf16[(1,)](x, out, 64, BLOCK=64)
    assert torch.equal(out.view(torch.int16), x.to(torch.bfloat16).view(torch.int16))
