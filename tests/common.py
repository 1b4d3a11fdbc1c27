"""What the test files share: where the kernels run (skip markers, devices, dtypes) and how random
inputs are made (seeded q, k, v; bool, float and -inf masks of every broadcast shape; key padding).

The factories draw from ``generator`` when one is given, else from the global RNG (tests/conftest.py
seeds it with 0 before every test), always in the order their docstrings state: a seeded case keeps
its numbers as long as its calls stay in the same order.
"""
from __future__ import annotations

import math
from typing import Sequence

import pytest
import torch

from attnzoo.ops.triton_utils import HAVE_TRITON
from attnzoo.ops.triton_utils import INTERPRETED as INTERPRET  # TRITON_INTERPRET=1 set before the import

# --- where the kernels run ----------------------------------------------------------------------------

HAVE_CUDA = torch.cuda.is_available()
ON_GPU = HAVE_TRITON and not INTERPRET and HAVE_CUDA
KERNEL_DEVICE = "cuda" if ON_GPU else "cpu"     # where the Triton kernels take their tensors
# the interpreter runs fp32 only (it is slow); a GPU runs all three
TRITON_DTYPES = [torch.float32] + ([torch.bfloat16, torch.float16] if ON_GPU else [])

needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
needs_cuda = pytest.mark.skipif(not HAVE_CUDA, reason="needs a CUDA GPU")
needs_kernels = pytest.mark.skipif(not (INTERPRET or ON_GPU), reason=(
    "the Triton kernels need TRITON_INTERPRET=1 (CPU tensors; `make test` sets it) or a CUDA GPU with "
    "TRITON_INTERPRET unset (compiled kernels): neither is available here"))
needs_interpreter = pytest.mark.skipif(not INTERPRET, reason=(
    "runs the Triton kernels on CPU tensors under TRITON_INTERPRET=1, set before attnzoo is imported "
    "(`make test` sets it); on a GPU the compiled kernels run in the GPU tests instead"))
needs_gpu = pytest.mark.skipif(not ON_GPU, reason=(
    "CUDA only: needs a CUDA GPU and TRITON_INTERPRET unset (compiled kernels; the interpreter would "
    "take minutes at this size)"))


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


# --- random inputs ------------------------------------------------------------------------------------

def seeded(seed: int) -> torch.Generator:
    """A CPU generator of its own, so a case's numbers do not depend on what ran before it."""
    return torch.Generator().manual_seed(seed)


def randn(shape, seed: int | None = None, scale: float = 1.0, *, dtype=torch.float64, generator=None):
    """``scale`` * N(0, 1) of ``shape`` in ``dtype``, from ``seeded(seed)`` when a seed is given."""
    if seed is not None:
        generator = seeded(seed)
    return torch.randn(shape, generator=generator, dtype=dtype) * scale


def qkv(b: int, h: int, nq: int, nk: int, d: int, dv: int | None = None, *, dtype=torch.float32, generator=None,
        device=None):
    """N(0, 1) q (b, h, nq, d), k (b, h, nk, d) and v (b, h, nk, dv; dv defaults to d), drawn in that
    order in ``dtype`` on ``device`` (draw in float64 and cast to keep one case's numbers across dtypes)."""
    dv = d if dv is None else dv
    return tuple(torch.randn(b, h, n, width, generator=generator, dtype=dtype, device=device)
                 for n, width in ((nq, d), (nk, d), (nk, dv)))


# --- masks (SDPA's convention: bool True = takes part; float is added to the logits, -inf = masked) ----

def broadcast_shapes(b: int, h: int, nq: int, nk: int) -> dict[str, tuple]:
    """Every mask shape SDPA's rule broadcasts to (B, H, Nq, Nk), each read differently by a kernel:
    (Nk,) one dim; (Nq, 1) a whole row kept or not; (Nq, Nk); key padding (B, 1, 1, Nk); the full one."""
    return {"Nk": (nk,), "Nq,1": (nq, 1), "Nq,Nk": (nq, nk), "B,1,1,Nk": (b, 1, 1, nk), "B,H,Nq,Nk": (b, h, nq, nk)}


def bool_mask(shape, keep: float = 0.7, *, generator=None, empty_rows: Sequence = ()) -> torch.Tensor:
    """Each entry True (takes part) where its uniform draw is below ``keep``; every index in
    ``empty_rows`` (e.g. ``(0, 0, 1)`` or ``(slice(None), slice(None), 3)``) is set False, for rows
    that keep no key (their output must be zeros, not NaN)."""
    m = torch.rand(shape, generator=generator) < keep
    for index in empty_rows:
        m[index] = False
    return m


def float_mask(shape, removed: float = 0.0, *, scale: float = 1.0, generator=None, dtype=torch.float32,
               empty_rows: Sequence = ()) -> torch.Tensor:
    """``scale`` * N(0, 1) added to the logits, then -inf (the key is masked) where a second, uniform
    draw is below ``removed``, and on every index in ``empty_rows``. Draws: the values, then the
    uniforms (none when ``removed`` is 0)."""
    m = torch.randn(shape, generator=generator, dtype=dtype) * scale
    if removed:
        m = m.masked_fill(torch.rand(shape, generator=generator) < removed, -math.inf)
    for index in empty_rows:
        m[index] = -math.inf
    return m


def padding_mask(lengths: Sequence[int], nk: int) -> torch.Tensor:
    """Key padding (B, 1, 1, Nk): batch element b has ``lengths[b]`` real keys, the rest are padding."""
    return torch.arange(nk) < torch.tensor(lengths)[:, None, None, None]


def extreme_mask(shape, size: float = 1e4) -> torch.Tensor:
    """Float mask of -size, 0 or +size (uniform integers in {-1, 0, 1} times size): logits ~ size,
    where float32 itself keeps only ~size * 2^-24 of them."""
    return torch.randint(-1, 2, shape).float() * size


def band_allowed(nq: int, nk: int, window, causal: bool) -> torch.Tensor:
    """(nq, nk) bool written as loops from the definition of a window (left, right; -1 unbounded):
    d = j - i - (nk - nq) in [-left, right], and d <= 0 when causal (FlashAttention's bottom-right
    alignment)."""
    left, right = window
    allow = torch.zeros(nq, nk, dtype=torch.bool)
    for i in range(nq):
        for j in range(nk):
            d = j - i - (nk - nq)
            allow[i, j] = (left < 0 or d >= -left) and (right < 0 or d <= right) and (not causal or d <= 0)
    return allow


# --- packed calls ---------------------------------------------------------------------------------------

def refuse_other_packed_routes(patch) -> None:
    """Every packed route but the varlen Triton kernels fails the test if reached (``patch``: a pytest
    MonkeyPatch): ops/varlen.py's per-length and padded routes (the coupled one too) and the CPU blockwise one."""
    from attnzoo.ops import varlen, varlen_blockwise

    def refuse(*args, **kwargs):
        raise AssertionError("the packed call left the varlen Triton route")
    for module, name in ((varlen, "per_sequence"), (varlen, "padded"), (varlen, "padded_coupled"),
                         (varlen, "per_sequence_reading_offsets"), (varlen_blockwise, "run")):
        patch.setattr(module, name, refuse)
