"""Fenchel refusals name what the caller passed (issue 31 item 10): a NaN input to a
fenchel(preference='context') layer, and T5 with enable_gqa=True on Triton, were refused with errors about
``log_u``, which a layer's caller or a relative_bias caller never passed. T5 with grouped key/value heads
now runs on the Triton kernel (k, v expanded), checked against float64 math from T5's bucketing."""
from __future__ import annotations

import pytest
import torch

import attnzoo
import attnzoo.functional as AF
from attnzoo.ops.fenchel.t5 import T5Bias
from tests.common import needs_kernels
from tests.formulas import allow_and_add, fenchel_first, t5_bucket


def context_layer():
    torch.manual_seed(0)
    layer = attnzoo.create("fenchel(preference='context')", 16, num_heads=2)
    with torch.no_grad():
        layer.context_net[-1].weight.normal_()   # a trained-looking network (a fresh one outputs zeros)
    return layer


def test_context_layer_names_its_input_x():
    x = torch.randn(1, 5, 16)
    x[0, 2, 3] = float("nan")
    with pytest.raises(ValueError, match=r"preference='context'.*the layer's input x holds NaN") as e:
        context_layer()(x)
    assert "log_u" not in str(e.value)


def test_context_layer_names_its_network_when_x_is_finite():
    layer = context_layer()
    with torch.no_grad():
        layer.context_net[0].bias[0] = float("inf")
    with pytest.raises(ValueError, match=r"layer\.context_net") as e:
        layer(torch.randn(1, 5, 16))
    assert "log_u" not in str(e.value)


@needs_kernels
@pytest.mark.parametrize("causal", [False, True])
def test_t5_with_grouped_heads_runs_on_triton(causal):
    torch.manual_seed(1)
    B, H, Hkv, N, D, buckets, dist = 1, 4, 2, 7, 8, 8, 16
    q = torch.randn(B, H, N, D, requires_grad=True)
    k, v = (torch.randn(B, Hkv, N, D, requires_grad=True) for _ in range(2))
    table = torch.randn(buckets, H, requires_grad=True)
    out = AF.fenchel(q, k, v, is_causal=causal, alpha=0.7, enable_gqa=True, backend="triton",
                     relative_bias=T5Bias(table, buckets, dist, not causal))
    # float64: key/value head j // 2 serves query head j; log u_ij = table[bucket(j - i), h]
    wide = [t.detach().double().requires_grad_() for t in (q, k, v, table)]
    qw, kw, vw, tw = wide
    rows = [[t5_bucket(j - i, buckets, dist, not causal) for j in range(N)] for i in range(N)]
    log_u = tw[torch.tensor(rows)].permute(2, 0, 1)[None]
    allow, add = allow_and_add(None, causal, B, H, N, N)
    want = fenchel_first(qw, kw.repeat_interleave(2, 1), vw.repeat_interleave(2, 1), allow, add, D ** -0.5,
                         log_u=log_u, alpha=0.7)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    grad = torch.randn(want.shape, dtype=torch.float64)
    got = torch.autograd.grad(out, (q, k, v, table), grad.float())
    ref = torch.autograd.grad(want, wide, grad)
    for name, g, r in zip(("dq", "dk", "dv", "dtable"), got, ref):
        torch.testing.assert_close(g.double(), r, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
