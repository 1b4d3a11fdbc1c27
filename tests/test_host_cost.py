"""What one attention call costs the host, counted: kernel launches and their arguments, and the aten
operations around them. Short sequences make a training step host-bound, so an extra launch or
operation per call is a regression this file turns into a failure.

Counts are taken two ways:
- Triton paths (under the interpreter): launches are recorded instead of run (``launches`` fixture),
  and the torch profiler lists the top-level aten operations of the host code around them. Outputs
  are garbage then; only the counts matter.
- CPU paths: a TorchDispatchMode counts every aten operation of a layer's forward and backward against
  the same count for timm's own Attention (or F.scaled_dot_product_attention) in the same process.
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

import attnzoo
import attnzoo.functional as AF
from attnzoo.ops.kernels.flash_softmax.hopper_kernels import TENSOR_DESCRIPTORS
from attnzoo.ops import plan
from tests.common import needs_interpreter

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def launches(monkeypatch):
    """Every Triton launch as (kernel name, number of arguments), the kernels not run."""
    from triton.runtime.interpreter import InterpretedFunction
    seen = []

    def record(self, *args, grid, warmup, **kwargs):
        seen.append((self.fn.__name__, len(args) + len(kwargs)))
    monkeypatch.setattr(InterpretedFunction, "run", record)
    return seen


def top_level_aten(fn) -> list[str]:
    """The aten operations ``fn`` dispatches itself (not those inside another aten operation)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    names = []
    for event in prof.events():
        if not event.name.startswith("aten::"):
            continue
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        if parent is None:
            names.append(event.name)
    return names


def _qkv(grad=True, h=2, h_kv=2):
    q = torch.randn(1, h, 40, 16, requires_grad=grad)
    k, v = (torch.randn(1, h_kv, 40, 16, requires_grad=grad) for _ in range(2))
    return q, k, v


# (variant, options): forward launches, backward launches. The softmax family: one forward kernel;
# delta = rowsum(dO * O), dK/dV, dQ in the backward (FlashAttention-2's three). Pointwise kernels keep
# no row statistics: no delta. Sinkhorn(n), a small call: 2n log-sum-exp passes (the first also writes
# g^0) and the weighted output; backward: dv with the last adjoint (and delta), 2n - 1 adjoint passes,
# the adjoint's rank-one factors (O(n N)) and dq / dk. Causal linear: chunk states, then outputs; the
# backward rebuilds the states, then the normaliser gradient, the reverse scan and the two gradient kernels.
# Non-causal linear: the keys' state, reduced in 2 splits at N = 40 under the interpreter (32-row splits) and
# summed, then outputs; the backward reduces dS over the queries (writing dq), sums, then dk / dv
# (one launch fewer each way when a single split suffices: tests/test_fused_linear_noncausal.py).
# where Triton can build the Hopper variant, the softmax forward launches its selector kernel
# (kernels/flash_softmax/hopper_kernels.py): the classic kernel's arguments plus two constexpr switches
SOFTMAX_FWD = "softmax_fwd_select_kernel" if TENSOR_DESCRIPTORS else "softmax_fwd_kernel"
SOFTMAX_DQ = "softmax_dq_select_kernel" if TENSOR_DESCRIPTORS else "softmax_bwd_dq_kernel"  # likewise, one switch
SOFTMAX_DKDV = "softmax_dkdv_select_kernel" if TENSOR_DESCRIPTORS else "softmax_bwd_dkdv_kernel"  # and dK/dV's
LAUNCHES = {
    ("softmax", ()): ([SOFTMAX_FWD],
                      ["softmax_bwd_delta_kernel", SOFTMAX_DKDV, SOFTMAX_DQ]),
    ("l2", ()): ([SOFTMAX_FWD],
                 ["softmax_bwd_delta_kernel", SOFTMAX_DKDV, SOFTMAX_DQ]),
    ("fenchel", ()): ([SOFTMAX_FWD],
                      ["softmax_bwd_delta_kernel", SOFTMAX_DKDV, SOFTMAX_DQ]),
    ("sigmoid", ()): (["pointwise_fwd_kernel"], ["pointwise_bwd_dkdv_kernel", "pointwise_bwd_dq_kernel"]),
    ("relu", ()): (["pointwise_fwd_kernel"], ["pointwise_bwd_dkdv_kernel", "pointwise_bwd_dq_kernel"]),
    ("sinkhorn", (("n_iters", 3),)): (["_lse_kernel"] * 6 + ["_attend_kernel"],
                                      ["_grad_v_kernel"] + ["_wsum_kernel"] * 5 + ["_factors_kernel", "_grad_qk_kernel"]),
    ("linear", (("is_causal", True),)): (["_states_kernel", "_output_kernel"],
                                         ["_states_kernel", "_normaliser_grad_kernel", "_reverse_states_kernel",
                                          "_dv_kernel", "_dqk_kernel"]),
    ("linear", (("is_causal", False),)): (["_keys_state_kernel", "_sum_splits_kernel", "_queries_output_kernel"],
                                          ["_queries_grad_kernel", "_sum_splits_kernel", "_keys_grad_kernel"]),
}


@needs_interpreter
@pytest.mark.parametrize("variant,options", list(LAUNCHES), ids=[v for v, _ in LAUNCHES])
def test_each_triton_call_issues_its_launches_and_no_more(variant, options, launches):
    fn = getattr(AF, variant)
    q, k, v = _qkv()
    out = fn(q, k, v, backend="triton", **dict(options))
    forward = [name for name, _ in launches]
    launches.clear()
    torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    backward = [name for name, _ in launches]
    assert (forward, backward) == LAUNCHES[(variant, options)]


@needs_interpreter
def test_a_large_sinkhorn_call_launches_the_row_dots(launches, monkeypatch):
    """From FOLD_BELOW on, g^0 = -a|k|^2 and delta = dout.out get a row-dot launch each (computing them
    per tile in the first pass that reads them costs more than a launch at that size)."""
    from attnzoo.ops.sinkhorn import triton as sk
    monkeypatch.setattr(sk, "FOLD_BELOW", 0)
    plan.clear()  # a kept plan binds the folded passes (ops/sinkhorn/bound.py)
    q, k, v = _qkv()
    out = AF.sinkhorn(q, k, v, backend="triton", n_iters=3)
    forward = [name for name, _ in launches]
    launches.clear()
    torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    small_forward, small_backward = LAUNCHES[("sinkhorn", (("n_iters", 3),))]
    assert forward == ["_row_dot_kernel"] + small_forward
    assert [name for name, _ in launches] == ["_row_dot_kernel"] + small_backward


# Sinkhorn's host code between its launches: the potential stacks and their views (one unbind per
# stack, the kernels write every potential and adjoint in place), the outputs, dq's float32
# accumulator (zeros) and its scale (mul_); no arithmetic on potentials. A kept plan's bound passes
# (ops/sinkhorn/bound.py) allocate the unrounded output that half inputs' backward takes delta from
# (issue 21) only for half inputs: these float32 inputs' backward reads the output itself (the general
# route's custom op made a (0,) placeholder, its outputs may not alias each other).
SINKHORN_HOST_OPS = (["aten::empty"] * 4 + ["aten::unbind"] * 2,
                     ["aten::empty"] * 6 + ["aten::empty_like"] * 2 + ["aten::unbind"] * 4
                     + ["aten::zeros", "aten::mul_"])


@needs_interpreter
@pytest.mark.parametrize("cost", ["l2", "dot"])
def test_sinkhorn_host_code_does_no_arithmetic_on_potentials(cost, launches):
    q, k, v = _qkv()
    cot = torch.ones(1, 2, 40, 16)
    AF.sinkhorn(q, k, v, backend="triton", cost=cost)
    outs = []
    forward = top_level_aten(lambda: outs.append(AF.sinkhorn(q, k, v, backend="triton", cost=cost)))
    backward = top_level_aten(lambda: torch.autograd.grad(outs[0], (q, k, v), cot))
    assert (sorted(forward), sorted(backward)) == tuple(sorted(x) for x in SINKHORN_HOST_OPS)


# The host code around the softmax-family, pointwise and non-causal linear kernels allocates the outputs
# and nothing else: no fills, casts or reductions (stand-ins for absent inputs are made once per device).
ALLOCATIONS = {  # variant: (forward, backward) top-level aten ops
    # out, lse | delta, dq, dk, dv: a kept plan's bound launches (kernels/flash_softmax/bound.py) allocate
    # no placeholder for the absent T5 residual and no empty preference or table gradients
    "softmax": (["aten::empty"] * 2, ["aten::empty"] * 4),
    "l2": (["aten::empty"] * 2, ["aten::empty"] * 4),
    "sigmoid": (["aten::empty"] * 2, ["aten::empty"] * 3),   # out, n | dq, dk, dv (no empty dbias: bound launch)
    "relu": (["aten::empty"] * 2, ["aten::empty"] * 3),
    # non-causal: out, r, the state and its 2 split partials | dq, dk, dv, empty dmask, dS and its partials
    "linear": (["aten::empty"] * 4, ["aten::empty"] * 6),
}


@needs_interpreter
@pytest.mark.parametrize("variant", list(ALLOCATIONS))
def test_the_host_code_around_the_fused_kernels_only_allocates(variant, launches):
    fn = getattr(AF, variant)
    q, k, v = _qkv()
    cot = torch.ones(1, 2, 40, 16)
    fn(q, k, v, backend="triton")  # first call: the plan, stand-ins and frozen tiles are made
    outs = []
    forward = top_level_aten(lambda: outs.append(fn(q, k, v, backend="triton")))
    backward = top_level_aten(lambda: torch.autograd.grad(outs[0], (q, k, v), cot))
    assert (sorted(forward), sorted(backward)) == tuple(sorted(x) for x in ALLOCATIONS[variant])


# The T5 bias (ops/fenchel/t5.py): its offset -> bucket LUT is cached per shape, so a call's only extra
# host work is the per-head bias vector bias[h, r] = table[bucket(r), h] (t, select of the LUT's bucket
# row, index_select), in the forward and again in the backward (the dQ and dK/dV kernels read it). The
# backward also allocates the per-key-block table-gradient rows the dK/dV kernel writes and sums them
# (sum, and a slice to the table's buckets); the (num_buckets, H) result is cast to the table's dtype.
# The forward's third empty: out's rounding residual for the backward's delta, which half inputs fill
# (issue 21; (0,) here, fp32) and the same one allocation either way.
T5_HOST_OPS = (["aten::empty"] * 3 + ["aten::t", "aten::select", "aten::index_select"],
               ["aten::empty"] * 6 + ["aten::t", "aten::select", "aten::index_select"]
               + ["aten::sum", "aten::slice", "aten::to"])


@needs_interpreter
def test_t5_bias_launches_and_host_ops(launches):
    """The softmax family's launches (1 forward, 3 backward) and, around them, the bias gather, the
    allocations and the one reduction of the table gradient's rows: no LUT rebuilt per call, no atomics
    buffer to zero."""
    from attnzoo.ops.fenchel.t5 import t5_bias_attention
    q, k, v = _qkv()
    table = torch.nn.Parameter(torch.randn(8, 2))
    cot = torch.ones(1, 2, 40, 16)
    out = t5_bias_attention(q, k, v, table, 8, 16, True, scale=0.25)  # first call: LUT, plan, stand-ins
    torch.autograd.grad(out, (q, k, v, table), cot)
    launches.clear()
    outs = []
    forward = top_level_aten(lambda: outs.append(t5_bias_attention(q, k, v, table, 8, 16, True, scale=0.25)))
    fwd_launches = [name for name, _ in launches]
    launches.clear()
    backward = top_level_aten(lambda: torch.autograd.grad(outs[0], (q, k, v, table), cot))
    assert (fwd_launches, [name for name, _ in launches]) == LAUNCHES[("softmax", ())]
    assert (sorted(forward), sorted(backward)) == tuple(sorted(x) for x in T5_HOST_OPS)


@needs_interpreter
def test_grouped_query_heads_add_no_launch_and_no_copy(launches):
    """With enable_gqa the softmax family reads each shared key/value head in place: the same three
    backward launches, and dK/dV allocated at the key/value heads' size (no expanded copy summed)."""
    q, k, v = _qkv(h=4, h_kv=2)
    out = AF.softmax(q, k, v, backend="triton", enable_gqa=True)
    cot = torch.ones_like(out)
    names = top_level_aten(lambda: torch.autograd.grad(out, (q, k, v), cot, retain_graph=True))
    assert sorted(names) == ["aten::empty"] * 4  # delta, dq, dk, dv
    launches.clear()
    torch.autograd.grad(out, (q, k, v), cot)
    assert [n for n, _ in launches] == LAUNCHES[("softmax", ())][1]


# Arguments per launch: each one is bound by Triton on every call (about 1.5-2 us per tensor argument,
# triton#11880). These are the current signatures; a new argument must be worth its cost.
# softmax family: + SINKS, softcap, the window's two bounds and the three switches (issue 29: fused extras)
MAX_ARGUMENTS = {SOFTMAX_FWD: 69 if TENSOR_DESCRIPTORS else 67, SOFTMAX_DKDV: 73 if TENSOR_DESCRIPTORS else 72,
                 SOFTMAX_DQ: 70 if TENSOR_DESCRIPTORS else 69,
                 # delta: + the T5 half-input rounding residual of O and its switch (issue 21)
                 "softmax_bwd_delta_kernel": 18,
                 # pointwise: + SOFTCAP, WINDOW and the band's two offsets (issue 29: fused softcap, windows)
                 "pointwise_fwd_kernel": 61, "pointwise_bwd_dkdv_kernel": 63, "pointwise_bwd_dq_kernel": 63}


@needs_interpreter
def test_launch_arguments_stay_within_their_budget(launches):
    q, k, v = _qkv()
    for fn in (AF.softmax, AF.sigmoid):
        out = fn(q, k, v, backend="triton")
        torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    counts = dict(launches)
    for name, limit in MAX_ARGUMENTS.items():
        assert counts[name] <= limit, f"{name} takes {counts[name]} arguments (budget {limit})"


# --- CPU: a layer's aten operations against timm's own Attention -------------------------------------

class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def count_ops(step) -> Counter:
    step()  # the first call decides (plans, caches)
    with CountOps() as mode:
        step()
    return mode.ops


# What attnzoo's SDPA route adds on CPU: attnzoo's rule is that a NaN in a query reaches that query's
# output row, and SDPA's fused CPU kernel hides it, so one sum over q (detached) is read per call.
NAN_RULE = Counter({"aten.detach": 1, "aten.sum": 1, "aten._local_scalar_dense": 1})


def test_functional_softmax_is_sdpa_plus_the_nan_rule():
    q, k, v = _qkv()
    sdpa = count_ops(lambda: F.scaled_dot_product_attention(q, k, v).sum().backward())
    ours = count_ops(lambda: AF.softmax(q, k, v).sum().backward())
    assert ours - sdpa == NAN_RULE and not sdpa - ours


@pytest.mark.parametrize("variant", ["softmax", "fenchel"])
def test_a_softmax_layer_is_timms_attention_plus_the_nan_rule(variant):
    from timm.layers import Attention
    torch.manual_seed(0)
    x = torch.randn(2, 17, 64)
    timm_layer = Attention(64, num_heads=4)
    ours = attnzoo.create(variant, 64, 4)
    base = count_ops(lambda: timm_layer(x).sum().backward())
    got = count_ops(lambda: ours(x).sum().backward())
    assert got - base == NAN_RULE and not base - got, (got - base, base - got)


@needs_interpreter
def test_a_parameter_alone_needing_a_gradient_takes_the_autograd_route():
    """The eager route decides whether to record a backward from every argument: a T5 table (an
    nn.Parameter, a tensor subclass) must get its gradient when q, k, v need none."""
    from attnzoo.ops.fenchel.t5 import t5_bias_attention
    q, k, v = _qkv(grad=False)
    table = torch.nn.Parameter(torch.randn(8, 2))
    out = t5_bias_attention(q, k, v, table, 8, 16, True, scale=0.25)
    (out * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
    assert table.grad is not None and table.grad.abs().sum() > 0
