"""A call with ``window_size`` is a planned call (issue 29): the window is part of the call signature,
how it runs (on a backend that takes it, or its band folded into the mask) is decided once per
signature, a repeated call runs the kept plan, and grouped-query heads reach the Triton kernels with
H_kv key/value heads (never expanded). Every output is compared with float64 written from the formula."""
import math

import pytest
import torch

import attnzoo.functional as AF
from attnzoo.ops import call_path, plan
from attnzoo.ops.kernels.flash_softmax import bound as flash_bound
from attnzoo.ops.kernels.pointwise import bound as pointwise_bound
from tests.common import needs_interpreter


def band(nq: int, nk: int, window) -> torch.Tensor:
    """Key j takes part for query i iff i + (nk - nq) - left <= j <= i + (nk - nq) + right (-1: unbounded)."""
    left, right = window
    keep = torch.zeros(nq, nk, dtype=torch.bool)
    for i in range(nq):
        for j in range(nk):
            d = j - i - (nk - nq)
            keep[i, j] = (left < 0 or d >= -left) and (right < 0 or d <= right)
    return keep


def reference(kind: str, q, k, v, window, mask=None) -> torch.Tensor:
    """float64 softmax or ReLU / n attention over the band (and the bool / float mask), k and v with
    H_kv heads each serving H / H_kv query heads; scale 1 / sqrt(D)."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    keep = band(q.shape[2], k.shape[2], window).expand(s.shape)
    if mask is not None and mask.dtype == torch.bool:
        keep = keep & mask
    elif mask is not None:
        s = s + mask.double()
    if kind == "softmax":
        w = torch.softmax(s.masked_fill(~keep, -math.inf), dim=-1)
    else:  # relu: relu(s_ij) / n_i, n_i the keys taking part in row i
        w = torch.relu(s) * keep / keep.sum(-1, keepdim=True).clamp_min(1)
    return w @ v


@pytest.fixture
def plans_made(monkeypatch):
    """The variants of the calls that made a plan (every check and the backend's choice)."""
    made = []
    real = call_path._make_plan

    def counting(name, *args, **kwargs):
        made.append(name)
        return real(name, *args, **kwargs)
    monkeypatch.setattr(call_path, "_make_plan", counting)
    return made


def _new_plans(before: dict) -> list:
    return [p for key, p in plan._PLANS.items() if key not in before]


# "cpu": the blockwise path takes the window (it skips the key blocks outside the band);
# "torch": SDPA does not, so the band is folded into the mask
@pytest.mark.parametrize("backend,native", [("cpu", True), ("torch", False)])
def test_a_repeated_windowed_call_runs_its_kept_plan(backend, native, plans_made):
    torch.manual_seed(0)
    q = torch.randn(1, 2, 10, 8, dtype=torch.float64)
    k, v = (torch.randn(1, 2, 14, 8, dtype=torch.float64) for _ in range(2))
    window = (3, 1)
    before = dict(plan._PLANS)
    first = AF.softmax(q, k, v, window_size=window, backend=backend)
    q2 = torch.randn_like(q)  # new values, the same signature
    second = AF.softmax(q2, k, v, window_size=window, backend=backend)
    assert plans_made == ["softmax"]
    kept, = _new_plans(before)
    if native:
        assert kept.shared["window_size"] == window and kept.fold_window is None
    else:
        assert kept.fold_window == window and kept.band is not None  # the band built once, kept
    torch.testing.assert_close(first, reference("softmax", q, k, v, window), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(second, reference("softmax", q2, k, v, window), rtol=1e-10, atol=1e-10)
    AF.softmax(q, k, v, window_size=(2, 1), backend=backend)  # another window: another signature
    AF.softmax(q, k, v, window_size=[3, 1], backend=backend)  # a list is checked and keyed as its pair
    assert plans_made == ["softmax", "softmax"]


@pytest.mark.parametrize("float_mask", [False, True])
def test_a_folded_window_joins_each_calls_own_mask(float_mask, plans_made):
    """The band is kept, the mask is the call's: a kept plan folds the band into the mask it is given."""
    torch.manual_seed(1)
    q = torch.randn(2, 2, 9, 8, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 12, 8, dtype=torch.float64) for _ in range(2))
    window = (4, 0)
    diagonal = band(9, 12, (0, 0))  # every row keeps its diagonal key: no empty row
    for call in range(3):
        if float_mask:
            mask = torch.randn(2, 1, 9, 12, dtype=torch.float64).masked_fill(torch.rand(2, 1, 9, 12) < 0.3, -math.inf)
            mask = mask.masked_fill(diagonal, 0.0)
        else:
            mask = (torch.rand(2, 1, 9, 12) > 0.4) | diagonal
        out = AF.softmax(q, k, v, mask, window_size=window, backend="torch")
        torch.testing.assert_close(out, reference("softmax", q, k, v, window, mask), rtol=1e-10, atol=1e-10)
    assert plans_made == ["softmax"]


def test_a_large_band_is_built_per_call_not_kept(monkeypatch):
    monkeypatch.setattr(call_path, "KEEP_BAND_ENTRIES", 0)
    q, k, v = (torch.randn(1, 2, 7, 8, dtype=torch.float64) for _ in range(3))
    before = dict(plan._PLANS)
    for _ in range(2):
        out = AF.softmax(q, k, v, window_size=(2, 0), backend="torch")
        torch.testing.assert_close(out, reference("softmax", q, k, v, (2, 0)), rtol=1e-10, atol=1e-10)
    kept, = _new_plans(before)
    assert kept.fold_window == (2, 0) and kept.band is None


@pytest.fixture
def key_heads(monkeypatch):
    """The k argument's head count of every forward kernel launch (the kernels still run)."""
    from triton.runtime.interpreter import InterpretedFunction
    seen = []
    real = InterpretedFunction.run

    def record(self, *args, **kwargs):
        if "fwd" in self.fn.__name__:
            seen.append(args[1].shape[1])  # (q, k, v, ...) in every forward kernel
        return real(self, *args, **kwargs)
    monkeypatch.setattr(InterpretedFunction, "run", record)
    return seen


@needs_interpreter
@pytest.mark.parametrize("kind,bound_type", [("softmax", flash_bound.BoundLaunch),
                                             ("relu", pointwise_bound.BoundLaunch)])
def test_windowed_grouped_heads_reach_the_triton_kernels_unexpanded(kind, bound_type, key_heads, plans_made):
    torch.manual_seed(2)
    q = torch.randn(1, 4, 16, 16, requires_grad=True)
    k, v = (torch.randn(1, 2, 20, 16, requires_grad=True) for _ in range(2))
    window, fn = (5, 2), getattr(AF, kind)
    before = dict(plan._PLANS)
    outs = [fn(q, k, v, window_size=window, enable_gqa=True, backend="triton") for _ in range(2)]
    assert plans_made == [kind]
    kept, = _new_plans(before)
    assert isinstance(kept.fn, bound_type)  # the window bound into the signature's launches
    assert kept.gqa_group == 0 and kept.shared["enable_gqa"] is True
    assert key_heads and set(key_heads) == {2}  # both calls: k with H_kv = 2 heads, never 4
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = reference(kind, *leaves, window)
    grad = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, leaves, grad)
    for out in outs:
        torch.testing.assert_close(out.double(), want, rtol=2e-5, atol=2e-5)
    got_grads = torch.autograd.grad(outs[1], (q, k, v), grad.float())
    for got, expected in zip(got_grads, want_grads):
        torch.testing.assert_close(got.double(), expected, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_windowed_grouped_heads_on_the_cpu_routes(backend, plans_made):
    """The blockwise path takes the window but not shared heads (k, v expanded); SDPA takes shared
    heads but not the window (the band folded in, enable_gqa passed on)."""
    torch.manual_seed(3)
    q = torch.randn(1, 4, 9, 8, dtype=torch.float64)
    k, v = (torch.randn(1, 2, 11, 8, dtype=torch.float64) for _ in range(2))
    for _ in range(2):
        out = AF.softmax(q, k, v, window_size=(2, 2), enable_gqa=True, backend=backend)
        torch.testing.assert_close(out, reference("softmax", q, k, v, (2, 2)), rtol=1e-10, atol=1e-10)
    assert plans_made == ["softmax"]


@pytest.mark.parametrize("backend,route,heads", [("triton", "skips what lies outside the band", "in place"),
                                                 ("cpu", "skips what lies outside the band", "expanded"),
                                                 ("torch", "folded into its mask", "in place")])
def test_explain_tells_the_window_route_and_the_grouped_heads(backend, route, heads):
    import attnzoo
    q = torch.randn(1, 4, 9, 8)
    k, v = (torch.randn(1, 2, 9, 8) for _ in range(2))
    notes = attnzoo.explain("softmax", q, k, v, window_size=(2, 0), enable_gqa=True, backend=backend).notes
    assert any("window_size=(2, 0)" in n and route in n for n in notes), notes
    assert any("grouped-query" in n and heads in n for n in notes), notes


# the kept plan's host work around the kernels of a windowed grouped-query call: the allocations of a
# plain call (out, lse | delta, dq, dk, dv; pointwise: out, n | dq, dk, dv) and nothing else: no band
# built, no k / v expanded (repeat_interleave) and no gradient summed back over a group
WINDOWED_GQA_HOST_OPS = {"softmax": (["aten::empty"] * 2, ["aten::empty"] * 4),
                         "sigmoid": (["aten::empty"] * 2, ["aten::empty"] * 3)}


@needs_interpreter
@pytest.mark.parametrize("kind", list(WINDOWED_GQA_HOST_OPS))
def test_a_kept_windowed_gqa_plan_only_allocates(kind, monkeypatch):
    from triton.runtime.interpreter import InterpretedFunction
    from tests.test_host_cost import top_level_aten
    monkeypatch.setattr(InterpretedFunction, "run", lambda self, *args, grid, warmup, **kwargs: None)
    q = torch.randn(1, 4, 24, 16, requires_grad=True)
    k, v = (torch.randn(1, 2, 24, 16, requires_grad=True) for _ in range(2))
    fn = getattr(AF, kind)
    fn(q, k, v, window_size=(7, 0), enable_gqa=True, backend="triton")  # the plan, its bound launches
    outs = []
    forward = top_level_aten(lambda: outs.append(fn(q, k, v, window_size=(7, 0), enable_gqa=True, backend="triton")))
    cot = torch.ones(1, 4, 24, 16)
    backward = top_level_aten(lambda: torch.autograd.grad(outs[0], (q, k, v), cot))
    assert (sorted(forward), sorted(backward)) == WINDOWED_GQA_HOST_OPS[kind]
