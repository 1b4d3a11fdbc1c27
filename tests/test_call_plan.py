"""Decide once per call signature (attnzoo/ops/plan.py): a repeated call skips the checks and the
dispatcher, yet every decision that depends on something outside the signature is still made, and
every check that reads tensor values still runs on every call."""
import math

import pytest
import torch

import attnzoo.functional as AF
from attnzoo.ops import dispatch, plan
from attnzoo.ops.kernels import blockwise
from tests import formulas


def _qkv(B=1, H=2, N=6, D=4, dtype=torch.float64, grad=False):
    return tuple(torch.randn(B, H, N, D, dtype=dtype, requires_grad=grad) for _ in range(3))


@pytest.fixture
def choose_calls(monkeypatch):
    """How many times a call's backend is decided (the dispatcher asked at the call itself; the corners
    of a length class it asks too are part of that one decision)."""
    calls = []
    real = plan._decide

    def counting(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)
    monkeypatch.setattr(plan, "_decide", counting)
    return calls


def test_a_repeated_signature_decides_once(choose_calls):
    q, k, v = _qkv()
    first = AF.sinkhorn(q, k, v, n_iters=2)
    for _ in range(3):
        again = AF.sinkhorn(q, k, v, n_iters=2)
    assert len(choose_calls) == 1
    torch.testing.assert_close(again, first, rtol=0, atol=0)
    AF.sinkhorn(q, k, v, n_iters=3)        # another option value: another signature
    AF.sinkhorn(*_qkv(N=20), n_iters=2)    # another length bucket (6 and 20: 1..16 and 17..32)
    AF.sinkhorn(*_qkv(D=5), n_iters=2)     # another head dim
    assert len(choose_calls) == 4


def test_the_kept_plan_computes_the_formula():
    q, k, v = _qkv()
    mask = torch.rand(6, 6) > 0.3
    mask[:, 0] = True
    for _ in range(2):  # the first call makes the plan, the second runs it
        out = AF.softmax(q, k, v, attn_mask=mask, scale=0.3)
        allow, add = formulas.allow_and_add(mask, False, 1, 2, 6, 6)
        torch.testing.assert_close(out, formulas.softmax(q, k, v, allow, add, 0.3))


@pytest.mark.parametrize("what", ["requires_grad", "grad_mode", "dtype", "mask_dtype", "use_backend"])
def test_what_changes_a_choice_is_part_of_the_signature(what, choose_calls):
    q, k, v = _qkv(dtype=torch.float32)
    mask = torch.zeros(6, 6)
    AF.softmax(q, k, v, attn_mask=mask)
    before = len(choose_calls)
    if what == "requires_grad":
        AF.softmax(q, k, v, attn_mask=mask.clone().requires_grad_())
    elif what == "grad_mode":
        with torch.no_grad():
            AF.softmax(q, k, v, attn_mask=mask)
    elif what == "dtype":
        AF.softmax(*(t.double() for t in (q, k, v)), attn_mask=mask.double())
    elif what == "mask_dtype":
        AF.softmax(q, k, v, attn_mask=mask == 0)
    else:
        with dispatch.use_backend("reference"):
            AF.softmax(q, k, v, attn_mask=mask)
    assert len(choose_calls) == before + 1


def test_a_mask_gradient_on_cpu_still_changes_the_backend():
    """On CPU auto declines SDPA when a float mask needs a gradient: a later call of the same shapes
    with requires_grad must not reuse the SDPA decision."""
    q, k, v = _qkv(dtype=torch.float32, grad=True)
    mask = torch.zeros(1, 1, 6, 6)
    assert AF.explain("softmax", q, k, v, attn_mask=mask).backend.name == "torch"
    AF.softmax(q, k, v, attn_mask=mask)
    grad_mask = mask.clone().requires_grad_()
    AF.softmax(q, k, v, attn_mask=grad_mask).sum().backward()
    assert grad_mask.grad is not None and grad_mask.grad.abs().sum() > 0


def test_value_checks_run_on_every_call():
    q, k, v = _qkv()
    mask = torch.zeros(6, 6, dtype=torch.float64)
    AF.softmax(q, k, v, attn_mask=mask)
    bad = mask.clone()
    bad[2, 3] = math.nan
    with pytest.raises(ValueError, match="attn_mask holds 1 NaN"):
        AF.softmax(q, k, v, attn_mask=bad)
    log_u = torch.zeros(6, dtype=torch.float64)
    AF.fenchel(q, k, v, log_u=log_u)
    with pytest.raises(ValueError, match="log_u holds"):
        AF.fenchel(q, k, v, log_u=torch.full((6,), math.inf, dtype=torch.float64))


def test_plain_values_enter_with_their_type():
    """scale=1.0 and scale=True hash alike; a kept plan for one must not accept the other."""
    q, k, v = _qkv()
    AF.softmax(q, k, v, scale=1.0)
    with pytest.raises(TypeError, match="scale must be a real number"):
        AF.softmax(q, k, v, scale=True)
    AF.softmax(q, k, v, is_causal=False)
    with pytest.raises(TypeError, match="is_causal must be a bool"):
        AF.softmax(q, k, v, is_causal=0)


def test_a_choice_that_read_values_is_not_kept():
    """The implicit Sinkhorn backward refuses masks that empty a key column (its supports reads the
    mask): a clean mask of the same signature must not let a bad one through."""
    q, k, v = _qkv()
    good = torch.ones(6, 6, dtype=torch.bool)
    AF.sinkhorn(q, k, v, attn_mask=good, backend="cpu_implicit")
    bad = good.clone()
    bad[:, 2] = False
    with pytest.raises(ValueError, match="implicit gradient needs every query row and key column"):
        AF.sinkhorn(q, k, v, attn_mask=bad, backend="cpu_implicit")


def test_registering_a_backend_drops_kept_plans(choose_calls):
    q, k, v = _qkv()
    AF.relu(q, k, v)
    AF.relu(q, k, v)
    assert len(choose_calls) == 1
    table = dispatch.backend_table("relu")
    old = table["reference"]
    # the same record again (extras included: the tests that follow run softcap on it)
    dispatch.register_backend("relu", "reference", old.fn, priority=old.priority, description=old.description,
                              extras=old.extras)
    AF.relu(q, k, v)
    assert len(choose_calls) == 2


def test_module_constants_read_by_choices_take_effect_after_clear(monkeypatch):
    q, k, v = _qkv(dtype=torch.float32)
    assert AF.explain("relu", q, k, v).backend.name == "reference"
    AF.relu(q, k, v)
    monkeypatch.setattr(blockwise, "SMALL_CALL_ELEMENTS", 1)
    plan.clear()
    assert AF.explain("relu", q, k, v).backend.name == "cpu"
    before = plan.size()
    AF.relu(q, k, v)
    assert plan.size() == before + 1


def test_object_options_take_the_full_path(choose_calls):
    """An option that is neither a plain value nor a tensor (a T5 relative bias: a named tuple holding
    the table) cannot be keyed safely: such calls decide every time and keep nothing."""
    from attnzoo.ops.fenchel.t5 import T5Bias
    q, k, v = _qkv()
    bias = T5Bias(torch.randn(8, 2, dtype=torch.float64), num_buckets=8, max_distance=16)
    kept = plan.size()
    first = AF.fenchel(q, k, v, relative_bias=bias)
    second = AF.fenchel(q, k, v, relative_bias=bias)
    assert len(choose_calls) == 2 and plan.size() == kept
    torch.testing.assert_close(second, first, rtol=0, atol=0)


def test_the_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(plan, "MAX_PLANS", 4)
    plan.clear()
    for n in range(3, 12):
        AF.softmax(*_qkv(N=n))
        assert plan.size() <= 4


@pytest.mark.parametrize("nq,nk,causal,plain", [(6, 6, False, True), (6, 6, True, True), (4, 6, True, False),
                                                (6, 4, True, False)])
def test_a_signature_needing_no_adjustment_runs_sdpa_itself(nq, nk, causal, plain):
    """SDPA aligns is_causal top-left; attnzoo bottom-right. Only where they agree (Nq == Nk, no mask,
    equal head dims) does the plan call SDPA as it is; elsewhere the adjusted route runs. Both give the
    formula, on the first call and on the kept plan."""
    from attnzoo.ops.kernels.sdpa import plain_sdpa
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 2, nq, 4, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 2, nk, 4, generator=g, dtype=torch.float64) for _ in range(2))
    allow, add = formulas.allow_and_add(None, causal, 1, 2, nq, nk)
    want = formulas.softmax(q, k, v, allow, add, 0.5)
    for _ in range(2):
        torch.testing.assert_close(AF.softmax(q, k, v, is_causal=causal), want)
    key, _ = plan.signature("softmax", "auto", q, k, v, None, causal, None, 0.0, False, {})
    assert (plan.lookup(key).fn is plain_sdpa) == plain
