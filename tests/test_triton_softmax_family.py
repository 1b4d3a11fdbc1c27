"""The softmax-family Triton kernels (softmax, L2, per-key preference, T5 bias) against float64 math.

The table of cases and the float64 formulas are in tests/softmax_family_cases.py. On CPU the real
kernels run under TRITON_INTERPRET=1 (set by `make test`); tests/test_triton_gpu.py reruns the same
table on a GPU.
"""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import attnzoo
import attnzoo.functional as AF
from attnzoo.ops import dispatch
from attnzoo.ops.fenchel.t5 import t5_bias_attention
from attnzoo.ops.kernels.flash_softmax import triton as fused
from tests.common import INTERPRET, needs_interpreter, qkv
from tests.flash_rule import max_error
from tests.softmax_family_cases import (BY_NAME, CASES, KNOWN_FAILURES, LOW_PRECISION, MAX_DISTANCE, NUM_BUCKETS,
                                        check_case)


@needs_interpreter
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_forward_and_gradients_fp32(case):
    check_case(case)


@needs_interpreter
@pytest.mark.parametrize("name,dtype", LOW_PRECISION, ids=lambda x: str(x).replace("torch.", ""))
def test_low_precision_flash_rule(name, dtype, request):
    if (name, dtype) in KNOWN_FAILURES:
        request.applymarker(pytest.mark.xfail(strict=True, reason=KNOWN_FAILURES[name, dtype]))
    check_case(BY_NAME[name], dtype=dtype)


# --- dispatch and argument checks (no kernel launch unless said) ---------------------------------

class _OpLog(TorchDispatchMode):
    """Records every op that reaches the dispatcher (the custom ops included)."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


@needs_interpreter
@pytest.mark.parametrize("variant,op", [("softmax", "softmax_family_fwd"), ("l2", "softmax_family_fwd"),
                                        ("fenchel", "softmax_family_fwd"), ("sigmoid", "pointwise_fwd"),
                                        ("relu", "pointwise_fwd")])
def test_named_triton_backend_runs_the_kernel(variant, op):
    q, k, v = qkv(1, 2, 7, 9, 16)
    assert attnzoo.explain(variant, q, k, v, backend="triton").backend.name == "triton"
    assert attnzoo.explain(variant, q, k, v).backend.name != "triton"  # auto never interprets on CPU
    with _OpLog() as log:
        getattr(AF, variant)(q, k, v, backend="triton")
    assert any(f"attnzoo.{op}" in name for name in log.names), log.names


@pytest.mark.parametrize("variant,kwargs,expect", [
    ("softmax", {"dropout_p": 1.0}, "dropout_p"),  # dropout itself runs in the kernel (test_triton_dropout.py)
    ("fenchel", {"solve": "second_order"}, "first-order"),
    ("fenchel", {"log_u": torch.zeros(7, 9)}, "varies with the query"),
    ("sigmoid", {"bias": torch.zeros(1, 2, 1, 9)}, "varies with the key"),
    ("l2", {"attn_mask": torch.zeros(1, 1, 7, 9, requires_grad=True)}, "requires grad"),
])
def test_supports_gives_reasons(variant, kwargs, expect, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q, k, v = qkv(1, 2, 7, 9, 16)
    if not INTERPRET:
        pytest.skip("the kernels were compiled for a GPU in this process")
    with pytest.raises(ValueError, match=expect):
        getattr(AF, variant)(q, k, v, backend="triton", **kwargs)


def test_cpu_without_interpreter_is_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v = qkv(1, 2, 7, 9, 16)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        AF.softmax(q, k, v, backend="triton")
    assert "TRITON_INTERPRET=1" in dispatch._TABLE["relu"]["triton"].supports(q, k, v)


@pytest.mark.parametrize("call,exc,expect", [
    (lambda q, k, v: t5_bias_attention(q, k, v, torch.zeros(8, 3), 8, 20, True), ValueError, "table must have shape"),
    (lambda q, k, v: t5_bias_attention(q, k, v, torch.zeros(8, 2, dtype=torch.long), 8, 20, True), TypeError, "table"),
    (lambda q, k, v: t5_bias_attention(q, k, v, torch.zeros(8, 2), 8, 1.5, True), ValueError, "max_distance"),
    (lambda q, k, v: fused.preference_attention(q, k, v, None), ValueError, "log_pref"),
    (lambda q, k, v: fused.preference_attention(q, k, v, torch.zeros(1, 2, 5)), ValueError, "log_pref"),
    (lambda q, k, v: fused.preference_attention(q, k[..., :8], v, torch.zeros(9)), ValueError, "head dim"),
])
def test_entry_points_check_arguments(call, exc, expect):
    q, k, v = qkv(1, 2, 7, 9, 16)
    with pytest.raises(exc, match=expect):
        call(q, k, v)


# --- the layer uses the T5 kernel when triton is asked for ----------------------------------------

@needs_interpreter
def test_fenchel_t5_layer_matches_reference_backend():
    layer = attnzoo.FenchelAttention(32, num_heads=2, preference="t5", num_buckets=NUM_BUCKETS,
                                     max_distance=MAX_DISTANCE, alpha=0.8, backend="triton")
    torch.nn.init.normal_(layer.relative_bias.weight)
    x = torch.randn(1, 21, 32)
    out = layer(x, is_causal=True)
    (g_fused,) = torch.autograd.grad(out.square().sum(), layer.relative_bias.weight)
    layer.backend = "reference"
    ref = layer(x, is_causal=True)
    (g_ref,) = torch.autograd.grad(ref.square().sum(), layer.relative_bias.weight)
    assert max_error(out, ref) < 1e-5 and max_error(g_fused, g_ref) < 1e-4 * max(1.0, float(g_ref.abs().max()))
    assert g_ref.abs().sum() > 0


@needs_interpreter
def test_ops_are_registered_custom_ops():
    q, k, v = (t.requires_grad_(True) for t in qkv(1, 2, 3, 5, 16))
    torch.library.opcheck(torch.ops.attnzoo.softmax_family_fwd.default,
                          (q, k, v, None, torch.zeros(1, 2, 5), None, None, 0.25, True, False),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
