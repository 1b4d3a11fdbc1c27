"""The T5-bias Triton kernel (paper 004 eqs 16-18) against float64 math, under TRITON_INTERPRET=1.

The kernels read a per-head bias vector bias[h, r] = table[bucket(r), h] and decide per tile whether
all its offsets share a bucket (one scalar, one gradient sum) or walk the runs of equal buckets the
tile spans (near the diagonal); the table gradient is summed per bucket without atomics. The cases
below make the interpreter's 16 x 16 tiles fall both ways (``test_cases_cover_one_run_and_many_run_tiles``
checks it) and compare the output and the gradients of q, k, v and the table with two float64
references: attnzoo's eager one (ops/fenchel/t5_reference.py) and a dense log u written out here
from T5's bucketing (tests/formulas.py), with the masked softmax spelled out.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from attnzoo.ops.fenchel.t5 import kernel_lut, t5_bias_attention
from attnzoo.ops.fenchel.t5_reference import t5_bias_attention_reference
from attnzoo.ops.kernels.flash_softmax.triton import offset_lut
from tests.common import bool_mask, float_mask, needs_interpreter, padding_mask, qkv, seeded
from tests.formulas import t5_bucket

TILE = 16  # triton_tuning.INTERPRETER_TILES: BLOCK_M = BLOCK_N = 16 under the interpreter


@dataclass
class Case:
    name: str
    nq: int
    nk: int
    num_buckets: int
    max_distance: int
    bidirectional: bool = True
    causal: bool = False
    mask: str = "none"   # none | bool (B, 1, Nq, Nk) with an empty row | float (1, H, Nq, Nk) with -inf | padding
    b: int = 1
    h: int = 2
    alpha: float = 1.0


CASES = [
    # many buckets: near the diagonal every tile spans many runs (exact buckets up to |offset| 15)
    Case("many-buckets-70", 70, 70, 64, 300),
    # few buckets: nearly every tile is one run; the diagonal tiles span the two sides' buckets
    Case("few-buckets-70", 70, 70, 4, 2),
    Case("few-buckets-causal-unidirectional", 70, 70, 2, 2, bidirectional=False, causal=True),
    Case("default-buckets-causal-bool-23x75", 23, 75, 32, 128, causal=True, mask="bool", alpha=1.5),
    Case("unidirectional-noncausal-75x23-padding", 75, 23, 8, 20, bidirectional=False, mask="padding", b=2),
    Case("float-mask-48x80", 48, 80, 16, 40, mask="float"),
    Case("bidirectional-causal-33x33", 33, 33, 8, 20, causal=True),
]


def _inputs(case: Case):
    g = seeded(7)
    q, k, v = qkv(case.b, case.h, case.nq, case.nk, 16, generator=g)
    table = torch.randn(case.num_buckets, case.h, generator=g)
    if case.mask == "bool":
        mask = bool_mask((case.b, 1, case.nq, case.nk), 0.7, generator=g, empty_rows=[(slice(None), slice(None), 1)])
    elif case.mask == "float":
        mask = float_mask((1, case.h, case.nq, case.nk), 0.2, generator=g,
                          empty_rows=[(slice(None), slice(None), case.nq // 2)])
    elif case.mask == "padding":
        mask = padding_mask([case.nk - 5, case.nk // 2][:case.b], case.nk)
    else:
        mask = None
    return q, k, v, table, mask


def _dense_formula(case: Case, q, k, v, table, mask):
    """float64: out_i = sum_j softmax_j(alpha scale q_i.k_j + table[bucket(j - (i + Nk - Nq)), h] + mask_ij) v_j
    over the allowed keys (causal: j <= i + Nk - Nq; bool mask True; float mask > -inf), zeros for a row
    with no key; the buckets from tests/formulas.t5_bucket, one (i, j) at a time."""
    nq, nk = case.nq, case.nk
    rows = [[t5_bucket(j - (i + nk - nq), case.num_buckets, case.max_distance, case.bidirectional) for j in range(nk)]
            for i in range(nq)]
    log_u = table[torch.tensor(rows)].permute(2, 0, 1)[None]                  # (1, H, Nq, Nk)
    logits = case.alpha * 16 ** -0.5 * torch.einsum("bhid,bhjd->bhij", q, k) + log_u
    allow = torch.ones(case.b, case.h, nq, nk, dtype=torch.bool)
    if case.causal:
        allow &= torch.arange(nk)[None, :] <= torch.arange(nq)[:, None] + (nk - nq)
    if mask is not None:
        m = mask.expand(case.b, case.h, nq, nk)
        if m.dtype == torch.bool:
            allow &= m
        else:
            allow &= m > -math.inf
            logits = logits + torch.where(m > -math.inf, m, 0.0).double()
    logits = logits.masked_fill(~allow, -math.inf)
    top = logits.amax(-1, keepdim=True).detach()
    e = torch.exp(logits - torch.where(torch.isfinite(top), top, torch.zeros_like(top)))
    z = e.sum(-1, keepdim=True)
    return (e / torch.where(z > 0, z, torch.ones_like(z))) @ v


def _tiles_by_runs(case: Case):
    """(tiles whose offsets lie in one run of equal buckets, tiles spanning several) of the 16 x 16 grid."""
    lut = kernel_lut(case.nq, case.nk, case.num_buckets, case.max_distance, case.bidirectional, torch.empty(0))
    one = many = 0
    for m0 in range(0, case.nq, TILE):
        for n0 in range(0, case.nk, TILE):
            lo = n0 - min(m0 + TILE - 1, case.nq - 1) + case.nq - 1
            hi = min(n0 + TILE - 1, case.nk - 1) - m0 + case.nq - 1
            if case.causal:
                hi = min(hi, case.nk - 1)
            if lo > hi:
                continue  # hidden by the causal mask
            one, many = (one + 1, many) if int(lut[1, lo]) >= hi else (one, many + 1)
    return one, many


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_t5_buckets_of_the_kernel_match_the_formula(case):
    """The LUT the kernel reads (attnzoo's bucketing in fp32) equals T5's rule in float64 at every offset of
    these cases, so the dense formula below is an independent reference, not a copy of a rounding."""
    lut = kernel_lut(case.nq, case.nk, case.num_buckets, case.max_distance, case.bidirectional, torch.empty(0))
    want = [t5_bucket(r - (case.nk - 1), case.num_buckets, case.max_distance, case.bidirectional)
            for r in range(case.nq + case.nk - 1)]
    assert lut[0].tolist() == want


def test_offset_lut_marks_the_end_of_each_run():
    buckets = torch.tensor([3, 3, 1, 0, 0, 0, 2, 5, 5, 3])
    want_end = []
    for r in range(len(buckets)):  # walk right while the bucket stays the same
        e = r
        while e + 1 < len(buckets) and buckets[e + 1] == buckets[r]:
            e += 1
        want_end.append(e)
    got = offset_lut(buckets)
    assert got.dtype == torch.int32 and got[0].tolist() == buckets.tolist() and got[1].tolist() == want_end


def test_cases_cover_one_run_and_many_run_tiles():
    """Both paths of the kernel run: tiles of one bucket (one scalar per tile) and tiles that span several."""
    counts = {c.name: _tiles_by_runs(c) for c in CASES}
    assert all(many > 0 for _, many in counts.values()), counts      # every case has a diagonal
    assert counts["many-buckets-70"] == (0, 25), counts                # every tile walks its runs
    one, many = counts["few-buckets-70"]
    assert one > many > 0, counts                                      # mostly one-bucket tiles


@needs_interpreter
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_t5_kernel_forward_and_gradients_under_the_interpreter(case):
    q, k, v, table, mask = _inputs(case)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, table)]
    out = t5_bias_attention(*leaves[:3], leaves[3], case.num_buckets, case.max_distance, case.bidirectional,
                            attn_mask=mask, is_causal=case.causal, alpha=case.alpha)
    cot = torch.randn(out.shape, generator=seeded(3))
    grads = torch.autograd.grad(out, leaves, cot)

    exact = [t.double().requires_grad_(True) for t in (q, k, v, table)]
    dense = _dense_formula(case, *exact, mask)
    ref = t5_bias_attention_reference(*[t.double().requires_grad_(True) for t in (q, k, v)],
                                      exact[3].detach().requires_grad_(True), case.num_buckets, case.max_distance,
                                      case.bidirectional, attn_mask=mask, is_causal=case.causal, alpha=case.alpha)
    torch.testing.assert_close(ref.double(), dense, rtol=1e-10, atol=1e-12)  # the two references agree
    dense_grads = torch.autograd.grad(dense, exact, cot.double())
    for name, got, want in zip(["out", "q", "k", "v", "table"], [out] + list(grads), [dense] + list(dense_grads)):
        assert torch.isfinite(got).all(), f"{case.name}: {name} has NaN/Inf"
        scale = float(want.detach().abs().max())
        err = float((got.detach().double() - want.detach()).abs().max())
        # fp32 kernels: sums of up to ~80 terms per entry, the table's of up to Nq * Nk dS per bucket
        assert err <= 2e-5 * max(scale, 1.0), f"{case.name}: {name} off by {err:.3g} (scale {scale:.3g})"


@needs_interpreter
def test_t5_table_gradient_sums_each_bucket_exactly_once_under_the_interpreter():
    """With q = k = 0 the weights depend on the table alone; the table gradient of a sum of outputs with a
    constant cotangent must equal the float64 sum of dS over each bucket's (i, j) pairs, per head: a bucket
    counted twice (two runs walked over the same offsets) or skipped shows here as a whole dS block."""
    case = Case("zero-logits", 40, 56, 16, 40)
    _, _, v, table, _ = _inputs(case)
    q = torch.zeros(1, 2, case.nq, 16)
    k = torch.zeros(1, 2, case.nk, 16)
    t = table.clone().requires_grad_(True)
    out = t5_bias_attention(q, k, v, t, case.num_buckets, case.max_distance, case.bidirectional)
    cot = torch.randn(out.shape, generator=seeded(5))
    (got,) = torch.autograd.grad(out, t, cot)
    t64 = table.double().requires_grad_(True)
    dense = _dense_formula(case, q.double(), k.double(), v.double(), t64, None)
    (want,) = torch.autograd.grad(dense, t64, cot.double())
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
