"""Every layer in the registry runs under torch.compile (inductor, CPU) and under bf16 autocast (within
FlashAttention's rule of float64).

One tiny model holds every registered layer (plus the blockwise "cpu" backend's custom op, reached
through layers that name it), so torch.compile runs once; the compiled model must match eager,
forward and parameter gradients. Inductor's code generation is too slow on the shared 2-core
machine for all layers in the test budget: it runs on the layers whose kernels this part adds, and
on all of them when ATTNZOO_COMPILE_ALL=1 (about 10 minutes on that machine)."""
from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import attnzoo
from tests.flash_rule import assert_flash_rule, autocast_triples, flash_rule_failures, scale_grad

DIM, HEADS = 16, 2
# (registry name, constructor kwargs): all ten names, then layers that force the blockwise custom op
LAYERS = [(name, {}) for name in ("softmax", "l2", "sinkhorn", "sigmoid", "relu", "linear", "masked",
                                  "multihead", "fenchel", "ot")] + [
    ("softmax", {"backend": "cpu"}),
    ("sigmoid", {"backend": "cpu", "learnable_bias": True}),
    ("fenchel", {"backend": "cpu", "preference": "t5", "num_buckets": 8, "max_distance": 16}),
    ("masked", {"backend": "cpu", "kind": "relu"}),
]
# every layer traces as one graph (torch.compile(fullgraph=True) works)
GRAPH_BREAKS_EXPECTED: set = set()


class Zoo(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.names = [name for name, _ in layers]
        self.layers = nn.ModuleList(attnzoo.create(name, DIM, num_heads=HEADS, **kw) for name, kw in layers)
        for layer in self.layers:  # zero-initialised preference tables would hide their gradients
            if getattr(layer, "relative_bias", None) is not None:
                nn.init.normal_(layer.relative_bias.weight)
            if getattr(layer, "bias_shift", None) is not None:
                nn.init.normal_(layer.bias_shift)

    def forward(self, x):
        outs = []
        for name, layer in zip(self.names, self.layers):
            outs.append(layer(x, x, x, need_weights=False)[0] if name == "multihead" else layer(x))
        return torch.stack(outs)


def _run(model, x):
    out = model(x)
    grads = torch.autograd.grad((out * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum(),
                                list(model.parameters()))
    return out, grads


def _compiled_matches_eager(layers, backend, fullgraph=False):
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = Zoo(layers)
    x = torch.randn(2, 7, DIM)
    want, want_grads = _run(model, x)
    got, got_grads = _run(torch.compile(model, backend=backend, dynamic=False, fullgraph=fullgraph), x)
    for i, name in enumerate(model.names):
        torch.testing.assert_close(got[i], want[i], rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    for (pname, _), a, b in zip(model.named_parameters(), got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m, n=pname: f"grad {n}: {m}")


def test_every_layer_compiles_and_matches_eager():
    """All layers through torch.compile's full front end (dynamo, AOTAutograd with fake tensors and
    functionalisation, the custom op's fake and autograd registrations) without inductor's C++
    code generation, which costs ~10 minutes for this model on the shared 2-core machine."""
    _compiled_matches_eager(LAYERS, "aot_eager")


INDUCTOR_LAYERS = [("softmax", {}), ("sigmoid", {"backend": "cpu", "learnable_bias": True}),
                   ("fenchel", {"backend": "cpu", "preference": "t5", "num_buckets": 8, "max_distance": 16})]


def test_inductor_compiles_sdpa_and_blockwise_paths():
    """Inductor itself on the two kinds of kernel this part adds: SDPA with attnzoo's mask
    handling, and the blockwise custom op (with a learnable bias and a T5 table through it)."""
    _compiled_matches_eager(INDUCTOR_LAYERS, "inductor")


@pytest.mark.skipif(os.environ.get("ATTNZOO_COMPILE_ALL") != "1",
                    reason="opt-in (ATTNZOO_COMPILE_ALL=1): inductor on all layers takes ~10 min here")
def test_every_layer_compiles_with_inductor():
    _compiled_matches_eager(LAYERS, "inductor")


def test_no_graph_breaks():
    """Dynamo traces every layer as one graph: the dispatcher's choice and the custom ops are
    traceable (explain only traces; nothing is compiled)."""
    torch._dynamo.reset()
    model = Zoo([(n, kw) for n, kw in LAYERS if n not in GRAPH_BREAKS_EXPECTED])
    explanation = torch._dynamo.explain(model)(torch.randn(2, 7, DIM))
    assert explanation.graph_break_count == 0, [str(r.reason)[:200] for r in explanation.break_reasons]


def _autocast_triples(layers, tested=None):
    """FlashAttention's rule under CPU bf16 autocast for a Zoo of ``layers``: the output and every
    parameter gradient against the float64 Zoo, with the Zoo on the reference backend under the same
    autocast as the bar (tests/flash_rule.py). Where a layer's backend resolves to the reference itself
    the comparison reduces to finiteness."""
    torch.manual_seed(1)
    model = Zoo(layers)
    x = torch.randn(2, 9, DIM)
    weights = torch.linspace(-1, 1, len(layers) * x.numel(), dtype=torch.float64)
    return autocast_triples(model, (x,), device="cpu", tested=tested(model) if tested else None,
                            loss=lambda out: (out.double() * weights.view(out.shape)).sum())


def _layer_id(name, kw):
    return name + ("-" + kw["backend"] if "backend" in kw else "")


@pytest.mark.parametrize("name,kw", LAYERS, ids=[_layer_id(n, kw) for n, kw in LAYERS])
def test_autocast_bf16_meets_the_flash_rule(name, kw):
    triples = _autocast_triples([(name, kw)])
    for part, got, _, _ in triples:
        assert torch.isfinite(got).all(), part
    assert_flash_rule(_layer_id(name, kw), torch.bfloat16, 1.0, triples)


@pytest.mark.parametrize("compiler", ["eager", "aot_eager"])
@pytest.mark.parametrize("backend,n_iters,masked", [("cpu", 0, False), ("cpu", 3, True), ("cpu_implicit", 20, False)])
def test_sinkhorn_streaming_backward_under_compile_matches_eager(backend, n_iters, masked, compiler):
    """The streaming Sinkhorn call is a torch op (ops/sinkhorn/cpu.py: attnzoo::sinkhorn_streaming and its
    backward), opaque to torch.compile, so fullgraph=True holds and the compiled gradients are eager's. Traced
    as the autograd.Function it was, torch 2.11's dynamo returned wrong gradients (zeros at n_iters = 0), and
    cpu_implicit's data-dependent stop broke the graph; this file also runs on that torch (.ci/run)."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, n, 8, generator=g, dtype=torch.float64) for n in (6, 5, 5))
    mask = (torch.rand(1, 1, 6, 5, generator=g) > 0.3) | (torch.arange(5) == 0) if masked else None

    def step(fn):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        return (out,) + torch.autograd.grad(out.square().sum(), leaves)

    sinkhorn = lambda q, k, v: attnzoo.functional.sinkhorn(q, k, v, attn_mask=mask, n_iters=n_iters, backend=backend)
    want = step(sinkhorn)
    reference = step(lambda q, k, v: attnzoo.functional.sinkhorn(q, k, v, attn_mask=mask, n_iters=n_iters,
                                                                 backend="reference"))
    got = step(torch.compile(sinkhorn, backend=compiler, fullgraph=True, dynamic=False))
    for name, a, b, r in zip(("out", "dq", "dk", "dv"), got, want, reference):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")
        if backend == "cpu":  # the unrolled gradient is the reference's (the implicit one only near the fixed point)
            torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-10, msg=lambda m, n=name: f"{n} vs reference: {m}")


# The Triton backends under the interpreter: an interpreted launch cannot be traced, so their ops are
# opaque there (ops/triton_utils.kernel_op; a traced launch-free op would return uninitialised memory),
# and every layer still traces as one graph (fullgraph=True). On a GPU, tests/test_triton_gpu.py
# compiles them for real.
TRITON_LAYERS = [("softmax", {"backend": "triton"}), ("l2", {"backend": "triton"}),
                 ("fenchel", {"backend": "triton", "preference": "t5", "num_buckets": 8, "max_distance": 16}),
                 ("sigmoid", {"backend": "triton", "learnable_bias": True}), ("relu", {"backend": "triton"}),
                 ("sinkhorn", {"backend": "triton"}), ("linear", {"backend": "triton"}),
                 ("masked", {"backend": "triton", "kind": "linear"}),
                 ("ot", {"backend": "triton"})]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="CPU tensors run the Triton kernels only under TRITON_INTERPRET=1 (make test sets it)")
def test_triton_backends_compile_and_match_eager_under_the_interpreter():
    _compiled_matches_eager(TRITON_LAYERS, "aot_eager", fullgraph=True)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="CPU tensors run the Triton kernels only under TRITON_INTERPRET=1 (make test sets it)")
@pytest.mark.parametrize("name,kw", TRITON_LAYERS, ids=[_layer_id(n, kw) for n, kw in TRITON_LAYERS])
def test_triton_layers_under_bf16_autocast_meet_the_flash_rule_under_the_interpreter(name, kw):
    """Autocast hands the kernels bf16 q, k, v beside fp32 parameters (T5 table, sigmoid bias)."""
    assert_flash_rule(_layer_id(name, kw), torch.bfloat16, 1.0, _autocast_triples([(name, kw)]))


@pytest.mark.parametrize("perturb,what", [
    (lambda model: (lambda x: model(x) * 0.95), "out error"),
    (lambda model: (lambda x: scale_grad(model(x), 0.95)), "layers.0.qkv.weight error")], ids=["out", "grads"])
def test_autocast_check_sees_a_scaled_output_or_gradient(perturb, what):
    triples = _autocast_triples([("softmax", {"backend": "cpu"})], tested=perturb)
    assert any(what in f for f in flash_rule_failures("softmax-cpu", torch.bfloat16, 1.0, triples))
