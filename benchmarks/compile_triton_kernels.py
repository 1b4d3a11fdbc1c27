"""Build check, no GPU needed: compile every Triton kernel of attnzoo to a cubin for a CUDA target
(default sm_90, H100/H200) and check that each fits: shared memory against the per-block limit,
registers and spills from Triton's bundled ptxas.

The interpreter (TRITON_INTERPRET=1, how CI runs the kernels) does not lower them through MLIR/PTX,
so a kernel can pass every interpreted test and still fail to compile, or need more shared memory
than an SM has; this catches both. It proves the kernels build and fit, not that they run correctly
or fast.

Two kinds of jobs:
- softmax-family, pointwise and dropout kernels: signatures and flags written out below (their host
  code needs CUDA tensors);
- Sinkhorn, linear and OT kernels: *captured* from their real host code. The script runs each backend's
  forward and backward on small CPU tensors with every Triton launch intercepted: the launch is
  specialised exactly as the JIT would on a GPU (argument dtypes, int specialisation, constexprs,
  num_warps / num_stages from the host code) and compiled for the target instead of run. So what is
  compiled is what those host paths hand the kernels (half inputs upcast to fp32 by the linear and OT
  drivers, column slices of a wide v, the causal prefix loop, ...). Outputs of intercepted launches are
  left uninitialised: the host code's arithmetic on them is meaningless and is ignored.

    .venv/bin/python benchmarks/compile_triton_kernels.py --dtypes bf16 fp16 fp32 fp64 \\
        --out benchmarks/results/gpu/ptx_build_check.md

Exits non-zero when any kernel fails to compile or needs more shared memory than the limit.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import multiprocessing
import os
import re
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from unittest import mock

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("unset TRITON_INTERPRET: the interpreter does not compile kernels")
# ptxas's -v report (registers, spills) is printed only with this knob, and only when ptxas runs
os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"
os.environ["TRITON_ALWAYS_COMPILE"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402
from triton import knobs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

from attnzoo.ops import triton_dropout as dropout  # noqa: E402
from attnzoo.ops.linear import triton as linear_triton  # noqa: E402
from attnzoo.ops.linear import varlen as linear_varlen  # noqa: E402
from attnzoo.ops.ot import triton as ot_triton  # noqa: E402
from attnzoo.ops.ot import varlen as ot_varlen  # noqa: E402
from attnzoo.ops.kernels.pointwise import triton as pointwise_host  # noqa: E402
from attnzoo.ops.sinkhorn import triton as sinkhorn_triton  # noqa: E402
from attnzoo.ops.kernels.flash_softmax import triton as softmax_host  # noqa: E402

# Dynamic shared memory one block may opt into, bytes (CUDA occupancy tables, "maximum shared memory
# per block (opt-in)"): 227 KB on sm_90, 163 KB on sm_80, 99 KB on sm_86/89.
SHARED_LIMIT = {90: 232448, 80: 166912, 86: 101376, 89: 101376}
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}


@dataclass
class Job:
    """One kernel specialisation to compile; ``labels``: the calls that launch it."""
    fn: JITFunction
    signature: dict
    constexprs: dict
    attrs: dict
    options: dict
    labels: list = field(default_factory=list)


@dataclass
class Result:
    ok: bool
    shared: int = 0
    regs: int | None = None
    spill_bytes: int | None = None
    error: str = ""
    seconds: float = 0.0


# ---------------------------------------------------------------------------------------------------
# softmax family, pointwise, dropout: signatures written out. Their tiles come from the autotune lists
# of attnzoo/ops/triton_tuning.py (per kernel and tile class); what is compiled:
# - every configuration of every list in the flavours a benchmark times, causal (the causal kernels
#   contain every loop stage: whole blocks, diagonal blocks, partial blocks), all dtypes and widths;
# - every configuration of the dropout lists, in a dropout flavour (bf16 and fp32: fp16 compiles the
#   same code as bf16);
# - the default configuration of each list in the most demanding flavours the host code launches
#   (masks as tiles, L2, preferences, T5 with its fixed dK/dV tiles, row biases), widths 64 and 128.

INT_ARGS = {"H", "Nq", "Nk", "D", "DV", "GROUP"}  # GROUP: query heads per key/value head (GQA)
FLOAT_ARGS = {"scale", "bias_scalar", "dropout_p", "softcap"}
_SOFTMAX = dict(L2=False, MASK_KIND=0, MASK_SHAPE=0, HAS_PREF=False, HAS_T5=False, CAUSAL=True, DROPOUT=False,
                SOFTCAP=False, HAS_SINKS=False, WINDOW=False)
_POINTWISE = dict(SIGMOID=True, BIAS_MODE=0, MASK_KIND=0, MASK_SHAPE=0, CAUSAL=True, DROPOUT=False, SOFTCAP=0.0,
                  WINDOW=False)
# (label, flags, which configurations: "all" | "default", dtypes, widths)
SOFTMAX_JOBS = [
    ("causal", dict(_SOFTMAX), "all", ("bf16", "fp16", "fp32"), (64, 128, 256)),
    ("causal+dropout", dict(_SOFTMAX, DROPOUT=True), "all", ("bf16", "fp32"), (64, 128, 256)),
    ("l2+key-padding+pref+causal", dict(_SOFTMAX, L2=True, MASK_KIND=1, MASK_SHAPE=1, HAS_PREF=True), "default",
     ("bf16", "fp32"), (64, 128)),
    ("l2+bool-tile-mask+pref+causal+dropout",
     dict(_SOFTMAX, L2=True, MASK_KIND=1, HAS_PREF=True, DROPOUT=True), "default", ("bf16", "fp32"), (64, 128)),
    ("t5+float-tile-mask+causal", dict(_SOFTMAX, MASK_KIND=2, HAS_T5=True), "default", ("bf16", "fp32"), (64, 128)),
    ("t5+float-tile-mask+causal+dropout", dict(_SOFTMAX, MASK_KIND=2, HAS_T5=True, DROPOUT=True), "default",
     ("bf16", "fp32"), (64, 128)),
    # packed sequences (kernels/flash_softmax/varlen.py): the same kernels with the offsets read at entry
    ("varlen+causal", dict(_SOFTMAX, VARLEN=True), "all", ("bf16", "fp32"), (64, 128)),
    ("varlen+l2+causal", dict(_SOFTMAX, L2=True, VARLEN=True), "default", ("bf16",), (64, 128)),
    # softcap, sinks and the window's band fused (issue 29; labels "extras:..." for --match extras): the window
    # replaces the causal stages (CAUSAL is folded into its right bound by the host), every configuration of
    # the band's loops; the rest default
    ("extras:window", dict(_SOFTMAX, CAUSAL=False, WINDOW=True), "all", ("bf16",), (64, 128)),
    ("extras:softcap+sinks+causal", dict(_SOFTMAX, SOFTCAP=True, HAS_SINKS=True), "default", ("bf16",), (64, 128)),
    ("extras:softcap+sinks+window+key-padding+dropout",
     dict(_SOFTMAX, CAUSAL=False, SOFTCAP=True, HAS_SINKS=True, WINDOW=True, MASK_KIND=1, MASK_SHAPE=1,
          DROPOUT=True), "default", ("bf16", "fp32"), (64, 128)),
    ("extras:l2+softcap+sinks+window+bool-tile-mask",
     dict(_SOFTMAX, CAUSAL=False, L2=True, SOFTCAP=True, HAS_SINKS=True, WINDOW=True, MASK_KIND=1), "default",
     ("bf16",), (64, 128)),
    ("extras:pref+softcap+sinks+causal+float-tile-mask",
     dict(_SOFTMAX, HAS_PREF=True, SOFTCAP=True, HAS_SINKS=True, MASK_KIND=2), "default", ("bf16",), (64, 128)),
]
# the softmax forward's, dQ's and dK/dV's Hopper rows (kernels/flash_softmax/hopper_kernels.py, offered on
# sm_90 only): every row of triton_tuning.FORWARD_HOPPER / QUERIES_BACKWARD_HOPPER / KEYS_BACKWARD_HOPPER in
# the flavours they compute, fp16 / bf16 (their only dtypes);
# masks varying along both axes are not among them (kernels/flash_softmax/hopper.py)
HOPPER_JOBS = [
    ("hopper causal", dict(_SOFTMAX), ("bf16", "fp16"), (64, 128)),
    ("hopper non-causal", dict(_SOFTMAX, CAUSAL=False), ("bf16", "fp16"), (64, 128)),
    ("hopper l2+key-padding+pref+causal", dict(_SOFTMAX, L2=True, MASK_KIND=1, MASK_SHAPE=1, HAS_PREF=True),
     ("bf16",), (64, 128)),
    ("hopper float-key-padding+causal", dict(_SOFTMAX, MASK_KIND=2, MASK_SHAPE=1), ("bf16",), (64, 128)),
]
POINTWISE_JOBS = [
    ("sigmoid+causal", dict(_POINTWISE), "all", ("bf16", "fp16", "fp32"), (64, 128, 256)),
    ("relu+causal+dropout", dict(_POINTWISE, SIGMOID=False, DROPOUT=True), "all", ("bf16", "fp32"), (64, 128, 256)),
    ("sigmoid+row-bias+float-tile-mask+causal", dict(_POINTWISE, BIAS_MODE=2, MASK_KIND=2), "default",
     ("bf16", "fp32"), (64, 128)),
    ("sigmoid+row-bias+float-tile-mask+causal+dropout", dict(_POINTWISE, BIAS_MODE=2, MASK_KIND=2, DROPOUT=True),
     "default", ("bf16", "fp32"), (64, 128)),
    # packed sequences (kernels/pointwise/varlen.py)
    ("varlen+sigmoid+causal", dict(_POINTWISE, VARLEN=True), "default", ("bf16", "fp32"), (64, 128)),
    ("varlen+relu+causal", dict(_POINTWISE, SIGMOID=False, VARLEN=True), "default", ("bf16",), (64, 128)),
    # issue 29: the cap fused (a constexpr) and the window's band stages (causality folded into the band)
    ("sigmoid+softcap+window", dict(_POINTWISE, SOFTCAP=30.0, WINDOW=True, CAUSAL=False), "all", ("bf16", "fp16"),
     (64, 128, 256)),
    ("relu+softcap+bool-tile-mask+window+dropout",
     dict(_POINTWISE, SIGMOID=False, SOFTCAP=30.0, WINDOW=True, CAUSAL=False, MASK_KIND=1, DROPOUT=True), "default",
     ("bf16", "fp32"), (64, 128)),
]
# the sigmoid evaluation each dtype compiles (fp16: the hardware tanh; bf16: exp2 + Newton; fp32: exact)
SIGMOID_IMPL_OF = {"fp32": 0, "fp16": 1, "bf16": 2}


def signature(fn, dtype, pointer_types, constexprs):
    """Triton type of each argument: tensors of the input dtype unless listed, ints, floats, constexprs."""
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in pointer_types:
            sig[name] = pointer_types[name]
        elif name in FLOAT_ARGS:
            sig[name] = "fp32"
        elif name[0].isupper() and name not in INT_ARGS:
            sig[name] = "*" + dtype
        else:
            sig[name] = "i32"
    return sig


def hopper_specs(dtype, precision):
    """The Hopper rows of the forward, dQ and dK/dV (none where this Triton cannot build them)."""
    pointers = {"LSE": "*fp32", "DELTA": "*fp32", "PREF": "*fp32", "BIAS": "*fp32", "LUT": "*i32", "SEED": "*i64",
                "DPREF": "*fp32", "DTABLE": "*fp32", "SINKS": "*fp32"}
    for (name, flags, dtypes, widths), tuned in itertools.product(
            HOPPER_JOBS, (softmax_host.FORWARD, softmax_host.QUERIES_BACKWARD, softmax_host.KEYS_BACKWARD)):
        if dtype not in dtypes:
            continue
        for width in widths:
            rows = tuned.configs_for(TORCH_DTYPES[dtype], width, width, False, variants=True)
            for i, cfg in enumerate(rows):
                if not cfg.kwargs.get("HOPPER"):
                    continue
                meta = dict(cfg.kwargs, BLOCK_D=width, BLOCK_DV=width,
                            HEAD_MASK=False, UPCAST=False, PRECISION=precision, **flags)
                if tuned is softmax_host.KEYS_BACKWARD:
                    meta["BUCKETS"] = 1  # no T5 in a Hopper flavour
                mask = "*fp32" if flags["MASK_KIND"] == 2 else "*u8"
                yield (tuned.fn, dict(pointers, MASK=mask), meta,
                       {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages},
                       f"softmax {dtype} {name} {tuned.fn.fn.__name__} D={width} config {i}")


def softmax_family_specs(dtype):
    """(kernel, pointer types, constexprs, launch options, label) of every specialisation to compile."""
    precision = "ieee" if dtype == "fp32" else "tf32"
    families = [
        ("softmax", SOFTMAX_JOBS, (softmax_host.FORWARD, softmax_host.KEYS_BACKWARD, softmax_host.QUERIES_BACKWARD)),
        ("pointwise", POINTWISE_JOBS,
         (pointwise_host.FORWARD, pointwise_host.KEYS_BACKWARD, pointwise_host.QUERIES_BACKWARD)),
    ]
    for family, table, kernels in families:
        for name, flags, which, dtypes, widths in table:
            if dtype not in dtypes:
                continue
            flags = dict(flags)
            if "SIGMOID" in flags:
                flags["SIGMOID_IMPL"] = SIGMOID_IMPL_OF[dtype] if flags["SIGMOID"] else 0
            mask = "*fp32" if flags["MASK_KIND"] == 2 else "*u8"
            pointers = {"LSE": "*fp32", "DELTA": "*fp32", "DPREF": "*fp32", "DTABLE": "*fp32", "PREF": "*fp32",
                        "LUT": "*i32", "SEED": "*i64", "MASK": mask, "N_ROWS": "*fp32",
                        "BIAS": "*fp32", "DBIAS": "*fp32", "SINKS": "*fp32", "CU_Q": "*i32", "CU_K": "*i32"}
            for tuned in kernels:
                for width in widths:
                    configs = tuned.configs_for(TORCH_DTYPES[dtype], width, width, flags["DROPOUT"])
                    # the T5 gradient's dK/dV launch always runs its default (atomics-safe) tiles
                    if which == "default" or (flags.get("HAS_T5") and tuned is softmax_host.KEYS_BACKWARD):
                        configs = configs[:1]
                    for i, cfg in enumerate(configs):
                        # a dense row passes the offsets as None (constexpr); a packed launch passes tensors
                        row = {name: value for name, value in cfg.kwargs.items()
                               if not (flags.get("VARLEN") and name in ("CU_Q", "CU_K"))}
                        meta = dict(row, BLOCK_D=width, BLOCK_DV=width, HEAD_MASK=False, UPCAST=False,
                                    PRECISION=precision, **flags)
                        if tuned is softmax_host.KEYS_BACKWARD:  # T5's per-bucket gradient registers (32 buckets)
                            meta["BUCKETS"] = 32 if flags.get("HAS_T5") else 1
                        yield (tuned.fn, pointers, meta, {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages},
                               f"{family} {dtype} {name} D={width} config {i}")
    yield from hopper_specs(dtype, precision)
    yield (dropout.dropout_mask_kernel, {"KEEP": "*u8", "SEED": "*i64"}, dict(BLOCK_M=64, BLOCK_N=64),
           {"num_warps": 4, "num_stages": 2}, "dropout keep-mask")


def softmax_family_jobs(dtypes):
    jobs = {}
    for dtype in dtypes:
        if dtype == "fp64":
            continue  # triton_utils.common_reason refuses float64
        for fn, pointers, meta, options, label in softmax_family_specs(dtype):
            sig = signature(fn, dtype, pointers, meta)
            key = (fn.fn.__name__, str(sorted(sig.items())), str(sorted(meta.items())), str(sorted(options.items())))
            job = jobs.setdefault(key, Job(fn, sig, dict(meta), {}, dict(options)))
            job.labels.append(label)
    return list(jobs.values())


# ---------------------------------------------------------------------------------------------------
# Sinkhorn, linear, OT: launches captured from the host code

class LaunchCapture:
    """Replaces JITFunction.run: specialises each launch as the JIT does for ``target`` and records it
    (deduplicated) instead of running it."""

    def __init__(self, target):
        self.backend = make_backend(target)
        self.binders = {}
        self.jobs = {}
        self.label = ""

    def run(self, fn, *args, grid, warmup, **kwargs):
        kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug
        kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
        if fn not in self.binders:
            self.binders[fn] = create_function_from_signature(fn.signature, fn.params, self.backend)
        bound, specialization, options = self.binders[fn](*args, **kwargs)
        key = (id(fn), str(specialization), str(sorted(options.items())))
        if key not in self.jobs:
            opts, sig, constexprs, attrs = fn._pack_args(self.backend, kwargs, bound, specialization, options)
            self.jobs[key] = Job(fn, sig, constexprs, attrs, dict(opts.__dict__))
        if self.label not in self.jobs[key].labels:
            self.jobs[key].labels.append(self.label)
        return None

    @contextlib.contextmanager
    def calls(self, label):
        """Everything launched inside is recorded under ``label``."""
        self.label = label
        capture = self

        def run(fn, *args, grid, warmup, **kwargs):
            return capture.run(fn, *args, grid=grid, warmup=warmup, **kwargs)

        with mock.patch.object(JITFunction, "run", run), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. the implicit adjoint "diverging" on uninitialised outputs
            yield


def forward_backward(fn, q, k, v, **kw):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    fn(q, k, v, **kw).float().sum().backward()


def qkv(dtype, nq, nk, d, dv, b=2, h=2):
    gen = torch.Generator().manual_seed(0)
    make = lambda n, width: torch.randn(b, h, n, width, generator=gen).to(dtype)
    return make(nq, d), make(nk, d), make(nk, dv)


def masks(kind, dtype, nq, nk, b=2):
    """None, a key-padding bool mask (B, 1, 1, Nk), or a float (B, 1, Nq, Nk) mask with -inf entries."""
    if kind == "none":
        return None
    if kind == "bool":
        keep = torch.ones(b, 1, 1, nk, dtype=torch.bool)
        keep[..., -3:] = False
        return keep
    bias = torch.zeros(b, 1, nq, nk, dtype=dtype)
    bias[..., -2:] = float("-inf")
    return bias


SINKHORN_HEAD_DIMS = (64, 128, 256)  # 256: sinkhorn/triton.py MAX_HEAD_DIM
SINKHORN_CASES = [  # (cost, mask, is_causal, grad_mode, large): every flag of the kernels, both grad modes;
    # large: the path of calls from FOLD_BELOW on (row-dot launches for g^0 and delta), taken here by
    # patching FOLD_BELOW to 0 (the small shapes keep the compile jobs cheap)
    ("l2", "none", False, "unrolled", False),
    ("dot", "bool", False, "implicit", False),
    ("l2", "float", False, "unrolled", False),
    ("l2", "bool", True, "implicit", False),
    ("l2", "none", False, "unrolled", True),
    ("l2", "float", False, "unrolled", True),
    # issue 29: the softcap (a constexpr) in every pass, forward and the unrolled backward
    ("l2", "bool", False, "unrolled", False, 30.0),
    ("dot", "none", True, "unrolled", False, 30.0),
    ("l2", "float", False, "unrolled", True, 30.0),
    # issue 29: a window's band (BAND, its two offsets) in every pass; causal: batched window problems
    ("l2", "bool", False, "unrolled", False, None, (31, 8)),
    ("dot", "none", False, "unrolled", False, 30.0, (16, -1)),
    ("l2", "none", True, "unrolled", False, None, (7, 0)),
]


def sinkhorn_calls(dtype_name):
    if dtype_name == "fp64":
        return  # sinkhorn/triton.py refuses float64
    dtype = TORCH_DTYPES[dtype_name]
    for d in SINKHORN_HEAD_DIMS:
        for cost, mask, causal, grad_mode, large, *extras in SINKHORN_CASES:
            cap = [extras[0]] if extras and extras[0] is not None else []
            window = extras[1] if len(extras) > 1 else None
            # causal runs the kernels of the non-causal call on every prefix: only the int
            # specialisations differ (Nq = Nk = 1, sizes that are no multiple of 16), so N = 15
            n = 15 if causal else 64
            q, k, v = qkv(dtype, n, n, d, d)
            label = f"sinkhorn {dtype_name} D=Dv={d} {cost} mask={mask} causal={causal} {grad_mode}" + " large" * large
            label += f" softcap={cap[0]}" if cap else ""
            label += f" window={window}" if window else ""

            run = lambda q, k, v, **kw: sinkhorn_triton.sinkhorn_attention(q, k, v, **kw)

            def call(q=q, k=k, v=v, mask=mask, causal=causal, cost=cost, grad_mode=grad_mode, large=large,
                     softcap=cap[0] if cap else None, window=window):
                with mock.patch.object(sinkhorn_triton, "FOLD_BELOW", 0) if large else contextlib.nullcontext():
                    forward_backward(run, q, k, v, attn_mask=masks(mask, dtype, n, n), is_causal=causal, cost=cost,
                                     grad_mode=grad_mode, n_iters=3, softcap=softcap, window_size=window)
            yield label, call


def key_mask(kind, dtype, nk, b=2):
    """None, a key-padding bool mask (B, 1, 1, Nk), or a float one with -inf entries that needs its gradient."""
    if kind == "key-float":
        bias = torch.zeros(b, 1, 1, nk, dtype=dtype)
        bias[..., -2:] = float("-inf")
        return bias.requires_grad_()
    return masks(kind, dtype, 1, nk, b)


LINEAR_HEAD_DIMS = [(64, 64), (128, 128), (256, 255)]  # (D, Dv): one tile, 128-wide tiles, several and unaligned


def linear_calls(dtype_name):
    dtype = TORCH_DTYPES[dtype_name]
    for d, dv in LINEAR_HEAD_DIMS:
        # unmasked: phi, the normaliser (elu) or 1/n_i (identity) in the kernels; a key mask hands them
        # host features; Nk > Nq hands a prefix state s0, Nk < Nq a query slice.
        for feature_map, nq, nk, mask in (("elu", 64, 64, "none"), ("identity", 64, 64, "none"), ("elu", 48, 80, "none"),
                                          ("identity", 48, 80, "bool"), ("elu", 80, 48, "bool")):
            q, k, v = qkv(dtype, nq, nk, d, dv)
            label = f"linear {dtype_name} D={d} Dv={dv} {feature_map} Nq={nq} Nk={nk} mask={mask} causal"
            yield label, lambda: forward_backward(linear_triton.linear_attention_triton, q, k, v, is_causal=True,
                                                  feature_map=feature_map, attn_mask=masks(mask, dtype, nq, nk))
        # non-causal (ops/linear/noncausal_kernels.py): unmasked; the identity's kept-key count; a float key
        # mask with its gradient and 2100 keys, so the key reduction is split and summed
        for feature_map, nq, nk, mask in (("elu", 64, 64, "none"), ("identity", 48, 80, "bool"),
                                          ("relu", 48, 2100, "key-float")):
            q, k, v = qkv(dtype, nq, nk, d, dv)
            label = f"linear {dtype_name} D={d} Dv={dv} {feature_map} Nq={nq} Nk={nk} mask={mask} full"
            yield label, lambda: forward_backward(linear_triton.linear_attention_triton, q, k, v, is_causal=False,
                                                  feature_map=feature_map, attn_mask=key_mask(mask, dtype, nk))
        # packed sequences (ops/linear/varlen.py): the kernels' VARLEN branch, grouped heads, n_q != n_k
        for feature_map, causal in (("elu", True), ("identity", True), ("relu", False), ("identity", False)):
            label = f"linear {dtype_name} D={d} Dv={dv} {feature_map} packed {'causal' if causal else 'full'}"
            yield label, lambda: packed_forward_backward(dtype, d, dv, causal, feature_map)


def packed_forward_backward(dtype, d, dv, causal, feature_map, len_q=(48, 80, 1), len_k=(80, 48, 3)):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(sum(len_q), 4, d, generator=gen).to(dtype).requires_grad_()
    k, v = (torch.randn(sum(len_k), 2, width, generator=gen).to(dtype).requires_grad_() for width in (d, dv))
    cu_q, cu_k = (torch.tensor((0,) + tuple(itertools.accumulate(n)), dtype=torch.int32) for n in (len_q, len_k))
    linear_varlen.linear_varlen_triton(q, k, v, cu_q, cu_k, max(len_q), max(len_k), is_causal=causal, scale=1.0,
                                       feature_map=feature_map).float().sum().backward()


OT_HEAD_DIMS = (64, 128, 256)  # D shapes the logit tiles of _exp_kernel and the fallback, Dv the out / dC tiles
# (mask, is_causal, extra templates, log_u with a gradient): a key mask, causal with templates, a float
# mask; the last case launches the log_u gradient path (_pair_kernel's NEED_UG, _dlu_kernel)
OT_CASES = [("none", False, 0, False), ("bool", True, 16, False), ("float", False, 5, True)]


def ot_calls(dtype_name):
    if dtype_name == "fp64":
        return  # ot/triton.py refuses float64 (the kernels compute in float32; backend='cpu' runs it)
    dtype = TORCH_DTYPES[dtype_name]
    for d in OT_HEAD_DIMS:
        for mask, causal, n_templates, with_log_u in OT_CASES:
            q, k, v = qkv(dtype, 48, 64, d, d)
            gen = torch.Generator().manual_seed(1)
            tk = torch.randn(2, 2, n_templates, d, generator=gen).to(dtype) if n_templates else None
            tv = torch.randn(2, 2, n_templates, d, generator=gen).to(dtype) if n_templates else None
            log_u = torch.randn(2, 2, 64, generator=gen).requires_grad_() if with_log_u else None
            label = f"ot {dtype_name} D={d} mask={mask} causal={causal} templates={n_templates} log_u={with_log_u}"
            yield label, lambda: forward_backward(ot_triton.ot_attention_triton, q, k, v, scale=d ** -0.5,
                                                  attn_mask=masks(mask, dtype, 48, 64), is_causal=causal,
                                                  templates_k=tk, templates_v=tv, log_u=log_u)
        # packed sequences (ops/ot/varlen.py): the kernels' VARLEN branch, grouped heads, n_q != n_k
        for causal in (False, True):
            yield (f"ot {dtype_name} D={d} packed causal={causal}",
                   lambda: ot_packed_forward_backward(dtype, d, causal))


def ot_packed_forward_backward(dtype, d, causal, len_q=(48, 80, 1), len_k=(80, 48, 3)):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(sum(len_q), 4, d, generator=gen).to(dtype).requires_grad_()
    k, v = (torch.randn(sum(len_k), 2, d, generator=gen).to(dtype).requires_grad_() for _ in range(2))
    cu_q, cu_k = (torch.tensor((0,) + tuple(itertools.accumulate(n)), dtype=torch.int32) for n in (len_q, len_k))
    ot_varlen.ot_varlen_triton(q, k, v, cu_q, cu_k, max(len_q), max(len_k), is_causal=causal, alpha=1.0,
                               gamma=d ** 0.5).float().sum().backward()


AUTOCAST_MODES = {"off": (False,), "on": (True,), "both": (False, True)}


def with_fp64_scalars(jobs):
    """The jobs again with every float scalar argument typed fp64: inductor hands a user kernel the
    Python floats of a torch.compile'd call as fp64 scalars (the JIT types them fp32), so a kernel
    whose loop-carried fp32 values meet an uncast scalar compiles eagerly and fails under
    torch.compile ("initial type fp32 but is re-assigned to fp64")."""
    out = []
    for job in jobs:
        sig = {name: ("fp64" if kind == "fp32" else kind) for name, kind in dict(job.signature).items()}
        if sig != dict(job.signature):
            out.append(Job(job.fn, sig, job.constexprs, job.attrs, job.options,
                           [label + " fp64 scalars" for label in job.labels]))
    return out


def captured_jobs(dtypes, target, families, autocast="both"):
    """Every launch of the families' host paths, for each input dtype; with autocast, the same calls
    also run inside ``torch.autocast("cpu", dtype=torch.bfloat16)``: the host-side matmuls then return
    bfloat16 as they do under CUDA autocast, so the kernels see what a mixed-precision training step
    hands them (labels end in "autocast"). float16 inputs are left out there: CPU autocast cannot
    promote them (a cat of float16 tensors raises), and a bf16 autocast region hands bf16 or fp32."""
    capture = LaunchCapture(target)
    makers = {"sinkhorn": sinkhorn_calls, "linear": linear_calls, "ot": ot_calls}
    # the Sinkhorn entry point refuses CPU tensors outside the interpreter: here they only carry shapes
    with mock.patch.object(sinkhorn_triton, "unsupported_reason", lambda *a, **k: None):
        for under_autocast in AUTOCAST_MODES[autocast]:
            for family in families:
                for dtype in dtypes:
                    if under_autocast and dtype == "fp16":
                        continue
                    for label, call in makers[family](dtype):
                        ctx = (torch.autocast("cpu", dtype=torch.bfloat16) if under_autocast
                               else contextlib.nullcontext())
                        with capture.calls(label + (" autocast" if under_autocast else "")), ctx:
                            call()
    return list(capture.jobs.values())


# ---------------------------------------------------------------------------------------------------
# compile and measure

PTXAS_REGS = re.compile(r"Used (\d+) registers")
PTXAS_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def compile_job(job: Job, target) -> Result:
    start = time.perf_counter()
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log):
            kernel = triton.compile(ASTSource(job.fn, job.signature, job.constexprs, job.attrs), target=target,
                                    options=job.options)
    except Exception as exc:  # every failure is reported, then the script exits non-zero
        lines = traceback.format_exception_only(type(exc), exc)
        return Result(False, error=" ".join(x.strip() for x in lines)[:400], seconds=time.perf_counter() - start)
    text = log.getvalue()
    regs = PTXAS_REGS.search(text)
    spills = PTXAS_SPILLS.search(text)
    return Result(True, shared=kernel.metadata.shared, regs=int(regs.group(1)) if regs else None,
                  spill_bytes=int(spills.group(1)) + int(spills.group(2)) if spills else None,
                  seconds=time.perf_counter() - start)


_POOL_JOBS: list = []  # handed to forked workers by index (JIT functions do not pickle)


def _compile_index(args):
    index, arch = args
    return compile_job(_POOL_JOBS[index], GPUTarget("cuda", arch, 32))


def compile_all(jobs, arch, workers):
    _POOL_JOBS[:] = jobs
    work = [(i, arch) for i in range(len(jobs))]
    if workers <= 1:
        yield from map(_compile_index, work)
        return
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        yield from pool.imap(_compile_index, work)


def describe(job: Job) -> str:
    """The constexprs that pick the code path, and ints the JIT specialised to 1."""
    parts = []
    for path, value in job.constexprs.items():
        name = path if isinstance(path, str) else job.fn.arg_names[path[0]]  # written-out jobs use names
        if job.signature.get(name) != "constexpr":
            parts.append(f"{name}=1*")  # an int argument equal to 1 becomes a constant
        elif value is not False and value is not None:
            parts.append(f"{name}={getattr(value, 'name', value)}")
    return " ".join(parts)


def input_dtype(job: Job) -> str:
    """The element type of the first pointer argument (what the kernel computes on)."""
    return next((t[1:] for t in job.signature.values() if isinstance(t, str) and t.startswith("*")), "-")


def verdict(result: Result, limit: int) -> str:
    if not result.ok:
        return "FAIL (compile)"
    if result.shared > limit:
        return "FAIL (shared)"
    return "ok, spills" if result.spill_bytes else "ok"


def summary(rows, limit):
    """One line per family (first word of the call label): the largest shared memory, spills, failures."""
    families = {}
    for job, res in rows:
        families.setdefault(job.labels[0].split()[0], []).append((job, res))
    lines = ["| family | specialisations | most shared memory (B) | in | with spills | largest spill (B) | failed |",
             "|---|---|---|---|---|---|---|"]
    for family, members in families.items():
        job, res = max(members, key=lambda m: m[1].shared)
        spills = [r.spill_bytes for _, r in members if r.spill_bytes]
        failed = sum(not verdict(r, limit).startswith("ok") for _, r in members)
        lines.append(f"| {family} | {len(members)} | {res.shared} | {job.fn.fn.__name__} ({job.labels[0]}) | "
                     f"{len(spills)} | {max(spills, default=0)} | {failed} |")
    return lines


def markdown(rows, arch, limit, command, seconds):
    lines = [
        f"# Triton build check: sm_{arch}, compiled without a device",
        "",
        f"Produced by `{command}` in {seconds:.0f} s (triton {triton.__version__}, torch {torch.__version__}).",
        "",
        f"Every kernel was lowered through MLIR to PTX and assembled to a cubin by Triton's bundled ptxas for "
        f"GPUTarget(\"cuda\", {arch}, 32), with no GPU present. This proves each kernel **builds and fits** "
        f"(dynamic shared memory <= {limit} bytes, the sm_{arch} opt-in per-block maximum); it does not show "
        "that it runs correctly or fast. Sinkhorn, linear and OT rows are the launches their host code makes "
        "(captured from forward + backward calls, deduplicated by specialisation); `calls` lists the first "
        "call that launches it and how many more do. `X=1*` marks an int argument the JIT turns into a constant.",
        "",
        *summary(rows, limit),
        "",
        "| kernel | dtype | constexprs | warps | stages | shared (B) | regs | spill (B) | result | calls |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for job, res in rows:
        first = job.labels[0] + (f" (+{len(job.labels) - 1} more)" if len(job.labels) > 1 else "")
        cells = [job.fn.fn.__name__, input_dtype(job), describe(job), job.options.get("num_warps", 4),
                 job.options.get("num_stages", 3), res.shared if res.ok else "-",
                 "-" if res.regs is None else res.regs, "-" if res.spill_bytes is None else res.spill_bytes,
                 verdict(res, limit) + (f": {res.error}" if res.error else ""), first]
        lines.append("| " + " | ".join(str(c).replace("|", "/") for c in cells) + " |")
    failed = sum(not verdict(res, limit).startswith("ok") for _, res in rows)
    lines += ["", f"{len(rows)} kernel specialisations, {failed} failed."]
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", nargs="+", default=["bf16", "fp16", "fp32", "fp64"], choices=list(TORCH_DTYPES),
                        help="input dtypes (fp64 reaches only the linear kernels)")
    parser.add_argument("--families", nargs="+", default=["softmax", "sinkhorn", "linear", "ot"],
                        choices=["softmax", "sinkhorn", "linear", "ot"])
    parser.add_argument("--autocast", default="both", choices=list(AUTOCAST_MODES),
                        help="run the captured Sinkhorn / linear / OT host paths plainly, under CPU bf16 autocast "
                             "(what CUDA autocast hands the kernels), or both")
    parser.add_argument("--match", default=None,
                        help="compile only the jobs with a label containing this text (e.g. 'D=64 ', 'window', 'softcap')")
    parser.add_argument("--scalars", default="fp32", choices=("fp32", "fp64", "both"),
                        help="type of float scalar arguments: fp32 as the JIT launches them, fp64 as inductor does "
                             "under torch.compile, or both")
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 90 (H100), 80 (A100)")
    parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1), help="parallel compiles")
    parser.add_argument("--out", help="also write the table as Markdown to this path")
    args = parser.parse_args(argv)
    target = GPUTarget("cuda", args.arch, 32)
    limit = SHARED_LIMIT.get(args.arch, SHARED_LIMIT[80])
    start = time.perf_counter()
    jobs = softmax_family_jobs(args.dtypes) if "softmax" in args.families else []
    captured = captured_jobs(args.dtypes, target, [f for f in args.families if f != "softmax"], args.autocast)
    jobs += captured
    if args.match is not None:
        jobs = [job for job in jobs if any(args.match in label for label in job.labels)]
    if args.scalars != "fp32":
        jobs = (jobs if args.scalars == "both" else []) + with_fp64_scalars(jobs)
    print(f"{len(jobs)} kernel specialisations to compile for sm_{args.arch} (shared memory limit {limit} B)", flush=True)
    rows = []
    for job, res in zip(jobs, compile_all(jobs, args.arch, args.workers)):
        rows.append((job, res))
        print(f"{verdict(res, limit):15s} {job.fn.fn.__name__:26s} {input_dtype(job):5s} shared={res.shared:6d} "
              f"regs={res.regs} spill={res.spill_bytes} w={job.options.get('num_warps')} "
              f"s={job.options.get('num_stages')} {describe(job)} [{job.labels[0]}] {res.seconds:.1f}s", flush=True)
        if res.error:
            print("    ", res.error, flush=True)
    failed = [(job, res) for job, res in rows if not verdict(res, limit).startswith("ok")]
    if args.out:
        command = "python benchmarks/compile_triton_kernels.py " + " ".join(argv if argv is not None else sys.argv[1:])
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        tmp = args.out + ".tmp"
        with open(tmp, "w") as fh:
            fh.write(markdown(rows, args.arch, limit, command, time.perf_counter() - start))
        os.replace(tmp, args.out)
    print(f"{len(failed)} of {len(rows)} failed" if failed else f"all {len(rows)} kernel specialisations compiled and fit")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
