"""The packed rows of the speed grid (attnzoo/bench/packed_grid.py): they are in the grid the GPU session
runs, their batch is the mixed lengths of a fine-tuning batch (half the padded tokens padding), their
FLOPs count each sequence's own n^2, and on CPU the auto row runs the packed route while the Triton and
varlen_attn rows say why they do not run here."""
from __future__ import annotations

import pytest
import torch

import attnzoo.functional as AF
from attnzoo.bench import packed_grid, speed_grid
from attnzoo.bench.errors import Skipped, Unsupported
from attnzoo.bench.flops import flops
from attnzoo.bench.packed_batch import FRACTIONS
from attnzoo.bench.problem import Problem
from attnzoo.ops.sizes import Shape
from tests.common import INTERPRET

PROBLEM = Problem(Shape(batch=8, heads=2, seq_q=1024, head_dim=16), torch.float32, torch.device("cpu"), "fwd", False)


def cases(device):
    return {c.label: c for c in speed_grid.speed_cases(torch.device(device))}


def test_the_gpu_grid_has_the_packed_rows():
    labels = cases("cuda")
    assert "varlen_attn" in labels
    for name in packed_grid.PACKED_VARIANTS:
        assert f"{name}-packed / triton" in labels and f"{name}-packed / auto" in labels
    assert labels["softmax-packed / triton"].applies(PROBLEM)
    # Sinkhorn: the non-causal problems only (causal is each sequence's prefix loop, per length)
    assert labels["sinkhorn-packed / triton"].applies(PROBLEM)
    assert not labels["sinkhorn-packed / triton"].applies(Problem(Shape(8, 2, 1024, 16), torch.float16,
                                                                  torch.device("cuda"), "fwd", True))
    assert not labels["softmax-packed / triton"].applies(Problem(Shape(1, 2, 4096, 16), torch.float16,
                                                                 torch.device("cuda"), "fwd", True))


def test_batch_is_half_padding_and_flops_count_each_sequence():
    lengths = packed_grid.packed_lengths(PROBLEM)
    assert sum(lengths) * 2 == PROBLEM.shape.batch * PROBLEM.shape.seq_q     # FRACTIONS sum to 4 of 8
    dense = flops("softmax", PROBLEM.shape, "fwd")
    share = sum(f * f for f in FRACTIONS) / len(FRACTIONS)                   # sum n_i^2 / (B N^2)
    assert packed_grid.packed_flops("softmax", PROBLEM) == pytest.approx(dense * share, rel=1e-3)


def test_cpu_auto_row_runs_the_packed_route_and_the_others_say_why_not():
    small = Problem(Shape(batch=3, heads=2, seq_q=16, head_dim=8), torch.float32, torch.device("cpu"), "fwd", True)
    grid = cases("cpu")
    prepared = grid["softmax-packed / auto"].prepare(small)
    q, k, v, cu, longest = packed_grid.packed_inputs(small)
    want = AF.varlen("softmax", q, k, v, cu, cu, longest, longest, is_causal=True, backend="reference")
    torch.testing.assert_close(prepared.forward(), want, atol=1e-5, rtol=1e-5)
    with pytest.raises(Unsupported, match="float16 / bfloat16"):
        grid["varlen_attn"].prepare(small)
    if INTERPRET:
        with pytest.raises(Skipped, match="interpreter"):
            grid["softmax-packed / triton"].prepare(small)
