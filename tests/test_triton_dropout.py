"""In-kernel dropout of the softmax-family and pointwise Triton kernels against float64 formulas.

With the keep-mask Z that the call used (written out by ``dropout_keep_mask`` from the call's seed,
which ``torch.manual_seed`` replays), the kernels must compute
    out = ((Z * W) / (1 - p)) @ V
with W the variant's undropped weights: softmax_j(l_ij) (plain, L2, per-key preference, T5 table),
sigmoid(s_ij + b_i) or relu(s_ij) / n_i, written here from the formulas, and every gradient (q, k, v,
preference, table, bias) must be autograd's of that float64 expression. Also: the dropped fraction,
seeds, dropout_p = 0, fully masked rows, dispatch, layers, torch.compile tracing.
On CPU the kernels run under TRITON_INTERPRET=1; the same table runs on CUDA when there is one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

import attnzoo
import attnzoo.functional as AF
from attnzoo.ops.fenchel.t5 import t5_bias_attention
from attnzoo.ops.kernels.flash_softmax import triton as fused
from attnzoo.ops.triton_dropout import draw_seed, dropout_keep_mask
from tests.common import INTERPRET, bool_mask, leaves, needs_gpu, needs_interpreter, needs_kernels, padding_mask, qkv
from tests.flash_rule import assert_flash_rule, max_error, yardstick_dtype
from tests.formulas import t5_bucket

NUM_BUCKETS, MAX_DISTANCE = 8, 20
SEED = 1234


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def default_tiles(monkeypatch):
    """On a GPU: each kernel specialisation runs its default tiles, one compile each (no autotuning)."""
    monkeypatch.setenv("ATTNZOO_TRITON_AUTOTUNE", "0")


@dataclass
class Case:
    name: str
    kind: str              # softmax | l2 | fenchel | t5 | sigmoid | relu
    p: float = 0.3
    nq: int = 19
    nk: int = 23
    b: int = 1
    h: int = 2
    d: int = 16
    mask: str = "none"     # none | padding | bool (with a row that has no key left)
    causal: bool = False
    bias: str = "default"  # sigmoid: default -log n | fixed (a float) | learnable (1, H, 1, 1) tensor


CASES = [
    Case("softmax", "softmax"),
    Case("softmax-causal-p0.5", "softmax", p=0.5, causal=True),
    Case("softmax-padding-b2", "softmax", b=2, mask="padding", p=0.2),
    Case("l2-bool-empty-row", "l2", mask="bool"),
    Case("fenchel-per-key-pref", "fenchel"),
    Case("t5-causal", "t5", causal=True),
    Case("sigmoid-default-bias-padding", "sigmoid", b=2, mask="padding"),
    Case("sigmoid-fixed-bias-causal", "sigmoid", causal=True, bias="fixed"),
    Case("sigmoid-learnable-bias-bool", "sigmoid", mask="bool", bias="learnable"),
    Case("relu-causal-bool-p0.6", "relu", p=0.6, mask="bool", causal=True),
]


# --- inputs and the call under test ----------------------------------------------------------------

def make_inputs(case: Case, device, dtype):
    B, H, nq, nk = case.b, case.h, case.nq, case.nk
    q, k, v = qkv(B, H, nq, nk, case.d)
    t = {"q": q, "k": k, "v": v, "mask": None}
    if case.mask == "padding":  # two batch elements (the padding cases have b=2)
        t["mask"] = padding_mask([nk - 4, nk // 2], nk)
    elif case.mask == "bool":  # row 3 has no key left: zeros, not NaN
        t["mask"] = bool_mask((B, 1, nq, nk), 0.7, empty_rows=[(slice(None), slice(None), 3)])
    if case.kind == "fenchel":
        pref = torch.randn(1, H, 1, nk)
        pref[..., 5] = -math.inf  # a key removed by its preference
        t["pref"] = pref
    if case.kind == "t5":
        t["table"] = torch.randn(NUM_BUCKETS, H)
    if case.kind == "sigmoid" and case.bias == "learnable":
        t["bias"] = torch.randn(1, H, 1, 1) - math.log(nk)
    return leaves(t, device, dtype)


def differentiable(inp):
    return [n for n in ("q", "k", "v", "pref", "table", "bias") if inp.get(n) is not None]


def run_kernel(case: Case, inp, p):
    q, k, v, mask = inp["q"], inp["k"], inp["v"], inp["mask"]
    kw = dict(attn_mask=mask, is_causal=case.causal, scale=case.d ** -0.5, dropout_p=p)
    if case.kind in ("softmax", "l2", "relu"):
        return getattr(AF, case.kind)(q, k, v, backend="triton", **kw)
    if case.kind == "fenchel":
        return AF.fenchel(q, k, v, log_u=inp["pref"], alpha=0.7, backend="triton", **kw)
    if case.kind == "t5":
        return t5_bias_attention(q, k, v, inp["table"], NUM_BUCKETS, MAX_DISTANCE, False, alpha=1.3, **kw)
    bias = {"default": None, "fixed": 0.4, "learnable": inp.get("bias")}[case.bias]
    return AF.sigmoid(q, k, v, bias=bias, backend="triton", **kw)


def run_with_mask(case: Case, inp, p, seed=SEED):
    """The kernel's output and the keep-mask it used: the call draws its seed first thing from q's
    device generator, so re-seeding and drawing again gives that seed back."""
    torch.manual_seed(seed)
    out = run_kernel(case, inp, p)
    torch.manual_seed(seed)
    keep = dropout_keep_mask(draw_seed(inp["q"].device), p, (case.b, case.h, case.nq, case.nk))
    return out, keep


# --- the formulas ---------------------------------------------------------------------------------

def weights(case: Case, inp, dtype):
    """The undropped weights W (B, H, Nq, Nk) in `dtype`, zero where a key does not take part."""
    leaves = {n: inp[n].detach().to(dtype).requires_grad_(True) for n in differentiable(inp)}
    q, k = leaves["q"], leaves["k"]
    B, H, nq, nk = case.b, case.h, case.nq, case.nk
    scale = case.d ** -0.5
    i = torch.arange(nq, device=q.device)[:, None]
    j = torch.arange(nk, device=q.device)[None, :]
    allow = torch.ones(B, H, nq, nk, dtype=torch.bool, device=q.device)
    if case.causal:
        allow &= j <= i + (nk - nq)  # bottom-right aligned
    if inp["mask"] is not None:
        allow &= inp["mask"].expand(B, H, nq, nk)
    zero = torch.zeros((), dtype=dtype, device=q.device)
    if case.kind in ("sigmoid", "relu"):
        s = scale * torch.einsum("bhid,bhjd->bhij", q, k)
        n = allow.sum(-1, keepdim=True).to(dtype).clamp_min(1.0)  # keys taking part in row i
        if case.kind == "relu":
            w = torch.relu(s) / n
        else:
            b = {"default": -torch.log(n), "fixed": 0.4}.get(case.bias, leaves.get("bias"))
            w = torch.sigmoid(s + b)
        return torch.where(allow, w, zero), leaves
    if case.kind == "l2":
        logits = -scale * ((q[:, :, :, None, :] - k[:, :, None, :, :]) ** 2).sum(-1)
    else:
        alpha = {"fenchel": 0.7, "t5": 1.3}.get(case.kind, 1.0)
        logits = alpha * scale * torch.einsum("bhid,bhjd->bhij", q, k)
    if "pref" in leaves:
        g = leaves["pref"]
        allow &= (g > -math.inf).expand(B, H, nq, nk)
        logits = logits + torch.where(g > -math.inf, g, zero)
    if "table" in leaves:
        bucket = torch.tensor([[t5_bucket(jj - (ii + nk - nq), NUM_BUCKETS, MAX_DISTANCE, False) for jj in range(nk)]
                               for ii in range(nq)], device=q.device)
        logits = logits + leaves["table"][bucket].permute(2, 0, 1).unsqueeze(0)
    logits = logits.masked_fill(~allow, -math.inf)
    top = logits.amax(-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top)).detach()
    e = torch.exp(logits - top)
    z = e.sum(-1, keepdim=True)
    return e / torch.where(z > 0, z, torch.ones_like(z)), leaves


def dropped_attention(case: Case, inp, keep, p, dtype=torch.float64):
    """((Z * W) / (1 - p)) @ V, FlashAttention's / F.dropout's inverted dropout on the weights."""
    w, leaves = weights(case, inp, dtype)
    out = (keep.to(dtype) * w / (1.0 - p)) @ leaves["v"]
    return out, leaves


# --- forward and every gradient against the formula with the same Z ------------------------------

def check_case(case: Case, device, dtype):
    inp = make_inputs(case, device, dtype)
    out, keep = run_with_mask(case, inp, case.p)
    assert out.shape == (case.b, case.h, case.nq, case.d) and out.dtype == dtype
    names = differentiable(inp)
    grad_out = torch.randn(out.shape, device=device).to(dtype)
    grads = torch.autograd.grad(out, [inp[n] for n in names], grad_out)
    for name, t in [("out", out)] + list(zip(names, grads)):
        assert torch.isfinite(t).all(), f"{case.name}: {name} has NaN/Inf"
    ref, leaves = dropped_attention(case, inp, keep, case.p)
    ref_grads = torch.autograd.grad(ref, [leaves[n] for n in names], grad_out.double())
    # the same math as the eager reference runs it for `dtype` (fp32 for bf16 / fp16), stored in `dtype`
    low, low_leaves = dropped_attention(case, inp, keep, case.p, yardstick_dtype(dtype))
    low_grads = [g.to(dtype) for g in torch.autograd.grad(low, [low_leaves[n] for n in names], grad_out.to(low.dtype))]
    low = low.to(dtype)
    assert_flash_rule(case.name, dtype, 1.0, [("out", out, low, ref)] + list(zip(names, grads, low_grads, ref_grads)))
    if case.mask == "bool":  # row 3 has no key: exact zeros (its gradients: finite and the formula's, above)
        assert (out.detach()[:, :, 3] == 0).all()
    # the mask did something: without it the output is far from the kernel's
    undropped = weights(case, inp, torch.float64)[0] @ inp["v"].detach().double()
    assert max_error(out, undropped) > 10 * max_error(out, ref)


@needs_interpreter
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_forward_and_gradients_match_formula(case):
    check_case(case, "cpu", torch.float32)


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_forward_and_gradients_match_formula_cuda(case, dtype):
    check_case(case, "cuda", dtype)


# --- the mask itself -------------------------------------------------------------------------------

@needs_interpreter
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropped_fraction_is_binomial(p):
    shape = (2, 3, 37, 53)  # 11766 draws, tiles cut by both lengths
    keep = dropout_keep_mask(torch.tensor([987654321]), p, shape)
    n = keep.numel()
    dropped = 1.0 - keep.double().mean().item()
    assert abs(dropped - p) <= 5 * math.sqrt(p * (1 - p) / n), (dropped, p)
    # each (b, h) slice gets its own stream (the offsets include b and h), and rows differ
    flat = keep.reshape(6, -1)
    assert all(not torch.equal(flat[0], flat[r]) for r in range(1, 6))
    assert not torch.equal(keep[0, 0, 0], keep[0, 0, 1])


@needs_interpreter
def test_mask_helper_takes_int_or_tensor_seed():
    a = dropout_keep_mask(42, 0.3, (1, 2, 5, 7), device="cpu")
    b = dropout_keep_mask(torch.tensor([42]), 0.3, (1, 2, 5, 7))
    c = dropout_keep_mask(43, 0.3, (1, 2, 5, 7), device="cpu")
    assert torch.equal(a, b) and not torch.equal(a, c)


# --- seeds, p = 0, dispatch -------------------------------------------------------------------------

@needs_interpreter
@pytest.mark.parametrize("kind", ["softmax", "relu"])
def test_same_seed_same_output_other_seed_other_output(kind):
    case = Case(kind, kind, nq=9, nk=11)
    inp = make_inputs(case, "cpu", torch.float32)
    a, _ = run_with_mask(case, inp, 0.4, seed=1)
    b, _ = run_with_mask(case, inp, 0.4, seed=1)
    c, _ = run_with_mask(case, inp, 0.4, seed=2)
    assert torch.equal(a, b)
    assert max_error(a, c) > 1e-3


@needs_interpreter
@pytest.mark.parametrize("kind", ["softmax", "sigmoid"])
def test_dropout_p_zero_is_the_plain_path(kind):
    """dropout_p=0 draws no random number and launches exactly the op without dropout arguments."""
    case = Case(kind, kind, nq=9, nk=11, causal=True)
    inp = make_inputs(case, "cpu", torch.float32)
    q, k, v = inp["q"], inp["k"], inp["v"]
    state = torch.get_rng_state()
    out = run_kernel(case, inp, 0.0)
    assert torch.equal(state, torch.get_rng_state())
    if kind == "softmax":
        plain, _, _ = torch.ops.attnzoo.softmax_family_fwd(q, k, v, None, None, None, None, 0.25, True, False)
    else:
        plain, _ = torch.ops.attnzoo.pointwise_fwd(q, k, v, None, None, 0.0, 0, 0.25, True, True)
    assert torch.equal(out, plain)


@needs_interpreter
def test_explain_and_named_backend_run_the_kernel_with_dropout():
    q, k, v = (torch.randn(1, 2, 9, 16) for _ in range(3))
    for variant in ("softmax", "l2", "fenchel", "sigmoid", "relu"):
        assert attnzoo.explain(variant, q, k, v, backend="triton", dropout_p=0.2).backend.name == "triton"
    # the Sinkhorn, linear and OT Triton backends still refuse dropout, saying so
    for variant in ("sinkhorn", "linear", "ot"):
        with pytest.raises(ValueError, match="dropout"):
            attnzoo.explain(variant, q, k, v, backend="triton", dropout_p=0.2)


@pytest.mark.parametrize("call,exc", [
    (lambda q: AF.softmax(q, q, q, dropout_p=1.0, backend="triton"), ValueError),
    (lambda q: AF.relu(q, q, q, dropout_p=-0.1, backend="triton"), ValueError),
    (lambda q: AF.sigmoid(q, q, q, dropout_p="0.1x", backend="triton"), TypeError),
    (lambda q: t5_bias_attention(q, q, q, torch.zeros(8, 2), 8, 20, True, dropout_p=1.5), ValueError),
    (lambda q: fused.preference_attention(q, q, q, torch.zeros(5), dropout_p=None), TypeError),
])
def test_bad_dropout_p_is_named(call, exc):
    with pytest.raises(exc, match="dropout_p"):
        call(torch.randn(1, 2, 5, 16))


# --- layers and torch.compile -----------------------------------------------------------------------

@needs_interpreter
@pytest.mark.parametrize("name,kw", [("softmax", {}), ("sigmoid", {"learnable_bias": True}),
                                     ("fenchel", {"preference": "t5", "num_buckets": 8, "max_distance": 16})])
def test_layer_drops_in_training_only(name, kw):
    layer = attnzoo.create(name, 32, num_heads=2, attn_drop=0.3, backend="triton", **kw)
    x = torch.randn(1, 13, 32)
    torch.manual_seed(3)
    a = layer(x)
    torch.manual_seed(3)
    b = layer(x)
    c = layer(x)
    assert torch.equal(a, b) and max_error(a, c) > 1e-4  # reproducible under manual_seed, else fresh
    layer.eval()
    ev = layer(x)
    layer.backend = "reference"
    assert max_error(ev, layer(x)) < 1e-5  # eval: no dropout, the reference's output
    assert max_error(a, ev) > 1e-3
    params = [p for p in layer.parameters() if p.requires_grad]
    layer.train()
    layer.backend = "triton"
    grads = torch.autograd.grad(layer(x).square().sum(), params)
    assert all(torch.isfinite(g).all() for g in grads)


@needs_kernels
def test_compile_traces_dropout_without_graph_break():
    """The seed is a tensor drawn inside the graph (no .item()), so dynamo traces the whole call.
    On CUDA, aot_eager runs the graph's randint on the default generator: the compiled call draws the
    same seed as eager and must give the same output and gradients. (Under the interpreter the ops
    skip the launch on fake tensors, so a compiled graph cannot run there: only tracing is checked.)"""
    device = "cpu" if INTERPRET else "cuda"
    q, k, v = (torch.randn(1, 2, 9, 16, device=device, requires_grad=True) for _ in range(3))

    def f(q, k, v):
        return AF.sigmoid(q, k, v, is_causal=True, dropout_p=0.3, backend="triton") + \
            AF.softmax(q, k, v, is_causal=True, dropout_p=0.3, backend="triton")

    torch._dynamo.reset()
    report = torch._dynamo.explain(f)(q, k, v)
    assert report.graph_break_count == 0 and report.graph_count == 1, report.break_reasons
    if INTERPRET:
        return
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    torch.manual_seed(5)
    want = f(q, k, v)
    g_want = torch.autograd.grad(want.sum(), (q, k, v))
    torch.manual_seed(5)
    got = compiled(q, k, v)
    g_got = torch.autograd.grad(got.sum(), (q, k, v))
    assert torch.equal(got, want)
    assert all(max_error(a, b) < 1e-5 for a, b in zip(g_got, g_want))


@needs_interpreter
@pytest.mark.parametrize("op", ["softmax_family_fwd", "pointwise_fwd"])
def test_ops_with_dropout_pass_opcheck(op):
    q, k, v = (torch.randn(1, 2, n, 16, requires_grad=True) for n in (3, 5, 5))
    seed = torch.tensor([7])
    if op == "softmax_family_fwd":
        args = (q, k, v, None, torch.zeros(1, 2, 5, requires_grad=True), None, None, 0.25, True, False, 0.3, seed)
    else:
        args = (q, k, v, None, torch.zeros(1, 2, 1, requires_grad=True), 0.0, 2, 0.25, False, True, 0.3, seed)
    torch.library.opcheck(getattr(torch.ops.attnzoo, op).default, args,
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    with pytest.raises(ValueError, match="seed"):
        getattr(torch.ops.attnzoo, op)(*args[:-1], None)
