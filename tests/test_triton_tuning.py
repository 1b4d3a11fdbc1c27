"""The tile configurations and autotuning rules of the softmax-family and pointwise kernels
(attnzoo/ops/triton_tuning.py), checked on a CPU. Whether each configuration compiles and fits is
benchmarks/compile_triton_kernels.py's job; whether each computes the right numbers is
tests/test_triton_gpu.py's (it pins every configuration in turn)."""
from __future__ import annotations

import pytest
import torch

from attnzoo.ops import triton_tuning as tuning
from tests.common import needs_triton

pytestmark = needs_triton
TABLES = {
    "forward": (tuning.FORWARD, tuning.FORWARD_DROPOUT),
    "keys_backward": (tuning.KEYS_BACKWARD, tuning.KEYS_BACKWARD_DROPOUT),
    "queries_backward": (tuning.QUERIES_BACKWARD, tuning.QUERIES_BACKWARD_DROPOUT),
}
CLASSES = [(fp32, width) for fp32 in (False, True) for width in tuning.WIDTHS]


@pytest.mark.parametrize("name", list(TABLES))
def test_every_tile_class_has_a_short_list_of_valid_configs(name):
    for table in TABLES[name]:
        assert sorted(table) == sorted(CLASSES)
        for cls, rows in table.items():
            # each configuration costs one compile per kernel specialisation when autotuning
            assert 1 <= len(rows) <= 4, (cls, rows)
            assert len(set(rows)) == len(rows), (cls, rows)
            for bm, bn, warps, stages in rows:
                # tl.dot needs every dimension >= 16; tiles are powers of two
                assert bm >= 16 and bn >= 16 and bm & (bm - 1) == 0 and bn & (bn - 1) == 0, (cls, rows)
                assert warps in (4, 8) and 2 <= stages <= 4, (cls, rows)


def test_length_buckets_are_powers_of_two():
    assert [tuning.n_bucket(n) for n in (1, 16, 17, 197, 1024, 1025, 4096)] == [16, 16, 32, 256, 1024, 2048, 4096]


@pytest.mark.parametrize("dtype,d,dv,expect", [
    (torch.bfloat16, 16, 16, (False, 64)), (torch.float16, 64, 32, (False, 64)), (torch.bfloat16, 128, 64, (False, 128)),
    (torch.float32, 64, 128, (True, 128)), (torch.float32, 256, 256, (True, 256)), (torch.bfloat16, 32, 256, (False, 256)),
])
def test_tile_class_follows_dtype_and_widest_head(dtype, d, dv, expect):
    assert tuning.tile_class(dtype, d, dv) == expect


def _kernel():
    from attnzoo.ops.kernels.flash_softmax import triton as softmax
    return softmax.FORWARD


def test_interpreter_uses_fixed_small_tiles(monkeypatch):
    monkeypatch.setattr(tuning, "INTERPRETED", True)
    kernel = _kernel()
    fn, tiles = kernel.launch(torch.bfloat16, 64, 64, False)
    assert tuning.INTERPRETER_TILES == {"BLOCK_M": 16, "BLOCK_N": 16}
    # the interpreter's tiles, plus the row's other constexprs (the forward's variant switches, off)
    assert fn is kernel.fn and tiles == {**kernel.configs_for(torch.bfloat16, 64, 64)[0].kwargs, **tuning.INTERPRETER_TILES}
    assert not tiles.get("HOPPER", False)


def test_gpu_launches_autotune_unless_told_not_to(monkeypatch):
    """On a GPU: an Autotuner over the class's list (one per class, reused), the default configuration
    with ATTNZOO_TRITON_AUTOTUNE=0 or tune=False (T5's dK/dV launch), configuration i inside pinned_config(i)."""
    from triton.runtime.autotuner import Autotuner

    monkeypatch.setattr(tuning, "INTERPRETED", False)
    monkeypatch.delenv(tuning.AUTOTUNE_ENV, raising=False)
    kernel = _kernel()
    tuner, extra = kernel.launch(torch.bfloat16, 64, 64, False)
    assert isinstance(tuner, Autotuner) and extra == {} and tuner.fn is kernel.fn
    assert [c.kwargs for c in tuner.configs] == [c.kwargs for c in kernel.configs_for(torch.bfloat16, 64, 64)]
    assert kernel.launch(torch.bfloat16, 32, 64, False)[0] is tuner  # same class, same tuner (its cache)
    assert kernel.launch(torch.bfloat16, 64, 64, True)[0] is not tuner  # dropout: its own list
    # the Hopper rows offered: their own tuner over the class's list followed by the variant rows
    with_variants = kernel.launch(torch.bfloat16, 64, 64, False, variants=True)[0]
    assert with_variants is not tuner and kernel.variants[(False, False, 64)]
    assert [c.kwargs for c in with_variants.configs] == [c.kwargs for c in kernel.configs_for(torch.bfloat16, 64, 64, variants=True)]
    assert kernel.launch(torch.bfloat16, 64, 64, False)[0] is tuner
    default = kernel.configs_for(torch.float32, 128, 128)[0]
    fn, tiles = kernel.launch(torch.float32, 128, 128, False, tune=False)
    assert fn is kernel.fn
    assert tiles == {**default.kwargs, "num_warps": default.num_warps, "num_stages": default.num_stages}
    monkeypatch.setenv(tuning.AUTOTUNE_ENV, "0")
    assert kernel.launch(torch.float32, 128, 128, False) == (fn, tiles)
    monkeypatch.delenv(tuning.AUTOTUNE_ENV)
    rows = kernel.configs_for(torch.bfloat16, 64, 64)
    with tuning.pinned_config(1):
        fn, tiles = kernel.launch(torch.bfloat16, 64, 64, False)
        assert fn is kernel.fn and tiles["BLOCK_M"] == rows[1].kwargs["BLOCK_M"]
        assert tiles["num_warps"] == rows[1].num_warps and tiles["num_stages"] == rows[1].num_stages
        with tuning.pinned_config(len(rows) + 2):  # indices wrap around shorter lists
            assert kernel.launch(torch.bfloat16, 64, 64, False)[1]["BLOCK_N"] == rows[2].kwargs["BLOCK_N"]
    assert isinstance(kernel.launch(torch.bfloat16, 64, 64, False)[0], Autotuner)


def test_tuning_keys_name_kernel_arguments():
    """A key name that is no argument of the kernel would be silently ignored by triton.autotune."""
    from attnzoo.ops.kernels.pointwise import triton as pointwise
    from attnzoo.ops.kernels.flash_softmax import triton as softmax

    for module in (softmax, pointwise):
        for kernel in (module.FORWARD, module.KEYS_BACKWARD, module.QUERIES_BACKWARD):
            assert set(kernel.key) <= set(kernel.fn.arg_names), (kernel.fn.fn.__name__, kernel.key)
            assert {"tune_nq", "tune_nk", "D", "DV", "CAUSAL", "DROPOUT"} <= set(kernel.key)
