"""Kept for the test files not yet importing tests/common.py (tests/test_fused_linear.py): where the
Triton kernel tests run lives in tests/common.py."""
from tests.common import (INTERPRET, KERNEL_DEVICE, ON_GPU, TRITON_DTYPES, leaves,  # noqa: F401
                          needs_gpu, needs_kernels)
