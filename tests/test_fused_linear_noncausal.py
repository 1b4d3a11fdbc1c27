"""Non-causal linear attention's Triton kernels (ops/linear/noncausal.py) against float64 math.

tests/formulas.py.linear is the N x N form written from Katharopoulos et al. / paper 002 eq 2.2:
w_ij = phi(scale q_i).phi(k_j) exp(mask_ij) on the keys taking part, out_i = sum_j w_ij v_j /
(sum_j w_ij + 1e-6), or / n_i for the identity map. The kernels never form w: they reduce the keys to
S = sum_j w_j phi(k_j) v_j^T and z, then read S per query, so agreement checks the reductions (split
over row ranges), the fused normaliser, the mask's shift and every hand-written gradient, the float
mask's included. Under TRITON_INTERPRET=1 the tiles are 16 rows / 16 head dims and a reduction split
is 32 rows: 37 rows are 3 chunks (a partial last one) in 2 splits, D = 24 two head-dim tiles.
"""
from __future__ import annotations

import math

import pytest
import torch

import attnzoo.functional as AF
from tests import formulas as FM
from tests.common import INTERPRET, KERNEL_DEVICE, float_mask, needs_gpu, needs_interpreter, needs_kernels, qkv, seeded
from tests.flash_rule import assert_flash_rule

B, H = 2, 2


def _mask(kind, nk, g):
    """A key-only mask of ``kind``: None, "bool" (key padding (B, 1, 1, Nk), key 0 kept), "float" (log
    weights with -inf entries, (Nk,)), "large" (entries ~300, (B, 1, 1, Nk), key 0 of batch 0 removed),
    "heads" (a float (1, H, 1, Nk) mask: one shift per head, its gradient summed over the batch),
    "low" (entries ~ -15, (B, 1, 1, Nk): the weights sum to less than the normaliser's 1e-6, which must
    be taken in the shifted units), "high" (entries ~ +100: exp overflows float32 without the shift),
    "all-or-none" (a bool (B, 1, 1, 1): batch 1 keeps no key)."""
    if kind is None:
        return None
    if kind == "bool":
        m = torch.rand(B, 1, 1, nk, generator=g) > 0.3
        m[..., 0] = True
        return m
    if kind == "float":
        return float_mask((nk,), 0.3, scale=0.5, generator=g, dtype=torch.float64)
    if kind == "large":
        return 300.0 + float_mask((B, 1, 1, nk), 0.3, scale=2.0, generator=g, dtype=torch.float64,
                                  empty_rows=[(0, ..., 0)])
    if kind in ("low", "high"):
        return (-15.0 if kind == "low" else 100.0) + float_mask((B, 1, 1, nk), 0.2, scale=0.5, generator=g,
                                                                 dtype=torch.float64)
    if kind == "heads":
        return float_mask((1, H, 1, nk), 0.2, scale=1.0, generator=g, dtype=torch.float64)
    if kind == "all-or-none":
        return torch.tensor([True, False]).view(B, 1, 1, 1)
    raise AssertionError(kind)


def _inputs(nq, nk, d, dv, mask_kind, seed):
    g = seeded(seed)
    q, k, v = qkv(B, H, nq, nk, d, dv, dtype=torch.float64, generator=g)
    return q, k, v, _mask(mask_kind, nk, g)


def _formula(q, k, v, mask, fm, scale):
    """The float64 formula (leaves q, k, v and a float mask keep their graph)."""
    allow, add = FM.allow_and_add(mask, False, B, H, q.shape[2], k.shape[2])
    return FM.linear(q, k, v, allow, add, feature_map=fm, scale=scale)


def _call(q, k, v, mask, fm, scale):
    dev = KERNEL_DEVICE
    out = AF.linear(q.to(dev), k.to(dev), v.to(dev), attn_mask=None if mask is None else mask.to(dev),
                    scale=scale, feature_map=fm, backend="triton")
    return out.cpu()


def _leaves(mask, *tensors):
    """q, k, v as leaves, and the mask too when it is a float one (its gradient is checked)."""
    ts = [t.detach().clone().requires_grad_() for t in tensors]
    if mask is not None and mask.is_floating_point():
        mask = mask.detach().clone().requires_grad_()
    return ts, mask


# (feature_map, nq, nk, mask, D, Dv): every form the reference has, in fp64 kernels (fp64 sums and
# products), so agreement with the float64 formula is exact up to rounding.
FP64_CASES = [
    ("elu", 37, 50, None, 16, 16),            # 2 key splits, partial chunks, Nq < Nk
    ("relu", 50, 37, None, 24, 17),           # Nq > Nk, two head-dim tiles, Dv no power of two
    ("identity", 37, 37, None, 5, 3),         # 1 / Nk
    ("elu", 20, 9, "bool", 5, 3),             # one split (no sum launch), key padding
    ("identity", 37, 50, "bool", 24, 16),     # 1 / n of the kept keys, two head-dim tiles
    ("relu", 37, 50, "float", 16, 16),        # log-weights with -inf entries; the mask's gradient
    ("identity", 50, 37, "float", 24, 3),     # e^shift / n
    ("elu", 37, 50, "large", 5, 3),           # entries ~300: weights exp(m - shift) and their epsilon
    ("identity", 37, 50, "large", 16, 3),
    ("elu", 9, 37, "heads", 5, 3),            # a shift per head, the gradient summed over the batch
    ("relu", 9, 37, "all-or-none", 24, 3),    # a key-broadcast mask: batch 1 keeps none (zeros)
    ("identity", 9, 37, "all-or-none", 5, 3),
]


@needs_kernels
@pytest.mark.parametrize("fm,nq,nk,mask_kind,d,dv", FP64_CASES)
def test_fp64_matches_formula_to_rounding(fm, nq, nk, mask_kind, d, dv):
    q, k, v, mask = _inputs(nq, nk, d, dv, mask_kind, seed=nq * 100 + nk)
    (q, k, v), mask = _leaves(mask, q, k, v)
    out = _call(q, k, v, mask, fm, 0.8)
    want = _formula(q, k, v, mask, fm, 0.8)
    torch.testing.assert_close(out, want, rtol=1e-9, atol=1e-9)
    grad = torch.randn(want.shape, generator=seeded(1), dtype=torch.float64)
    inputs = (q, k, v) + ((mask,) if mask is not None and mask.requires_grad else ())
    got = torch.autograd.grad(out, inputs, grad)
    expect = torch.autograd.grad(want, inputs, grad, allow_unused=True)
    for name, a, b in zip(("dq", "dk", "dv", "dmask"), got, expect):
        b = torch.zeros_like(a) if b is None else b
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=lambda m, n=name: f"{n}: {m}")


def _formula_low(q, k, v, mask, fm, scale):
    """The N x N formula in float32 arithmetic: the yardstick of FlashAttention's rule. Fed the kernel's
    (rounded) inputs and rounded to its output dtype, its error is what storing in that dtype costs.
    The weights are exp(mask - shift), shift the row's largest entry, as in the reference (exp(100)
    overflows float32), the shift put back through the normaliser's epsilon or the identity's output."""
    allow, add = FM.allow_and_add(mask, False, B, H, q.shape[2], k.shape[2])
    add = add.float()
    shift = add.amax(-1, keepdim=True).detach()
    weight = torch.where(allow, torch.exp(add - shift), torch.zeros(()))
    q = q * scale
    if fm == "identity":
        n = allow.sum(-1, keepdim=True).clamp_min(1).float()
        return ((q @ k.transpose(-1, -2)) * weight / n) @ v * torch.exp(shift)
    phi = (lambda x: torch.where(x > 0, x + 1, torch.exp(x))) if fm == "elu" else (lambda x: x.clamp(min=0))
    w = (phi(q) @ phi(k).transpose(-1, -2)) * weight
    eps = (1e-6 * torch.exp(-shift)).clamp_min(torch.finfo(torch.float32).tiny ** 0.5)
    return (w @ v) / (w.sum(-1, keepdim=True) + eps)


def _check_rule(fm, nq, nk, mask_kind, d, dv, dtype, scale=0.8, seed=0, dead_head=None):
    """The kernels in ``dtype`` against float64: FlashAttention's rule for out and every gradient.
    ``dead_head``: that head's keys are made non-positive (relu: every weight 0, r = 1 / eps)."""
    q, k, v, mask = _inputs(nq, nk, d, dv, mask_kind, seed)
    if dead_head is not None:
        k[:, dead_head] = -k[:, dead_head].abs()
    low_mask = None if mask is None else (mask if mask.dtype == torch.bool else mask.to(dtype))
    (q, k, v), m = _leaves(low_mask, *(t.to(dtype) for t in (q, k, v)))
    out = _call(q, k, v, m, fm, scale)
    assert out.dtype == dtype and out.shape == (B, H, nq, dv)
    def cast(mask, to):   # a bool mask stays bool
        return mask if mask is None or mask.dtype == torch.bool else mask.detach().to(to)
    (wq, wk, wv), wm = _leaves(cast(m, torch.float64), q.double(), k.double(), v.double())
    (lq, lk, lv), lm = _leaves(cast(m, torch.float32), q.float(), k.float(), v.float())
    want = _formula(wq, wk, wv, wm, fm, scale)
    low = _formula_low(lq, lk, lv, lm, fm, scale)
    grad = torch.randn(want.shape, generator=seeded(seed + 1), dtype=torch.float64).to(dtype)
    names = ["dq", "dk", "dv"] + (["dmask"] if m is not None and m.requires_grad else [])
    got = torch.autograd.grad(out, [q, k, v, m][:len(names)], grad)
    want_g = torch.autograd.grad(want, [wq, wk, wv, wm][:len(names)], grad.double())
    low_g = [g.to(dtype) for g in torch.autograd.grad(low, [lq, lk, lv, lm][:len(names)], grad.float())]
    assert all(torch.isfinite(t).all() for t in (out, *got))
    assert_flash_rule(f"linear {fm} {nq}x{nk} mask={mask_kind} D={d} Dv={dv}", dtype, 1.0,
                      [("out", out, low.to(dtype), want)] + list(zip(names, got, low_g, want_g)))


# The interpreter runs half-precision products by upcasting the rounded operands (its bf16 dot is
# wrong): what is checked is the rounding the kernels choose (phi(k), r phi(q) to the input dtype for
# the reductions; S, dS in fp32), the accumulators and the stores.
RULE_CASES = [
    ("elu", 37, 50, None, 16, 16),
    ("relu", 50, 37, "bool", 24, 17),
    ("identity", 37, 50, "float", 16, 3),
    ("elu", 37, 21, "heads", 5, 16),
    ("relu", 21, 37, "low", 16, 16),
    ("elu", 21, 37, "high", 5, 3),
]


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("fm,nq,nk,mask_kind,d,dv", RULE_CASES)
def test_low_precision_by_flash_attention_rule(fm, nq, nk, mask_kind, d, dv, dtype):
    _check_rule(fm, nq, nk, mask_kind, d, dv, dtype)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_relu_head_whose_weights_are_all_zero(dtype):
    # head 1's keys are non-positive: z = 0, so r = 1 / 1e-6 and r phi(q) passes fp16's 65504 (the dS
    # pass takes it in fp32 for fp16 inputs); out and every gradient of that head are 0
    _check_rule("relu", 21, 37, None, 16, 16, dtype, dead_head=1)


@needs_kernels
@pytest.mark.parametrize("fm", ["elu", "identity"])
def test_heads_without_keys_are_zero_with_finite_grads(fm):
    # batch 1: every key masked, by a bool and by a float (-inf) mask
    q, k, v, _ = _inputs(9, 20, 5, 3, None, seed=3)
    for mask in (torch.tensor([True, False]).view(B, 1, 1, 1).expand(B, 1, 1, 20),
                 torch.zeros(B, 1, 1, 20).index_fill_(0, torch.tensor([1]), -math.inf)):
        (lq, lk, lv), _ = _leaves(None, *(t.float() for t in (q, k, v)))
        out = _call(lq, lk, lv, mask, fm, 1.0)
        assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isfinite(out[0]).all()
        grads = torch.autograd.grad(out.sum(), (lq, lk, lv))
        assert all(torch.isfinite(g).all() for g in grads)
        assert torch.equal(grads[1][1], torch.zeros_like(grads[1][1]))


@needs_kernels
@pytest.mark.parametrize("fm", ["elu", "identity"])
def test_nan_in_a_masked_key_stays_out(fm):
    # the reference removes a masked key with masked_fill (0, not 0 * NaN): so do the kernels
    q, k, v, _ = _inputs(9, 20, 5, 3, None, seed=4)
    q, k, v = (t.float() for t in (q, k, v))
    mask = torch.ones(20, dtype=torch.bool)
    mask[7] = False
    clean = _call(q, k, v, mask, fm, 1.0)
    k[..., 7, 1], v[..., 7, 2] = math.nan, math.nan
    for m in (mask, torch.zeros(20).masked_fill(~mask, -math.inf)):
        (lq, lk, lv), _ = _leaves(None, q, k, v)
        out = _call(lq, lk, lv, m, fm, 1.0)
        torch.testing.assert_close(out, clean, rtol=1e-6, atol=1e-6)
        assert all(torch.isfinite(g).all() for g in torch.autograd.grad(out.sum(), (lq, lk, lv)))


@needs_kernels
def test_under_autocast():
    # q, k, v from an autocast matmul are bf16 strided views (the kernels take row strides, no copies);
    # the float mask stays fp32 and gets its gradient
    x = torch.randn(2, 40, 16, device=KERNEL_DEVICE)
    proj = torch.nn.Linear(16, 3 * 16, device=KERNEL_DEVICE)
    mask = torch.randn(2, 1, 1, 33, device=KERNEL_DEVICE, requires_grad=True)
    with torch.autocast(KERNEL_DEVICE, dtype=torch.bfloat16):
        q, k, v = proj(x).view(2, 40, 3, 2, 8).permute(2, 0, 3, 1, 4)   # three (B, H, N, 8) views
        out = AF.linear(q[..., 19:, :], k[..., 7:, :], v[..., 7:, :], attn_mask=mask, backend="triton")
    assert out.dtype == torch.bfloat16
    args = [t.detach().double().cpu() for t in (q[..., 19:, :], k[..., 7:, :], v[..., 7:, :])]
    allow, add = FM.allow_and_add(mask.detach().double().cpu(), False, 2, 2, 21, 33)
    ref = FM.linear(*args, allow, add)
    torch.testing.assert_close(out.double().cpu(), ref, rtol=2e-2, atol=2e-2)
    out.float().sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in proj.parameters()) and torch.isfinite(mask.grad).all()


class _Outputs(torch.utils._python_dispatch.TorchDispatchMode):
    """(dtype, number of elements) of every floating-point tensor an aten op returns."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                self.seen.append((t.dtype, t.numel()))
        return out


@needs_kernels
def test_no_fp32_copy_of_the_inputs_and_nothing_of_n_by_n_or_n_d_dv():
    # bf16 inputs: no fp32 tensor as large as q, k or v (the states, r and the splits' partial states are
    # per head), nothing larger than q (no (N, D, Dv) products, no N x N weights)
    n, d = 128, 16
    q, k, v = (t.to(torch.bfloat16).requires_grad_() for t in qkv(1, 2, n, n, d, device=KERNEL_DEVICE))
    mask = torch.randn(n, device=KERNEL_DEVICE, requires_grad=True)
    with _Outputs() as mode:
        out = AF.linear(q, k, v, attn_mask=mask, backend="triton")
        out.sum().backward()
    assert max(size for _, size in mode.seen) <= q.numel() < min(n * n, n * d * d)
    assert max(size for dtype, size in mode.seen if dtype == torch.float32) < q.numel()


@needs_interpreter
def test_short_sequences_launch_no_split_sum(monkeypatch):
    # up to one split of rows (32 under the interpreter) per reduction: two launches each way
    from triton.runtime.interpreter import InterpretedFunction
    seen = []
    monkeypatch.setattr(InterpretedFunction, "run", lambda self, *a, grid, warmup, **kw: seen.append(self.fn.__name__))
    q, k, v = (t.requires_grad_() for t in qkv(1, 2, 32, 20, 16))
    out = AF.linear(q, k, v, backend="triton")
    forward = list(seen)
    seen.clear()
    torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert (forward, seen) == (["_keys_state_kernel", "_queries_output_kernel"],
                               ["_queries_grad_kernel", "_keys_grad_kernel"])


# --- GPU only: compiled kernels at sizes the interpreter cannot run ---------------------------------------

@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("fm,mask_kind", [("elu", None), ("identity", "bool"), ("relu", "float")])
def test_gpu_matches_formula(fm, mask_kind, head_dim, dtype):
    # 1000 x 1500 rows (partial chunks, Nq != Nk); splits of the reductions when B * H is small
    _check_rule(fm, 1000, 1500, mask_kind, head_dim, head_dim, dtype, scale=head_dim ** -0.5)


@pytest.mark.gpu
@needs_gpu
def test_gpu_widest_head_dims():
    # D = 256, Dv = 255: four head-dim tiles, unaligned rows of v
    _check_rule("elu", 300, 700, "bool", 256, 255, torch.bfloat16, scale=1 / 16)


@pytest.mark.gpu
@needs_gpu
def test_gpu_fp16_state_does_not_overflow():
    # v with a mean of 20 over 16384 keys: S reaches ~3e5 > fp16's 65504; S stays fp32 in the kernels
    q, k, v = qkv(1, 2, 4096, 16384, 64, device="cuda")
    q, k, v = (t.half().requires_grad_() for t in (q, k, v + 20.0))
    out = AF.linear(q, k, v, scale=0.125, feature_map="identity", backend="triton")
    allow, add = FM.allow_and_add(None, False, 1, 2, 4096, 16384)
    ref = FM.linear(q.detach().double(), k.detach().double(), v.detach().double(), allow.cuda(), add.cuda(),
                    feature_map="identity", scale=0.125)
    torch.testing.assert_close(out.double(), ref, rtol=1e-2, atol=1e-2)
    assert all(torch.isfinite(g).all() for g in torch.autograd.grad(out.float().sum(), (q, k, v)))


@pytest.mark.gpu
@needs_gpu
def test_gpu_extra_memory_at_most_sdpas():
    # the shape (bf16, B4 H32 N4096 D64): the forward + backward's peak above the inputs, against
    # SDPA's default dispatch on the same inputs
    q, k, v = (torch.randn(4, 32, 4096, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))

    def extra(fn):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = fn()
        torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    extra(lambda: AF.linear(q, k, v, backend="triton"))   # compile first
    ours = extra(lambda: AF.linear(q, k, v, backend="triton"))
    sdpa = extra(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v))
    assert ours <= sdpa, (ours, sdpa)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("mask_kind", [None, "float"])
def test_gpu_compiles_fullgraph(mask_kind):
    from attnzoo.ops.linear.triton import linear_attention_triton
    q, k, v = (t.requires_grad_() for t in qkv(2, 4, 300, 500, 64, dtype=torch.bfloat16, device="cuda"))
    mask = None if mask_kind is None else torch.randn(2, 1, 1, 500, device="cuda")

    def run(a, b, c):
        return linear_attention_triton(a, b, c, attn_mask=mask, is_causal=False, scale=0.125)

    compiled = torch.compile(run, fullgraph=True)
    got = compiled(q, k, v)
    got_grads = torch.autograd.grad(got.float().sum(), (q, k, v))
    want = run(q, k, v)
    want_grads = torch.autograd.grad(want.float().sum(), (q, k, v))
    torch.testing.assert_close(got, want, rtol=0, atol=0)   # the same kernels, launched by the graph
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
