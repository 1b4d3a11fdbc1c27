"""The Hopper variant of the softmax-family dK/dV kernel (kernels/flash_softmax/hopper_kernels.py
``softmax_dkdv_hopper``: Q and dO streamed through TMA descriptors) against float64 math, and the
host rule that offers it (hopper.keys_backward_variants).

As in tests/test_triton_hopper_forward.py, ``hopper.device_ready`` is patched to say yes and
``pinned_config`` picks a row, so the interpreter runs the descriptor kernel on CPU tensors. The
pinned index is the dK/dV list's first Hopper row; the forward's and dQ's longer classic lists put
the same index on a classic row, so the variant computes dK, dV and the preference gradient from
the classic forward's lse (dq is checked too: it comes from the classic dQ). A spy on the dK/dV
launch checks it ran the variant (a pinned index past a list without the Hopper rows would wrap to a
classic row and pass unnoticed). bf16 inputs, FlashAttention's rule (tests/flash_rule.py).
"""
from __future__ import annotations

import contextlib
import zlib

import pytest
import torch

from attnzoo.ops import triton_tuning as tuning
from attnzoo.ops.kernels.flash_softmax import hopper, hopper_kernels
from attnzoo.ops.kernels.flash_softmax import triton as fused
from tests.common import needs_gpu, needs_interpreter
from tests.flash_rule import assert_flash_rule, yardstick_dtype
from tests.test_triton_hopper_forward import formula, needs_descriptors, needs_sm90

DTYPE = torch.bfloat16


def keys_row_index(dtype, width):
    """Where the class's first Hopper row sits in the dK/dV list a launch with variants sees; the
    forward and dQ have more classic rows, so there the index is a classic row."""
    index = len(fused.KEYS_BACKWARD.configs_for(dtype, width, width))
    assert index < len(fused.FORWARD.configs_for(dtype, width, width))
    assert index < len(fused.QUERIES_BACKWARD.configs_for(dtype, width, width))
    return index


def _gqa_formula(q, k, v, g, *, group, dtype=torch.float64, **kw):
    """formula() with each key/value head shared by ``group`` query heads (repeated, so its gradient sums
    over them)."""
    k, v = (x.repeat_interleave(group, dim=1) for x in (k, v))
    return formula(q, k, v, pref=g, dtype=dtype, **kw)


CASES = [  # (name, B, H, H_kv, Nq, Nk, D, causal, l2, pref, key mask)
    ("plain D64 Nq<Nk", 1, 2, 2, 37, 53, 64, False, False, False, False),
    ("causal D64 Nq<Nk gqa2", 1, 4, 2, 37, 53, 64, True, False, False, False),
    ("causal D64 Nq>Nk", 1, 2, 2, 45, 29, 64, True, False, False, False),
    ("l2+pref causal D64 Nq>Nk gqa2", 1, 4, 2, 47, 33, 64, True, True, True, False),
    ("pref+key-mask D48 Nq<Nk", 2, 1, 1, 21, 35, 48, False, False, True, True),
    ("l2 causal D48 odd gqa3", 1, 3, 1, 19, 19, 48, True, True, False, False),
    ("l2+pref D48 Nq<Nk gqa2", 1, 2, 1, 23, 41, 48, False, True, True, False),
]


def _run_case(name, B, H, H_kv, nq, nk, d, causal, l2, pref, masked, monkeypatch, row=0, device="cpu"):
    """One case with the dK/dV launch pinned to Hopper row ``row`` of its class."""
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    q = torch.randn(B, H, nq, d, generator=gen).to(DTYPE).to(device)
    k, v = (torch.randn(B, H_kv, nk, d, generator=gen).to(DTYPE).to(device) for _ in range(2))
    g = (torch.randn(B, H, nk, generator=gen) * 0.5).to(device) if pref else None
    keep = None
    if masked:
        keep = torch.ones(nk, dtype=torch.bool)
        keep[::5] = False
        keep = keep.to(device)
    scale = d ** -0.5
    grad_out = torch.randn(B, H, nq, d, generator=gen).to(DTYPE).to(device)
    kw = dict(scale=scale, causal=causal, l2=l2, keep=keep, group=H // H_kv)
    inputs = (q, k, v) + ((g,) if pref else ())

    def tested(q, k, v, g=None):
        mask = keep[None, None, None, :].expand(B, 1, 1, nk) if keep is not None else None
        return fused._run(q, k, v, mask, causal, scale, l2=l2, pref=g)

    def leaves():
        return [x.detach().clone().requires_grad_() for x in inputs]

    def with_grads(fn, xs):
        out = fn(*xs)
        out.backward(grad_out.to(out.dtype))
        return [out.detach()] + [x.grad for x in xs]

    launched = []  # the constexprs of each dK/dV launch
    real_launch = fused.KEYS_BACKWARD.launch

    def spy(*args, **kwargs):
        kernel, tiles = real_launch(*args, **kwargs)
        launched.append(tiles)
        return kernel, tiles

    monkeypatch.setattr(hopper, "device_ready", lambda device: True)
    monkeypatch.setattr(fused.KEYS_BACKWARD, "launch", spy)
    with tuning.pinned_config(keys_row_index(DTYPE, d) + row):
        got = with_grads(tested, leaves())
    assert [t["HOPPER"] for t in launched] == [True], "the dK/dV launch did not run its Hopper row"
    want_inputs = [x.detach().double().requires_grad_() for x in inputs]
    want = with_grads(lambda *xs: _gqa_formula(*xs[:3], xs[3] if pref else None, **kw), want_inputs)
    low = with_grads(lambda *xs: _gqa_formula(*xs[:3], xs[3] if pref else None, dtype=yardstick_dtype(DTYPE), **kw),
                     leaves())
    kk = k.float().repeat_interleave(H // H_kv, dim=1)
    logit_size = float((q.float() @ kk.transpose(-1, -2)).abs().max()) * scale * (4 if l2 else 1)
    names = ("out", "dq", "dk", "dv", "dpref")
    assert_flash_rule(f"hopper dkdv {name}", DTYPE, logit_size, zip(names, got, low, want))


@needs_interpreter
@needs_descriptors
@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_hopper_dkdv_gradients_under_the_interpreter(case, monkeypatch):
    _run_case(*case, monkeypatch=monkeypatch)


@needs_interpreter
@needs_descriptors
def test_pinned_row_runs_hopper_dkdv_and_classic_forward_under_the_interpreter():
    """The index the tests pin is a Hopper row of dK/dV and a classic row of the forward and dQ."""
    index = keys_row_index(DTYPE, 64)
    with tuning.pinned_config(index):
        assert fused.KEYS_BACKWARD.launch(DTYPE, 64, 64, False, variants=True)[1]["HOPPER"] is True
        assert fused.FORWARD.launch(DTYPE, 64, 64, False, variants=True)[1]["HOPPER"] is False
        assert fused.QUERIES_BACKWARD.launch(DTYPE, 64, 64, False, variants=True)[1]["HOPPER"] is False
        assert fused.KEYS_BACKWARD.launch(DTYPE, 64, 64, False)[1]["HOPPER"] is False  # no variants: classic


@needs_descriptors
def test_dkdv_selector_takes_the_classic_kernels_arguments():
    """softmax_dkdv_select_kernel forwards every argument of softmax_bwd_dkdv_kernel: a change to one must be
    made to the other."""
    from attnzoo.ops.kernels.flash_softmax.triton_kernels import softmax_bwd_dkdv_kernel

    assert hopper_kernels.softmax_dkdv_select_kernel.arg_names == softmax_bwd_dkdv_kernel.arg_names + ["HOPPER"]
    assert fused.KEYS_BACKWARD.fn is hopper_kernels.softmax_dkdv_select_kernel
    assert set(fused.KEYS_BACKWARD.variants) == {(False, False, 64), (False, False, 128)}
    for rows in fused.KEYS_BACKWARD.variants.values():
        assert rows and all(row.kwargs["HOPPER"] is True for row in rows)
    for rows in fused.KEYS_BACKWARD.configs.values():  # every classic row switches the variant off
        assert all(row.kwargs["HOPPER"] is False for row in rows)


@needs_descriptors
def test_dkdv_variants_need_tma_readable_queries_and_output_gradient(monkeypatch):
    q, k, v, do = (torch.randn(2, 2, 40, 64).to(DTYPE) for _ in range(4))
    meta = fused._flags(q, v, False, False, False)
    flags = dict(MASK_KIND=0, MASK_SHAPE=0, HAS_PREF=False, HAS_T5=False)

    def offered(q, do, meta=meta, flags=flags):  # as the backward asks: the dQ launch's answer, then Q and dO
        return hopper.keys_backward_variants(q, do, hopper.forward_variants(q, k, v, meta, flags))

    assert not offered(q, do)  # a CPU tensor: no sm_90 device
    monkeypatch.setattr(hopper, "device_ready", lambda device: True)
    assert offered(q, do)
    strided = torch.randn(2, 2, 64, 40).to(DTYPE).transpose(-1, -2)  # last stride != 1
    assert not offered(strided, do)
    assert not offered(q, strided)
    rows_shared = torch.randn(2, 2, 1, 64).to(DTYPE).expand(2, 2, 40, 64)  # row stride 0 (e.g. a summed output)
    assert not offered(q, rows_shared)
    assert not offered(q, do, meta=dict(meta, DROPOUT=True))
    assert not offered(q, do, flags=dict(flags, HAS_T5=True))


def test_classic_dkdv_kernel_when_triton_cannot_build_the_variant(monkeypatch):
    from attnzoo.ops.kernels.flash_softmax.triton_kernels import softmax_bwd_dkdv_kernel

    monkeypatch.setattr(hopper, "TENSOR_DESCRIPTORS", False)
    assert hopper.keys_backward_kernel(softmax_bwd_dkdv_kernel) is softmax_bwd_dkdv_kernel
    assert hopper._rows(tuning.KEYS_BACKWARD_HOPPER) == {}


# --- on an sm_90 GPU: every dK/dV Hopper row compiled and run ------------------------------------------

GPU_CASES = [  # lengths no tile divides, Nq != Nk both ways, grouped heads
    ("gpu causal gqa2", 2, 4, 2, 333, 517, 64, True, False, False, False),
    ("gpu l2+pref+key-mask", 2, 2, 2, 517, 333, 64, False, True, True, True),
    ("gpu causal D128", 2, 2, 2, 333, 517, 128, True, False, False, False),
    ("gpu pref causal D96 gqa2", 1, 4, 2, 300, 300, 96, True, False, True, False),
]


@needs_gpu
@needs_sm90
@needs_descriptors
@pytest.mark.parametrize("row", range(2))
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c[0])
def test_every_hopper_dkdv_row_on_the_gpu(case, row, monkeypatch):
    rows = fused.KEYS_BACKWARD.variants.get((False, False, 64 if case[6] <= 64 else 128), [])
    if row >= len(rows):
        pytest.skip(f"{len(rows)} Hopper dK/dV rows in this tile class")
    _run_case(*case, monkeypatch=monkeypatch, row=row, device="cuda")
