"""A removed key (-inf) or a strongly negative log u in half precision: every backend that accepts the
call gives finite numbers within FlashAttention's rule (the eager reference in the same dtype against
float64), never NaN from a sentinel that overflows the dtype."""
import math

import pytest
import torch

import attnzoo.functional as AF
from attnzoo.ops import dispatch
from tests.common import INTERPRET, KERNEL_DEVICE, ON_GPU
from tests.flash_rule import assert_flash_rule

LOG_US = {"removed": [0.3, -0.2, -math.inf, 0.1, 1.5], "far": [0.3, -0.2, -1e5, 0.1, 1.5],
          "one_left": [-math.inf, -math.inf, 0.4, -math.inf, -math.inf]}


def _backends():
    out = []
    for name in dispatch.backends("fenchel") + ["auto"]:
        if name == "flex" or (name.startswith("triton") and not (INTERPRET or ON_GPU)):
            continue
        out.append(name)
    return out


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("log_u", sorted(LOG_US))
@pytest.mark.parametrize("backend", _backends())
def test_fenchel_log_u_sentinels_in_half_precision(dtype, log_u, backend):
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 5, 8, generator=g, dtype=torch.float64) for _ in range(3))
    lu = torch.tensor(LOG_US[log_u], dtype=torch.float64)
    device = KERNEL_DEVICE if backend.startswith("triton") else "cpu"
    leaves = [t.to(dtype).to(device).requires_grad_() for t in (q, k, v)]
    try:
        out = AF.fenchel(*leaves, log_u=lu.to(dtype).to(device), backend=backend)
    except ValueError as e:
        assert backend not in ("auto", "reference") and "cannot run this" in str(e), str(e)
        return
    assert torch.isfinite(out).all(), f"{backend} {dtype}: non-finite output"
    # the same math in the low dtype (the eager reference) and in float64
    low_leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    low = AF.fenchel(*low_leaves, log_u=lu.to(dtype), backend="reference")
    want_leaves = [t.to(dtype).double().requires_grad_() for t in (q, k, v)]
    want = AF.fenchel(*want_leaves, log_u=lu.to(dtype).double(), backend="reference")
    cot = torch.randn(out.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad(out, leaves, cot.to(dtype).to(device))
    low_g = torch.autograd.grad(low, low_leaves, cot.to(dtype))
    want_g = torch.autograd.grad(want, want_leaves, cot)
    assert all(torch.isfinite(t).all() for t in grads), f"{backend} {dtype}: non-finite gradient"
    assert_flash_rule(f"fenchel {backend} log_u={log_u}", dtype, 4.0,
                      [("out", out.cpu(), low, want)] + [(f"d{n}", a.cpu(), b, c)
                                                         for n, a, b, c in zip("qkv", grads, low_g, want_g)])
