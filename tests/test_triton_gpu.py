"""The Triton kernels on a real GPU: the same tables as the interpreter tests in bf16 and fp16 (compiled
kernels, tensor-core dots), and torch.compile(fullgraph=True) of every layer with backend="triton"
against eager, also under autocast. Skipped (and reported as skipped) without CUDA or under
TRITON_INTERPRET=1, where the kernels are interpreted and take CPU tensors only.
"""
from __future__ import annotations

import pytest
import torch

import attnzoo
from attnzoo.ops.triton_utils import HAVE_TRITON, INTERPRETED

from . import test_triton_pointwise as pointwise_tests
from . import test_triton_softmax_family as softmax_tests

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (HAVE_TRITON and torch.cuda.is_available() and not INTERPRETED),
                       reason="needs a CUDA GPU and compiled (not interpreted) Triton kernels"),
]
DTYPES = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", softmax_tests.CASES, ids=lambda c: c.name)
def test_softmax_family_on_gpu(case, dtype):
    softmax_tests.check_case(case, device="cuda", dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", pointwise_tests.CASES, ids=lambda c: c.name)
def test_pointwise_on_gpu(case, dtype):
    pointwise_tests.check_case(case, device="cuda", dtype=dtype)


@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_head_dims_and_long_sequences(head_dim):
    """FlashAttention-sized tiles (64 x 64) with partial blocks, in bf16, against the fp32 reference."""
    q, k, v = (torch.randn(2, 4, n, head_dim, device="cuda", dtype=torch.bfloat16) for n in (333, 517, 517))
    for variant in ("softmax", "l2", "sigmoid", "relu"):
        fn = getattr(attnzoo.functional, variant)
        got = fn(q, k, v, is_causal=True, backend="triton").float()
        want = fn(q.float(), k.float(), v.float(), is_causal=True, backend="reference")
        low = fn(q, k, v, is_causal=True, backend="reference").float()
        assert (got - want).abs().max() <= 2 * (low - want).abs().max() + 1e-2, variant


LAYERS = {
    "softmax": lambda: attnzoo.SoftmaxAttention(64, num_heads=2),
    "l2": lambda: attnzoo.L2Attention(64, num_heads=2),
    "fenchel-uniform": lambda: attnzoo.FenchelAttention(64, num_heads=2, alpha=0.8),
    "fenchel-t5": lambda: attnzoo.FenchelAttention(64, num_heads=2, preference="t5", num_buckets=8, max_distance=20),
    "sigmoid-learnable": lambda: attnzoo.SigmoidAttention(64, num_heads=2, learnable_bias=True),
    "relu": lambda: attnzoo.ReLUAttention(64, num_heads=2),
}


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "autocast-bf16"])
@pytest.mark.parametrize("name", list(LAYERS))
def test_layers_compile_without_graph_breaks(name, autocast):
    torch.manual_seed(0)
    layer = LAYERS[name]().cuda()
    layer.backend = "triton"
    if name == "fenchel-t5":
        torch.nn.init.normal_(layer.relative_bias.weight)
    x = torch.randn(2, 37, 64, device="cuda", requires_grad=True)
    compiled = torch.compile(layer, fullgraph=True)  # fullgraph: a graph break is an error
    results = []
    for fn in (layer, compiled):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            out = fn(x, is_causal=True)
        grads = torch.autograd.grad(out.float().square().sum(), [x] + [p for p in layer.parameters()])
        results.append((out.float(), grads))
    tol = 3e-2 if autocast else 2e-4
    (out_e, g_e), (out_c, g_c) = results
    assert (out_e - out_c).abs().max() <= tol * max(1.0, float(out_e.abs().max()))
    for a, b in zip(g_e, g_c):
        assert (a - b).abs().max() <= tol * max(1.0, float(a.abs().max()))
