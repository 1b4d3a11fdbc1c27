"""Tensor options of a packed call (``attnzoo.functional.varlen``) that the one-call routes take: a
sigmoid bias that is one value per head (a layer's learned shift on a fixed bias), and Fenchel's log u
given per key token (``ops.varlen_options.PerKey``, a layer's context preference). Each through every
packed route (the blockwise CPU path in one call, the per-length route, the padded route torch.compile
traces) against the float64 formula on each sequence alone, with the option's own gradient."""
from __future__ import annotations

import pytest
import torch

import attnzoo.functional as AF
from attnzoo.ops import varlen
from attnzoo.ops.kernels import blockwise
from attnzoo.ops.varlen_options import PerKey
from tests import formulas as R
from tests.test_varlen import D, H, grads, offsets, packed_inputs

LQ, LK = [1, 6, 4], [3, 6, 7]          # Nq != Nk in two, lengths over one 2 x 3 block, a length-1 sequence
SCALE = D ** -0.5
TOL = 1e-9


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(blockwise, "DEFAULT_BLOCK_Q", 2)
    monkeypatch.setattr(blockwise, "DEFAULT_BLOCK_K", 3)


def route_call(route, variant, causal, **options):
    """The packed call through one route; the blockwise one must not fall back to per length."""
    def call(q, k, v):
        args = (q, k, v, offsets(LQ), offsets(LK), max(LQ), max(LK))
        if route == "padded":
            return varlen.padded(AF.VARIANT_FUNCTIONS[variant], *args, causal,
                                 dict(enable_gqa=True, backend="reference", **options))
        backend = "cpu" if route == "blockwise" else "reference"
        return AF.varlen(variant, *args, is_causal=causal, enable_gqa=True, backend=backend, **options)
    return call


def formula_per_sequence(formula, q, k, v, causal, option, per_key):
    """formula(q_i, k_i, v_i, allow_i, add_i, option_i) on each sequence alone, float64, grouped heads
    expanded; option_i: the option itself, or with ``per_key`` its (T_k, H) rows of sequence i's keys
    as a (1, H, 1, n_k) log u."""
    outs, cq, ck = [], 0, 0
    for nq, nk in zip(LQ, LK):
        qs = q[cq:cq + nq].transpose(0, 1)[None]
        ks, vs = (t[ck:ck + nk].transpose(0, 1)[None].repeat_interleave(H // t.shape[1], dim=1) for t in (k, v))
        allow, add = R.allow_and_add(None, causal, 1, H, nq, nk)
        own = option[ck:ck + nk].t()[None, :, None, :] if per_key else option
        outs.append(formula(qs, ks, vs, allow, add, own)[0].transpose(0, 1))
        cq, ck = cq + nq, ck + nk
    return torch.cat(outs)


def check(call, formula, causal, option, per_key=False):
    """call(q, k, v) against the formula, outputs and the gradients of q, k, v and the option."""
    q, k, v = packed_inputs(torch.float64, LQ, LK, seed=3)
    out = call(q, k, v)
    ref_in = [t.detach().clone().requires_grad_() for t in (q, k, v, option)]
    ref = formula_per_sequence(formula, *ref_in[:3], causal, ref_in[3], per_key)
    torch.testing.assert_close(out, ref, atol=TOL, rtol=TOL)
    for name, got, want in zip(("dq", "dk", "dv", "d option"), grads(out, (q, k, v, option)), grads(ref, ref_in)):
        torch.testing.assert_close(got, want, atol=TOL, rtol=TOL, msg=lambda m: f"{name}: {m}")


ROUTES = ["blockwise", "per_length", "padded"]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("route", ROUTES)
def test_sigmoid_bias_per_head(route, causal, small_blocks, monkeypatch):
    if route == "blockwise":
        monkeypatch.setattr(varlen, "per_sequence", lambda *a, **k: pytest.fail("the per-length route ran"))
    bias = torch.tensor([-1.5, 0.3, -0.2, 0.8], dtype=torch.float64).view(H, 1, 1).requires_grad_()
    check(route_call(route, "sigmoid", causal, bias=bias),
          lambda q, k, v, a, add, b: R.sigmoid(q, k, v, a, add, SCALE, bias=b), causal, bias)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("route", ROUTES)
def test_fenchel_log_u_per_key_token(route, causal, small_blocks, monkeypatch):
    if route == "blockwise":
        monkeypatch.setattr(varlen, "per_sequence", lambda *a, **k: pytest.fail("the per-length route ran"))
    g = torch.Generator().manual_seed(4)
    log_u = torch.randn(sum(LK), H, generator=g, dtype=torch.float64)
    log_u[2, 1] = -float("inf")          # a key token its preference removes, in one head
    log_u.requires_grad_()
    check(route_call(route, "fenchel", causal, log_u=PerKey(log_u), alpha=1.3),
          lambda q, k, v, a, add, lu: R.fenchel_first(q, k, v, a, add, SCALE, lu, 1.3), causal, log_u,
          per_key=True)


def test_per_key_option_of_the_wrong_shape_is_an_error():
    q, k, v = (t.detach() for t in packed_inputs(torch.float64, LQ, LK))
    with pytest.raises(ValueError, match=r"log_u given per key token \(PerKey\) must be a \(T_k=16, H=4 or 1\)"):
        AF.varlen("fenchel", q, k, v, offsets(LQ), offsets(LK), max(LQ), max(LK), enable_gqa=True,
                  log_u=PerKey(torch.zeros(sum(LQ), H, dtype=torch.float64)))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_per_key_log_u_with_nan_or_plus_inf_is_an_error_on_the_one_call_route(bad, monkeypatch):
    monkeypatch.setattr(varlen, "per_sequence", lambda *a, **k: pytest.fail("the per-length route ran"))
    q, k, v = (t.detach() for t in packed_inputs(torch.float64, LQ, LK))
    log_u = torch.zeros(sum(LK), H, dtype=torch.float64)
    log_u[5, 0] = bad
    with pytest.raises(ValueError, match="log_u holds"):
        AF.varlen("fenchel", q, k, v, offsets(LQ), offsets(LK), max(LQ), max(LK), enable_gqa=True, backend="cpu",
                  log_u=PerKey(log_u))


def test_offsets_are_read_once_for_every_layer_of_a_forward(monkeypatch):
    """Each layer of a packed forward hands attend_varlen the same offsets tensors: read once (a host sync
    per layer on a GPU otherwise), read again after an in-place change."""
    q, k, v = (t.detach() for t in packed_inputs(torch.float64, LQ, LK))
    cu_q, cu_k = offsets(LQ), offsets(LK)
    reads = []
    real = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t) or real(t))
    for _ in range(3):
        varlen.check(q, k, v, cu_q, cu_k, max(LQ), max(LK))
    assert len(reads) == 2
    cu_k[1:] += 0                       # a new version of the same tensor
    varlen.check(q, k, v, cu_q, cu_k, max(LQ), max(LK))
    assert len(reads) == 3
    with pytest.raises(ValueError, match="max_k=6 is shorter than the longest sequence in cu_seq_k"):
        varlen.check(q, k, v, cu_q, cu_k, max(LQ), 6)
