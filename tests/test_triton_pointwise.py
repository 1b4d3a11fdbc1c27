"""The pointwise Triton kernels (sigmoid, ReLU / n) against float64 math written from paper 002 eq (2.5):
the table of cases and the formulas are in tests/pointwise_cases.py. On CPU the real kernels run under
TRITON_INTERPRET=1; tests/test_triton_gpu.py reruns the table on a GPU.
"""
from __future__ import annotations

import pytest
import torch

import attnzoo
from tests.common import needs_interpreter
from tests.flash_rule import max_error
from tests.pointwise_cases import BY_NAME, CASES, LOW_PRECISION, SIGMOID_POINTS, check_case, run_sigmoid


@needs_interpreter
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_forward_and_gradients_fp32(case):
    check_case(case)


@needs_interpreter
@pytest.mark.parametrize("name,dtype", LOW_PRECISION, ids=lambda x: str(x).replace("torch.", ""))
def test_low_precision_flash_rule(name, dtype):
    check_case(BY_NAME[name], dtype=dtype)


@needs_interpreter
def test_learnable_bias_layer_matches_reference_backend():
    layer = attnzoo.SigmoidAttention(32, num_heads=2, learnable_bias=True, backend="triton")
    with torch.no_grad():
        layer.bias_shift.copy_(torch.tensor([0.3, -0.7]))
    x = torch.randn(2, 11, 32)
    out = layer(x, is_causal=True)
    (g_fused,) = torch.autograd.grad(out.square().sum(), layer.bias_shift)
    layer.backend = "reference"
    ref = layer(x, is_causal=True)
    (g_ref,) = torch.autograd.grad(ref.square().sum(), layer.bias_shift)
    assert max_error(out, ref) < 1e-5 and max_error(g_fused, g_ref) < 1e-4 * max(1.0, float(g_ref.abs().max()))


@needs_interpreter
def test_op_is_a_registered_custom_op():
    q, k, v = (torch.randn(1, 2, n, 16, requires_grad=True) for n in (3, 5, 5))
    bias = torch.zeros(1, 2, 1, requires_grad=True)
    torch.library.opcheck(torch.ops.attnzoo.pointwise_fwd.default, (q, k, v, None, bias, 0.0, 2, 0.25, False, True),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


# --- the sigmoid evaluations of the kernels ---------------------------------------------------------

@needs_interpreter
@pytest.mark.parametrize("impl,rel_tol", [(0, 1e-6), (2, 3e-5)], ids=["exact", "exp2-newton"])
def test_sigmoid_evaluations_are_accurate_for_small_weights_too(impl, rel_tol):
    """Relative error against float64 everywhere, including sigmoid(x) ~ 1e-8 (where 0.5 tanh(x/2) + 0.5
    loses everything to cancellation), and exactly 0 at -inf (keys that do not take part). The exp2 evaluation's Newton
    reciprocal from a linear guess is within (1/17)^4 ~ 1.2e-5; the hardware tanh (impl 1) is PTX
    asm and runs on a GPU only (tests/test_triton_gpu.py)."""
    got = run_sigmoid(SIGMOID_POINTS.float(), impl).double()
    want = torch.sigmoid(SIGMOID_POINTS.double())
    assert got[0] == 0 and torch.isfinite(got).all()
    rel = ((got - want).abs() / want.clamp_min(1e-300))[want > 1e-37]
    assert float(rel.max()) <= rel_tol, float(rel.max())
