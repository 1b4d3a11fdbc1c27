"""Sinkhorn attention with the streaming passes as Triton kernels (the "triton" backend).

Same semantics as ``reference.py`` and the same algorithm as ``cpu.py`` (``streaming.py`` gives
the math); here each pass is one kernel launch over a (row blocks, B*H) grid, with the l2 norms
folded into the potentials (streaming.py, reduced potentials) so every kernel sees dot-product
logits. Cost per call at n_iters = k (one pass = one sweep over the N x N logits, recomputed from q
and k on the tensor cores, one exponential per logit): forward 2k logsumexp passes + 1
softmax-with-bias pass; backward 1 (dv and the last adjoint) + 2k - 1 (unrolled adjoint) + 1 (dq
and dk, FlashAttention-2's layout: key blocks own dk, dq is summed with float32 atomics), plus an
O(k N) kernel forming the adjoint's rank-one factors. Every pass after the first sums its
exponentials under one known shift per program instead of a running maximum, and the dq / dk pass
takes every unrolled term from one small product instead of one exponential per logit each
(triton_kernels.py; docs/kernels_sinkhorn.md has the algebra and the cost model). Inputs fp16 /
bf16 / fp32, every potential and reduction float32; only O(n_iters N) vectors are kept.

The potentials live in two stacks written in place by the kernels, F = f^1..f^T (T, B, H, Nq) and
G = g^0..g^T (T + 1, B, H, Nk); the backward's adjoints likewise (DF, DG): no host arithmetic
between launches. Calls with B*H*Nq*Nk < FOLD_BELOW also compute the O(N) vectors each pass needs
first (g^0 = -a|k|^2 in the first row pass, dout.out in the dv pass) inside that pass, one launch
less each way; larger calls launch a row-dot kernel for them (the per-tile norms would cost more
than the launch there).

The forward and the two backwards are torch custom ops (``attnzoo::sinkhorn_fwd``, ``_bwd``,
``_bwd_implicit``): torch.compile sees through the forward and the unrolled backward
(``triton_op`` on a GPU); the implicit backward stops when its series converges, a data-dependent
loop, so it is an opaque op. Causal attention runs the prefix loop of
``streaming.causal_by_prefix`` (exact, O(N) memory, O(n_iters N^3) work); under a sliding window with no
other mask or a per-key one, each row's window problem instead, batched (``causal_window.py``,
O(n_iters N w^2)). A
non-causal window reaches every pass as its band's two offsets: the tiles outside it are skipped.

Tiles: on a GPU each kernel has a short list of (BLOCK_X, BLOCK_Y, warps, stages) candidates
(``candidates``); large problems pick among them with ``triton.autotune`` (one compile per
candidate, once per process), small ones take the first. Under TRITON_INTERPRET=1 every kernel
runs 16 x 16 tiles, so tiny test shapes cross several blocks. Off a GPU without the interpreter
the kernels cannot run at all; the only callers there are tools that intercept the launches
(benchmarks/compile_triton_kernels.py, tests/mutation_probe.py), and they get one launch per
candidate, so every tile a GPU may pick is compiled and analysed.
"""
from __future__ import annotations

import contextlib
import math
import os
from typing import Optional

import torch
import triton
from torch import Tensor

from ..logit_extras import mask_with_window, window_band
from ..triton_logit_extras import band_bounds
from ..triton_utils import INTERPRETED, dot_precision, kernel_op, launcher, quick_bench, stand_in, tracing_only
from . import triton_kernels as K
from .causal_window import causal_by_window, takes
from .cpu import check_options
from .streaming import Problem, causal_by_prefix, streaming_backward

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
HALF = (torch.float16, torch.bfloat16)
COSTS = ("l2", "dot")
# Largest head dim (D and Dv) the kernels are built for: every candidate below fits an H100's
# 227 KB of shared memory per block up to it (benchmarks/compile_triton_kernels.py).
MAX_HEAD_DIM = 256
# B*H*Nx*Ny from which a launch autotunes among its candidates (a few ms of benchmarking per new
# shape); below it the first candidate runs: tests and small layers do not pay the compiles.
AUTOTUNE_MIN_WORK = 1 << 26
# B*H*Nq*Nk below which g^0 (l2) and delta are computed inside the first pass that reads them
# (module doc): host-bound sizes, where a launch costs more than the per-tile norms.
FOLD_BELOW = AUTOTUNE_MIN_WORK
# Numerical limits of the shifted sums (triton_kernels.py explains each): a row summing to less
# than MIN_SUM under its program's shift is walked again with a running maximum; a backward row
# potential leaves the exponent when its program's potentials span at most SPREAD_MAX (log2
# units); an iteration's adjoint terms use rank-one factors when no factor exceeds 2^FACTOR_MAX.
MIN_SUM = 2.0 ** -80
SPREAD_MAX = 40.0
FACTOR_MAX = 58.0
# Factor columns per tensor-core product in _grad_qk_kernel (a TF32 product's K step): 2 per
# unrolled term and 1 for delta, so up to n_iters = 3 in one product.
FACTOR_COLUMNS = 8


# (BLOCK_X, BLOCK_Y, num_warps, num_stages); the first of each list is the untuned choice.
# "scan": the logsumexp and weighted-sum passes (q, k tiles only); "attend": + a (BLOCK_X, Dv)
# fp32 accumulator; "grad_v": + (BLOCK_X, Dv) accumulator, dout tiles; "grad_qk": + k, v resident,
# a (BLOCK_X, D) accumulator and three (BLOCK_X, BLOCK_Y) fp32 tiles. Every candidate is compiled
# for sm_90 by the build check (shared memory within the limit; spills listed there).
_HALF = {
    "scan": {64: ((128, 64, 4, 3), (128, 128, 8, 3), (64, 128, 4, 3)),
             128: ((128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3)),
             256: ((64, 64, 8, 2),)},
    "attend": {64: ((128, 64, 4, 3), (128, 128, 8, 3), (64, 64, 4, 3)),
               128: ((128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3)),
               256: ((64, 32, 8, 2),)},
    "grad_v": {64: ((128, 64, 8, 3), (64, 64, 4, 3)),
               128: ((128, 64, 8, 2), (64, 64, 4, 3)),
               256: ((64, 32, 8, 2),)},
    "grad_qk": {64: ((128, 64, 8, 2), (64, 64, 4, 3)),
                128: ((128, 32, 8, 2), (64, 32, 4, 2)),
                256: ((32, 32, 8, 1),)},
}
# fp32 dots without TF32 run on the FMA units, whose operand layouts take many registers: small
# tiles, and still some spills in _grad_qk_kernel at D >= 128 (the least of the tiles tried).
_FP32 = {
    "scan": {64: ((32, 32, 8, 1),), 128: ((32, 32, 8, 1),), 256: ((32, 16, 8, 1),)},
    "attend": {64: ((32, 32, 8, 1),), 128: ((32, 32, 8, 1),), 256: ((16, 32, 8, 1),)},
    "grad_v": {64: ((32, 32, 4, 2),), 128: ((32, 16, 4, 2),), 256: ((16, 32, 8, 1),)},
    "grad_qk": {64: ((32, 32, 8, 1),), 128: ((16, 32, 8, 1),), 256: ((16, 32, 8, 1),)},
}
_INTERPRETED_TILE = ((16, 16, 1, 1),)


def _block(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def candidates(kind: str, width: int, dtype, masked: bool = False) -> tuple:
    """The tile candidates of a kernel kind for a padded head width (64 covers 16..64). With a
    (BLOCK_X, BLOCK_Y) mask tile to read (not a vector: key padding is one), tiles above 128 x 64 are
    left out: the mask's pointer tile alone then needs more registers than a thread has (they
    spilled in the build check)."""
    if INTERPRETED:
        return _INTERPRETED_TILE
    table = _HALF if dtype in (torch.float16, torch.bfloat16) else _FP32
    cands = table[kind][max(64, _block(width))]
    if masked:
        cands = tuple(c for c in cands if c[0] * c[1] <= 128 * 64) or cands[:1]
    return cands


AUTOTUNE_ENV = "ATTNZOO_TRITON_AUTOTUNE"   # "0": every launch takes its first candidate
_TUNERS: dict = {}
_PINNED: list = []


@contextlib.contextmanager
def pinned_tile(index: int):
    """Every launch inside runs candidate ``index`` of its list (modulo its length), untuned: how the
    GPU tests check the numbers of every tile the autotuner may pick."""
    _PINNED.append(int(index))
    try:
        yield
    finally:
        _PINNED.pop()


def length_bucket(n: int) -> int:
    """The autotuning key's length bucket (the next power of two, at least 16)."""
    return max(16, 1 << max(0, int(n) - 1).bit_length())


def _tuner(kernel, cands, reset):
    key = (kernel.fn.__name__, cands)
    if key not in _TUNERS:
        configs = [triton.Config(dict(BLOCK_X=bx, BLOCK_Y=by), num_warps=w, num_stages=s) for bx, by, w, s in cands]
        _TUNERS[key] = triton.autotune(configs, key=["tune_nx", "tune_ny", "D"], reset_to_zero=list(reset) or None,
                                       do_bench=quick_bench)(kernel)
    return _TUNERS[key]


def _is_fake(t: Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake
    return is_fake(t)


def _launch(kernel, kind, width, nx, ny, bh, x, args, meta, tune, reset=()):
    """Launch ``kernel`` over (row blocks of nx, bh) with the tile of its kind (see the module doc).
    ``tune``: the call may autotune (not for the causal prefix loop: every prefix is a new shape)."""
    args = (*args, length_bucket(nx), length_bucket(ny))
    cands = candidates(kind, width, x.dtype, meta["MASK_KIND"] != 0 and meta["MASK_SHAPE"] == 0)
    if _PINNED:
        cands = (cands[_PINNED[-1] % len(cands)],)
    elif not tune or os.environ.get(AUTOTUNE_ENV, "1") == "0":
        cands = cands[:1]
    if x.device.type == "cuda":
        # an atomically accumulated output is zeroed between autotuning runs (reset_to_zero): done
        # eagerly only, while tracing for torch.compile it takes the first candidate
        if len(cands) > 1 and bh * nx * ny >= AUTOTUNE_MIN_WORK and not (reset and _is_fake(x)):
            grid = lambda META: (triton.cdiv(nx, META["BLOCK_X"]), bh)
            launcher(_tuner(kernel, cands, reset))[grid](*args, **meta)
            return
        cands = cands[:1]
    elif INTERPRETED:
        cands = cands[:1]
    for bx, by, warps, stages in cands:  # off a GPU without the interpreter: launches are intercepted
        opts = {} if INTERPRETED else dict(num_warps=warps, num_stages=stages)
        launcher(kernel)[(triton.cdiv(nx, bx), bh)](*args, **meta, BLOCK_X=bx, BLOCK_Y=by, **opts)



class TritonEngine:
    """The passes of streaming.py as launches of the kernels in triton_kernels.py, on reduced
    potentials: the kernels see logits A q.k (A = 2a for l2, a for dot) and g^0 = -a|k|^2 (l2).

    ``forward`` and ``backward_unrolled`` run a whole call (stacks written in place, every exponent
    bound used); the per-pass methods (``lse_rows``, ``wsum_rows``, ...) are streaming.py's engine
    interface, used by the implicit adjoint and by benchmarks/fused_sinkhorn.py."""

    @staticmethod
    def acc_dtype(p: Problem):
        return torch.float32

    def _setup(self, p: Problem) -> dict:
        """Shapes, the dot factor, the mask as the kernels read it (rows and columns orientation)."""
        s = getattr(p, "_triton", None)
        if s is not None:
            return s
        B, H, nq, D = p.q.shape
        nk, DV = p.k.shape[2], p.v.shape[3]
        mask, kind, rows, cols = stand_in(p.q, torch.uint8), 0, (0,) * 4, (0,) * 4
        if p.mask is not None:
            mask = p.mask.expand(B, H, nq, nk)
            kind = 1 if mask.dtype == torch.bool else 2
            if kind == 1:
                mask = mask.view(torch.uint8)  # same item size: a view, broadcast strides kept
            sb, sh, sm, sn = mask.stride()
            rows, cols = (sb, sh, sm, sn), (sb, sh, sn, sm)
        shape = lambda st: 1 if st[2] == 0 else 2 if st[3] == 0 else 0  # see _apply_mask
        a = p.logit_scale
        # a window: a row pass walks its band, a column pass the transposed band (triton_kernels._band_span)
        # passed to every launch, also without a band: inductor's write analysis binds only the arguments
        # a launch is handed (triton_utils.packed_defaults)
        band_rows = band_cols = dict(left=0, right=0, BAND=False)
        if p.band is not None:
            left, right = p.band
            band_rows, band_cols = dict(left=left, right=right, BAND=True), dict(left=right, right=left, BAND=True)
        s = dict(B=B, H=H, nq=nq, nk=nk, D=D, DV=DV, BH=B * H, a=a, A=2.0 * a if p.cost == "l2" else a,
                 mask=mask, rows=rows, cols=cols, shape_rows=shape(rows), shape_cols=shape(cols),
                 band_rows=band_rows, band_cols=band_cols,
                 # the O(N) vectors folded into a pass's first program need that program to walk every
                 # row: not under a band
                 fold=B * H * nq * nk < FOLD_BELOW and p.band is None, split_p=p.q.dtype in HALF,
                 meta=dict(MASK_KIND=kind, BLOCK_D=_block(D), UPCAST=INTERPRETED, PRECISION=dot_precision(p.q.dtype),
                           CAP=float(p.softcap), CAP_L2=bool(p.softcap) and p.cost == "l2"))
        p._triton = s
        return s

    def _vec(self, p, n, *lead):
        return torch.empty(*lead, p.q.shape[0], p.q.shape[1], n, dtype=torch.float32, device=p.q.device)

    def _orient(self, p, s, rows):
        """(X, Y, Nx, Ny, mask strides, meta) of a row pass (X = q) or a column pass (X = k)."""
        if rows:
            return p.q, p.k, s["nq"], s["nk"], s["rows"], dict(s["meta"], MASK_SHAPE=s["shape_rows"], **s["band_rows"])
        return p.k, p.q, s["nk"], s["nq"], s["cols"], dict(s["meta"], MASK_SHAPE=s["shape_cols"], **s["band_cols"])

    def row_dot(self, a, b, out=None, scale=1.0):
        """scale * sum_d a_d b_d per row, float32 (shape a.shape[:-1]), into ``out`` if given."""
        a, b = a.contiguous(), b.contiguous()
        rows, d = a.numel() // a.shape[-1], a.shape[-1]
        if out is None:
            out = torch.empty(a.shape[:-1], dtype=torch.float32, device=a.device)
        block = 16 if INTERPRETED else 64
        opts = {} if INTERPRETED else dict(num_warps=4)
        launcher(K._row_dot_kernel)[(triton.cdiv(rows, block),)](a, b, out, rows, d, float(scale), BLOCK_R=block,
                                                                      BLOCK_D=_block(d), **opts)
        return out

    # -- one pass each (streaming.py's engine interface) ------------------------------------------

    def initial_g(self, p):
        s = self._setup(p)
        if p.cost == "l2" and not p.softcap:  # capped logits are formed whole in the kernels: g^0 = 0
            return self.row_dot(p.k, p.k, scale=-s["a"])
        return torch.zeros(s["B"], s["H"], s["nk"], dtype=torch.float32, device=p.q.device)

    def _lse(self, p, other, rows, out=None, out_shift=0.0, ref=None, ref_shift=0.0, g0_mode=0):
        """out = out_shift - lse over the other side of (A x.y + other_y); ``ref``: the bound of a
        shifted pass (ref_shift - ref_x, triton_kernels.py); ``g0_mode``: see _lse_online."""
        s = self._setup(p)
        X, Y, nx, ny, strides, meta = self._orient(p, s, rows)
        out = self._vec(p, nx) if out is None else out
        args = (X, Y, other, out if ref is None else ref, out, s["mask"], s["H"], nx, ny, s["D"], s["A"],
                float(ref_shift), float(out_shift), *strides)
        meta.update(BOUNDED=ref is not None, G0_MODE=g0_mode, MIN_SUM=MIN_SUM, SPREAD_MAX=SPREAD_MAX)
        _launch(K._lse_kernel, "scan", s["D"], nx, ny, s["BH"], X, args, meta, p.tune)
        return out

    def lse_rows(self, p, g):
        """lse_j (L_ij + g_j)."""
        return self._lse(p, g.contiguous(), True, out_shift=0.0).neg_()

    def lse_cols(self, p, f):
        """lse_i (L_ij + f_i)."""
        return self._lse(p, f.contiguous(), False, out_shift=0.0).neg_()

    def _wsum(self, p, xp, yp, w, rows, out=None, shift=0.0, out_scale=1.0):
        s = self._setup(p)
        X, Y, nx, ny, strides, meta = self._orient(p, s, rows)
        out = self._vec(p, nx) if out is None else out
        args = (X, Y, xp, yp, w, out, s["mask"], s["H"], nx, ny, s["D"], s["A"], float(shift), float(out_scale),
                *strides)
        meta.update(SPREAD_MAX=SPREAD_MAX)
        _launch(K._wsum_kernel, "scan", s["D"], nx, ny, s["BH"], X, args, meta, p.tune)
        return out

    def wsum_rows(self, p, a, b, w):
        """sum_j exp(L_ij + a_i + b_j) w_j."""
        return self._wsum(p, a.contiguous(), b.contiguous(), w.contiguous(), True)

    def wsum_cols(self, p, a, b, w):
        """sum_i exp(L_ij + a_i + b_j) w_i."""
        return self._wsum(p, b.contiguous(), a.contiguous(), w.contiguous(), False)

    def attend(self, p, g, ref=None, ref_shift=0.0):
        """(out, lse) of softmax_j(L_ij + g_j) v_j; ``ref``: c - ref_i bounds row i's exponents."""
        return self.attend_exact(p, g, ref, ref_shift)[:2]

    def attend_exact(self, p, g, ref=None, ref_shift=0.0):
        """(out, lse, exact): ``attend``'s results and, for half inputs, the output before its rounding
        to the dtype (float32; an empty placeholder for float32 inputs, whose out is that): the backward's
        delta = dout.out must come from it (triton_kernels._plan_product). fp16 inputs take the running
        maximum walk: under a bound that is not the row's maximum the plan tile falls under fp16's range."""
        s = self._setup(p)
        out = torch.empty(p.q.shape[:-1] + (s["DV"],), dtype=p.q.dtype, device=p.q.device)
        exact = torch.empty(out.shape if s["split_p"] else (0,), dtype=torch.float32, device=p.q.device)
        lse = self._vec(p, s["nq"])
        args = (p.q, p.k, p.v, g, lse if ref is None else ref, out, exact if s["split_p"] else out, lse, s["mask"],
                s["H"], s["nq"], s["nk"], s["D"], s["DV"], s["A"], float(ref_shift), *s["rows"])
        meta = dict(s["meta"], MASK_SHAPE=s["shape_rows"], BLOCK_DV=_block(s["DV"]), **s["band_rows"],
                    BOUNDED=ref is not None and p.q.dtype != torch.float16, MIN_SUM=MIN_SUM, SPREAD_MAX=SPREAD_MAX,
                    SPLIT_P=s["split_p"])
        _launch(K._attend_kernel, "attend", max(s["D"], s["DV"]), s["nq"], s["nk"], s["BH"], p.q, args, meta, p.tune)
        return out, lse, exact

    def grad_v_and_bias(self, p, g, lse, dout, delta, dg=None, out=None):
        """(dv, dg): dv = P^T dout, dg_j = sum_i dS_ij. With ``out`` given (and delta an empty vector)
        delta_i = dout_i . out_i is computed by the same launch and written to ``delta``."""
        s = self._setup(p)
        dv = torch.empty_like(p.v)
        dg = self._vec(p, s["nk"]) if dg is None else dg
        args = (p.k, p.q, p.v, dout, dout if out is None else out, g, lse, delta, dv, dg, s["mask"], s["H"], s["nk"],
                s["nq"], s["D"], s["DV"], s["A"], *s["cols"])
        # fp16: the row potential stays in the exponent (SPREAD_MAX -1), so the plan tile rounded to fp16
        # is the plan itself (<= 1), not the plan scaled down by up to 2^SPREAD_MAX below fp16's range
        meta = dict(s["meta"], MASK_SHAPE=s["shape_cols"], BLOCK_DV=_block(s["DV"]), DELTA_HERE=out is not None,
                    **s["band_cols"],
                    SPREAD_MAX=-1.0 if p.q.dtype == torch.float16 else SPREAD_MAX, SPLIT_P=s["split_p"])
        _launch(K._grad_v_kernel, "grad_v", max(s["D"], s["DV"]), s["nk"], s["nq"], s["BH"], p.q, args, meta, p.tune)
        return dv, dg

    def grad_qk(self, p, g, lse, dout, delta, terms):
        """(dq, dk) from dL = dS - sum_t (C^t dg^t + R^t df^t); ``terms`` = (F, G, DG, DF) stacks
        (streaming.py) or None. ``g`` is G[-1] (the final column potential)."""
        s = self._setup(p)
        B, H, nq, nk, BH = s["B"], s["H"], s["nq"], s["nk"], s["BH"]
        if terms is None:
            T, G = 0, g.unsqueeze(0)
        else:
            F, G, DG, DF = (t.contiguous() for t in terms)
            T = F.shape[0]
        if T > 0:
            XF = torch.empty(B, H, nq, 2 * T, dtype=torch.float32, device=p.q.device)
            UF = torch.empty(B, H, nk, 2 * T, dtype=torch.float32, device=p.q.device)
            fast = torch.empty(T, BH, dtype=torch.int32, device=p.q.device)
            block = 16 if INTERPRETED else 1024
            opts = {} if INTERPRETED else dict(num_warps=4)
            launcher(K._factors_kernel)[(T, BH)](F, G, lse, DF, DG, XF, UF, fast, T, nq, nk, float(p.col_target),
                                                 FACTOR_MAX=FACTOR_MAX, BLOCK=block, **opts,
                                                 **s.get("factors_packed", {}))   # varlen.py's offsets
        else:  # never read: no terms
            F = DG = DF = XF = UF = lse
            fast = stand_in(p.q, torch.int32)
        dq = torch.zeros(p.q.shape, dtype=torch.float32, device=p.q.device)
        dk = torch.empty_like(p.k)
        args = (p.k, p.q, p.v, dout, G, lse, delta, F, DG, DF, XF, UF, fast, T, float(p.col_target), dq, dk,
                s["mask"], H, nk, nq, s["D"], s["DV"], s["A"], *s["cols"])
        meta = dict(s["meta"], MASK_SHAPE=s["shape_cols"], L2=p.cost == "l2", BLOCK_DV=_block(s["DV"]),
                    KT=FACTOR_COLUMNS, **s["band_cols"])
        _launch(K._grad_qk_kernel, "grad_qk", max(s["D"], s["DV"]), nk, nq, BH, p.q, args, meta, p.tune,
                reset=("DQ",))
        return dq.mul_(s["A"]), dk

    # -- whole calls ------------------------------------------------------------------------------

    def forward(self, p: Problem, n_iters: int):
        """(out, lse, F, G, exact): the output, the final row lse, F = f^1..f^T, G = g^0..g^T (reduced)
        and the unrounded output of half inputs (``attend_exact``), which the backward takes as ``out``.

        Passes: the first row pass (running maximum: nothing bounds it yet; it also writes g^0 when
        the call is small or the cost is dot), then per iteration a column pass bounded by the row
        pass before it and a row pass bounded by the column pass before it, and the final attend
        bounded by the last column pass."""
        s = self._setup(p)
        T, c = n_iters, p.col_target
        F = self._vec(p, s["nq"], T)
        G = self._vec(p, s["nk"], T + 1)
        f, g = F.unbind(0), G.unbind(0)   # one view op each, not one per pass
        if (p.cost == "dot" or p.softcap) and p.band is not None:  # g^0 = 0, not written by a banded pass
            g0_mode = 0
            g[0].zero_()
        elif p.cost == "dot" or p.softcap:  # a capped logit carries its own norms (triton_kernels.py)
            g0_mode = 1
        elif s["fold"] and T > 0:
            g0_mode = 2
        else:
            g0_mode = 0
            self.row_dot(p.k, p.k, out=g[0], scale=-s["a"])
        if T == 0:
            if g0_mode == 1:
                g[0].zero_()
            return self._finish(self.attend_exact(p, g[0]), F, G)
        self._lse(p, g[0], True, out=f[0], g0_mode=g0_mode)
        for t in range(1, T + 1):
            self._lse(p, f[t - 1], False, out=g[t], out_shift=c, ref=g[t - 1], ref_shift=0.0)
            if t < T:
                self._lse(p, g[t], True, out=f[t], ref=f[t - 1], ref_shift=c)
        return self._finish(self.attend_exact(p, g[T], ref=f[T - 1], ref_shift=c), F, G)

    @staticmethod
    def _finish(attended, F, G):
        out, lse, exact = attended
        return out, lse, F, G, exact

    def backward_unrolled(self, p: Problem, dout, out, lse, F, G):
        """(dq, dk, dv) of the n_iters unrolled iterations (streaming._adjoint_unrolled's recursion),
        every adjoint written in place into the DG / DF stacks by its pass."""
        s = self._setup(p)
        T, c = F.shape[0], p.col_target
        dout = dout.contiguous()
        delta = self._vec(p, s["nq"])
        if not s["fold"]:
            self.row_dot(dout, out, out=delta)
        DG = self._vec(p, s["nk"], T)
        DF = self._vec(p, s["nq"], T)
        f, g, dg, df = (t.unbind(0) for t in (F, G, DG, DF))
        dv, _ = self.grad_v_and_bias(p, g[T], lse, dout, delta, dg=dg[T - 1] if T else None,
                                     out=out if s["fold"] else None)
        for t in range(T - 1, -1, -1):
            self._wsum(p, f[t], g[t + 1], dg[t], True, out=df[t], shift=-c, out_scale=-1.0)
            if t > 0:
                self._wsum(p, g[t], f[t], df[t], False, out=dg[t - 1], out_scale=-1.0)
        dq, dk = self.grad_qk(p, g[T], lse, dout, delta, (F, G, DG, DF) if T else None)
        return dq, dk, dv


ENGINE = TritonEngine()


def _problem(q, k, v, mask, scale, eps, l2, tune, softcap=0.0, window_left=-1, window_right=-1):
    band = None
    if (window_left, window_right) != (-1, -1):
        band = band_bounds((window_left, window_right), False, q.shape[-2], k.shape[-2])
    return Problem(q, k, v, None, None, scale, eps, "l2" if l2 else "dot", mask, tune, softcap, band)


def _empty(q, *shape):
    return torch.empty(shape, dtype=torch.float32, device=q.device)


@kernel_op("attnzoo::sinkhorn_fwd", mutates_args=())
def sinkhorn_fwd(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], scale: float, eps: float, l2: bool,
                 n_iters: int, implicit: bool, tune: bool, softcap: float = 0.0, window_left: int = -1,
                 window_right: int = -1) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(out (B, H, Nq, Dv) in q's dtype, final row lse (B, H, Nq), F = f^1..f^T (T, B, H, Nq),
    G = g^0..g^T (T + 1, B, H, Nk), float32 reduced potentials, and for half inputs the unrounded
    output (float32, (B, H, Nq, Dv); (0,) for float32 inputs), which the backward's delta is taken from.
    ``implicit`` picks the backward, ``tune`` whether large launches may autotune (forward and backward);
    ``softcap`` caps the logits (0: none; the unrolled backward only); ``window_left`` / ``window_right``:
    a sliding window (logit_extras' meaning, -1 unbounded; the passes skip the tiles outside its band)."""
    B, H, nq, _ = q.shape
    nk = k.shape[2]
    if tracing_only(q):
        exact = (B, H, nq, v.shape[-1]) if q.dtype in HALF else (0,)
        return (q.new_empty(B, H, nq, v.shape[-1]), _empty(q, B, H, nq), _empty(q, n_iters, B, H, nq),
                _empty(q, n_iters + 1, B, H, nk), _empty(q, *exact))
    return ENGINE.forward(_problem(q, k, v, mask, scale, eps, l2, tune, softcap, window_left, window_right), n_iters)


def _backward(dout, q, k, v, mask, out, lse, F, G, scale, eps, l2, tune, grad_mode, softcap=0.0, window=(-1, -1)):
    p = _problem(q, k, v, mask, scale, eps, l2, tune, softcap, *window)
    if grad_mode == "unrolled":
        dq, dk, dv = ENGINE.backward_unrolled(p, dout, out, lse, F, G)
    else:
        dq, dk, dv = streaming_backward(ENGINE, p, dout, out, lse, list(F.unbind(0)), list(G.unbind(0)), grad_mode)
    return (dq if dq.dtype == q.dtype else dq.to(q.dtype)), dk, dv


@kernel_op("attnzoo::sinkhorn_bwd", mutates_args=())
def sinkhorn_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], out: Tensor, lse: Tensor,
                 F: Tensor, G: Tensor, scale: float, eps: float, l2: bool, tune: bool, softcap: float = 0.0,
                 window_left: int = -1, window_right: int = -1) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of the unrolled iterations (the exact gradient of what the forward computed)."""
    if tracing_only(q):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    return _backward(dout, q, k, v, mask, out, lse, F, G, scale, eps, l2, tune, "unrolled", softcap,
                     (window_left, window_right))


# Not a kernel_op: the implicit adjoint sums its Neumann series until the term's norm falls below a
# tolerance (streaming._adjoint_implicit), a branch on tensor values. A triton_op is traced with fake
# tensors on a GPU, which cannot decide that branch, so this stays an opaque custom op on every device:
# torch.compile calls it as one node (no graph break) and it launches its kernels eagerly.
@torch.library.custom_op("attnzoo::sinkhorn_bwd_implicit", mutates_args=())
def sinkhorn_bwd_implicit(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], out: Tensor,
                          lse: Tensor, F: Tensor, G: Tensor, scale: float, eps: float,
                          l2: bool, tune: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of the fixed point (implicit function theorem; streaming._adjoint_implicit)."""
    return _backward(dout, q, k, v, mask, out, lse, F, G, scale, eps, l2, tune, "implicit")


@sinkhorn_bwd_implicit.register_fake
def _(dout, q, k, v, mask, out, lse, F, G, scale, eps, l2, tune):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, mask, scale, eps, l2, n_iters, implicit, tune, softcap, window_left, window_right = inputs
    out, lse, F, G, exact = output
    # the backward reads out only for delta = dout.out: the unrounded one where the output was rounded
    ctx.save_for_backward(q, k, v, mask, exact if q.dtype in HALF else out, lse, F, G)
    ctx.args = (scale, eps, l2, implicit, tune)
    ctx.softcap = softcap
    ctx.window = (window_left, window_right)


def _grad(ctx, dout, _dlse, _dF, _dG, _dexact):
    q, k, v, mask, out, lse, F, G = ctx.saved_tensors
    scale, eps, l2, implicit, tune = ctx.args
    if implicit and F.shape[0] > 0:
        dq, dk, dv = sinkhorn_bwd_implicit(dout.contiguous(), q, k, v, mask, out, lse, F, G, scale, eps, l2, tune)
    else:
        dq, dk, dv = sinkhorn_bwd(dout.contiguous(), q, k, v, mask, out, lse, F, G, scale, eps, l2, tune, ctx.softcap,
                                  *ctx.window)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None, None


sinkhorn_fwd.register_autograd(_grad, setup_context=_setup_context)


def unsupported_reason(q, attn_mask=None, dropout_p=0.0, v=None) -> str | None:
    if q.dtype not in DTYPES:
        return f"the Triton kernels take float16, bfloat16 or float32 inputs, got {q.dtype}"
    dv = 0 if v is None else v.shape[-1]
    if max(q.shape[-1], dv) > MAX_HEAD_DIM:
        return (f"head dims above {MAX_HEAD_DIM} are not supported by the Triton kernels (q D={q.shape[-1]}"
                f"{'' if v is None else f', v Dv={dv}'}): use backend='cpu'")
    if q.device.type != "cuda" and not INTERPRETED:
        return "Triton kernels need a CUDA device (or TRITON_INTERPRET=1 for CPU tensors, for testing)"
    if dropout_p > 0:
        return "dropout on the transport plan needs the N x N weights (use backend='reference')"
    if attn_mask is not None and attn_mask.requires_grad:
        return "no gradient is computed for a float attn_mask (use backend='reference')"
    if attn_mask is not None and attn_mask.dim() > 4:
        return f"attn_mask has {attn_mask.dim()} dims; at most 4 (broadcastable to (B, H, Nq, Nk))"
    return None


def sinkhorn_attention(q, k, v, *, attn_mask=None, is_causal=False, scale=None, n_iters=3, eps=1.0,
                       cost="l2", dropout_p=0.0, grad_mode="unrolled", softcap=None, window_size=None):
    """Same semantics as ``reference.sinkhorn_attention``, on Triton kernels.
    ``softcap`` caps the logits in the kernels (forward and the unrolled backward; the implicit
    backward is the fixed point of uncapped logits' passes and refuses it).

    ``window_size`` (left, right), logit_extras' meaning (checked by the call path): non-causal, every
    pass skips the tiles outside the band (the unrolled backward; the implicit one gets it folded into
    the mask). Causal with a left reach that removes keys and no attn_mask or a per-key one (key
    padding), the unrolled backward: row i's problem lies in its window, solved in batches
    (causal_window.py); with any other attn_mask the band is folded into it and the prefix loop runs
    (exact, ``masking.coupled_causal_rows``).

    The mask goes to the kernels as given (bool: False = masked; float: added, -inf = masked),
    broadcast by strides. k and v are taken in q's dtype (a no-op unless they differ, e.g. mixed
    autocast inputs); fp32 potentials whatever the dtype.
    """
    check_options(dropout_p, grad_mode)
    if softcap is not None and grad_mode == "implicit":
        raise ValueError("softcap is computed with grad_mode='unrolled' only (the Triton implicit backward takes "
                         "uncapped logits): use backend='triton'")
    if cost not in COSTS:
        raise ValueError(f"cost must be one of {list(COSTS)}, got {cost!r}")
    why = unsupported_reason(q, attn_mask, dropout_p, v=v)
    if why is not None:
        raise ValueError(why)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    k, v = (t if t.dtype == q.dtype else t.to(q.dtype) for t in (k, v))
    window = (-1, -1) if window_size is None else (int(window_size[0]), int(window_size[1]))
    # the implicit backward needs every row and column of a problem to keep an entry: not the padded windows
    by_window = grad_mode == "unrolled" and takes(is_causal, attn_mask, window[0], k.shape[-2])
    if window != (-1, -1) and (grad_mode == "implicit" or (is_causal and not by_window)):
        attn_mask = mask_with_window(attn_mask, window_band(window, q.shape[-2], k.shape[-2], q.device))
    # the causal prefix loop never autotunes: every prefix is a new shape (the window batches have one)
    flags = (float(scale), float(eps), cost == "l2", int(n_iters), grad_mode == "implicit",
             not is_causal or by_window, float(softcap or 0.0))
    banded = () if is_causal or grad_mode == "implicit" else window

    def run(q, k, v, mask):
        return sinkhorn_fwd(q.contiguous(), k.contiguous(), v.contiguous(), mask, *flags, *banded)[0]

    if by_window:
        return causal_by_window(run, q, k, v, window[0], attn_mask)
    if is_causal:
        return causal_by_prefix(run, q, k, v, attn_mask)
    return run(q, k, v, attn_mask)
