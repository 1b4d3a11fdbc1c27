"""softcap, sinks and window_size fused in the softmax-family Triton kernels (softmax, fenchel first order,
l2), under the interpreter: forward and every gradient (q, k, v, sinks, log u) against float64 math
written here from the definitions (Gemma 2's cap on the logits before masks and preferences, gpt-oss's
sink joining each row's normaliser as a key with no value, FlashAttention's bottom-right aligned band),
fp32 tight and fp16 / bf16 by FlashAttention's rule (tests/flash_rule.py); that the band's outside
blocks are never visited (NaN there does not reach the result); that a windowed call reaches the kernels
as two integers, not as a dense mask; and that the Hopper rows decline the three."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import pytest
import torch

import attnzoo.functional as AF
from attnzoo.ops import dispatch, logit_extras
from attnzoo.ops.triton_dropout import draw_seed, dropout_keep_mask
from attnzoo.ops.triton_utils import HAVE_TRITON, INTERPRETED

from .flash_rule import assert_flash_rule, yardstick_dtype

pytestmark = pytest.mark.skipif(not (HAVE_TRITON and INTERPRETED),
                                reason="the Triton kernels on CPU tensors need TRITON_INTERPRET=1")

D = 8
BATCH = 1
SEED = 1234
TILE = 16  # the interpreter's BLOCK_M = BLOCK_N (ops/triton_tuning.INTERPRETER_TILES)


@dataclass(frozen=True)
class Case:
    name: str  # softmax | fenchel | l2
    nq: int
    nk: int
    h: int = 2
    h_kv: int = 2  # fewer than h: grouped-query attention
    causal: bool = False
    mask: Optional[str] = None  # None | "bool" | "float"
    softcap: Optional[float] = None
    sinks: bool = False
    window: Optional[tuple] = None
    log_u: bool = False  # fenchel: a per-key preference (B, 1, 1, Nk)
    alpha: float = 1.0
    dropout: float = 0.0  # in-kernel dropout on the weights (the sink's share is never dropped: no value)
    dtype: torch.dtype = torch.float32


def make_inputs(case: Case, seed=0):
    g = torch.Generator().manual_seed(seed)
    b = BATCH
    q = torch.randn(b, case.h, case.nq, D, generator=g, dtype=torch.float64) * 1.5
    k = torch.randn(b, case.h_kv, case.nk, D, generator=g, dtype=torch.float64) * 1.5
    v = torch.randn(b, case.h_kv, case.nk, D, generator=g, dtype=torch.float64)
    inp = dict(q=q, k=k, v=v, mask=None, sinks=None, log_u=None)
    if case.mask == "bool":
        m = torch.rand(b, 1, case.nq, case.nk, generator=g) > 0.3
        m[:, :, 1] = False  # one row with no key: zeros (and, with sinks, no NaN)
        inp["mask"] = m
    elif case.mask == "float":
        m = torch.randn(b, case.h, case.nq, case.nk, generator=g, dtype=torch.float64)
        m = m.masked_fill(torch.rand(b, case.h, case.nq, case.nk, generator=g) < 0.2, -math.inf)
        inp["mask"] = m
    if case.sinks:
        inp["sinks"] = torch.randn(case.h, generator=g, dtype=torch.float64)
    if case.log_u:
        inp["log_u"] = torch.randn(b, 1, 1, case.nk, generator=g, dtype=torch.float64) * 0.5
    return inp


def allowed(case: Case, mask, b, h):
    """Bool (b, h, nq, nk): which keys take part, from the definitions (loops over the offsets)."""
    nq, nk = case.nq, case.nk
    allow = torch.ones(b, h, nq, nk, dtype=torch.bool)
    for i in range(nq):
        for j in range(nk):
            d = j - i - (nk - nq)  # bottom-right aligned offset
            if case.causal and d > 0:
                allow[..., i, j] = False
            if case.window is not None:
                left, right = case.window
                if (left >= 0 and d < -left) or (right >= 0 and d > right):
                    allow[..., i, j] = False
    if mask is not None:
        allow &= mask if mask.dtype == torch.bool else mask > -math.inf
    return allow


def formula(case: Case, leaves: dict, dtype, keep=None):
    """The output from the definitions, computed in ``dtype`` (float64: the truth; fp32 on half inputs:
    the rule's eager yardstick); with dropout, ``keep`` is the kernel's keep-mask Z: (Z P / (1 - p)) V."""
    q, k, v = leaves["q"], leaves["k"], leaves["v"]
    group = case.h // case.h_kv
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scale = D ** -0.5
    if case.name == "l2":
        s = -scale * ((q[:, :, :, None, :] - k[:, :, None, :, :]) ** 2).sum(-1)
    else:
        s = case.alpha * scale * torch.einsum("bhid,bhjd->bhij", q, k)
    if case.softcap is not None:
        s = case.softcap * torch.tanh(s / case.softcap)
    if leaves.get("log_u") is not None:
        s = s + leaves["log_u"]
    mask = leaves.get("mask")
    if mask is not None and mask.dtype != torch.bool:
        s = s + torch.where(mask > -math.inf, mask, torch.zeros_like(mask)).to(dtype)
    allow = allowed(case, mask, q.shape[0], case.h)
    s = s.masked_fill(~allow, -math.inf)
    top = s.amax(-1, keepdim=True)
    if leaves.get("sinks") is not None:
        sink = leaves["sinks"].to(dtype).reshape(1, -1, 1, 1)
        top = torch.maximum(top, sink)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top)).detach()
    e = torch.exp(s - top)
    total = e.sum(-1, keepdim=True)
    if leaves.get("sinks") is not None:
        total = total + torch.exp(sink - top)
    p = e / torch.where(total > 0, total, torch.ones_like(total))
    if keep is not None:
        p = keep.to(dtype) * p / (1.0 - case.dropout)
    return p @ v


def run_triton(case: Case, leaves: dict):
    kw = dict(attn_mask=leaves["mask"], is_causal=case.causal, backend="triton", softcap=case.softcap,
              sinks=leaves["sinks"], window_size=case.window, enable_gqa=case.h_kv != case.h,
              dropout_p=case.dropout)
    if case.name == "fenchel":
        kw.update(log_u=leaves["log_u"], alpha=case.alpha)
    return getattr(AF, case.name)(leaves["q"], leaves["k"], leaves["v"], **kw)


def leaves_of(inp: dict, dtype, sink_dtype=None):
    """Differentiable copies: q, k, v, log u in ``dtype``; the sinks in ``sink_dtype`` (a parameter of its
    own: fp32 beside half inputs), the mask as given (a float mask in ``dtype``)."""
    sink_dtype = sink_dtype or dtype
    out = {}
    for n, x in inp.items():
        if x is None or (n == "mask" and x.dtype == torch.bool):
            out[n] = x
        elif n == "mask":
            out[n] = x.to(dtype)
        else:
            out[n] = x.detach().to(sink_dtype if n == "sinks" else dtype).requires_grad_(True)
    return out


def rounded_inputs(inp: dict, dtype) -> dict:
    """The inputs as the tested call holds them (rounded to ``dtype``; sinks to fp32), back in float64: the
    rule counts no input rounding."""
    return {n: x if x is None or x.dtype == torch.bool
            else x.to(torch.float32 if n == "sinks" else dtype).to(torch.float64) for n, x in inp.items()}


def grads(out, leaves, grad_out):
    names = [n for n in ("q", "k", "v", "sinks", "log_u") if leaves.get(n) is not None]
    return names, torch.autograd.grad(out, [leaves[n] for n in names], grad_out)


def check(case: Case):
    dtype = case.dtype
    inp = rounded_inputs(make_inputs(case), dtype)
    low_dtype = yardstick_dtype(dtype)
    tested = leaves_of(inp, dtype, torch.float32)
    torch.manual_seed(SEED)  # the call draws its dropout seed first thing: drawn again below, Z is known
    out = run_triton(case, tested)
    keep = None
    if case.dropout:
        torch.manual_seed(SEED)
        keep = dropout_keep_mask(draw_seed(out.device), case.dropout, (BATCH, case.h, case.nq, case.nk))
    assert out.dtype == dtype and out.shape == (BATCH, case.h, case.nq, D)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    names, got = grads(out, tested, grad_out.to(dtype))
    for n, t in [("out", out)] + list(zip(names, got)):
        assert torch.isfinite(t).all(), f"{case}: {n} has NaN/inf"
    truth = leaves_of(inp, torch.float64)
    want = formula(case, truth, torch.float64, keep)
    _, want_g = grads(want, truth, grad_out)
    # the rule's yardstick: the same formula on the same rounded inputs, computed in fp32, stored in dtype
    low_leaves = leaves_of(inp, low_dtype, torch.float32)
    low = formula(case, low_leaves, low_dtype, keep)
    _, low_g = grads(low, low_leaves, grad_out.to(dtype).to(low_dtype))
    logit_size = float(formula_logit_size(case, truth))
    triples = [("out", out, low.to(dtype), want)]
    triples += [(n, g, lg.to(g.dtype), wg) for n, g, lg, wg in zip(names, got, low_g, want_g)]
    assert_flash_rule(f"{case}", dtype, logit_size, triples)


def formula_logit_size(case: Case, truth: dict) -> float:
    q, k = truth["q"].detach(), truth["k"].detach()
    if case.name == "l2":  # the L2 logits with the row constant, which the kernels keep when capped or sunk
        return float(D ** -0.5 * (q.norm(dim=-1).max() + k.norm(dim=-1).max()) ** 2)
    return float(case.alpha * D ** -0.5 * q.norm(dim=-1).max() * k.norm(dim=-1).max())


F32_CASES = [
    # softcap alone, Nq != Nk and neither a multiple of the tile
    Case("softmax", 17, 35, softcap=2.0),
    # sinks with causality where Nq > Nk: the first rows see no key (output 0, lse = the sink, no NaN),
    # and a bool mask with an empty row
    Case("softmax", 24, 13, causal=True, mask="bool", sinks=True),
    # a window narrower than a tile, with a float mask (-inf entries) and GQA
    Case("softmax", 33, 33, h=2, h_kv=1, mask="float", window=(3, 2)),
    # a window wider than a tile, causal folded in, Nq < Nk
    Case("softmax", 24, 45, causal=True, window=(20, -1), softcap=1.5, sinks=True),
    # fenchel first order: the cap on alpha s, then the per-key preference, sinks, a window and a float mask
    Case("fenchel", 20, 33, mask="float", softcap=2.5, sinks=True, window=(-1, 7), log_u=True, alpha=0.7),
    # l2: the cap on -scale ||q - k||^2 (the row constant kept), sinks, a band, a bool mask
    Case("l2", 30, 21, h=1, h_kv=1, mask="bool", softcap=3.0, sinks=True, window=(9, 4)),
    # l2 with sinks alone (the row constant's gradient without a cap), GQA, causal
    Case("l2", 17, 17, h=2, h_kv=1, causal=True, sinks=True),
    # in-kernel dropout with all three (the normaliser and dsinks use the undropped weights)
    Case("softmax", 20, 37, causal=True, softcap=2.0, sinks=True, window=(9, 0), dropout=0.3),
]

HALF_CASES = [
    Case("softmax", 20, 37, causal=True, softcap=2.0, sinks=True, window=(18, 0), dtype=torch.bfloat16),
    Case("softmax", 20, 20, softcap=1.0, window=(5, 5), mask="bool", dtype=torch.float16),
    Case("fenchel", 18, 18, h=2, h_kv=1, sinks=True, window=(3, -1), log_u=True, dtype=torch.bfloat16),
    Case("l2", 19, 19, softcap=4.0, sinks=True, dtype=torch.bfloat16),
]


@pytest.mark.parametrize("case", F32_CASES + HALF_CASES, ids=str)
def test_fused_extras_match_the_formula(case):
    check(case)


def test_window_never_visits_blocks_outside_the_band():
    """NaN in keys / values of key blocks wholly outside every row's band of a query block leaves that
    block's output and dQ exact (the forward and dQ kernels skip them); NaN in queries / dO of query
    blocks that see none of a key block leaves its dK, dV exact (the dK/dV kernel skips them). A kernel
    that visited them, masked, would carry the NaN (0 * NaN in P V)."""
    case = Case("softmax", 64, 64, h=1, h_kv=1, window=(8, 0))
    inp = make_inputs(case)
    grad_out = torch.randn(BATCH, 1, 64, D, dtype=torch.float64)
    truth = leaves_of(inp, torch.float64)
    want = formula(case, truth, torch.float64)
    want_dq, want_dk, want_dv = torch.autograd.grad(want, [truth["q"], truth["k"], truth["v"]], grad_out)

    # keys 0..15 (key block 0) lie outside the band of every row >= 24: query blocks 32.. never visit it
    poisoned = dict(inp)
    poisoned["k"], poisoned["v"] = inp["k"].clone(), inp["v"].clone()
    poisoned["k"][:, :, :TILE] = float("nan")
    poisoned["v"][:, :, :TILE] = float("nan")
    leaves = leaves_of(poisoned, torch.float32)
    out = run_triton(case, leaves)
    dq, = torch.autograd.grad(out, [leaves["q"]], grad_out.float())
    rows = slice(2 * TILE, None)
    torch.testing.assert_close(out[:, :, rows].double(), want[:, :, rows], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(dq[:, :, rows].double(), want_dq[:, :, rows], atol=2e-5, rtol=2e-5)

    # queries 48..63 (query block 3) see keys >= 40 only: key blocks 0 and 1 never visit it
    poisoned = dict(inp)
    poisoned["q"] = inp["q"].clone()
    poisoned["q"][:, :, 3 * TILE:] = float("nan")
    leaves = leaves_of(poisoned, torch.float32)
    out = run_triton(case, leaves)
    bad_grad = grad_out.float().clone()
    bad_grad[:, :, 3 * TILE:] = float("nan")
    dk, dv = torch.autograd.grad(out, [leaves["k"], leaves["v"]], bad_grad)
    keys = slice(0, 2 * TILE)
    torch.testing.assert_close(dk[:, :, keys].double(), want_dk[:, :, keys], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(dv[:, :, keys].double(), want_dv[:, :, keys], atol=2e-5, rtol=2e-5)


def test_a_window_reaches_the_kernels_without_a_dense_mask(monkeypatch):
    """The Triton backends declare window_size: the call path hands them the pair, and never folds the
    band into an (Nq, Nk) mask for them."""
    def refuse(*a, **k):
        raise AssertionError("the band was folded into a dense mask")
    monkeypatch.setattr(logit_extras, "mask_with_window", refuse)
    case = Case("softmax", 20, 20, window=(4, 4))
    leaves = leaves_of(make_inputs(case), torch.float32)
    out = run_triton(case, leaves)
    want = formula(case, leaves_of(make_inputs(case), torch.float64), torch.float64)
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("variant", ["softmax", "l2", "fenchel"])
def test_triton_backends_declare_the_fused_extras(variant):
    backend = dispatch.backend_table(variant)["triton"]
    assert {"softcap", "sinks", "window_size"} <= set(backend.extras)
    assert dispatch.extras_reason(backend, {"softcap": 2.0, "sinks": torch.zeros(2)}) is None


def test_hopper_rows_decline_the_extras(monkeypatch):
    """The Hopper TMA rows compute none of softcap, sinks and window: a launch with any of them never
    offers them to the autotuner (and their selector kernels static_assert the same)."""
    from attnzoo.ops.kernels.flash_softmax import hopper
    if not hopper.FORWARD_VARIANTS:
        pytest.skip("this Triton cannot build the Hopper rows: there is nothing to decline")
    monkeypatch.setattr(hopper, "device_ready", lambda device: True)
    monkeypatch.setattr(hopper, "_ensure_allocator", lambda: True)
    q, k, v = (torch.randn(1, 2, 64, 64, dtype=torch.bfloat16) for _ in range(3))
    meta = dict(BLOCK_D=64, BLOCK_DV=64, DROPOUT=False)
    plain = dict(MASK_KIND=0, MASK_SHAPE=0, HAS_T5=False, SOFTCAP=False, HAS_SINKS=False, WINDOW=False)
    assert hopper.forward_variants(q, k, v, meta, plain)  # the control: the same launch without extras
    for extra in ("SOFTCAP", "HAS_SINKS", "WINDOW"):
        assert not hopper.forward_variants(q, k, v, meta, dict(plain, **{extra: True})), extra


def test_auto_leaves_a_sinks_call_on_cuda_to_triton(monkeypatch):
    """SDPA's auto veto for sinks on CUDA (ops/softmax/__init__.py): only where Triton can run the call."""
    import types

    import attnzoo.ops.softmax as softmax_ops
    q = types.SimpleNamespace(device=torch.device("cuda"))
    sinks = torch.zeros(2)
    monkeypatch.setattr(softmax_ops, "call_reason", lambda *a, **k: None)
    assert softmax_ops.sinks_fused_on_cuda(q, q, q, sinks=sinks) is not None
    assert softmax_ops.sinks_fused_on_cuda(q, q, q, sinks=None) is None
    monkeypatch.setattr(softmax_ops, "call_reason", lambda *a, **k: "float64")  # Triton cannot: SDPA keeps it
    assert softmax_ops.sinks_fused_on_cuda(q, q, q, sinks=sinks) is None
    cpu = types.SimpleNamespace(device=torch.device("cpu"))
    assert softmax_ops.sinks_fused_on_cuda(cpu, cpu, cpu, sinks=sinks) is None


@pytest.mark.parametrize("spec_text", [text for _, text in __import__(
    "attnzoo.bench.speed_grid", fromlist=["EXTRAS_SPECS"]).EXTRAS_SPECS])
def test_the_gpu_bench_rows_run_the_triton_kernels(spec_text, monkeypatch):
    """The speed grid's "softmax+<extra> / triton" rows (attnzoo/bench/speed_grid.EXTRAS_SPECS): their
    call reaches the Triton backend with the extra (no refusal, no fallback) and computes the spec."""
    monkeypatch.setenv("ATTNZOO_BENCH_INTERPRETER", "1")  # the bench skips interpreted rows otherwise
    from attnzoo.bench.flops import Shape
    from attnzoo.bench.problem import Problem
    from attnzoo.bench.targets import AttnzooTarget, parse_variant
    spec = parse_variant(spec_text)
    p = Problem(Shape(batch=1, heads=1, seq_q=20, head_dim=8), torch.float32, torch.device("cpu"), "fwd+bwd", True,
                seed=3)
    got = AttnzooTarget(spec, "triton").prepare(p)
    want = AttnzooTarget(spec, "reference").prepare(p)
    out, ref = got.forward(), want.forward()
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    g = torch.autograd.grad(out, got.leaves, torch.ones_like(out))
    r = torch.autograd.grad(ref, want.leaves, torch.ones_like(ref))
    assert len(g) == len(r) >= 3
    for a, b in zip(g, r):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)


def test_the_op_with_extras_is_a_registered_custom_op():
    """softmax_family_fwd's schema, fake tensor and autograd registration with sinks, softcap and a window."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 16, generator=g).requires_grad_(True) for n in (3, 5, 5))
    sinks = torch.randn(2, generator=g).requires_grad_(True)
    torch.library.opcheck(torch.ops.attnzoo.softmax_family_fwd.default,
                          (q, k, v, None, None, None, None, 0.25, True, False, 0.0, None, sinks, 2.0, 2, -1),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
