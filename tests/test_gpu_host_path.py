"""The host path on a real GPU: every layer captured in CUDA graphs (``torch.cuda.make_graphed_callables``
and ``torch.compile(mode="reduce-overhead")``) equals eager, forward and backward; grouped-query heads
read in place by the Triton kernels meet FlashAttention's rule; a frozen autotuned configuration gives
the autotuned launch's numbers. Skipped (and reported as skipped) without CUDA or under
TRITON_INTERPRET=1."""
from __future__ import annotations

import pytest
import torch

import attnzoo
import attnzoo.functional as AF
from attnzoo.ops import triton_tuning as tuning
from tests.common import needs_gpu
from tests.flash_rule import assert_flash_rule

pytestmark = [pytest.mark.gpu, needs_gpu]

DIM, HEADS, N = 64, 4, 40
# every registry name and the presets that change a layer's call path
SPECS = ["softmax", "l2", "sinkhorn", "sigmoid", "relu", "linear", "masked", "fenchel", "ot",
         "l2(tie_qk=True)", "sigmoid(learnable_bias=True)", "fenchel(preference='t5', num_buckets=8, max_distance=16)",
         "linear(feature_map='identity')", "sinkhorn(cost='dot', n_iters=2)", "masked(kind='sigmoid')"]


def _layer(spec):
    torch.manual_seed(0)
    layer = attnzoo.create(spec, DIM, num_heads=HEADS).cuda()
    for p in layer.parameters():  # zero-initialised tables and shifts would hide their gradients
        if p.dim() <= 2 and float(p.abs().sum()) == 0:
            torch.nn.init.normal_(p, std=0.1)
    return layer


def _eager(layer, x, causal):
    out = layer(x, is_causal=causal)
    grads = torch.autograd.grad(out.square().sum(), [x] + list(layer.parameters()))
    return out.detach(), grads


def _close(label, got, want, tol=2e-4):
    err = float((got.float() - want.float()).abs().max())
    assert err <= tol * max(1.0, float(want.float().abs().max())), f"{label}: error {err:.3g}"


@pytest.mark.parametrize("spec", SPECS)
def test_make_graphed_callables_matches_eager(spec):
    layer = _layer(spec)
    causal = spec.startswith(("linear", "masked")) or spec == "softmax"
    x = torch.randn(2, N, DIM, device="cuda", requires_grad=True)
    want_out, want_grads = _eager(layer, x, causal)

    class Call(torch.nn.Module):  # make_graphed_callables takes positional tensors only
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x, is_causal=causal)
    graphed = torch.cuda.make_graphed_callables(Call(layer), (x.detach().clone().requires_grad_(),))
    for _ in range(2):  # replays reuse the captured launches
        xg = x.detach().clone().requires_grad_()
        out = graphed(xg)
        grads = torch.autograd.grad(out.square().sum(), [xg] + list(layer.parameters()))
    _close(f"{spec} out", out, want_out)
    for i, (a, b) in enumerate(zip(grads, want_grads)):
        _close(f"{spec} grad {i}", a, b)


@pytest.mark.parametrize("spec", ["softmax", "l2", "sigmoid(learnable_bias=True)", "relu", "linear", "sinkhorn", "ot"])
def test_reduce_overhead_compile_matches_eager(spec):
    layer = _layer(spec)
    x = torch.randn(2, N, DIM, device="cuda", requires_grad=True)
    want_out, want_grads = _eager(layer, x, False)
    compiled = torch.compile(layer, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):  # warm-up, record, replay
        out = compiled(x, is_causal=False)
        grads = torch.autograd.grad(out.square().sum(), [x] + list(layer.parameters()))
    _close(f"{spec} out", out, want_out, 1e-3)
    for i, (a, b) in enumerate(zip(grads, want_grads)):
        _close(f"{spec} grad {i}", a, b, 1e-3)


@pytest.mark.parametrize("variant", ["softmax", "l2", "fenchel", "sigmoid", "relu"])
@pytest.mark.parametrize("causal", [False, True])
def test_grouped_query_heads_on_the_triton_kernels(variant, causal):
    """k, v with 2 heads for 8 query heads, read in place: FlashAttention's rule against float64 on k, v
    repeated per group, output and every gradient."""
    fn = getattr(AF, variant)
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 8, 300, 64, device="cuda", generator=g).bfloat16().requires_grad_()
    k, v = (torch.randn(2, 2, 300, 64, device="cuda", generator=g).bfloat16().requires_grad_() for _ in range(2))
    cot = torch.randn(2, 8, 300, 64, device="cuda", generator=g).bfloat16()
    got = fn(q, k, v, is_causal=causal, backend="triton", enable_gqa=True)
    got_g = torch.autograd.grad(got, (q, k, v), cot)
    runs = []
    for dtype in (torch.float64, torch.bfloat16):
        xs = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        out = fn(xs[0], xs[1].repeat_interleave(4, 1), xs[2].repeat_interleave(4, 1), is_causal=causal,
                 backend="reference")
        runs.append((out, torch.autograd.grad(out, xs, cot.to(dtype))))
    (want, want_g), (low, low_g) = runs
    assert_flash_rule(f"{variant} gqa", torch.bfloat16, 1.0, [("out", got, low, want)] + [
        (n, a, b, c) for n, a, b, c in zip(("dq", "dk", "dv"), got_g, low_g, want_g)])


def test_a_frozen_autotuned_configuration_computes_what_the_tuned_launch_did(monkeypatch):
    monkeypatch.setenv(tuning.AUTOTUNE_ENV, "1")
    q, k, v = (torch.randn(2, 4, 700, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    first = AF.softmax(q, k, v, backend="triton")      # tunes, then freezes the chosen tiles
    g1 = torch.autograd.grad(first, (q, k, v), torch.ones_like(first))
    again = AF.softmax(q, k, v, backend="triton")      # the frozen tiles, straight to the kernel
    g2 = torch.autograd.grad(again, (q, k, v), torch.ones_like(again))
    torch.testing.assert_close(again, first, rtol=0, atol=0)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
