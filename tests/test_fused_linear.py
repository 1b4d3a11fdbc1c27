"""Chunked linear attention (ops/linear/{cpu,triton}.py) against float64 math from the formulas.

tests/formulas.py.linear is the N x N form written from Katharopoulos et al. / paper 002 eq 2.2:
w_ij = phi(scale q_i).phi(k_j) exp(mask_ij) on the keys taking part, out_i = sum_j w_ij v_j /
(sum_j w_ij + 1e-6), or / n_i for the identity map. The fused paths never form w: agreement
checks the chunking, the state recurrence and the hand-written backward.
The Triton kernels run under TRITON_INTERPRET=1 (set by `make test`) on tiny shapes and CPU tensors; on
a machine with a CUDA GPU and no interpreter the same table runs compiled on the GPU in fp32, bf16 and
fp16 (FlashAttention's tolerance rule, tests/flash_rule.py), plus larger shapes that only a GPU runs.
"""
from __future__ import annotations

import math

import pytest
import torch

import attnzoo.functional as AF
from attnzoo.ops.linear import cpu as lin_cpu

from . import formulas as FM
from tests.flash_rule import assert_flash_rule
from tests.memory_probe import LargestOutput

from tests.kernel_devices import INTERPRET, KERNEL_DEVICE, ON_GPU, TRITON_DTYPES, needs_gpu, needs_kernels

# (feature_map, is_causal, nq, nk, mask kind): odd lengths that do not fill the last chunk,
# self and cross attention with Nq < Nk and Nq > Nk (bottom-right causal), key masks.
CPU_CASES = [
    (fm, causal, nq, nk, mask)
    for fm in ("elu", "relu", "identity")
    for causal in (False, True)
    for nq, nk, mask in ((21, 21, None), (13, 30, "bool"), (30, 13, "float"), (16, 16, "float"))
]
CPU_CHUNK = 8   # small chunks so these lengths span several, with a partial last one
# the interpreter is slow: one case per feature map and form, still odd lengths and cross
TRITON_CASES = [
    ("elu", True, 37, 37, None), ("relu", True, 20, 45, "bool"), ("identity", True, 45, 20, "float"),
    ("elu", False, 11, 7, "bool"), ("identity", False, 9, 9, None),
]


def _mask(kind, B, nk):
    if kind == "bool":
        m = torch.rand(B, 1, 1, nk) > 0.3
        m[..., 0] = True
        return m
    if kind == "float":
        return (0.5 * torch.randn(nk, dtype=torch.float64)).masked_fill(torch.rand(nk) < 0.3, -math.inf)
    return None


def _inputs(nq, nk, dtype, B=2, H=2, D=5, Dv=3):
    q = torch.randn(B, H, nq, D, dtype=dtype, requires_grad=True)
    k = torch.randn(B, H, nk, D, dtype=dtype, requires_grad=True)
    v = torch.randn(B, H, nk, Dv, dtype=dtype, requires_grad=True)
    return q, k, v


def _expected(q, k, v, mask, causal, fm, scale):
    B, H, nq, _ = q.shape
    allow, add = FM.allow_and_add(mask, causal, B, H, nq, k.shape[2])
    return FM.linear(q.double(), k.double(), v.double(), allow, add, feature_map=fm, scale=scale)


def _check(backend, fm, causal, nq, nk, mask_kind, dtype, tol):
    q, k, v = _inputs(nq, nk, dtype)
    mask = _mask(mask_kind, q.shape[0], nk)
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(dtype)
    scale = 0.8
    out = AF.linear(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, feature_map=fm, backend=backend)
    ref = _expected(q, k, v, mask, causal, fm, scale)
    grad = torch.randn_like(ref)
    got = torch.autograd.grad(out, (q, k, v), grad.to(dtype))
    want = torch.autograd.grad(ref, (q, k, v), grad)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    for name, g, w in zip("qkv", got, want):
        torch.testing.assert_close(g.double(), w.double(), rtol=tol, atol=tol, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("fm,causal,nq,nk,mask", CPU_CASES)
def test_cpu_matches_formula(monkeypatch, fm, causal, nq, nk, mask):
    monkeypatch.setattr(lin_cpu, "DEFAULT_CHUNK", CPU_CHUNK)
    _check("cpu", fm, causal, nq, nk, mask, torch.float64, 1e-9)


def _linear_fp32(q, k, v, allow, add, fm, scale):
    """The N x N formula of tests/formulas.py.linear in float32 arithmetic: the yardstick of the
    FlashAttention rule. Fed the kernel's (rounded) inputs and rounded to its output dtype, its error
    is what storing in that dtype costs. (fp16 arithmetic itself would overflow the relu map's
    1 / (0 + 1e-6)^2 in the backward of a row whose weights are all zero.)"""
    dtype = torch.float32
    q = q * scale
    add = add.to(dtype)
    if fm == "identity":
        n = allow.sum(-1, keepdim=True).clamp_min(1).to(dtype)
        w = torch.einsum("bhid,bhjd->bhij", q, k) * torch.exp(add)
        return (torch.where(allow, w, torch.zeros((), dtype=dtype)) / n) @ v
    phi = (lambda x: torch.where(x > 0, x + 1, torch.exp(x))) if fm == "elu" else (lambda x: x.clamp(min=0))
    w = torch.einsum("bhid,bhjd->bhij", phi(q), phi(k)) * torch.exp(add)
    w = torch.where(allow, w, torch.zeros((), dtype=dtype))
    return (w @ v) / (w.sum(-1, keepdim=True) + 1e-6)


def _check_kernel(fm, causal, nq, nk, mask_kind, dtype, B=2, H=2, D=5, Dv=3, scale=0.8):
    """The Triton backend on KERNEL_DEVICE against float64 math, FlashAttention's rule for out and every
    gradient. Leaves stay on the CPU; .to(device) is differentiable, so their gradients come back."""
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in _inputs(nq, nk, torch.float32, B, H, D, Dv))
    mask = _mask(mask_kind, B, nk)
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(dtype)
    dev = KERNEL_DEVICE
    out = AF.linear(q.to(dev), k.to(dev), v.to(dev), attn_mask=None if mask is None else mask.to(dev),
                    is_causal=causal, scale=scale, feature_map=fm, backend="triton").cpu()
    assert out.dtype == dtype and out.shape == (B, H, nq, Dv)
    allow, add = FM.allow_and_add(mask, causal, B, H, nq, nk)
    wide = [t.detach().double().requires_grad_() for t in (q, k, v)]
    same = [t.detach().float().requires_grad_() for t in (q, k, v)]
    want = FM.linear(*wide, allow, add, feature_map=fm, scale=scale)
    low = _linear_fp32(*same, allow, add, fm, scale)
    grad = torch.randn(want.shape, dtype=torch.float64).to(dtype)
    got_g = torch.autograd.grad(out, (q, k, v), grad)
    want_g = torch.autograd.grad(want, wide, grad.double())
    low_g = [g.to(dtype) for g in torch.autograd.grad(low, same, grad.float())]
    low = low.to(dtype)
    assert all(torch.isfinite(t).all() for t in (out,) + got_g)
    assert_flash_rule(f"linear {fm} causal={causal} {nq}x{nk} mask={mask_kind} D={D}", dtype, 1.0,
                      [("out", out, low, want)]
                      + [(f"d{n}", g, lo, w) for n, g, lo, w in zip("qkv", got_g, low_g, want_g)])


@needs_kernels
@pytest.mark.parametrize("dtype", TRITON_DTYPES, ids=str)
@pytest.mark.parametrize("fm,causal,nq,nk,mask", TRITON_CASES)
def test_triton_matches_formula(fm, causal, nq, nk, mask, dtype):
    _check_kernel(fm, causal, nq, nk, mask, dtype)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_triton_large_shapes_on_gpu(head_dim, dtype):
    # many 32-row chunks with a partial last one, Nq < Nk (the first 184 keys form the initial state);
    # at D = Dv = 128 the 129 columns of v and the normaliser run as slices of 128 and 1
    _check_kernel("elu", True, 333, 517, "bool", dtype, B=2, H=2, D=head_dim, Dv=head_dim,
                  scale=head_dim ** -0.5)


@needs_kernels
def test_triton_splits_wide_values_into_column_slices(monkeypatch):
    # with a 16 x 16 state budget the Dv + 1 = 41 columns (v and the normaliser's ones) run as slices
    # of 16, 16 and 9, each with its own state; q and k gradients are summed over the slices
    from attnzoo.ops.linear import triton as lin_triton
    monkeypatch.setattr(lin_triton, "STATE_ELEMENTS", 16 * 16)
    assert lin_triton.value_columns(5, 41) == 16
    _check_kernel("elu", True, 37, 30, "float", torch.float32, H=1, Dv=40)


def test_fp64_state_gets_the_same_bytes_as_fp32():
    # sized for sm_90's shared memory (benchmarks/results/gpu/ptx_build_check.md): an 8-byte state
    # gets half the elements of a 4-byte one, so wide fp64 values run in narrower column slices
    from attnzoo.ops.linear import triton as lin_triton
    assert lin_triton.value_columns(128, 129) == 128            # 128 x 128 fp32 = STATE_ELEMENTS * 4 bytes
    assert lin_triton.value_columns(128, 129, itemsize=8) == 64  # 128 x 64 fp64: the same bytes
    assert lin_triton.value_columns(64, 65, itemsize=8) == 65    # 64 x 128 (padded) fp64 fits whole


@pytest.mark.gpu
@needs_gpu
def test_triton_widest_head_dims_on_gpu():
    # D = 256, Dv + 1 = 256: the largest the backend takes, run as four 64-column slices of the state
    _check_kernel("relu", True, 70, 70, None, torch.float32, B=1, H=2, D=256, Dv=255, scale=1 / 16)


@pytest.mark.gpu
@needs_gpu
def test_auto_picks_triton_on_gpu():
    q = torch.randn(1, 2, 8, 16, device="cuda")
    assert AF.explain("linear", q, q, q, is_causal=True).backend.name == "triton"
    on_cpu = q.cpu()
    assert AF.explain("linear", on_cpu, on_cpu, on_cpu, is_causal=True).backend.name == "cpu"


BACKENDS = ["cpu"] + (["triton"] if INTERPRET or ON_GPU else [])


def _device(backend):
    return KERNEL_DEVICE if backend == "triton" else "cpu"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fm", ["elu", "identity"])
def test_rows_without_keys_are_zero_with_finite_grads(backend, fm):
    # causal with Nq > Nk: the first Nq - Nk queries see nothing; batch 1 has every key masked
    q, k, v = _inputs(9, 5, torch.float32)
    mask = torch.ones(2, 1, 1, 5, dtype=torch.bool)
    mask[1] = False
    dev = _device(backend)
    out = AF.linear(q.to(dev), k.to(dev), v.to(dev), attn_mask=mask.to(dev), is_causal=True, feature_map=fm,
                    backend=backend).cpu()
    assert torch.equal(out[:, :, :4], torch.zeros_like(out[:, :, :4]))
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype,mag", [(torch.float32, 30.0), (torch.bfloat16, 1.0), (torch.bfloat16, 30.0)])
def test_extreme_and_half_inputs_stay_finite(backend, dtype, mag):
    q, k, v = (t.detach().mul(mag).to(dtype).requires_grad_() for t in _inputs(40, 40, torch.float32))
    dev = _device(backend)
    out = AF.linear(q.to(dev), k.to(dev), v.to(dev), is_causal=True, backend=backend).cpu()
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert all(torch.isfinite(g).all() for g in torch.autograd.grad(out.float().sum(), (q, k, v)))
    if mag == 1.0:   # bf16 inputs, fp32 math inside: only the rounding of inputs/outputs remains
        ref = _expected(q, k, v, None, True, "elu", 1.0)
        torch.testing.assert_close(out.double(), ref, rtol=3e-2, atol=3e-2)




def test_cpu_causal_never_builds_prefix_sums_or_n_by_n():
    n, d = 512, 16
    q, k, v = (torch.randn(1, 1, n, d, requires_grad=True) for _ in range(3))
    with LargestOutput() as mode:
        out = AF.linear(q, k, v, is_causal=True, backend="cpu")
        out.sum().backward()
    # the reference's prefix sums hold n * d * (d + 1) numbers, the weights n * n; chunks hold n * 64
    assert mode.largest <= n * lin_cpu.DEFAULT_CHUNK < min(n * n, n * d * d) // 2


def test_dispatch_and_clear_refusals():
    q, k, v = _inputs(6, 6, torch.float32)
    assert AF.explain("linear", q, k, v, is_causal=True).backend.name == "cpu"
    general = torch.rand(6, 6) > 0.5
    with pytest.raises(ValueError, match="query-dependent attn_mask"):
        AF.linear(q, k, v, attn_mask=general, backend="cpu")
    with pytest.raises(ValueError, match="dropout"):
        AF.linear(q, k, v, dropout_p=0.1, backend="cpu")
    # auto falls back to the reference for a general mask, and still matches the formula
    out = AF.linear(q, k, v, attn_mask=general)
    allow, add = FM.allow_and_add(general, False, 2, 2, 6, 6)
    torch.testing.assert_close(out.double(), FM.linear(q.double(), k.double(), v.double(), allow, add),
                               rtol=1e-5, atol=1e-5)


def test_triton_refuses_what_it_cannot_hold():
    q = torch.randn(1, 1, 4, 300, device=KERNEL_DEVICE)
    expected = "registers" if INTERPRET or ON_GPU else "TRITON_INTERPRET"
    with pytest.raises(ValueError, match=expected):
        AF.linear(q, q, q, backend="triton")
