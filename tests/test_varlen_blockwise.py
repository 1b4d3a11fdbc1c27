"""The blockwise CPU path on packed sequences (ops/kernels/blockwise_varlen.py, chosen by
ops/varlen_blockwise.py): one call for all the sequences of ``attnzoo.functional.varlen`` that visits
only the (query block, key block) pairs inside a sequence. Against the float64 formula per sequence
with blocks of 2 queries x 3 keys (sequences span blocks, start mid-block of the packed rows), forward
and gradients; the blocks it visits; when it is taken and when the per-length route runs instead."""
from __future__ import annotations

import math

import pytest
import torch

import attnzoo.functional as AF
from attnzoo.ops import varlen
from attnzoo.ops.kernels import blockwise, blockwise_varlen
from tests import formulas as R
from tests.test_varlen import CASES, assert_matches, offsets, packed_inputs
from tests.test_varlen_extras import FORMULAS, check_against

LQ, LK = [1, 6, 4, 5], [3, 6, 7, 5]     # Nq != Nk in two; lengths over one block; a length-1 sequence
BLOCKWISE = ["softmax", "l2", "fenchel", "sigmoid", "relu"]


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(blockwise, "DEFAULT_BLOCK_Q", 2)
    monkeypatch.setattr(blockwise, "DEFAULT_BLOCK_K", 3)


@pytest.fixture
def one_blockwise_call(monkeypatch):
    """Counts the packed blockwise calls; the per-length route must not run."""
    calls = []
    real = blockwise_varlen._PackedBlockwise.apply

    def apply(*args):
        calls.append(args[-1][:2])
        return real(*args)

    def per_length(*args, **kwargs):
        raise AssertionError("the per-length route ran")

    monkeypatch.setattr(blockwise_varlen._PackedBlockwise, "apply", apply)
    monkeypatch.setattr(varlen, "per_sequence", per_length)
    return calls


def packed_call(variant, len_q=LQ, len_k=LK, **kw):
    return lambda q, k, v: AF.varlen(variant, q, k, v, offsets(len_q), offsets(len_k), max(len_q), max(len_k),
                                     enable_gqa=True, backend="cpu", **kw)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", BLOCKWISE)
def test_packed_blockwise_equals_each_sequence_alone(case, causal, small_blocks, one_blockwise_call):
    variant, options, _ = CASES[case]
    assert_matches(case, packed_call(variant, is_causal=causal, **options), causal, torch.float64, 1e-9, LQ, LK)
    assert len(one_blockwise_call) == 1


def test_sigmoid_constant_bias(small_blocks, one_blockwise_call):
    def formula(q, k, v, a, add, c):
        return R.sigmoid(q, k, v, a, add, q.shape[-1] ** -0.5, bias=-1.5)

    check_against(packed_call("sigmoid", [1, 6, 4], [3, 6, 7], is_causal=True, bias=-1.5), formula, True, (-1, -1))
    assert len(one_blockwise_call) == 1


@pytest.mark.parametrize("window,causal", [((2, 0), True), ((1, 1), False)], ids=str)
@pytest.mark.parametrize("name", BLOCKWISE)
def test_window_inside_each_sequence(name, window, causal, small_blocks, one_blockwise_call):
    check_against(packed_call(name, [1, 6, 4], [3, 6, 7], is_causal=causal, window_size=window), FORMULAS[name],
                  causal, window)


def test_softcap_and_sinks_with_their_gradients(small_blocks, one_blockwise_call):
    from tests.test_logit_extras import expected
    sinks = torch.tensor([0.5, -0.4, 0.9, 0.1], dtype=torch.float64, requires_grad=True)
    check_against(packed_call("softmax", [1, 6, 4], [3, 6, 7], is_causal=True, softcap=0.7, sinks=sinks,
                              window_size=(3, 0)),
                  lambda q, k, v, a, add, c, s: expected("softmax", q, k, v, a, add, softcap=0.7, sinks=s),
                  True, (3, 0), (sinks,))


def test_visits_only_the_block_pairs_inside_a_sequence(monkeypatch, small_blocks):
    """Blocks start at each sequence's first row: sum over sequences of ceil(n_q / 2) ceil(n_k / 3) pairs
    in the forward (none that crosses a boundary), where the packed rows as one problem would hold
    ceil(T_q / 2) ceil(T_k / 3)."""
    visited = []
    real = blockwise._Masks.scores

    def spy(self, q_scaled, k, qs, qe, ks, ke, *a):
        visited.append((self.nq, self.nk))
        return real(self, q_scaled, k, qs, qe, ks, ke, *a)

    monkeypatch.setattr(blockwise._Masks, "scores", spy)
    q, k, v = (t.detach() for t in packed_inputs(torch.float64, LQ, LK))
    packed_call("relu")(q, k, v)
    assert len(visited) == sum(math.ceil(nq / 2) * math.ceil(nk / 3) for nq, nk in zip(LQ, LK))
    assert set(visited) == set(zip(LQ, LK))  # every block belongs to one sequence's own problem


def test_auto_takes_it_from_the_measured_size_on(monkeypatch):
    q, k, v = (t.detach() for t in packed_inputs(torch.float64, LQ, LK))
    calls = []
    real = blockwise_varlen._PackedBlockwise.apply
    monkeypatch.setattr(blockwise_varlen._PackedBlockwise, "apply", lambda *a: calls.append(1) or real(*a))
    args = (q, k, v, offsets(LQ), offsets(LK), max(LQ), max(LK))
    small = AF.varlen("softmax", *args, enable_gqa=True)      # a few hundred scores: the per-length route
    assert not calls
    monkeypatch.setattr(blockwise, "SMALL_CALL_ELEMENTS", 1)
    torch.testing.assert_close(AF.varlen("softmax", *args, enable_gqa=True), small, atol=1e-12, rtol=1e-12)
    assert calls


@pytest.mark.parametrize("variant,kw", [("softmax", {"dropout_p": 0.5}), ("sigmoid", {"bias": torch.zeros(2, 1)}),
                                        ("softmax", {"backend": "reference"}), ("sinkhorn", {})])
def test_calls_it_cannot_take_run_per_length(variant, kw, monkeypatch):
    ran = []
    monkeypatch.setattr(varlen, "per_sequence", lambda *a, **k: ran.append(1) or torch.zeros(1))
    q, k, v = (t.detach() for t in packed_inputs(torch.float64, LQ, LK))
    kw = {"backend": "cpu", **kw} if variant != "sinkhorn" else kw
    AF.varlen(variant, q, k, v, offsets(LQ), offsets(LK), max(LQ), max(LK), enable_gqa=True, **kw)
    assert ran


def test_bf16_matches_the_per_length_route(small_blocks):
    """Both compute in float32 and round once: the same bf16 numbers up to float32 summation order."""
    q, k, v = (t.detach().bfloat16() for t in packed_inputs(torch.float64, LQ, LK))
    got = packed_call("softmax", is_causal=True)(q, k, v)
    want = varlen.per_sequence(AF.softmax, q, k, v, offsets(LQ).tolist(), offsets(LK).tolist(),
                               dict(is_causal=True, enable_gqa=True, backend="cpu"))
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)


def test_bad_arguments_still_get_one_clear_error():
    q, k, v = (t.detach() for t in packed_inputs(torch.float64, LQ, LK))
    with pytest.raises(ValueError, match="sinks must have shape"):
        packed_call("softmax", sinks=torch.zeros(3, dtype=torch.float64))(q, k, v)
    with pytest.raises(ValueError, match="window_size must be a pair"):
        packed_call("softmax", window_size=(1,))(q, k, v)
    with pytest.raises(ValueError, match="alpha"):
        packed_call("fenchel", alpha=-1.0)(q, k, v)
    with pytest.raises(ValueError, match="bias must be finite"):
        packed_call("sigmoid", bias=float("inf"))(q, k, v)
    with pytest.raises(ValueError, match="enable_gqa=True"):
        AF.varlen("softmax", q, k, v, offsets(LQ), offsets(LK), max(LQ), max(LK), backend="cpu")


def test_double_backward_is_refused_with_the_way_out():
    q, k, v = packed_inputs(torch.float64, LQ, LK)
    out = packed_call("softmax", is_causal=True)(q, k, v)
    with pytest.raises(RuntimeError, match="double backward .* backend='reference'"):
        torch.autograd.grad(out.sum(), q, create_graph=True)
