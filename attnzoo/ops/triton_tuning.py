"""Tile configurations of the softmax-family and pointwise Triton kernels, and their autotuning.

Each kernel has a short list of ``triton.Config`` (BLOCK_M, BLOCK_N, num_warps, num_stages) per
*tile class*: element size (fp32 vs fp16/bf16), head width (the padded head dim BLOCK_D / BLOCK_DV:
<= 64, 128 or 256) and whether the launch drops weights in the kernel (Philox state is
register-hungry, so dropout flavours get smaller tiles per thread). The lists hold configurations
known to do well on Hopper and Ampere (the Triton fused-attention tutorial's search space: BLOCK_M
64/128, BLOCK_N 32/64/128, 4/8 warps, 2-4 stages), pruned to 2-4 per class because every
configuration costs one compile per kernel specialisation; `benchmarks/compile_triton_kernels.py`
compiles every one of them for sm_90 and checks that it fits (shared memory, spills). The first
configuration of a list is its default.

How a launch picks its tiles (``TunedKernel.launch``):
- under the interpreter: 16 x 16 tiles (``INTERPRETER_TILES``), so the tiny CI shapes still cross
  several blocks (partial blocks, causal block skipping) and stay fast;
- on a GPU: ``triton.autotune`` over the class's list, keyed on the tuning key (the kernel's
  flavour constexprs, D, DV, a power-of-two bucket of Nq and of Nk, and the dtypes of the tensor
  arguments, which Triton adds itself). Each key is tuned once per process;
- on a GPU with ``ATTNZOO_TRITON_AUTOTUNE=0``, or for a launch whose tiles the host must know
  beforehand (T5's dK/dV launch sizes its table-gradient rows from BLOCK_N): the default configuration;
- inside ``pinned_config(i)`` (tests): configuration i of the list, without tuning.

*Variants*: a kernel may also have configurations of another code path, picked by constexprs in the
configuration (the softmax forward's Hopper variant: HOPPER / WARP_SPEC, kernels/flash_softmax/
hopper.py). They join the list only for launches that pass ``variants=True`` (the host code decides
which launches can run them: device, flavour, alignment), after the classic ones, so the default
stays the classic first row and the autotuner chooses between the code paths by timing them. Such
launches get their own Autotuner and frozen choice. Under the interpreter a pinned variant row keeps
its constexprs with the interpreter's tiles (how its tests run it).

Grids are functions of the chosen configuration (``META["BLOCK_M"]``), which is what both
``triton.autotune`` and torch.compile's ``wrap_triton`` expect.
"""
from __future__ import annotations

import contextlib
import os

import torch

from .triton_utils import HAVE_TRITON, INTERPRETED, launcher, quick_bench

if HAVE_TRITON:
    import triton

AUTOTUNE_ENV = "ATTNZOO_TRITON_AUTOTUNE"
INTERPRETER_TILES = {"BLOCK_M": 16, "BLOCK_N": 16}
WIDTHS = (64, 128, 256)  # head-width classes: the padded head dim rounded up to one of these

_pinned: list = []  # innermost pinned_config index last (a plain list: dynamo never traces these)


def autotune_enabled() -> bool:
    """Autotuning runs on a GPU unless ATTNZOO_TRITON_AUTOTUNE=0 (read at each launch)."""
    return not INTERPRETED and os.environ.get(AUTOTUNE_ENV, "1") != "0"


@contextlib.contextmanager
def pinned_config(index: int):
    """Every tuned launch inside uses configuration ``index`` of its list (modulo its length), without
    autotuning: how the GPU tests check each configuration's numbers."""
    _pinned.append(int(index))
    try:
        yield
    finally:
        _pinned.pop()


def tile_class(dtype: torch.dtype, block_d: int, block_dv: int) -> tuple[bool, int]:
    """(fp32 operands?, head-width class) of a launch."""
    widest = max(block_d, block_dv)
    width = next((w for w in WIDTHS if widest <= w), WIDTHS[-1])
    return dtype == torch.float32, width


def n_bucket(n: int) -> int:
    """The autotuning key's sequence-length bucket: the next power of two (at least 16), so a new
    length retunes only when it changes bucket."""
    return max(16, 1 << max(0, int(n) - 1).bit_length())


def configs(table):
    """{(fp32, width): [triton.Config]} from {(fp32, width): [(BLOCK_M, BLOCK_N, warps, stages[, constexprs])]}."""
    return {cls: [triton.Config({"BLOCK_M": row[0], "BLOCK_N": row[1], **(row[4] if len(row) > 4 else {})},
                                num_warps=row[2], num_stages=row[3]) for row in rows]
            for cls, rows in table.items()}


def _with(constants, rows):
    """The rows with ``constants`` added to each one's constexprs (a row's own values win)."""
    for row in rows:
        row.kwargs = {**constants, **row.kwargs}
    return rows


class TunedKernel:
    """One ``@triton.jit`` kernel, its configurations per tile class and its autotuning key.

    ``launch(dtype, block_d, block_dv, dropout, tune=True)`` returns (the object to launch through
    ``wrap_triton``, the launch keywords to add): an Autotuner with no extra keywords, or the kernel
    itself with BLOCK_M / BLOCK_N / num_warps / num_stages. One Autotuner per tile class is kept for
    the process, so its cache of tuned keys persists across calls."""

    def __init__(self, fn, table, dropout_table, key, variants=None, constants=None):
        self.fn = fn
        # constants: constexprs every row passes unless it sets its own (the variant switches, off):
        # explicit values, not signature defaults, so every launcher (inductor's included) sees them
        constants = dict(constants or {})
        self.configs = {(False,) + cls: _with(constants, rows) for cls, rows in configs(table).items()}
        self.configs.update({(True,) + cls: _with(constants, rows) for cls, rows in configs(dropout_table).items()})
        # {(dropout, fp32, width): [triton.Config]}: rows of another code path, offered per launch
        self.variants = {(False,) + cls: _with(constants, rows) for cls, rows in configs(variants or {}).items()}
        self.key = list(key)
        self._tuners = {}
        # (dropout, dtype, block_d, block_dv, shape_key, variants) -> the launch keywords tuned for it
        self._frozen = {}

    def configs_for(self, dtype, block_d, block_dv, dropout=False, variants=False):
        """The class's list; with ``variants``, followed by the class's variant rows (if any)."""
        cls = (bool(dropout),) + tile_class(dtype, block_d, block_dv)
        rows = self.configs[cls]
        return rows + self.variants.get(cls, []) if variants else rows

    def launch(self, dtype, block_d, block_dv, dropout=False, tune=True, variants=False):
        candidates = self.configs_for(dtype, block_d, block_dv, dropout, variants)
        if INTERPRETED:  # the interpreter's tiles; the row's other constexprs (a variant's switches) kept
            chosen = candidates[_pinned[-1] % len(candidates)] if _pinned else candidates[0]
            return self.fn, {**chosen.kwargs, **INTERPRETER_TILES}
        if _pinned or not tune or not autotune_enabled() or len(candidates) == 1:
            chosen = candidates[_pinned[-1] % len(candidates)] if _pinned else candidates[0]
            return self.fn, {**chosen.kwargs, "num_warps": chosen.num_warps, "num_stages": chosen.num_stages}
        # the list is fixed by (dropout, tile class, variants offered): one Autotuner per list
        cls = (bool(dropout),) + tile_class(dtype, block_d, block_dv) + (bool(variants),)
        if cls not in self._tuners:
            self._tuners[cls] = triton.autotune(configs=candidates, key=self.key, do_bench=quick_bench)(self.fn)
        return self._tuners[cls], {}

    def run_bound(self, bound: dict, grid, args, kwargs, *, dtype, block_d, block_dv, dropout=False, shape_key,
                  variants=False):
        """``run`` for a launch bound to a kept plan's signature (kernels/*/bound.py, linear/bound.py): ``bound`` (the
        plan's dict) keeps this kernel's launch (the kernel, its tuple grid and every keyword) once the
        first launch froze its tiles, and later launches index the kernel with them directly."""
        launch = bound.get((self, variants))
        if launch is not None:
            launch[0][launch[1]](*args, **launch[2])
            return
        self.run(grid, args, kwargs, dtype=dtype, block_d=block_d, block_dv=block_dv, dropout=dropout,
                 shape_key=shape_key, variants=variants)
        tiles = self._frozen.get((bool(dropout), dtype, block_d, block_dv, shape_key, variants))
        if tiles is not None:
            bound[(self, variants)] = (self.fn, grid(tiles), {**kwargs, **tiles})

    def run(self, grid, args, kwargs, *, dtype, block_d, block_dv, dropout=False, tune=True, shape_key=None,
            variants=False):
        """Launch the kernel on ``grid`` (a function of the launch's tile keywords, META) with ``args``
        and ``kwargs``. ``shape_key`` names what the autotuner keys on for this launch (the flavour
        constexprs, D, DV, the length buckets); in eager mode the configuration tuned for it is frozen
        after the first launch, and later launches go straight to the kernel with those keywords and a
        tuple grid: no autotuner bookkeeping over every argument on each call (host-overhead.md)."""
        frozen_key = (bool(dropout), dtype, block_d, block_dv, shape_key, variants) if shape_key is not None else None
        eager = not torch.compiler.is_compiling()
        if eager and frozen_key is not None and not _pinned:
            tiles = self._frozen.get(frozen_key)
            if tiles is not None:
                self.fn[grid(tiles)](*args, **kwargs, **tiles)
                return
        kernel, tiles = self.launch(dtype, block_d, block_dv, dropout, tune, variants)
        launcher(kernel)[grid](*args, **kwargs, **tiles)
        if eager and frozen_key is not None and not _pinned:
            if isinstance(kernel, triton.runtime.Autotuner):
                best = getattr(kernel, "best_config", None)  # set by the launch (absent if it did not run)
                if best is None:
                    return
                tiles = best.all_kwargs()
            self._frozen[frozen_key] = dict(tiles)


# --- the configuration lists ------------------------------------------------------------------
# (BLOCK_M, BLOCK_N, num_warps, num_stages); the first row of each list is its default.
# Hopper's wgmma gives each warpgroup (4 warps) 64 rows of a dot's M dimension, so 8 warps go with
# 128-row tiles (M = BLOCK_M for the forward and dQ, BLOCK_N for dK/dV's transposed tiles). The lists
# keep configurations that compile for sm_90 without register spills in the plain flavours
# (benchmarks/results/gpu/ptx_build_check.md).
# Forward and dQ: one program per BLOCK_M queries streaming BLOCK_N keys. dK/dV: one program per
# BLOCK_N keys streaming BLOCK_M queries (small BLOCK_M, wide BLOCK_N, as in the tutorial's backward).
# fp32 operands take twice the registers and shared memory per element, wide heads more again;
# exact fp32 dots (input_precision "ieee", no tensor cores) hold their operands in registers, so fp32
# lists keep small tiles over 8 warps.

FORWARD = {
    (False, 64): [(128, 64, 4, 3), (128, 64, 4, 4), (128, 128, 8, 3), (64, 64, 4, 3)],
    (False, 128): [(128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 32, 8, 3)],
    (False, 256): [(128, 64, 8, 2), (64, 32, 8, 2)],
    (True, 64): [(32, 32, 4, 3), (32, 32, 8, 3)],
    (True, 128): [(32, 32, 8, 2), (16, 32, 8, 2)],
    (True, 256): [(16, 32, 8, 2), (16, 16, 8, 2)],
}
KEYS_BACKWARD = {  # dK/dV: BLOCK_M is the streamed (query) block
    (False, 64): [(64, 128, 8, 3), (32, 128, 8, 4), (32, 64, 4, 4)],
    (False, 128): [(32, 128, 8, 3), (32, 64, 4, 3), (32, 128, 8, 2)],
    (False, 256): [(32, 32, 8, 2), (16, 32, 8, 2)],
    (True, 64): [(32, 32, 4, 3), (32, 32, 8, 3)],
    (True, 128): [(32, 32, 8, 2), (16, 32, 8, 2)],
    (True, 256): [(16, 32, 8, 2), (16, 16, 8, 2)],
}
QUERIES_BACKWARD = {  # dQ: BLOCK_N is the streamed (key) block
    (False, 64): [(128, 64, 8, 3), (128, 32, 8, 4), (64, 64, 4, 3), (64, 32, 4, 4)],
    (False, 128): [(128, 32, 8, 3), (64, 32, 4, 3), (64, 64, 4, 2), (64, 64, 8, 3)],
    (False, 256): [(32, 32, 8, 2), (32, 16, 8, 2)],
    (True, 64): [(32, 32, 4, 3), (32, 32, 8, 3)],
    (True, 128): [(32, 32, 8, 2), (32, 16, 8, 2)],
    (True, 256): [(16, 32, 8, 2), (16, 16, 8, 2)],
}
# In-kernel dropout draws one Philox number per weight, whose state takes many registers per
# element of the tile: its flavours get tiles with fewer elements per thread.
FORWARD_DROPOUT = {
    (False, 64): [(64, 64, 4, 3), (128, 64, 8, 3)],
    (False, 128): [(64, 64, 4, 3), (128, 64, 8, 2)],
    (False, 256): [(64, 32, 8, 2), (32, 32, 4, 2)],
    (True, 64): [(32, 32, 4, 3), (32, 32, 8, 3)],
    (True, 128): [(32, 32, 8, 2), (16, 32, 8, 2)],
    (True, 256): [(16, 32, 8, 2), (16, 16, 8, 2)],
}
KEYS_BACKWARD_DROPOUT = {
    (False, 64): [(32, 64, 4, 3), (64, 64, 8, 3)],
    (False, 128): [(32, 64, 8, 3), (32, 32, 4, 2)],
    (False, 256): [(32, 32, 8, 2), (16, 32, 8, 2)],
    (True, 64): [(32, 32, 4, 3), (32, 32, 8, 3)],
    (True, 128): [(32, 32, 8, 2), (16, 32, 8, 2)],
    (True, 256): [(16, 32, 8, 2), (16, 16, 8, 2)],
}
QUERIES_BACKWARD_DROPOUT = {
    (False, 64): [(64, 32, 4, 3), (64, 64, 8, 3)],
    (False, 128): [(64, 32, 4, 3), (64, 64, 8, 2)],
    (False, 256): [(32, 32, 8, 2), (32, 16, 8, 2)],
    (True, 64): [(32, 32, 4, 3), (32, 32, 8, 3)],
    (True, 128): [(32, 32, 8, 2), (32, 16, 8, 2)],
    (True, 256): [(16, 32, 8, 2), (16, 16, 8, 2)],
}
# The Hopper variant of the forward (kernels/flash_softmax/hopper_kernels.py: TMA descriptor loads of
# K / V), fp16 / bf16 heads up to 128 wide only; offered next to FORWARD's rows on sm_90+ for the
# flavours it computes (kernels/flash_softmax/hopper.py), so the autotuner times both code paths.
# 128-row tiles (one wgmma M per warpgroup), the classic defaults' shapes. Which wins is unmeasured.
# No warp-specialised rows ({"WARP_SPEC": True}): Triton 3.6 and 3.8 crash in their
# NVGPUWarpSpecialization pass on an sm_90 attention loop with 4 warps and leave it unspecialised
# with 8 (docs/kernels_softmax_family.md); a row can be added here once a Triton builds one.
FORWARD_HOPPER = {
    (False, 64): [(128, 64, 4, 3, {"HOPPER": True}), (128, 128, 8, 3, {"HOPPER": True}),
                  (128, 64, 4, 4, {"HOPPER": True})],
    (False, 128): [(128, 64, 8, 3, {"HOPPER": True}), (128, 128, 8, 2, {"HOPPER": True})],
}
# The Hopper variant of dQ (same descriptors and conditions as the forward's): QUERIES_BACKWARD's
# shapes that build without spills as the Hopper kernel. Unmeasured.
# (Spilled in the build check, left out: 128 x 64 with 4 warps at D 64; 128 x 64 / 8 warps / 2 stages
# and 64 x 64 / 4 warps in the L2 flavour at D 128.)
QUERIES_BACKWARD_HOPPER = {
    (False, 64): [(128, 64, 8, 3, {"HOPPER": True}), (128, 32, 8, 4, {"HOPPER": True})],
    (False, 128): [(128, 32, 8, 3, {"HOPPER": True})],
}
# The Hopper variant of dK/dV (Q / dO streamed and the key block loaded through descriptors; the same
# conditions as dQ's plus TMA-readable q and dO). The rows that build for sm_90 without spills in all
# four checked flavours on both Triton 3.8 and 3.6 (benchmarks/compile_triton_kernels.py; on 3.8 every
# classic D 128 row and every classic L2 + preference row spills there). Unmeasured.
# (Spilled, left out: 64 x 128 / 8 warps at D 64 on 3.8, 32 x 128 / 4 stages on 3.6; 32 x 128, 32 x 64
# and 64 x 64 with 8 warps at D 128.)
KEYS_BACKWARD_HOPPER = {
    (False, 64): [(32, 128, 8, 3, {"HOPPER": True}), (32, 128, 8, 2, {"HOPPER": True})],
    (False, 128): [(16, 64, 8, 3, {"HOPPER": True}), (16, 64, 8, 2, {"HOPPER": True})],
}
