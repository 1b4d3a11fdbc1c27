"""Where the Triton kernel tests run: under TRITON_INTERPRET=1 (`make test`) on CPU tensors, or
compiled on a CUDA GPU when the interpreter is off and one exists."""
from __future__ import annotations

import pytest
import torch

from attnzoo.ops.triton_utils import HAVE_TRITON
from attnzoo.ops.triton_utils import INTERPRETED as INTERPRET  # TRITON_INTERPRET=1 set before the import

ON_GPU = HAVE_TRITON and not INTERPRET and torch.cuda.is_available()
KERNEL_DEVICE = "cuda" if ON_GPU else "cpu"     # where the Triton kernels take their tensors
needs_kernels = pytest.mark.skipif(not (INTERPRET or ON_GPU), reason=(
    "the Triton kernels need TRITON_INTERPRET=1 (CPU tensors; `make test` sets it) or a CUDA GPU with "
    "TRITON_INTERPRET unset (compiled kernels): neither is available here"))
needs_gpu = pytest.mark.skipif(not ON_GPU, reason=(
    "CUDA only: needs a CUDA GPU and TRITON_INTERPRET unset (compiled kernels; the interpreter would "
    "take minutes at this size)"))
# the interpreter runs fp32 only (it is slow); a GPU runs all three
TRITON_DTYPES = [torch.float32] + ([torch.bfloat16, torch.float16] if ON_GPU else [])


def leaves(tensors: dict, device, dtype) -> dict:
    """The inputs of one kernel case as leaves on ``device``: q, k, v cast to ``dtype``, every tensor
    but the mask requiring grad; anything that is not a tensor passes through."""
    out = {}
    for name, x in tensors.items():
        if isinstance(x, torch.Tensor):
            x = x.to(device)
            if name in ("q", "k", "v"):
                x = x.to(dtype)
            if name != "mask":
                x.requires_grad_(True)
        out[name] = x
    return out
