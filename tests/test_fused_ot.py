"""Fused OT attention (ops/ot/{cpu,triton}.py) against float64 math from paper 004 eq (22).

tests/formulas.py.ot loops over queries i and input templates j and applies eq (22) with
M = -a.b + C literally: out_i = sum_j u_ij softmax_t((alpha q_i.a_t + k_j.a_t) / gamma + mask_it) a_v_t
over the template set A = kept keys + extra templates, u uniform or softmax(log_u) over kept keys.
The fused paths never form the (Nq, Nk, |A|) tensor; every gradient (q, k, v, templates, log_u) is checked.
The Triton kernels run under TRITON_INTERPRET=1 (set by `make test`) on tiny shapes and CPU tensors; on
a machine with a CUDA GPU and no interpreter the same table runs compiled on the GPU in fp32, bf16 and
fp16 (FlashAttention's tolerance rule, tests/flash_rule.py), plus larger shapes that only a GPU runs,
checked against ``_eq22_dense`` (eq (22) on the whole (Nq, Nk, |A|) cube, itself checked against the
loops of tests/formulas.py).
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import attnzoo
import attnzoo.functional as AF
from attnzoo.models import OTViT
from attnzoo.ops import ot as ot_backends
from attnzoo.ops.ot import cpu as ot_cpu
from attnzoo.ops.ot import tiles as ot_tiles
from attnzoo.ops.ot import triton as ot_triton
from attnzoo.ops.ot.factorised import ot_terms

from . import formulas as FM
from tests.common import (INTERPRET, KERNEL_DEVICE, ON_GPU, TRITON_DTYPES, broadcast_shapes, float_mask,
                          needs_gpu, needs_kernels, needs_triton, padding_mask, qkv)
from tests.flash_rule import (assert_flash_rule, autocast_triples, flash_rule_failures, reference_or_rounded,
                              scale_grad)
from tests.memory_probe import LargestOutput

B, H, D, DV = 2, 2, 6, 3

# (is_causal, nq, nk, n_templates, mask kind, log_u)
CPU_CASES = [
    (False, 7, 7, 0, None, False), (False, 7, 7, 3, None, True), (True, 7, 7, 0, None, False),
    (True, 5, 9, 4, None, True), (True, 9, 5, 2, "key_bool", False), (False, 6, 8, 0, "key_float", True),
    (False, 8, 6, 3, "query_bool", True), (True, 7, 7, 3, "query_float", False), (False, 5, 7, 2, "padding", True),
]
TRITON_CASES = [
    (False, 7, 9, 3, None, True), (True, 9, 5, 2, "key_bool", False), (False, 6, 6, 2, "query_float", True),
    (True, 9, 7, 0, "padding", True),
]


@needs_kernels
def test_triton_tiles_crossing_every_block_boundary():
    # the interpreter's tiles are 16 wide: 17 queries, 18 sources and 18 + 15 = 33 templates give a
    # partial last tile on every axis of every kernel (pair tiles, template steps, fallback sub-tiles)
    _check_kernel(True, 17, 18, 15, "padding", True, torch.float32, D=5, DV=3)


def _mask(kind, nq, nk, B=B, H=H):
    # the bool kinds are drawn as rand > p (common.bool_mask draws rand < keep): the GPU runs of these
    # cases in bf16 / fp16 are checked on exactly these masks
    if kind == "key_bool":
        m = torch.rand(B, 1, 1, nk) > 0.3
        m[..., 0] = True
        return m
    if kind == "key_float":
        return float_mask((nk,), 0.3, scale=0.5, dtype=torch.float64)
    if kind == "query_bool":
        return torch.rand(B, H, nq, nk) > 0.4
    if kind == "query_float":
        return float_mask((nq, nk), 0.3, scale=0.5, dtype=torch.float64)
    if kind == "padding":   # batch 1's last two keys are padding
        return padding_mask([nk, nk - 2] + [nk] * (B - 2), nk)
    return None


def _inputs(nq, nk, n_templates, with_log_u, dtype, mag=1.0, B=B, H=H, D=D, DV=DV):
    def t(*shape, mag=1.0):
        return (mag * torch.randn(*shape, dtype=dtype)).requires_grad_()
    q, k, v = qkv(B, H, nq, nk, D, DV, dtype=dtype)
    q, k, v = (mag * q).requires_grad_(), (mag * k).requires_grad_(), v.requires_grad_()
    tk, tv = (t(B, H, n_templates, D, mag=mag), t(B, H, n_templates, DV)) if n_templates else (None, None)
    log_u = t(B, H, nk) if with_log_u else None
    return q, k, v, tk, tv, log_u


def _expected(q, k, v, tk, tv, log_u, mask, causal, scale, alpha):
    allow, add = FM.allow_and_add(mask, causal, B, H, q.shape[2], k.shape[2])
    d = (lambda x: None if x is None else x.double())
    return FM.ot(q.double(), k.double(), v.double(), allow, add, scale, alpha=alpha, log_u=d(log_u),
                 tk=d(tk), tv=d(tv))


def _check(backend, causal, nq, nk, n_templates, mask_kind, with_log_u, dtype, tol, mag=1.0):
    q, k, v, tk, tv, log_u = _inputs(nq, nk, n_templates, with_log_u, dtype, mag)
    mask = _mask(mask_kind, nq, nk)
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(dtype)
    scale, alpha = 0.7, 1.3
    out = AF.ot(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, alpha=alpha, log_u=log_u,
                templates_k=tk, templates_v=tv, backend=backend)
    ref = _expected(q, k, v, tk, tv, log_u, mask, causal, scale, alpha)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    names = [n for n, x in zip(("q", "k", "v", "templates_k", "templates_v", "log_u"), (q, k, v, tk, tv, log_u))
             if x is not None]
    inputs = [x for x in (q, k, v, tk, tv, log_u) if x is not None]
    grad = torch.randn_like(ref)
    got = torch.autograd.grad(out, inputs, grad.to(dtype))
    want = torch.autograd.grad(ref, inputs, grad)
    for name, g, w in zip(names, got, want):
        torch.testing.assert_close(g.double(), w.double(), rtol=tol, atol=tol, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("causal,nq,nk,n_templates,mask,log_u", CPU_CASES)
def test_cpu_matches_eq22(causal, nq, nk, n_templates, mask, log_u):
    _check("cpu", causal, nq, nk, n_templates, mask, log_u, torch.float64, 1e-9)


def _all_pairs_to_tiles(monkeypatch, tile_elements):
    """Send every (i, j) pair of the CPU path to its exact blockwise fallback (tiles.py)."""
    monkeypatch.setattr(ot_cpu, "SAFE_NORMALISER", {torch.float32: math.inf, torch.float64: math.inf})
    monkeypatch.setattr(ot_tiles, "TILE_ELEMENTS", tile_elements)


def test_cpu_large_logits_mix_matmul_and_exact_pairs():
    # logits of a few hundred: the matmul path cannot resolve some (i, j) pairs in floating point
    # and hands them to the exact tiles; together they must still be eq (22) to float64 accuracy
    torch.manual_seed(0)
    q, k, _, tk, _, _ = _inputs(7, 7, 3, False, torch.float64, mag=15.0)
    c, g, _ = ot_terms(q, k, attn_mask=None, is_causal=False, alpha=1.3, gamma=1 / 0.7, log_u=None, templates_k=tk)
    share = ot_cpu._parts(c, g)[3].double().mean().item()
    assert 0.05 < share < 0.95, share
    torch.manual_seed(0)
    _check("cpu", False, 7, 7, 3, None, False, torch.float64, 1e-9, mag=15.0)


@pytest.mark.parametrize("tile_elements", [1, 40, 10**6])
@pytest.mark.parametrize("causal,nq,nk,n_templates,mask,log_u", [CPU_CASES[4], CPU_CASES[6]])
def test_cpu_blockwise_fallback_matches_eq22(monkeypatch, tile_elements, causal, nq, nk, n_templates, mask, log_u):
    # tile_elements=1: one (i, j) pair per tile, every block boundary of the loops is crossed
    _all_pairs_to_tiles(monkeypatch, tile_elements)
    _check("cpu", causal, nq, nk, n_templates, mask, log_u, torch.float64, 1e-9)


def _softmax_where(x, allow):
    """softmax over the last dim restricted to ``allow``; all zeros where nothing is allowed (no NaN,
    forward or backward: masked entries are replaced, not subtracted as infinities)."""
    x = torch.where(allow, x, torch.full_like(x, torch.finfo(x.dtype).min))
    e = torch.where(allow, torch.exp(x - x.amax(-1, keepdim=True).detach()), torch.zeros_like(x))
    z = e.sum(-1, keepdim=True)
    return e / torch.where(z > 0, z, torch.ones_like(z))


def _eq22_dense(q, k, v, tk, tv, log_u, allow, add, scale, alpha):
    """Eq (22) with M = -a.b + C on the whole (B, H, Nq, Nk, |A|) cube, in the inputs' dtype: for query
    i, source j and template t of A = kept keys + extras, logit (alpha q_i.a_t + k_j.a_t) / gamma + mask_it,
    softmax over t, weighted by u_ij = softmax_j(log_u) over kept keys, summed over j."""
    dtype, gamma, nk = q.dtype, 1.0 / scale, k.shape[2]
    a_k = k if tk is None else torch.cat([k, tk], 2)
    a_v = v if tv is None else torch.cat([v, tv], 2)
    n_extra = a_k.shape[2] - nk
    t_allow = torch.cat([allow, allow.new_ones(allow.shape[:-1] + (n_extra,))], -1)         # (B,H,Nq,A)
    t_add = torch.nn.functional.pad(add.to(dtype), (0, n_extra))
    logits = ((alpha * q @ a_k.transpose(-1, -2)).unsqueeze(3) + (k @ a_k.transpose(-1, -2)).unsqueeze(2)) / gamma
    s = _softmax_where(logits + t_add.unsqueeze(3), t_allow.unsqueeze(3).expand(logits.shape))
    lu = torch.zeros(allow.shape, dtype=dtype) if log_u is None else log_u.unsqueeze(2).expand(allow.shape)
    u = _softmax_where(lu, allow)                                                          # (B,H,Nq,Nk)
    return (u.unsqueeze(-1) * s).sum(3) @ a_v


@torch.no_grad()
def _logit_size(q, k, tk, scale, alpha):
    """About the largest |logit|, the flash rule's logit_size."""
    a_k = k if tk is None else torch.cat([k, tk], 2)
    return float(scale * ((alpha * q @ a_k.transpose(-1, -2)).abs().max() + (k @ a_k.transpose(-1, -2)).abs().max()))


def _check_kernel(causal, nq, nk, n_templates, mask_kind, with_log_u, dtype, B=B, H=H, D=D, DV=DV, scale=0.7,
                  alpha=1.3, dense=False, mag=1.0):
    """The Triton backend on KERNEL_DEVICE against float64 eq (22), FlashAttention's rule for out and every
    gradient; the yardstick is eq (22) on the cube in float32 with the kernel's rounded inputs. Leaves
    stay on the CPU; .to(device) is differentiable, so their gradients come back. ``dense``: the float64
    truth from _eq22_dense instead of the (slow) loops of tests/formulas.py."""
    leaves = [None if x is None else x.detach().to(dtype).requires_grad_()
              for x in _inputs(nq, nk, n_templates, with_log_u, torch.float32, mag, B=B, H=H, D=D, DV=DV)]
    mask = _mask(mask_kind, nq, nk, B, H)
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(dtype)
    q, k, v, tk, tv, log_u = leaves
    dev = KERNEL_DEVICE

    def on(x):
        return None if x is None else x.to(dev)
    out = AF.ot(on(q), on(k), on(v), attn_mask=on(mask), is_causal=causal, scale=scale, alpha=alpha,
                log_u=on(log_u), templates_k=on(tk), templates_v=on(tv), backend="triton").cpu()
    assert out.dtype == dtype and out.shape == (B, H, nq, DV)
    allow, add = FM.allow_and_add(mask, causal, B, H, nq, nk)
    names = [n for n, x in zip(("q", "k", "v", "templates_k", "templates_v", "log_u"), leaves) if x is not None]
    used = [x for x in leaves if x is not None]
    wide = [None if x is None else x.detach().double().requires_grad_() for x in leaves]
    same = [None if x is None else x.detach().float().requires_grad_() for x in leaves]
    if dense:
        want = _eq22_dense(*wide, allow, add, scale, alpha)
    else:
        wq, wk, wv, wtk, wtv, wlu = wide
        want = FM.ot(wq, wk, wv, allow, add, scale, alpha=alpha, log_u=wlu, tk=wtk, tv=wtv)
    low = _eq22_dense(*same, allow, add, scale, alpha)
    grad = torch.randn(want.shape, dtype=torch.float64).to(dtype)
    got_g = torch.autograd.grad(out, used, grad)
    want_g = torch.autograd.grad(want, [x for x in wide if x is not None], grad.double())
    low_g = [g.to(dtype) for g in torch.autograd.grad(low, [x for x in same if x is not None], grad.float())]
    assert all(torch.isfinite(t).all() for t in (out,) + got_g)
    assert_flash_rule(f"ot causal={causal} {nq}x{nk}+{n_templates} mask={mask_kind} D={D}", dtype,
                      _logit_size(*wide[:2], wide[3], scale, alpha),
                      [("out", out, low.to(dtype), want)]
                      + [(f"d{n}", g, lo, w) for n, g, lo, w in zip(names, got_g, low_g, want_g)])


@needs_kernels
@pytest.mark.parametrize("dtype", TRITON_DTYPES, ids=str)
@pytest.mark.parametrize("causal,nq,nk,n_templates,mask,log_u", TRITON_CASES)
def test_triton_matches_eq22(causal, nq, nk, n_templates, mask, log_u, dtype):
    _check_kernel(causal, nq, nk, n_templates, mask, log_u, dtype)


@needs_kernels
def test_triton_chunks_over_batch_heads(monkeypatch):
    # one (batch, head) pair per chunk: every chunk finds its own slice of a per-(batch, head) mask
    # (the kernels rebuild (b, h) from the chunk offset) and its own rows of log u
    monkeypatch.setattr(ot_triton, "CHUNK_BYTES", 1)
    _check_kernel(False, 7, 6, 3, "query_bool", True, torch.float32, B=3, H=2)


@needs_kernels
@pytest.mark.parametrize("causal,nq,nk,n_templates,mask,log_u", TRITON_CASES)
def test_triton_exact_fallback_matches_eq22(monkeypatch, causal, nq, nk, n_templates, mask, log_u):
    # every pair with u > 0 counts as unresolved: the matmul path contributes nothing and the per-pair
    # fallback kernels must produce out and every gradient (log u's through UG) on their own
    monkeypatch.setattr(ot_triton, "SAFE_NORMALISER", math.inf)
    _check_kernel(causal, nq, nk, n_templates, mask, log_u, dtype=torch.float32)


@needs_kernels
def test_triton_large_logits_mix_matmul_and_fallback():
    # logits of a few hundred: about a quarter of the pairs fall below the kernels' SAFE_NORMALISER (the
    # same float32 rule as the CPU path's _parts) and go to the fallback, the rest stay matmuls
    torch.manual_seed(0)
    q, k, _, tk, _, _ = _inputs(7, 9, 3, False, torch.float32, mag=4.0)
    c, g, _ = ot_terms(q, k, attn_mask=None, is_causal=False, alpha=1.3, gamma=1 / 0.7, log_u=None, templates_k=tk)
    assert ot_cpu.SAFE_NORMALISER[torch.float32] == ot_triton.SAFE_NORMALISER
    share = ot_cpu._parts(c, g)[3].double().mean().item()
    assert 0.1 < share < 0.9, share
    torch.manual_seed(0)
    _check_kernel(False, 7, 9, 3, None, False, torch.float32, mag=4.0)


def test_dense_yardstick_is_eq22():
    """_eq22_dense (the large-shape truth and the flash-rule yardstick) agrees with the loops."""
    torch.manual_seed(3)
    q, k, v, tk, tv, log_u = _inputs(9, 5, 2, True, torch.float64)
    mask = _mask("query_float", 9, 5)
    allow, add = FM.allow_and_add(mask, True, B, H, 9, 5)
    got = _eq22_dense(q, k, v, tk, tv, log_u, allow, add, 0.7, 1.3)
    want = FM.ot(q, k, v, allow, add, 0.7, alpha=1.3, log_u=log_u, tk=tk, tv=tv)
    assert (want.abs().amax(-1) == 0).any()          # causal with Nq > Nk: some rows see no key
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_triton_large_shapes_on_gpu(head_dim, dtype):
    # 133 queries, 197 sources, |A| = 197 + 59 = 256 templates: many 16-wide tiles on every axis with a
    # partial last one, causal (bottom-right) with key padding and log u, the default gamma = sqrt(D)
    _check_kernel(True, 133, 197, 59, "padding", True, dtype, B=2, H=2, D=head_dim, DV=head_dim,
                  scale=head_dim ** -0.5, alpha=1.0, dense=True)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_exact_fallback_on_gpu(monkeypatch, dtype):
    # every pair through the per-pair fallback kernels (atomics into out, d a_v, dq, dk, d a_k), with
    # a float mask, causal, log u, several pair tiles and D = 64
    monkeypatch.setattr(ot_triton, "SAFE_NORMALISER", math.inf)
    _check_kernel(True, 70, 150, 30, "query_float", True, dtype, B=2, H=2, D=64, DV=64, scale=0.125, alpha=1.0,
                  dense=True)


@pytest.mark.gpu
@needs_gpu
def test_triton_chunks_on_gpu(monkeypatch):
    # several (batch, head) chunks on the GPU with a per-(batch, head) mask
    monkeypatch.setattr(ot_triton, "CHUNK_BYTES", 1 << 18)
    _check_kernel(False, 64, 96, 32, "query_bool", True, torch.bfloat16, B=3, H=4, D=64, DV=64, scale=0.125,
                  alpha=1.0, dense=True)


@pytest.mark.gpu
@needs_gpu
def test_peak_memory_follows_the_chunk_budget_on_gpu(monkeypatch):
    """Forward + backward at B=2, H=8, N=512, |A|=1024, bf16: the temporaries are made for CHUNK_BYTES
    worth of (batch, head) pairs at a time, so the extra peak stays near that budget (plus the
    gradients and fp32 buffers of size O(N D)), far below the ~130 MB the whole batch would take."""
    budget = 8 << 20
    monkeypatch.setattr(ot_triton, "CHUNK_BYTES", budget)
    B_, H_, N, D_ = 2, 8, 512, 64
    q, k, v, tk, tv = (torch.randn(B_, H_, N, D_, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                       for _ in range(5))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = AF.ot(q, k, v, templates_k=tk, templates_v=tv, backend="triton")
    out.float().sum().backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    small = B_ * H_ * N * D_ * 4            # one fp32 (B, H, N, D) tensor: grads, fp32 buffers, outputs
    whole = B_ * H_ * ot_triton.pair_bytes(N, N, 2 * N, D_, D_, torch.bfloat16, True)   # ~130 MB
    assert extra <= 2 * budget + 16 * small, (extra, budget, small)
    assert extra < whole / 2, (extra, whole)


def _tiny_timm_vit(device):
    import timm
    torch.manual_seed(0)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2,
                             num_classes=10, attn_layer=attnzoo.layer("ot")).to(device)


@pytest.mark.gpu
@needs_gpu
def test_timm_vit_with_ot_trains_under_bf16_autocast_on_gpu():
    """One training step of a small timm ViT whose attention is attnzoo.layer("ot") (auto = triton on
    CUDA), under bf16 autocast as people train: finite loss, parameter gradients within bf16 accuracy
    of the float32 step, and a step of SGD lowers the loss on the batch."""
    model = _tiny_timm_vit("cuda")
    x, y = torch.randn(8, 3, 32, 32, device="cuda"), torch.randint(0, 10, (8,), device="cuda")
    params = list(model.parameters())
    # the logits and every parameter gradient: FlashAttention's rule against the float64 model, with the
    # model on the reference backend under the same autocast as the bar
    triples = autocast_triples(model, (x,), device="cuda",
                               loss=lambda out: torch.nn.functional.cross_entropy(out.double(), y))
    assert_flash_rule("timm ViT with OT under bf16 autocast", torch.bfloat16, 1.0, triples)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = torch.nn.functional.cross_entropy(model(x), y)
    got = torch.autograd.grad(loss, params)
    assert torch.isfinite(loss)
    with torch.no_grad():
        for p, g in zip(params, got):
            p -= 0.05 * g
        with torch.autocast("cuda", dtype=torch.bfloat16):
            after = torch.nn.functional.cross_entropy(model(x), y)
    assert float(after) < float(loss.detach())


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("autocast", [False, True])
def test_layer_and_timm_vit_compile_fullgraph_on_gpu(autocast):
    """torch.compile(fullgraph=True) with inductor on CUDA: the OT layer (with templates) and the small
    timm ViT trace as one graph each (the Triton launches are triton_ops) and equal eager forward and
    backward; under bf16 autocast too."""
    layer = _ot_layer(None, dim=64, heads=2, device="cuda")
    x, t = torch.randn(2, 40, 64, device="cuda"), torch.randn(2, 12, 64, device="cuda")
    model = _tiny_timm_vit("cuda")
    img = torch.randn(4, 3, 32, 32, device="cuda")
    for module, inputs, kwargs in ((layer, (x,), dict(templates=t)), (model, (img,), {})):
        if autocast:  # the compiled module by FlashAttention's rule against the float64 module
            torch._dynamo.reset()
            compiled = torch.compile(module, fullgraph=True, backend="inductor")
            assert_flash_rule("compiled under bf16 autocast", torch.bfloat16, 1.0,
                              autocast_triples(module, inputs, kwargs, device="cuda", tested=compiled))
        else:
            _compiled_equals_eager(lambda_module(module, **kwargs), *inputs, tol=1e-4, backend="inductor")


@pytest.mark.gpu
@needs_gpu
def test_auto_picks_triton_on_gpu():
    q = torch.randn(1, 2, 8, 16, device="cuda")
    assert AF.explain("ot", q, q, q).backend.name == "triton"


BACKENDS = ["cpu"] + (["triton"] if INTERPRET or ON_GPU else [])


def _on(backend, *xs):
    dev = KERNEL_DEVICE if backend == "triton" else "cpu"
    return [None if x is None else x.to(dev) for x in xs]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n_templates", [0, 2])
def test_rows_without_keys_are_zero_with_finite_grads(backend, n_templates):
    q, k, v, tk, tv, log_u = _inputs(5, 4, n_templates, True, torch.float32)
    mask = torch.ones(B, H, 5, 4, dtype=torch.bool)
    mask[:, :, 2] = False      # query 2 has no input template left: u is empty, out is 0
    dq, dk, dv, dmask, dlog_u, dtk, dtv = _on(backend, q, k, v, mask, log_u, tk, tv)
    out = AF.ot(dq, dk, dv, attn_mask=dmask, log_u=dlog_u, templates_k=dtk, templates_v=dtv, backend=backend).cpu()
    assert torch.equal(out[:, :, 2], torch.zeros_like(out[:, :, 2]))
    inputs = [x for x in (q, k, v, tk, tv, log_u) if x is not None]
    assert all(torch.isfinite(g).all() for g in torch.autograd.grad(out.sum(), inputs))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype,mag", [(torch.float32, 1e3), (torch.bfloat16, 1.0), (torch.bfloat16, 1e2)])
def test_extreme_and_half_inputs_stay_finite(backend, dtype, mag):
    q, k, v, tk, tv, _ = _inputs(6, 5, 2, False, torch.float32)
    q, k, v, tk, tv = (x.detach().mul(mag).to(dtype).requires_grad_() for x in (q, k, v, tk, tv))
    dq, dk, dv, dtk, dtv = _on(backend, q, k, v, tk, tv)
    out = AF.ot(dq, dk, dv, is_causal=True, templates_k=dtk, templates_v=dtv, backend=backend).cpu()
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert all(torch.isfinite(g).all() for g in torch.autograd.grad(out.float().sum(), (q, k, v, tk, tv)))
    if mag == 1.0:   # bf16 inputs, fp32 math inside: FlashAttention's rule for out and every gradient
        assert_flash_rule(f"ot {backend} bf16", dtype, 1.0, _half_triples(backend, q, k, v, tk, tv))


def _half_triples(backend, q, k, v, tk, tv, perturb=None):
    """(name, ``backend`` on the half inputs, the reference backend on them (or the float64 result stored
    in their dtype where ``backend`` gave exactly the reference's bits), eq (22) in float64 on them) for
    out and the gradients of q, k, v and the templates; causal, default scale and alpha."""
    dtype = q.dtype
    cot = torch.randn(q.shape[:-1] + v.shape[-1:], generator=torch.Generator().manual_seed(5), dtype=torch.float64)

    def run(call, to, device, tested=False):
        leaves = [x.detach().to(device, to).requires_grad_() for x in (q, k, v, tk, tv)]
        out = call(*(perturb(*leaves) if tested and perturb else leaves))
        grads = torch.autograd.grad((out.double() * cot.to(device)).sum(), leaves)
        return [out.cpu()] + [g.cpu() for g in grads]

    def ot(backend):
        return lambda q, k, v, tk, tv: AF.ot(q, k, v, is_causal=True, templates_k=tk, templates_v=tv, backend=backend)
    want = run(lambda q, k, v, tk, tv: _expected(q, k, v, tk, tv, None, None, True, 1 / math.sqrt(D), 1.0),
               torch.float64, "cpu")
    dev = _on(backend, q)[0].device
    got = run(ot(backend), dtype, dev, tested=True)
    low = run(ot("reference"), dtype, dev)
    names = ("out", "dq", "dk", "dv", "dtemplates_k", "dtemplates_v")
    return list(zip(names, got, reference_or_rounded(got, low, want, dtype), want))


@pytest.mark.parametrize("backend", BACKENDS)
def test_half_check_sees_a_scaled_gradient(backend):
    q, k, v, tk, tv, _ = (None if x is None else x.detach().bfloat16() for x in _inputs(6, 5, 2, False, torch.float32))
    triples = _half_triples(backend, q, k, v, tk, tv, perturb=lambda q, k, v, tk, tv: (q, k, v, scale_grad(tk, 0.95), tv))
    assert any("dtemplates_k error" in f for f in flash_rule_failures("ot", torch.bfloat16, 1.0, triples))




@pytest.mark.parametrize("causal,tiles", [(False, False), (True, False), (True, True)])
def test_cpu_never_allocates_the_cube(monkeypatch, causal, tiles):
    if tiles:
        _all_pairs_to_tiles(monkeypatch, 1024)
    nq, nk, m = 16, 12, 20
    q, k, v, tk, tv, log_u = _inputs(nq, nk, m, True, torch.float32)
    mask = torch.ones(B, 1, 1, nk, dtype=torch.bool)
    with LargestOutput() as mode:
        out = AF.ot(q, k, v, attn_mask=mask, is_causal=causal, log_u=log_u, templates_k=tk, templates_v=tv,
                    backend="cpu")
        out.sum().backward()
    na = nk + m
    # the query term C (Nq x |A|) and the Gram term G (Nk x |A|) are the largest (u and the pair
    # normalisers are Nq x Nk <= Nq x |A|); the reference's (B, H, Nq, Nk, |A|) cube is 16x bigger here
    assert mode.largest <= B * H * max(nq, nk) * na < B * H * nq * nk * na // 8


def test_named_cpu_backend_refuses_dropout():
    q, k, v, *_ = _inputs(4, 4, 0, False, torch.float32)
    with pytest.raises(ValueError, match="dropout"):
        AF.ot(q, k, v, dropout_p=0.1, backend="cpu")
    assert AF.explain("ot", q, k, v, dropout_p=0.1).backend.name == "reference"


CROSSOVER = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "cpu" / "ot_dispatch_crossover.json"


def test_dispatch_thresholds_are_the_measured_ones():
    summary = json.loads(CROSSOVER.read_text())["summary"]
    assert ot_backends.OT_CPU_MIN_CUBE == summary["cube_threshold"]
    assert ot_backends.OT_CPU_MIN_CUBE_SINGLE_QUERY == summary["cube_threshold_single_query"]


# (B*H, Nq, Nk, extra templates, backend auto picks on CPU): both sides of both thresholds, with
# the cube B*H*Nq*Nk*|A| counted over the templates too; OT-ViT's class-token layer is Nq = 1
AUTO_CASES = [
    (4, 4, 4, 0, "reference"), (4, 3, 64, 0, "reference"), (4, 4, 64, 0, "cpu"), (1, 64, 64, 64, "cpu"),
    (4, 1, 50, 50, "reference"),               # one query, cube 20000
    (256, 1, 50, 50, "cpu"),                   # OT-ViT's reduced CPU run with partner templates, 1.28M
    (4, 1, 256, 0, "reference"),               # 262144 < the single-query threshold ...
    (4, 2, 256, 0, "cpu"),                     # ... and twice that for two queries is above the other one
]


def _expected_auto(bh, nq, nk, n_templates):
    cube = bh * nq * nk * (nk + n_templates)
    limit = (ot_backends.OT_CPU_MIN_CUBE_SINGLE_QUERY if nq == 1 else ot_backends.OT_CPU_MIN_CUBE)
    return "reference" if cube < limit else "cpu"


@pytest.mark.parametrize("bh,nq,nk,n_templates,want", AUTO_CASES)
def test_auto_on_cpu_follows_the_crossover_and_says_why(bh, nq, nk, n_templates, want):
    assert _expected_auto(bh, nq, nk, n_templates) == want      # the table is on the side it claims
    q, k = torch.zeros(bh, 1, nq, 8), torch.zeros(bh, 1, nk, 8)
    tk = torch.zeros(bh, 1, n_templates, 8) if n_templates else None
    choice = AF.explain("ot", q, k, k, templates_k=tk, templates_v=tk)
    assert choice.backend.name == want, str(choice)
    text = str(choice)
    if want == "reference":
        assert f"B*H*Nq*Nk*|A| = {bh * nq * nk * (nk + n_templates)} <" in text and "measured faster" in text
    else:
        assert "measured faster than the reference" in text
    assert AF.explain("ot", q, k, k, templates_k=tk, templates_v=tk, backend="cpu").backend.name == "cpu"



def _otvit_logits_and_grads(ot_backend, batch, embed_dim, num_heads):
    """An OT-ViT (two layers is enough: the OT layer's shapes depend on batch, heads and tokens only)
    on Fashion-MNIST-sized inputs with partner templates, as in training."""
    torch.manual_seed(0)
    model = OTViT(img_size=28, patch_size=4, in_chans=1, num_classes=10, embed_dim=embed_dim, depth=2,
                  num_heads=num_heads, dropout=0.0, ot_backend=ot_backend)
    x, partners = torch.randn(batch, 1, 28, 28), torch.randn(batch, 1, 28, 28)
    logits = model(x, templates=partners)
    return logits, torch.autograd.grad(logits.square().sum(), list(model.parameters()))


@pytest.mark.parametrize("batch,embed_dim,num_heads,auto", [
    (2, 16, 2, "reference"),     # a tiny model: auto picks the reference, bit for bit the same
    (64, 64, 4, "cpu"),          # the recorded CPU run's shapes (docs/results/fashion_mnist): auto picks cpu
])
def test_otvit_needs_no_backend_override(one_thread, batch, embed_dim, num_heads, auto):
    """OT-ViT needs no ``--set model.ot_backend=reference``: auto follows the measured crossover for the
    class-token layer (the reference for a tiny model, the fused path at the recorded CPU run's size), so
    the default (ot_backend=None) gives the override's outputs and gradients."""
    tokens, hd = (28 // 4) ** 2 + 1, embed_dim // num_heads
    q, k = torch.zeros(batch, num_heads, 1, hd), torch.zeros(batch, num_heads, tokens, hd)
    assert AF.explain("ot", q, k, k, templates_k=k, templates_v=k).backend.name == auto
    got, got_g = _otvit_logits_and_grads(None, batch, embed_dim, num_heads)
    want, want_g = _otvit_logits_and_grads("reference", batch, embed_dim, num_heads)
    if auto == "reference":
        assert torch.equal(got, want) and all(torch.equal(a, b) for a, b in zip(got_g, want_g))
    else:   # the fused path: the same eq (22), summed in another order
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for a, b in zip(got_g, want_g):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


# --- every broadcastable mask shape, with extra templates (an (Nq, 1) mask included) ----------------

MASK_SHAPES = list(broadcast_shapes(B, H, 1, 1))  # Nk, "Nq,1", ...: common.broadcast_shapes(B, H, nq, nk)[name]


def _broadcast_mask(shape, kind, dtype):
    # drawn as rand > p, like _mask's bool kinds: the GPU run checked these masks
    gen = torch.Generator().manual_seed(sum(shape))
    keep = torch.rand(shape, generator=gen) > 0.35
    if kind == "bool":
        return keep
    return float_mask(shape, scale=0.5, generator=gen, dtype=torch.float64).masked_fill(~keep, -math.inf).to(dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("shape", list(MASK_SHAPES))
def test_every_broadcastable_mask_shape_with_templates(backend, kind, shape):
    """Against the reference (float64 eq (22) on the whole cube): out and every gradient. The fused paths
    broadcast the mask over the keys and pad it over the extra templates, which are never masked."""
    nq, nk, n_templates = 6, 5, 3
    dtype, tol = (torch.float64, 1e-9) if backend == "cpu" else (torch.float32, 2e-5)
    torch.manual_seed(7)
    leaves = _inputs(nq, nk, n_templates, True, dtype)
    mask = _broadcast_mask(broadcast_shapes(B, H, nq, nk)[shape], kind, dtype)
    wide = [x.detach().double().requires_grad_() for x in leaves]
    want = AF.ot(*wide[:3], attn_mask=mask if kind == "bool" else mask.double(), scale=0.7, alpha=1.3,
                 log_u=wide[5], templates_k=wide[3], templates_v=wide[4], backend="reference")
    dq, dk, dv, dmask, dlog_u, dtk, dtv = _on(backend, *leaves[:3], mask, leaves[5], *leaves[3:5])
    got = AF.ot(dq, dk, dv, attn_mask=dmask, scale=0.7, alpha=1.3, log_u=dlog_u, templates_k=dtk, templates_v=dtv,
                backend=backend).cpu()
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    grad = torch.randn(want.shape, dtype=torch.float64)
    got_g = torch.autograd.grad(got, leaves, grad.to(dtype))
    want_g = torch.autograd.grad(want, wide, grad)
    for name, a, b in zip(("q", "k", "v", "templates_k", "templates_v", "log_u"), got_g, want_g):
        torch.testing.assert_close(a.double(), b, rtol=tol, atol=tol, msg=lambda m, n=name: f"d{n}: {m}")


# --- autocast, torch.compile ------------------------------------------------------------------------

LAYER_BACKENDS = [None, "cpu"] + (["triton"] if INTERPRET or ON_GPU else [])


def _ot_layer(backend, dim=16, heads=2, device="cpu"):
    torch.manual_seed(0)
    return attnzoo.create("ot", dim, num_heads=heads, backend=backend).to(device)


@pytest.mark.parametrize("backend", LAYER_BACKENDS)
def test_layer_under_bf16_autocast_matches_float32(backend):
    """Under CPU autocast the layer's projections hand bfloat16 q, k, v (and templates) to the kernels
    (the Triton ones interpreted here); out and the parameter gradients meet FlashAttention's rule
    against the float64 layer: at most ~2x the error of the eager reference under the same autocast."""
    dev = KERNEL_DEVICE if backend == "triton" else "cpu"
    layer = _ot_layer(backend, device=dev)
    x, t = torch.randn(2, 9, 16, device=dev), torch.randn(2, 4, 16, device=dev)
    triples = autocast_triples(layer, (x,), dict(templates=t), device=dev)
    assert triples[0][1].dtype == torch.bfloat16
    assert_flash_rule(f"ot layer {backend}", torch.bfloat16, 1.0, triples)


def _compiled_equals_eager(module, *inputs, tol=1e-5, backend="aot_eager"):
    torch._dynamo.reset()
    compiled = torch.compile(module, fullgraph=True, backend=backend)
    params = [p for p in module.parameters()]
    want = module(*inputs)
    want_g = torch.autograd.grad(want.square().sum(), params)
    got = compiled(*inputs)
    got_g = torch.autograd.grad(got.square().sum(), params)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    for (name, _), a, b in zip(module.named_parameters(), got_g, want_g):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=lambda m, n=name: f"grad {n}: {m}")


# (backend, tokens, what auto picks on CPU): the two sides of the measured crossover, and the kernels
COMPILE_CASES = [(None, 6, "reference"), (None, 26, "cpu"), ("cpu", 6, "cpu")] + (
    [("triton", 6, "triton")] if INTERPRET else [])


@pytest.mark.parametrize("backend,tokens,runs", COMPILE_CASES)
def test_layer_compiles_fullgraph_and_equals_eager(one_thread, backend, tokens, runs):
    """torch.compile(fullgraph=True) traces the OT layer as one graph (with extra templates; the
    cpu path's resolution check and the Triton launches sit inside opaque custom ops), forward and
    backward equal to eager. aot_eager: dynamo and AOTAutograd without inductor's slow C++ codegen."""
    layer = _ot_layer(backend)
    x, t = torch.randn(2, tokens, 16), torch.randn(2, 3, 16)
    q = torch.zeros(2, 2, tokens, 8)
    tk = torch.zeros(2, 2, 3, 8)
    assert AF.explain("ot", q, q, q, templates_k=tk, templates_v=tk, backend=backend).backend.name == runs
    _compiled_equals_eager(lambda_module(layer, templates=t), x)


def test_timm_block_with_ot_compiles_fullgraph(one_thread):
    from timm.models.vision_transformer import Block
    torch.manual_seed(0)
    block = Block(dim=16, num_heads=2, attn_layer=attnzoo.layer("ot"))
    _compiled_equals_eager(block, torch.randn(2, 26, 16))


class lambda_module(torch.nn.Module):  # noqa: N801 - a module that calls ``inner`` with fixed keywords
    def __init__(self, inner, **kwargs):
        super().__init__()
        self.inner, self.kwargs = inner, kwargs

    def forward(self, *args):
        return self.inner(*args, **self.kwargs)


# --- the sm_90 build of the kernels as bf16 autocast hands them over -----------------------------

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@needs_triton
def test_kernels_build_for_sm90_under_bf16_autocast():
    """The captured OT launches of an unmasked forward + backward under CPU bf16 autocast (what CUDA
    autocast hands the kernels) compile for sm_90 without a GPU: the kernels build their accumulators
    in float32 whatever dtype reaches them (a bf16 accumulator re-assigned an fp32 value is a Triton
    CompilationError; that is how the previous OT kernels failed under autocast on an H100)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "benchmarks/compile_triton_kernels.py", "--families", "ot", "--dtypes",
                           "bf16", "--autocast", "on", "--match", "D=64 mask=none", "--workers", "1"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "kernel specialisations compiled and fit" in done.stdout
