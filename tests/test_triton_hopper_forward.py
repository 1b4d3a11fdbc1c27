"""The Hopper variants of the softmax-family forward and dQ kernels (kernels/flash_softmax/
hopper_kernels.py) against float64 math, and the host rules that decide which launches may run them
(hopper.py).

The variant is offered to the autotuner on sm_90 only; here ``hopper.device_ready`` is patched to say
yes and ``pinned_config`` picks a Hopper row, so the interpreter runs the descriptor kernel on CPU
tensors (Triton 3.8's interpreter executes ``tl.make_tensor_descriptor`` loads, zero fill past the
bounds included, and accepts ``warp_specialize``, which it ignores). One pinned index selects the Hopper rows of
both the forward and dQ; dK / dV, whose list is shorter, takes whichever of its rows the index wraps to
(today a Hopper one: tests/test_triton_hopper_dkdv.py tests that variant on the classic forward's lse),
reading the lse the Hopper forward stored, so every gradient checks that too. bf16 inputs, FlashAttention's
rule (tests/flash_rule.py): the error against float64 at most twice that of the same formula computed
as attnzoo's eager references do (fp32 on the bf16 inputs, stored in bf16).
"""
from __future__ import annotations

import contextlib
import functools
import zlib

import pytest
import torch

from attnzoo.ops import triton_tuning as tuning
from attnzoo.ops.kernels.flash_softmax import hopper, hopper_kernels
from attnzoo.ops.kernels.flash_softmax import triton as fused
from tests.common import needs_gpu, needs_interpreter
from tests.flash_rule import assert_flash_rule, yardstick_dtype

needs_descriptors = pytest.mark.skipif(not hopper_kernels.TENSOR_DESCRIPTORS,
                                       reason="this Triton has no tl.make_tensor_descriptor: no Hopper variant")


def formula(q, k, v, *, scale, causal, l2=False, pref=None, keep=None, dtype=torch.float64):
    """softmax_j(l_ij) v_j in ``dtype`` (output in q's dtype): l = scale q.k or -scale ||q - k||^2, plus the
    per-key log-preference, bool key mask and bottom-right causal diagonal as -inf; rows with no key give 0."""
    out_dtype = q.dtype
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    if l2:
        logits = -scale * (q[..., :, None, :] - k[..., None, :, :]).pow(2).sum(-1)
    else:
        logits = scale * q @ k.transpose(-1, -2)
    if pref is not None:
        logits = logits + pref.to(dtype)[:, :, None, :]
    nq, nk = q.shape[2], k.shape[2]
    allowed = torch.ones(nq, nk, dtype=torch.bool, device=q.device)
    if causal:
        ar = functools.partial(torch.arange, device=q.device)
        allowed = ar(nk)[None, :] <= ar(nq)[:, None] + (nk - nq)
    if keep is not None:
        allowed = allowed & keep
    logits = logits.masked_fill(~allowed, float("-inf"))
    weights = torch.softmax(logits, -1).nan_to_num(0.0)
    return (weights @ v).to(out_dtype)


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def _with_grads(fn, inputs, grad_out):
    inputs = _leaves(*inputs)
    out = fn(*inputs)
    out.backward(grad_out)
    return [out.detach()] + [x.grad for x in inputs]


def hopper_row_index(dtype, width):
    """Where the class's first Hopper row sits in the list a launch with variants sees: the same index
    for the forward and dQ lists (asserted), so one pinned index runs both Hopper kernels."""
    index = len(fused.FORWARD.configs_for(dtype, width, width))
    assert len(fused.QUERIES_BACKWARD.configs_for(dtype, width, width)) == index
    return index


CASES = [  # (name, B, H, Nq, Nk, D, causal, l2, pref, key mask)
    ("plain D64 Nq<Nk", 1, 2, 37, 53, 64, False, False, False, False),
    ("causal D64 Nq<Nk", 1, 2, 37, 53, 64, True, False, False, False),
    ("causal D64 Nq>Nk", 1, 2, 45, 29, 64, True, False, False, False),
    ("l2+pref causal D64", 1, 2, 33, 47, 64, True, True, True, False),
    ("pref+key-mask D48", 2, 1, 21, 35, 48, False, False, True, True),
    ("l2 causal D48 odd", 1, 2, 19, 19, 48, True, True, False, False),
]


def _run_case(name, B, H, nq, nk, d, causal, l2, pref, masked, monkeypatch, row=0, device="cpu",
              pin=True):
    """One case through the Hopper row ``row`` of the class (``pin``; else the autotuner's choice)."""
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    q, k, v = (torch.randn(B, H, n, d, generator=gen).to(dtype).to(device) for n in (nq, nk, nk))
    g = (torch.randn(B, H, nk, generator=gen) * 0.5).to(device) if pref else None
    keep = None
    if masked:
        keep = torch.ones(nk, dtype=torch.bool)
        keep[::5] = False
        keep = keep.to(device)
    scale = d ** -0.5
    grad_out = torch.randn(B, H, nq, d, generator=gen).to(dtype).to(device)
    kw = dict(scale=scale, causal=causal, l2=l2, pref=g, keep=keep)

    def tested(q, k, v):
        mask = keep[None, None, None, :].expand(B, 1, 1, nk) if keep is not None else None
        if g is not None:
            return fused.preference_attention(q, k, v, g, attn_mask=mask, is_causal=causal, scale=scale, l2=l2)
        run = fused.l2_attention if l2 else fused.softmax_attention
        return run(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)

    monkeypatch.setattr(hopper, "device_ready", lambda device: True)
    launched = {"forward": [], "dQ": []}  # the constexprs of each launch: the pinned row must be a Hopper one
    for part, tuned in (("forward", fused.FORWARD), ("dQ", fused.QUERIES_BACKWARD)):
        def spy(*args, _real=tuned.launch, _part=part, **kwargs):
            kernel, tiles = _real(*args, **kwargs)
            launched[_part].append(tiles)
            return kernel, tiles
        monkeypatch.setattr(tuned, "launch", spy)
    pinned = tuning.pinned_config(hopper_row_index(dtype, d) + row) if pin else contextlib.nullcontext()
    with pinned:
        got = _with_grads(tested, (q, k, v), grad_out)
    if pin:  # the pinned index wraps to a classic row where a list has fewer Hopper rows than ``row``
        width = 64 if d <= 64 else 128
        for part, tuned in (("forward", fused.FORWARD), ("dQ", fused.QUERIES_BACKWARD)):
            expected = row < len(tuned.variants.get((False, False, width), []))
            assert [t["HOPPER"] for t in launched[part]] == [expected], \
                f"the {part} launch did not run the pinned row (Hopper: {expected})"
    want = _with_grads(lambda q, k, v: formula(q, k, v, **kw), (q.double(), k.double(), v.double()),
                       grad_out.double())
    low = [x.to(dtype) for x in _with_grads(lambda q, k, v: formula(q, k, v, **kw, dtype=yardstick_dtype(dtype)),
                                            (q, k, v), grad_out)]
    logit_size = float((q.float() @ k.float().transpose(-1, -2)).abs().max()) * scale * (4 if l2 else 1)
    assert_flash_rule(f"hopper {name}", dtype, logit_size,
                      zip(("out", "dq", "dk", "dv"), got, low, want))


@needs_interpreter
@needs_descriptors
@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_hopper_forward_and_gradients_under_the_interpreter(case, monkeypatch):
    _run_case(*case, monkeypatch=monkeypatch)


@needs_interpreter
@needs_descriptors
def test_warp_specialised_loop_under_the_interpreter(monkeypatch):
    """The WARP_SPEC branch (no configuration offers it yet: see triton_tuning.FORWARD_HOPPER) computes the
    same attention; the interpreter runs its loop as a plain one, so this checks the code, not the overlap."""
    if not hopper_kernels.WARP_SPECIALIZE:
        pytest.skip("this Triton's tl.range has no warp_specialize")
    cls = (False, False, 64)
    row = triton_config(128, 64, 4, 3, {"HOPPER": True, "WARP_SPEC": True})
    monkeypatch.setitem(fused.FORWARD.variants, cls, [row])
    _run_case("ws causal D64", 1, 2, 37, 53, 64, True, False, False, False, monkeypatch)


def triton_config(bm, bn, warps, stages, constexprs):
    return tuning.configs({(False, 64): [(bm, bn, warps, stages, constexprs)]})[(False, 64)][0]


@needs_interpreter
@needs_descriptors
def test_pinned_hopper_row_launches_the_hopper_path_under_the_interpreter():
    """The row index the tests pin is a Hopper row, and a launch without variants never sees one."""
    index = hopper_row_index(torch.bfloat16, 64)
    with tuning.pinned_config(index):
        _, tiles = fused.FORWARD.launch(torch.bfloat16, 64, 64, False, variants=True)
        assert tiles["HOPPER"] is True and tiles == {**tiles, **tuning.INTERPRETER_TILES}
        _, classic = fused.FORWARD.launch(torch.bfloat16, 64, 64, False)
        assert classic["HOPPER"] is False and classic["WARP_SPEC"] is False


# --- on an sm_90 GPU: every Hopper row compiled and run, and the autotuner's choice -------------------

def _sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


needs_sm90 = pytest.mark.skipif(not _sm90(), reason="the Hopper variant is offered on sm_90 and newer only")
GPU_CASES = [  # (name, B, H, Nq, Nk, D, causal, l2, pref, key mask): lengths no tile divides, Nq != Nk
    ("gpu causal", 2, 2, 333, 517, 64, True, False, False, False),
    ("gpu l2+pref+key-mask", 2, 2, 517, 333, 64, False, True, True, True),
    ("gpu causal D128", 2, 2, 333, 517, 128, True, False, False, False),
    ("gpu pref causal D96", 1, 2, 300, 300, 96, True, False, True, False),
]


@needs_gpu
@needs_sm90
@needs_descriptors
@pytest.mark.parametrize("row", range(3))
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c[0])
def test_every_hopper_row_on_the_gpu(case, row, monkeypatch):
    rows = fused.FORWARD.variants.get((False, False, 64 if case[5] <= 64 else 128), [])
    if row >= len(rows):
        pytest.skip(f"{len(rows)} Hopper rows in this tile class")
    _run_case(*case, monkeypatch=monkeypatch, row=row, device="cuda")


@needs_gpu
@needs_sm90
@needs_descriptors
def test_autotuner_choosing_between_classic_and_hopper_rows_on_the_gpu(monkeypatch):
    monkeypatch.setenv(tuning.AUTOTUNE_ENV, "1")
    _run_case("gpu autotuned causal", 2, 4, 1000, 1000, 64, True, False, False, False, monkeypatch, device="cuda",
              pin=False)


# --- which launches may run it (host rules; no kernel launch) ----------------------------------------

def _meta(q, v, dropout=False):
    return fused._flags(q, v, False, False, dropout)


def _flags(has_t5=False, mask_kind=0, mask_shape=0):
    return dict(MASK_KIND=mask_kind, MASK_SHAPE=mask_shape, HAS_PREF=False, HAS_T5=has_t5)


@needs_descriptors
def test_variants_offered_only_to_supported_launches(monkeypatch):
    q, k, v = (torch.randn(2, 2, 40, 64).to(torch.bfloat16) for _ in range(3))
    assert not hopper.forward_variants(q, k, v, _meta(q, v), _flags())  # a CPU tensor: no sm_90 device
    monkeypatch.setattr(hopper, "device_ready", lambda device: True)
    assert hopper.forward_variants(q, k, v, _meta(q, v), _flags())
    assert not hopper.forward_variants(q, k, v, _meta(q, v, dropout=True), _flags())
    assert not hopper.forward_variants(q, k, v, _meta(q, v), _flags(has_t5=True))
    assert not hopper.forward_variants(q, k, v, _meta(q, v), _flags(mask_kind=2, mask_shape=0))  # a full tile
    assert hopper.forward_variants(q, k, v, _meta(q, v), _flags(mask_kind=2, mask_shape=1))  # key padding
    q32, k32, v32 = q.float(), k.float(), v.float()
    assert not hopper.forward_variants(q32, k32, v32, _meta(q32, v32), _flags())
    wide = torch.randn(2, 2, 40, 256).to(torch.bfloat16)  # no Hopper rows for 256-wide heads
    assert not hopper.forward_variants(wide, wide, wide, _meta(wide, wide), _flags())
    strided = torch.randn(2, 2, 64, 40).to(torch.bfloat16).transpose(-1, -2)  # last stride != 1
    assert not hopper.forward_variants(q, strided, v, _meta(q, v), _flags())
    odd_rows = torch.randn(2, 2, 40, 60).to(torch.bfloat16)[..., :56]  # row stride 120 B: not 16-byte aligned
    assert not hopper.tma_ready(odd_rows)
    shifted = torch.randn(2 * 2 * 40 * 64 + 1).to(torch.bfloat16)[1:].view(2, 2, 40, 64)  # base off by 2 B
    assert not hopper.forward_variants(q, shifted, v, _meta(q, v), _flags())
    assert hopper.tma_ready(torch.randn(1, 3, 7, 48).to(torch.bfloat16))  # 96-byte rows are fine
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # traced calls keep the classic kernel
    assert not hopper.forward_variants(q, k, v, _meta(q, v), _flags())


def test_classic_kernel_when_triton_cannot_build_the_variant(monkeypatch):
    """Without tensor descriptors the forward is the classic kernel and no Hopper row exists."""
    from attnzoo.ops.kernels.flash_softmax.triton_kernels import softmax_fwd_kernel

    monkeypatch.setattr(hopper, "TENSOR_DESCRIPTORS", False)
    assert hopper.forward_kernel(softmax_fwd_kernel) is softmax_fwd_kernel
    assert hopper._rows(tuning.FORWARD_HOPPER) == {}


@needs_descriptors
def test_selector_takes_the_classic_kernels_arguments():
    """softmax_fwd_select_kernel forwards every argument of softmax_fwd_kernel: a change to one must be
    made to the other."""
    from attnzoo.ops.kernels.flash_softmax.triton_kernels import softmax_fwd_kernel

    assert hopper_kernels.softmax_fwd_select_kernel.arg_names == softmax_fwd_kernel.arg_names + ["HOPPER",
                                                                                                 "WARP_SPEC"]
    assert fused.FORWARD.fn is hopper_kernels.softmax_fwd_select_kernel
    for rows in fused.FORWARD.variants.values():
        assert rows and all(row.kwargs["HOPPER"] is True for row in rows)


@needs_descriptors
def test_dq_selector_takes_the_classic_kernels_arguments():
    from attnzoo.ops.kernels.flash_softmax.triton_kernels import softmax_bwd_dq_kernel

    assert hopper_kernels.softmax_dq_select_kernel.arg_names == softmax_bwd_dq_kernel.arg_names + ["HOPPER"]
    assert fused.QUERIES_BACKWARD.fn is hopper_kernels.softmax_dq_select_kernel
    for rows in fused.QUERIES_BACKWARD.variants.values():
        assert rows and all(row.kwargs["HOPPER"] is True for row in rows)


@needs_descriptors
def test_scratch_allocator_installed_only_where_none_is_set():
    """Device-side descriptors need Triton's launch-time scratch allocation: attnzoo installs one in a
    context (thread) that has none, and keeps a caller's own."""
    import contextvars

    import triton

    if hopper._CURRENT_ALLOCATOR is None:
        pytest.skip("this Triton keeps its allocator elsewhere: the variant is never offered")

    def installed():
        assert hopper._ensure_allocator()
        return hopper._CURRENT_ALLOCATOR.get()

    assert contextvars.Context().run(installed) is hopper._scratch  # an empty context: Triton's null allocator

    def mine(size, alignment, stream):
        return None

    def kept():
        triton.set_allocator(mine)
        return installed()

    assert contextvars.Context().run(kept) is mine
