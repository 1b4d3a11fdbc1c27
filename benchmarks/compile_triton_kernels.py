"""Build check, no GPU needed: compile every softmax-family and pointwise Triton kernel to PTX for a
CUDA target (default sm_90, H100/H200), for the given dtypes and the main flag combinations.

The interpreter (TRITON_INTERPRET=1, how CI runs the kernels) does not lower them through MLIR, so a
kernel can pass every interpreted test and still fail to compile on a GPU; this catches that.

    .venv/bin/python benchmarks/compile_triton_kernels.py --dtypes bf16 fp16 fp32
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("unset TRITON_INTERPRET: the interpreter does not compile kernels")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from attnzoo.ops import triton_dropout as dropout  # noqa: E402
from attnzoo.ops.pointwise import triton_kernels as pointwise  # noqa: E402
from attnzoo.ops.softmax import triton_kernels as softmax  # noqa: E402

INT_ARGS = {"H", "Nq", "Nk", "D", "DV"}
FLOAT_ARGS = {"scale", "bias_scalar", "dropout_p"}
SOFTMAX_FLAGS = [
    dict(L2=False, MASK_KIND=0, HAS_PREF=False, HAS_T5=False, CAUSAL=False, DROPOUT=False),
    dict(L2=True, MASK_KIND=1, HAS_PREF=True, HAS_T5=False, CAUSAL=True, DROPOUT=True),
    dict(L2=False, MASK_KIND=2, HAS_PREF=False, HAS_T5=True, CAUSAL=True, DROPOUT=True),
]


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


def compile_one(fn, dtype, pointer_types, constexprs, target, warps):
    src = ASTSource(fn=fn, signature=signature(fn, dtype, pointer_types, constexprs), constexprs=constexprs)
    return triton.compile(src, target=target, options={"num_warps": warps, "num_stages": 2})


def jobs(dtype):
    precision = "ieee" if dtype == "fp32" else "tf32"
    for flags in SOFTMAX_FLAGS:
        for head_dim in ((64, 128) if flags["HAS_T5"] else (64,)):
            tile = 32 if (dtype == "fp32" and head_dim >= 128) else 64  # as triton_utils.block_sizes
            meta = dict(BLOCK_M=tile, BLOCK_N=tile, BLOCK_D=head_dim, BLOCK_DV=head_dim, UPCAST=False,
                        PRECISION=precision, **flags)
            pointers = {"LSE": "*fp32", "DELTA": "*fp32", "DPREF": "*fp32", "DTABLE": "*fp32", "PREF": "*fp32",
                        "TABLE": "*fp32", "LUT": "*i32", "SEED": "*i64", "MASK": "*fp32" if flags["MASK_KIND"] == 2 else "*u8"}
            for fn in (softmax.softmax_fwd_kernel, softmax.softmax_bwd_dkdv_kernel, softmax.softmax_bwd_dq_kernel):
                yield fn, pointers, meta, 8 if head_dim >= 128 else 4, f"{flags} D={head_dim}"
    for sigmoid, modes in ((True, (0, 1, 2)), (False, (0,))):
        for mode in modes:
            meta = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_D=64, BLOCK_DV=64, SIGMOID=sigmoid, BIAS_MODE=mode, MASK_KIND=1,
                        CAUSAL=True, UPCAST=False, PRECISION=precision, DROPOUT=mode != 1)
            pointers = {"N_ROWS": "*fp32", "MASK": "*u8", "BIAS": "*fp32", "DBIAS": "*fp32", "SEED": "*i64"}
            for fn in (pointwise.pointwise_fwd_kernel, pointwise.pointwise_bwd_dkdv_kernel,
                       pointwise.pointwise_bwd_dq_kernel):
                yield fn, pointers, meta, 4, f"sigmoid={sigmoid} bias_mode={mode} dropout={mode != 1}"
    yield dropout.dropout_mask_kernel, {"KEEP": "*u8", "SEED": "*i64"}, dict(BLOCK_M=64, BLOCK_N=64), 4, "keep-mask"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", nargs="+", default=["bf16", "fp16", "fp32"], choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 90 (H100), 80 (A100)")
    args = parser.parse_args(argv)
    target = GPUTarget("cuda", args.arch, 32)
    failed = 0
    for dtype in args.dtypes:
        for fn, pointers, meta, warps, label in jobs(dtype):
            name = f"{fn.fn.__name__} {dtype} {label}"
            try:
                compile_one(fn, dtype, pointers, dict(meta), target, warps)
                print("ok  ", name, flush=True)
            except Exception:  # report every failure, then exit non-zero
                failed += 1
                print("FAIL", name, flush=True)
                traceback.print_exc(limit=2)
    print(f"{failed} failed" if failed else "all kernels compiled")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
