"""Pieces shared by the Triton kernels (softmax family and pointwise family).

- ``mask_tile``: the one place where a (BLOCK_M, BLOCK_N) tile learns which keys take part (bounds,
  bottom-right causal, bool or float ``attn_mask``) and what finite number the float mask adds.
- ``mm``: ``tl.dot`` with fp32 accumulation; under the interpreter half-precision operands are
  upcast first (the interpreter's bf16 dot is wrong), on a GPU they stay on the tensor cores.
- Host helpers: whether the kernels can run on a tensor's device, block sizes, how a mask is handed
  to a kernel (broadcast by strides, never copied to (B, H, Nq, Nk)).
"""
from __future__ import annotations

import os

import torch

try:  # triton is an optional dependency: without it the backends say so and never run
    import triton
    import triton.language as tl
    HAVE_TRITON = True
except ImportError:  # pragma: no cover - the dev environment has triton
    triton = None
    tl = None
    HAVE_TRITON = False

# Triton decides at decoration time whether a @triton.jit function is compiled or interpreted, so a
# CPU tensor can only run if TRITON_INTERPRET=1 was set before this module was imported.
INTERPRETED = HAVE_TRITON and os.environ.get("TRITON_INTERPRET") == "1"

MASK_NONE, MASK_BOOL, MASK_FLOAT = 0, 1, 2
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


def device_reason(q: torch.Tensor):
    """None when the Triton kernels can run on q's device, else why not."""
    if not HAVE_TRITON:
        return "triton is not installed"
    if q.device.type == "cpu":
        if os.environ.get("TRITON_INTERPRET") != "1":
            return "CPU tensors run the Triton kernels only under TRITON_INTERPRET=1 (the Triton interpreter)"
        if not INTERPRETED:
            return ("TRITON_INTERPRET=1 was set after attnzoo was imported; Triton compiled the kernels for "
                    "a GPU, so set it before the import to run them on CPU tensors")
        return None
    if q.device.type != "cuda":
        return f"Triton kernels run on CUDA tensors (or CPU under TRITON_INTERPRET=1), got {q.device.type}"
    if INTERPRETED:
        return "TRITON_INTERPRET=1 is set: the kernels are interpreted and take CPU tensors only"
    return None


def common_reason(q, k, v, attn_mask=None, dropout_p=0.0):
    """Reasons shared by the softmax-family and pointwise Triton backends (device, dtype, head dims,
    dropout_p range, mask). Dropout is done in those kernels (ops/triton_dropout.py); the Sinkhorn,
    linear and OT Triton backends refuse dropout with reasons of their own."""
    why = device_reason(q)
    if why is not None:
        return why
    if q.dtype not in KERNEL_DTYPES:
        return f"the Triton kernels take float16, bfloat16 or float32 inputs, got {q.dtype}"
    if q.shape[-1] > MAX_HEAD_DIM or v.shape[-1] > MAX_HEAD_DIM:
        return f"head dims above {MAX_HEAD_DIM} are not supported (q D={q.shape[-1]}, v Dv={v.shape[-1]})"
    if not 0.0 <= float(dropout_p) < 1.0:
        return f"dropout_p must be in [0, 1), got {dropout_p}"
    if attn_mask is not None:
        if attn_mask.dim() > 4:
            return f"attn_mask has {attn_mask.dim()} dims; at most 4 (broadcastable to (B, H, Nq, Nk))"
        if attn_mask.dtype != torch.bool and attn_mask.requires_grad:
            return "a float attn_mask that requires grad: the kernels give no gradient to attn_mask"
    return None


def kernel_op(name: str, *, mutates_args=()):
    """Register a function that launches Triton kernels as a torch custom op.

    On a GPU it is a ``torch.library.triton_op``: torch.compile traces through it and records each
    ``wrap_triton`` launch in the graph. Under the interpreter the launches are plain Python that a
    fake tensor cannot feed, so ``tracing_only`` returns before launching while tracing; a traced
    triton_op would then record no launch at all and the compiled graph would return uninitialised
    memory. There the function is an opaque ``custom_op`` instead, with itself as the fake
    implementation (shapes only, via ``tracing_only``): compiled graphs call it and it runs for real.
    """
    def register(fn):
        if not INTERPRETED:
            from torch.library import triton_op
            return triton_op(name, mutates_args=mutates_args)(fn)
        op = torch.library.custom_op(name, mutates_args=mutates_args)(fn)
        op.register_fake(fn)
        return op
    return register


def eager_under_interpreter(fn):
    """For entry points that launch Triton kernels from a torch.autograd.Function (Sinkhorn, linear,
    OT): under the interpreter dynamo cannot trace an interpreted launch, so torch.compile runs the
    function eagerly (a graph break; an error under fullgraph=True) instead of failing inside dynamo.
    On a GPU it is returned unchanged and dynamo traces the launches."""
    return torch.compiler.disable(fn, recursive=True) if INTERPRETED else fn


def tracing_only(t: torch.Tensor) -> bool:
    """True for a fake (shape-only) tensor under the interpreter. On a GPU ``wrap_triton`` records the
    launch for torch.compile; the interpreter's kernels are plain Python that would try to read a fake
    tensor's memory, so the ops return their (shape-correct) outputs without launching."""
    from torch._subclasses.fake_tensor import is_fake
    return INTERPRETED and is_fake(t)


def block_sizes(nq: int, nk: int, d: int, dv: int, device_type: str, dtype=torch.bfloat16):
    """(BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, num_warps).

    Interpreted runs use 16 x 16 tiles, so the tiny CI shapes still cross several blocks (partial
    blocks, causal block skipping); on a GPU 64 x 64 tiles, 8 warps for the widest heads, and
    32 x 32 tiles for fp32 heads wider than 64 (twice the registers per element). Untuned.
    """
    bd = max(16, triton.next_power_of_2(d))
    bdv = max(16, triton.next_power_of_2(dv))
    if device_type == "cpu":
        return 16, 16, bd, bdv, 1
    wide = max(bd, bdv) >= 128
    tile = 32 if (wide and dtype == torch.float32) else 64
    return tile, tile, bd, bdv, 8 if wide else 4


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs use exact fp32 products unless the user allowed TF32 for matmuls; fp16/bf16
    operands go to the tensor cores whatever this says (it only governs fp32 operands)."""
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


def kernel_mask(attn_mask, B, H, nq, nk):
    """(mask tensor for the kernel, MASK_KIND, strides (b, h, m, n)); broadcast dims get stride 0.

    A bool mask is reinterpreted as uint8 (same bytes), a float mask is passed as is: the kernel
    treats its -inf entries as masked keys and adds the finite ones to the logits.
    """
    if attn_mask is None:
        return None, MASK_NONE, (0, 0, 0, 0)
    m = attn_mask.expand(B, H, nq, nk)
    kind = MASK_BOOL if m.dtype == torch.bool else MASK_FLOAT
    if kind == MASK_BOOL:
        m = m.view(torch.uint8)
    return m, kind, tuple(m.stride())


def broadcast_rows(t, B, H, n):
    """A (B|1, H|1, n|1) tensor expanded to (B, H, n) by strides, or None."""
    if t is None:
        return None
    return t.expand(B, H, n)


def reduce_to_shape(grad: torch.Tensor, shape) -> torch.Tensor:
    """Sum a (B, H, n) gradient over the dims the original tensor broadcast along."""
    shape = tuple(shape)
    lead = grad.dim() - len(shape)
    if lead > 0:
        grad = grad.sum(dim=tuple(range(lead)))
    dims = tuple(i for i, s in enumerate(shape) if s == 1 and grad.shape[i] != 1)
    if dims:
        grad = grad.sum(dim=dims, keepdim=True)
    return grad.reshape(shape)


if HAVE_TRITON:
    @triton.jit
    def mm(a, b, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
        """a @ b with an fp32 result."""
        if UPCAST:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        return tl.dot(a, b, input_precision=PRECISION)

    @triton.jit
    def mask_tile(s, offs_m, offs_n, Nq, Nk, mask_ptr, stride_mm, stride_mn,
                  MASK_KIND: tl.constexpr, CAUSAL: tl.constexpr):
        """(s plus the float mask's finite part, keep) for one tile; keep is False out of bounds."""
        keep = (offs_m[:, None] < Nq) & (offs_n[None, :] < Nk)
        if CAUSAL:  # bottom-right aligned: key j takes part for query i iff j <= i + Nk - Nq
            keep = keep & (offs_n[None, :] <= offs_m[:, None] + (Nk - Nq))
        if MASK_KIND == 1:
            mv = tl.load(mask_ptr + offs_m[:, None] * stride_mm + offs_n[None, :] * stride_mn, mask=keep, other=0)
            keep = keep & (mv != 0)
        if MASK_KIND == 2:
            mv = tl.load(mask_ptr + offs_m[:, None] * stride_mm + offs_n[None, :] * stride_mn, mask=keep,
                         other=0.0).to(tl.float32)
            keep = keep & (mv > float("-inf"))
            s = s + tl.where(keep, mv, 0.0)
        return s, keep

    @triton.jit
    def causal_end(start_m, Nq, Nk, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr):
        """One past the last key any query of the block [start_m, start_m + BLOCK_M) can see."""
        if CAUSAL:
            return tl.minimum(Nk, tl.maximum(start_m + BLOCK_M + Nk - Nq, 0))
        return Nk

    @triton.jit
    def causal_start(start_n, Nq, Nk, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr):
        """The first query block (a multiple of BLOCK_M) that can see any key of [start_n, ...)."""
        if CAUSAL:
            first = tl.maximum(start_n - (Nk - Nq), 0)
            return (first // BLOCK_M) * BLOCK_M
        return 0
