"""torch.compile must see each Triton kernel write its outputs and nothing else.

Inductor reads the written arguments of a Triton launch off the kernel's IR (tests/mutation_probe.py
explains how and runs it on a CPU). A kernel that seems to write an input (a saved tensor of the
backward, a parameter) is compiled with clones and write-backs of that input; the T5 kernel did
this before, the likely reason its layer failed to compile on an H100 while the others passed.
The written sets below are the kernels' outputs by design (the tensors each launch allocates).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from attnzoo.ops.kernels.flash_softmax.hopper_kernels import TENSOR_DESCRIPTORS
from tests.common import needs_triton

ROOT = Path(__file__).resolve().parents[1]
S, P, SK = "attnzoo.ops.kernels.flash_softmax.triton_kernels", "attnzoo.ops.kernels.pointwise.triton_kernels", "attnzoo.ops.sinkhorn.triton_kernels"
L, O = "attnzoo.ops.linear.triton_kernels", "attnzoo.ops.ot.triton_kernels"
LN = "attnzoo.ops.linear.noncausal_kernels"
# the forward's, dQ's and dK/dV's autotuners launch the selector kernels where Triton can build the Hopper variant
FWD = ("attnzoo.ops.kernels.flash_softmax.hopper_kernels.softmax_fwd_select_kernel" if TENSOR_DESCRIPTORS
       else f"{S}.softmax_fwd_kernel")
DQ = ("attnzoo.ops.kernels.flash_softmax.hopper_kernels.softmax_dq_select_kernel" if TENSOR_DESCRIPTORS
      else f"{S}.softmax_bwd_dq_kernel")
DKDV = ("attnzoo.ops.kernels.flash_softmax.hopper_kernels.softmax_dkdv_select_kernel" if TENSOR_DESCRIPTORS
        else f"{S}.softmax_bwd_dkdv_kernel")
OUTPUTS = {
    FWD: {"O", "LSE", "ORES"},  # ORES: out's rounding residual, T5 with half inputs (issue 21)
    DKDV: {"DK", "DV_OUT", "DPREF", "DTABLE"},
    DQ: {"DQ"},
    f"{S}.softmax_bwd_delta_kernel": {"DELTA"},
    f"{P}.pointwise_fwd_kernel": {"O", "N_ROWS"},
    f"{P}.pointwise_bwd_dkdv_kernel": {"DK", "DV_OUT"},
    f"{P}.pointwise_bwd_dq_kernel": {"DQ", "DBIAS"},
    f"{SK}._lse_kernel": {"OUT", "OTHER"},          # OTHER: g^0, written by the first row pass of a small call
    f"{SK}._attend_kernel": {"OUT", "LSE", "OUT32"},   # OUT32: the unrounded output of half inputs
    f"{SK}._wsum_kernel": {"OUT"},
    f"{SK}._grad_v_kernel": {"DVOUT", "DG", "DELTA"},  # DELTA: dout.out, computed there in a small call
    f"{SK}._factors_kernel": {"XF", "UF", "FAST"},
    f"{SK}._grad_qk_kernel": {"DQ", "DK"},
    f"{SK}._row_dot_kernel": {"OUT"},
    f"{L}._states_kernel": {"HS", "ZS"},
    f"{L}._output_kernel": {"O", "RDEN", "O32"},       # O32: the unrounded output of half inputs
    f"{L}._normaliser_grad_kernel": {"CG"},
    f"{L}._reverse_states_kernel": {"DHS", "DZS"},
    f"{L}._dv_kernel": {"DV_OUT"},
    f"{L}._dqk_kernel": {"DQ", "DK"},
    f"{LN}._keys_state_kernel": {"PART"},
    f"{LN}._sum_splits_kernel": {"OUT"},
    f"{LN}._queries_output_kernel": {"O", "RDEN"},
    f"{LN}._queries_grad_kernel": {"PART", "DQ"},
    f"{LN}._keys_grad_kernel": {"DK", "DV_OUT", "DM"},
    f"{O}._exp_kernel": {"E", "LZ", "EDW", "DELTA", "LO", "HI"},  # DELTA, LO, HI: host-allocated scratch
    f"{O}._pair_kernel": {"R", "RG", "BAD", "TBAD"},
    f"{O}._out_kernel": {"OUT"},
    f"{O}._fallback_fwd_kernel": {"OUT"},
    f"{O}._dc_kernel": {"DC", "DAV"},
    f"{O}._dg_kernel": {"DG"},
    f"{O}._fallback_bwd_kernel": {"DAV", "DQ", "DK", "DAK"},
}
# The packed (varlen) launches (kernels/*/varlen.py) run the classic kernels (not the selectors) and the
# pointwise and delta kernels with VARLEN. Their store addresses start at offsets loaded from CU_Q / CU_K,
# and the analysis counts the tensors an address is computed from as written: under torch.compile inductor
# copies those N + 1 offsets around a launch (the kernels never write them; an address cannot avoid them).
OFFSETS = {"CU_Q", "CU_K"}
if TENSOR_DESCRIPTORS:
    OUTPUTS.update({f"{S}.softmax_fwd_kernel": {"O", "LSE"} | OFFSETS,
                    f"{S}.softmax_bwd_dkdv_kernel": {"DK", "DV_OUT"} | OFFSETS,
                    f"{S}.softmax_bwd_dq_kernel": {"DQ"} | OFFSETS})
else:
    for name in (FWD, DKDV, DQ):
        OUTPUTS[name] = OUTPUTS[name] | OFFSETS
OUTPUTS[f"{S}.softmax_bwd_delta_kernel"] = {"DELTA", "CU_Q"}
for name in ("pointwise_fwd_kernel", "pointwise_bwd_dkdv_kernel", "pointwise_bwd_dq_kernel"):
    OUTPUTS[f"{P}.{name}"] = OUTPUTS[f"{P}.{name}"] | OFFSETS
for name in ("_lse_kernel", "_attend_kernel", "_wsum_kernel", "_grad_v_kernel", "_factors_kernel",
             "_grad_qk_kernel"):                                   # ops/sinkhorn/varlen.py
    OUTPUTS[f"{SK}.{name}"] = OUTPUTS[f"{SK}.{name}"] | OFFSETS


@pytest.fixture(scope="module")
def inductor_writes():
    try:
        from torch._higher_order_ops.triton_kernel_wrap import identify_accessed_tensors  # noqa: F401
    except ImportError as e:  # a private torch API: say so rather than pass
        pytest.skip(f"this torch has no inductor Triton mutation analysis to check against ({e})")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the analysis needs JITFunctions
    done = subprocess.run([sys.executable, "-m", "tests.mutation_probe"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@needs_triton
def test_probe_launches_exactly_the_listed_kernels(inductor_writes):
    unlisted = sorted(set(inductor_writes) - set(OUTPUTS))
    missing = sorted(set(OUTPUTS) - set(inductor_writes))
    assert not unlisted and not missing, f"kernels launched but not listed: {unlisted}; listed, not launched: {missing}"


@needs_triton
@pytest.mark.parametrize("kernel", sorted(OUTPUTS), ids=lambda k: k.replace("attnzoo.ops.", ""))
def test_kernel_is_seen_writing_only_its_outputs(inductor_writes, kernel):
    """Autotuned kernels included: the analysis reads the IR of their first configuration."""
    if kernel not in inductor_writes:
        pytest.fail(f"the probe launched no {kernel}")
    written = set(inductor_writes[kernel])
    assert written <= OUTPUTS[kernel], f"inductor would treat these inputs as written: {sorted(written - OUTPUTS[kernel])}"
    # the probe's cases exercise every output
    assert OUTPUTS[kernel] <= written, f"outputs inductor would not see written: {sorted(OUTPUTS[kernel] - written)}"
