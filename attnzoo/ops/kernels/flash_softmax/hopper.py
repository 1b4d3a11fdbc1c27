"""Which forward, dQ and dK/dV launches may run the Hopper variants (hopper_kernels.py), decided on the host.

The variants' rows are offered to the forward's (and the dQ and dK/dV launches') autotuner
(ops/triton_tuning.py ``variants``) only when every condition holds; otherwise the launch tunes the classic rows alone, exactly as before:
- Triton can build it (``hopper_kernels.TENSOR_DESCRIPTORS``; the warp-specialised rows also need
  ``WARP_SPECIALIZE``) -- checked once at import;
- the device is sm_90 or newer -- once per device;
- the flavour is one it computes: fp16 / bf16, heads up to 128 wide, no dropout, no T5 bias, no softcap,
  sinks or window (fused in the classic kernels only), no mask
  that varies along both axes (causal, L2 logits, per-key preferences, key-padding or per-query
  masks, grouped heads are fine; a full (Nq, Nk) mask tile is loaded per key block like K and V and
  pushed the 128 x 128 row past sm_90's shared memory in the build check) -- once per flavour
  (lru_cache);
- K and V can be read by TMA: unit last stride, 16-byte aligned base and strides -- a few integer
  tests per call (a pointer's alignment is a property of the call, not of its signature); for dK/dV,
  which streams the queries, Q and dO as well;
- not while torch.compile traces the call: device-side descriptors need the global scratch buffer
  Triton's launcher allocates through ``triton.set_allocator``, which inductor's generated launches
  are not known to provide on torch 2.11, so compiled graphs keep the classic kernel.

Device-side descriptors (``tl.make_tensor_descriptor`` in the kernel) rather than host-side
``TensorDescriptor`` objects: a host descriptor is a Python object per tensor per call whose block
shape depends on the configuration (an autotune pre-hook), then encoded by the launcher on every
launch; the device-side one costs the launcher one scratch allocation (the allocator below: a torch
tensor from the caching allocator), and nothing else on the host. The project measures per-call host
cost at short sequences (tests/test_host_cost.py), where that difference matters most.
"""
from __future__ import annotations

import functools

import torch

from ... import triton_tuning as tuning
from ...triton_utils import HAVE_TRITON, MASK_TILE
from .hopper_kernels import TENSOR_DESCRIPTORS, WARP_SPECIALIZE

HALF = (torch.float16, torch.bfloat16)


def _rows(table):
    """The variant table with the warp-specialised rows dropped where Triton lacks the keyword."""
    if not TENSOR_DESCRIPTORS:
        return {}
    return {cls: [row for row in rows if WARP_SPECIALIZE or not row[4].get("WARP_SPEC", False)]
            for cls, rows in table.items()}


FORWARD_VARIANTS = _rows(tuning.FORWARD_HOPPER)
QUERIES_BACKWARD_VARIANTS = _rows(tuning.QUERIES_BACKWARD_HOPPER)
KEYS_BACKWARD_VARIANTS = _rows(tuning.KEYS_BACKWARD_HOPPER)
# what the classic rows of the selector kernels pass (every row names each switch)
FORWARD_CONSTANTS = {"HOPPER": False, "WARP_SPEC": False} if TENSOR_DESCRIPTORS else {}
QUERIES_BACKWARD_CONSTANTS = {"HOPPER": False} if TENSOR_DESCRIPTORS else {}
KEYS_BACKWARD_CONSTANTS = {"HOPPER": False} if TENSOR_DESCRIPTORS else {}


@functools.lru_cache(maxsize=16)
def device_ready(device: torch.device) -> bool:
    """sm_90 or newer (TMA and the Hopper warp specialisation)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


@functools.lru_cache(maxsize=1024)
def flavour_ready(dtype, block_d, block_dv, dropout, has_t5, mask_kind, mask_shape) -> bool:
    if dtype not in HALF or dropout or has_t5 or (mask_kind != 0 and mask_shape == MASK_TILE):
        return False
    return (False,) + tuning.tile_class(dtype, block_d, block_dv) in {(False,) + c for c in FORWARD_VARIANTS}


def tma_ready(t: torch.Tensor) -> bool:
    """A (B, H, N, D) tensor a TMA descriptor can read: last stride 1, rows apart, base and other strides
    16-byte multiples."""
    size = t.element_size()
    sb, sh, sn, sd = t.stride()
    # rows that do not overlap too (sn >= D): a broadcast dO (row stride 0, e.g. the gradient of a sum
    # over the queries) is no tensor map a TMA copy may read
    return sd == 1 and sn >= t.shape[3] and t.data_ptr() % 16 == 0 and (sb * size) % 16 == 0 and \
        (sh * size) % 16 == 0 and (sn * size) % 16 == 0


def _scratch(size: int, alignment: int, stream):
    """Triton's global-scratch allocator: the tensor descriptors' workspace of one launch."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


try:  # where Triton keeps its allocator (private: without it, no variant rather than a failed launch)
    from triton.runtime import _allocation as _triton_allocation
    _CURRENT_ALLOCATOR, _NULL_ALLOCATOR = _triton_allocation._allocator, _triton_allocation.NullAllocator
except (ImportError, AttributeError):
    _CURRENT_ALLOCATOR = _NULL_ALLOCATOR = None


def _ensure_allocator() -> bool:
    """Install the allocator above unless the caller set one (Triton keeps it in a ContextVar: per
    thread). False when this Triton's allocator state cannot be read (then no variant)."""
    if _CURRENT_ALLOCATOR is None:
        return False
    if isinstance(_CURRENT_ALLOCATOR.get(), _NULL_ALLOCATOR):
        import triton
        triton.set_allocator(_scratch)
    return True


def forward_variants(q, k, v, meta, flags) -> bool:
    """Whether this forward (or dQ) launch may also time the Hopper rows (see the module docstring);
    both read K and V the same way, so one answer serves both."""
    # cheapest tests first; while tracing the tensors are fake (no data_ptr to test)
    if not FORWARD_VARIANTS or not HAVE_TRITON or torch.compiler.is_compiling() or not device_ready(q.device):
        return False
    if flags.get("SOFTCAP") or flags.get("HAS_SINKS") or flags.get("WINDOW"):
        return False  # softcap, sinks and windows are fused in the classic kernels only
    if not flavour_ready(q.dtype, meta["BLOCK_D"], meta["BLOCK_DV"], meta["DROPOUT"], flags["HAS_T5"],
                         flags["MASK_KIND"], flags["MASK_SHAPE"]):
        return False
    return tma_ready(k) and tma_ready(v) and _ensure_allocator()


def forward_kernel(classic):
    """The kernel the forward's autotuner wraps: the selector (classic or Hopper by constexpr) where
    Triton can build the variant, the classic kernel itself otherwise."""
    if not TENSOR_DESCRIPTORS:
        return classic
    from .hopper_kernels import softmax_fwd_select_kernel
    return softmax_fwd_select_kernel


def queries_backward_kernel(classic):
    """The same for the backward's dQ launch."""
    if not TENSOR_DESCRIPTORS:
        return classic
    from .hopper_kernels import softmax_dq_select_kernel
    return softmax_dq_select_kernel


def keys_backward_variants(q, grad_out, queries_backward_variants: bool) -> bool:
    """Whether this dK/dV launch may also time the Hopper rows: the dQ launch's answer
    (``forward_variants``, computed once per backward: the flavour, device and K / V conditions; the
    variant loads K / V with plain pointers, but one answer keeps the three kernels' flavours the same),
    and Q and dO readable by TMA (the tiles it streams)."""
    return queries_backward_variants and tma_ready(q) and tma_ready(grad_out)


def keys_backward_kernel(classic):
    """The kernel the dK/dV launch's autotuner wraps: the selector where Triton can build the variant."""
    if not TENSOR_DESCRIPTORS:
        return classic
    from .hopper_kernels import softmax_dkdv_select_kernel
    return softmax_dkdv_select_kernel
