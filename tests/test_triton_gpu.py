"""The Triton kernels on a real GPU: the same tables as the interpreter tests in bf16 and fp16 (compiled
kernels, tensor-core dots), every autotune configuration of the softmax-family and pointwise kernels
pinned in turn, autotuned launches (including the T5 gradient's fixed dK/dV tiles), the sigmoid evaluations
(hardware tanh and exp2), and torch.compile(fullgraph=True) of every layer with backend="triton"
against eager, also under autocast. Skipped (and reported as skipped) without CUDA or under
TRITON_INTERPRET=1, where the kernels are interpreted and take CPU tensors only.

Compile budget: every kernel specialisation costs a compile per configuration, so tests run the
default configuration (ATTNZOO_TRITON_AUTOTUNE=0, the autouse fixture) unless they are about the
configurations: test_every_tile_configuration pins each one (about 50 kernel compiles) and
test_autotuned_* let the autotuner pick (about 20).
"""
from __future__ import annotations

import pytest
import torch

import attnzoo
import attnzoo.functional as AF
from attnzoo.ops import triton_tuning as tuning
from tests.common import needs_gpu, qkv
from tests.flash_rule import assert_flash_rule, autocast_triples, max_error

from tests import pointwise_cases, softmax_family_cases

pytestmark = [pytest.mark.gpu, needs_gpu]
DTYPES = [torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True)
def default_tiles(monkeypatch):
    """One configuration per kernel specialisation (no autotuning) unless a test turns it back on."""
    monkeypatch.setenv(tuning.AUTOTUNE_ENV, "0")


def _leaves(shape_q, shape_kv, dtype, seed=0):
    """q of shape_q, k and v of shape_kv (the same batch, heads and head dim), drawn in fp32 on the GPU."""
    (b, h, nq, d), nk = shape_q, shape_kv[2]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return tuple(t.to(dtype).requires_grad_(True) for t in qkv(b, h, nq, nk, d, generator=gen, device="cuda"))


def _check_against_float64(label, fn, q, k, v, **kw):
    """FlashAttention's rule for the output and dq, dk, dv: the Triton backend against float64, bounded
    by twice the error of the reference backend run in the same dtype."""
    grad_out = torch.randn(q.shape[:-1] + (v.shape[-1],), device="cuda").to(q.dtype)
    got = fn(q, k, v, backend="triton", **kw)
    got_grads = torch.autograd.grad(got, (q, k, v), grad_out)
    runs = []
    for dtype in (torch.float64, q.dtype):
        xs = [t.detach().to(dtype).requires_grad_(True) for t in (q, k, v)]
        out = fn(*xs, backend="reference", **kw)
        runs.append((out, torch.autograd.grad(out, xs, grad_out.to(dtype))))
    (want, want_grads), (low, low_grads) = runs
    assert_flash_rule(label, q.dtype, 1.0, [("out", got, low, want)] + [
        (name, g, lo, w) for name, g, lo, w in zip(("dq", "dk", "dv"), got_grads, low_grads, want_grads)])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", softmax_family_cases.CASES, ids=lambda c: c.name)
def test_softmax_family_on_gpu(case, dtype, request):
    if (case.name, dtype) in softmax_family_cases.KNOWN_FAILURES:  # measured under the interpreter only
        request.applymarker(pytest.mark.xfail(reason=softmax_family_cases.KNOWN_FAILURES[case.name, dtype]))
    softmax_family_cases.check_case(case, device="cuda", dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", pointwise_cases.CASES, ids=lambda c: c.name)
def test_pointwise_on_gpu(case, dtype):
    pointwise_cases.check_case(case, device="cuda", dtype=dtype)


@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_head_dims_and_long_sequences(head_dim):
    """FlashAttention-sized tiles (64 x 64) with partial blocks, in bf16: the output and dq, dk, dv by
    FlashAttention's rule against float64."""
    q, k, v = _leaves((2, 4, 333, head_dim), (2, 4, 517, head_dim), torch.bfloat16, seed=2)
    for variant in ("softmax", "l2", "sigmoid", "relu"):
        _check_against_float64(f"{variant} D={head_dim}", getattr(attnzoo.functional, variant), q, k, v,
                               is_causal=True)


LAYERS = {
    "softmax": lambda: attnzoo.SoftmaxAttention(64, num_heads=2),
    "l2": lambda: attnzoo.L2Attention(64, num_heads=2),
    "fenchel-uniform": lambda: attnzoo.FenchelAttention(64, num_heads=2, alpha=0.8),
    "fenchel-t5": lambda: attnzoo.FenchelAttention(64, num_heads=2, preference="t5", num_buckets=8, max_distance=20),
    "sigmoid-learnable": lambda: attnzoo.SigmoidAttention(64, num_heads=2, learnable_bias=True),
    "relu": lambda: attnzoo.ReLUAttention(64, num_heads=2),
}


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "autocast-bf16"])
@pytest.mark.parametrize("name", list(LAYERS) + ["softmax-autotuned"])
def test_layers_compile_without_graph_breaks(name, autocast, monkeypatch):
    """Every layer, with the default tiles; "softmax-autotuned": inductor tunes the autotuned kernels."""
    if name == "softmax-autotuned":
        monkeypatch.setenv(tuning.AUTOTUNE_ENV, "1")
        name = "softmax"
    torch.manual_seed(0)
    layer = LAYERS[name]().cuda()
    layer.backend = "triton"
    if name == "fenchel-t5":
        torch.nn.init.normal_(layer.relative_bias.weight)
    x = torch.randn(2, 37, 64, device="cuda", requires_grad=True)
    compiled = torch.compile(layer, fullgraph=True)  # fullgraph: a graph break is an error
    if autocast:  # the compiled layer by FlashAttention's rule against the float64 layer (tests/flash_rule.py)
        assert_flash_rule(f"compiled {name} under bf16 autocast", torch.bfloat16, 1.0,
                          autocast_triples(layer, (x,), dict(is_causal=True), device="cuda", tested=compiled))
        return
    results = []
    for fn in (layer, compiled):
        out = fn(x, is_causal=True)
        grads = torch.autograd.grad(out.float().square().sum(), [x] + [p for p in layer.parameters()])
        results.append((out.float(), grads))
    tol = 2e-4
    (out_e, g_e), (out_c, g_c) = results
    assert (out_e - out_c).abs().max() <= tol * max(1.0, float(out_e.abs().max()))
    for a, b in zip(g_e, g_c):
        assert (a - b).abs().max() <= tol * max(1.0, float(a.abs().max()))


# --- every tile configuration, pinned in turn ------------------------------------------------------

CONFIG_CASES = [(torch.bfloat16, 64, True), (torch.bfloat16, 128, True), (torch.float32, 64, False)]


def _longest_list(dtype, head_dim):
    from attnzoo.ops.kernels.pointwise import triton as pointwise
    from attnzoo.ops.kernels.flash_softmax import triton as softmax

    kernels = [m.__dict__[n] for m in (softmax, pointwise) for n in ("FORWARD", "KEYS_BACKWARD", "QUERIES_BACKWARD")]
    return max(len(kernel.configs_for(dtype, head_dim, head_dim)) for kernel in kernels)


@pytest.mark.parametrize("index", range(4))
@pytest.mark.parametrize("dtype,head_dim,with_pointwise", CONFIG_CASES, ids=lambda x: str(x).replace("torch.", ""))
def test_every_tile_configuration(dtype, head_dim, with_pointwise, index):
    """Configuration ``index`` of every kernel's list (shorter lists wrap around) computes the forward
    and every gradient within FlashAttention's rule: causal with Nq != Nk and lengths that no tile
    divides, so each launch runs the whole-block stage, the diagonal stage and the partial blocks."""
    if index >= _longest_list(dtype, head_dim):
        pytest.skip(f"at most {_longest_list(dtype, head_dim)} configurations in this tile class")
    q, k, v = _leaves((2, 2, 333, head_dim), (2, 2, 517, head_dim), dtype)
    with tuning.pinned_config(index):
        _check_against_float64(f"softmax config {index}", AF.softmax, q, k, v, is_causal=True)
        if with_pointwise:
            _check_against_float64(f"sigmoid config {index}", AF.sigmoid, q, k, v, is_causal=True)


# --- autotuned launches --------------------------------------------------------------------------------

def test_autotuned_launches_compute_the_same_attention(monkeypatch):
    """With the autotuner choosing the tiles (the default on a GPU), the kernels still meet the rule."""
    monkeypatch.setenv(tuning.AUTOTUNE_ENV, "1")
    q, k, v = _leaves((2, 2, 1000, 64), (2, 2, 1000, 64), torch.bfloat16, seed=1)
    _check_against_float64("autotuned softmax", AF.softmax, q, k, v)


def test_autotuned_t5_table_gradient_is_not_accumulated_twice(monkeypatch):
    """The T5 table gradient is summed from one row of partial sums per key block, sized from the dK/dV
    launch's default tiles before it runs, so that launch keeps them with autotuning on: the gradient must
    equal the one of a run without autotuning (rows missed or counted twice would change it)."""
    from attnzoo.ops.fenchel.t5 import t5_bias_attention

    q, k, v = _leaves((1, 2, 200, 64), (1, 2, 200, 64), torch.float32, seed=2)
    table = torch.randn(8, 2, device="cuda", requires_grad=True)
    grads = []
    for autotune in ("0", "1"):
        monkeypatch.setenv(tuning.AUTOTUNE_ENV, autotune)
        out = t5_bias_attention(q, k, v, table, 8, 20, False, is_causal=True)
        grads.append(torch.autograd.grad(out.square().sum(), table)[0])
    assert max_error(grads[0], grads[1]) <= 1e-4 * float(grads[0].abs().max()), grads


# --- the sigmoid evaluations -----------------------------------------------------------------------------

def test_sigmoid_evaluations_on_the_device():
    """exp2 + Newton: relative error < 3e-5 everywhere (as under the interpreter). Hardware tanh:
    0.5 tanh(x/2) + 0.5 with tanh's max relative error 2^-10.987 (PTX ISA) gives an absolute error
    below 2.5e-4; its relative error for small sigmoid values is reported, not bounded."""
    x = pointwise_cases.SIGMOID_POINTS.float().cuda()
    want = torch.sigmoid(x.double())
    exp2 = pointwise_cases.run_sigmoid(x, 2).double()
    rel = ((exp2 - want).abs() / want.clamp_min(1e-300))[want > 1e-37]
    assert exp2[0] == 0 and float(rel.max()) <= 3e-5, float(rel.max())
    tanh = pointwise_cases.run_sigmoid(x, 1).double()
    assert tanh[0] == 0 and float((tanh - want).abs().max()) <= 2.5e-4, float((tanh - want).abs().max())
    small = want < 1e-2
    print(f"hardware-tanh sigmoid: max abs error {float((tanh - want).abs().max()):.3g}, max relative error "
          f"where sigmoid < 1e-2: {float(((tanh - want).abs() / want)[small].max()):.3g}")


@pytest.mark.parametrize("impl", ["exp2", "tanh"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fast_sigmoid_meets_the_flash_rule(monkeypatch, impl, dtype):
    """Sigmoid attention with the default bias -log n (weights ~1/n, where 0.5 tanh(x/2) + 0.5 cancels)
    in fp16/bf16, forward and gradients, for each fast evaluation the kernels can use."""
    from attnzoo.ops.kernels.pointwise import triton as pointwise

    monkeypatch.setattr(pointwise, "FAST_SIGMOID", impl)
    q, k, v = _leaves((2, 4, 256, 64), (2, 4, 1024, 64), dtype, seed=3)
    _check_against_float64(f"sigmoid {impl}", AF.sigmoid, q, k, v)
