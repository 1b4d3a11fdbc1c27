"""Pieces shared by the Triton kernels (softmax family and pointwise family).

- ``mask_tile``: the one place where a (BLOCK_M, BLOCK_N) tile learns which keys take part (bounds,
  bottom-right causal, bool or float ``attn_mask``) and what finite number the float mask adds.
- ``mm`` / ``mma``: ``tl.dot`` with fp32 accumulation (``mma`` adds into an accumulator, the
  tensor cores' own accumulate); under the interpreter half-precision operands are upcast first
  (the interpreter's bf16 dot is wrong), on a GPU they stay on the tensor cores.
- ``load_tile`` / ``tile_logits``: the staged inner loops' loads and score masking. A loop stage
  whose blocks lie inside the bounds and below the causal diagonal passes False for the bounds /
  causal flags and gets loads without masks and no per-element masking arithmetic at all.
- ``query_block`` / ``key_block``: where a query-block program (forward, dQ) or a key-block program
  (dK/dV) stands: batch, head, its rows, their clamped addresses, the head-dim ranges;
  ``packed_sequence``: where a varlen program's sequence starts and how long it is (cu_seq offsets). ``store_tile``:
  the masked store of an output tile in the output's dtype.
- Host helpers: whether the kernels can run on a tensor's device, block sizes, how a mask is handed
  to a kernel (broadcast by strides, never copied to (B, H, Nq, Nk)).
"""
from __future__ import annotations

import inspect
import os

import torch

from .first_order import first_order_only

try:  # triton is an optional dependency: without it the backends say so and never run
    import triton
    import triton.language as tl
    import triton.testing
    HAVE_TRITON = True
except ImportError:  # pragma: no cover - the dev environment has triton
    triton = None
    tl = None
    HAVE_TRITON = False

# Triton decides at decoration time whether a @triton.jit function is compiled or interpreted, so a
# CPU tensor can only run if TRITON_INTERPRET=1 was set before this module was imported.
INTERPRETED = HAVE_TRITON and os.environ.get("TRITON_INTERPRET") == "1"

MASK_NONE, MASK_BOOL, MASK_FLOAT = 0, 1, 2
LOG2E = 1.4426950408889634  # the kernels run exp2: exp(x) = exp2(x * log2(e))
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


def eager_call(tensor) -> bool:
    """True when a kernel op's call runs its host function directly: eager mode (not while
    torch.compile traces), a plain tensor (not a fake tensor or another subclass) and no torch dispatch
    mode active (a mode that records ops, such as a FLOP counter or a tracer, sees the op)."""
    return (not torch.compiler.is_compiling() and type(tensor) is torch.Tensor
            and torch._C._len_torch_dispatch_stack() == 0)


class KernelOp:
    """A host function that launches Triton kernels, as a torch op and as a plain call.

    ``op`` is the registered torch op (``attnzoo::<name>``): on a GPU a ``torch.library.triton_op``,
    so torch.compile traces through it and records each ``wrap_triton`` launch in its graph; under
    the interpreter an opaque ``custom_op`` whose fake implementation is the host function itself
    returning before its launches (``tracing_only``), since a traced interpreted launch would record
    nothing. Calling the KernelOp in eager mode skips the op's dispatch (tens of microseconds per
    call in custom_op and autograd-registration overhead, measured in pytorch#177109 and
    attention-gym#302): the host function runs directly, inside an ``autograd.Function`` built from
    the same backward and setup_context as the op's ``register_autograd`` when a gradient is needed.
    Both routes run the same host code and kernels."""

    def __init__(self, name: str, host, mutates_args=()):
        self.name = name
        self.host = host
        if not INTERPRETED:
            from torch.library import triton_op
            self.op = triton_op(name, mutates_args=mutates_args)(host)
        else:
            self.op = torch.library.custom_op(name, mutates_args=mutates_args)(host)
            self.op.register_fake(host)
        self._function = None
        self.__doc__ = host.__doc__
        self.__name__ = host.__name__

    def register_autograd(self, backward, *, setup_context) -> None:
        self.op.register_autograd(backward, setup_context=setup_context)
        self._function = _autograd_function(self.name, self.host, backward, setup_context)

    def __call__(self, *args):
        if not eager_call(args[0]):
            return self.op(*args)
        # isinstance, not type(): a parameter handed over as it is (a T5 table) needs its gradient too
        if self._function is not None and torch.is_grad_enabled() and any(
                isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            return self._function.apply(*args)
        return self.host(*args)


def _autograd_function(name: str, host, backward, setup_context) -> type:
    """The eager route's autograd link: the op's own backward and setup_context around its host function.
    Gradients of outputs nobody used arrive as None (the backward functions ignore them), so no zeros
    are materialised for them. The forward takes ctx itself (the older autograd.Function form): with a
    separate setup_context, ``apply`` binds every call's arguments through ``inspect.signature``, which
    cost more host time than the whole launch; the defaults of omitted trailing arguments are filled in
    here instead."""
    params = list(inspect.signature(host).parameters.values())
    defaults = tuple(p.default for p in params)

    def forward(ctx, *args):
        if len(args) < len(defaults):
            args = args + defaults[len(args):]
        ctx.set_materialize_grads(False)
        output = host(*args)
        setup_context(ctx, args, output)
        return output

    return type(name.replace("::", "_"), (torch.autograd.Function,), {
        "forward": staticmethod(forward), "backward": staticmethod(first_order_only(backward, f"the backward of {name}"))})


def kernel_op(name: str, *, mutates_args=()):
    """Decorator: the host function as a :class:`KernelOp` registered under ``name``; the forward and
    backward ops of a family are tied by ``register_autograd`` like a torch op's."""
    def register(fn):
        return KernelOp(name, fn, mutates_args)
    return register


def quick_bench(kernel_call, quantiles):
    """The autotuners' timing of one candidate: ``triton.testing.do_bench`` with 5 ms of warm-up and
    20 ms of repeats instead of its 25 / 100 (tens of samples of a millisecond kernel are enough to
    rank a handful of tiles; the default made tuning dominate a short GPU session)."""
    return triton.testing.do_bench(kernel_call, warmup=5, rep=20, quantiles=quantiles)


def launcher(kernel):
    """What a host function indexes with the grid to launch ``kernel``: ``wrap_triton(kernel)`` while
    torch.compile traces a GPU op (the launch is recorded in its graph); the kernel itself otherwise.
    In eager mode ``wrap_triton`` outside a triton_op's body goes through the higher-order-op path (a
    grid per autotune configuration, generated code; flash-attention#2818 measured +70 us a call),
    and under the interpreter nothing is traced (the ops are opaque there, see ``KernelOp``) and
    torch 2.11's ``wrap_triton`` refuses interpreted kernels."""
    if INTERPRETED or not torch.compiler.is_compiling():
        return kernel
    from torch.library import wrap_triton
    return _TracedLaunch(wrap_triton(kernel), kernel)


# The packed-sequence (varlen) arguments kernels append at the end of their signatures with defaults
# that switch them off (CU_Q / CU_K offsets, sizes, VARLEN False; Sinkhorn's X_IS_Q, HEADS).
PACKED_ARGS = ("CU_Q", "CU_K", "CT", "GROUP", "TQ", "TK", "VARLEN", "X_IS_Q", "HEADS")


def _signature(kernel):
    while not inspect.isfunction(kernel):     # an Autotuner's .fn is its JITFunction, whose .fn is Python
        kernel = kernel.fn
    return inspect.signature(kernel).parameters


def packed_defaults(kernel, n_args: int, kwargs) -> dict:
    """The defaults of ``kernel``'s packed-sequence arguments that a launch with ``n_args`` positional
    arguments and ``kwargs`` leaves out. Under torch.compile they are passed explicitly: inductor's
    analysis of which tensors a launch writes binds only the arguments it is handed, and a missing one
    makes it treat every input as written (tests/test_triton_mutation_analysis.py)."""
    params = _signature(kernel)
    return {name: p.default for i, (name, p) in enumerate(params.items())
            if i >= n_args and name in PACKED_ARGS and name not in kwargs and p.default is not p.empty}


class _TracedLaunch:
    """``wrap_triton(kernel)`` whose launches pass the packed-sequence defaults explicitly (see
    ``packed_defaults``); only while torch.compile traces, so eager launches pay nothing."""

    def __init__(self, wrapped, kernel):
        self.wrapped, self.kernel = wrapped, kernel

    def __getitem__(self, grid):
        launch = self.wrapped[grid]
        return lambda *args, **kwargs: launch(*args, **packed_defaults(self.kernel, len(args), kwargs), **kwargs)


def tracing_only(t: torch.Tensor) -> bool:
    """True for a fake (shape-only) tensor under the interpreter. On a GPU ``wrap_triton`` records the
    launch for torch.compile; the interpreter's kernels are plain Python that would try to read a fake
    tensor's memory, so the ops return their (shape-correct) outputs without launching."""
    if not INTERPRETED or type(t) is torch.Tensor:  # a plain tensor is never fake: the eager calls' answer
        return False
    from torch._subclasses.fake_tensor import is_fake
    return is_fake(t)


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs use exact fp32 products unless the user allowed TF32 for matmuls; fp16/bf16
    operands go to the tensor cores whatever this says (it only governs fp32 operands)."""
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


_STAND_INS: dict = {}


def stand_in(like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A 1-element tensor on ``like``'s device passed for an absent optional input (the kernel never
    reads it: its flavour flag is off). Made once per device and dtype in eager mode, so a call
    allocates and fills nothing for it; while torch.compile traces (or for a fake tensor) a fresh one,
    since a real tensor cannot enter a fake-tensor trace."""
    if type(like) is not torch.Tensor or torch.compiler.is_compiling():
        return torch.zeros(1, dtype=dtype, device=like.device)
    key = (like.device, dtype)
    t = _STAND_INS.get(key)
    if t is None:
        t = _STAND_INS[key] = torch.zeros(1, dtype=dtype, device=like.device)
    return t


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


MASK_TILE, MASK_PER_KEY, MASK_PER_QUERY = 0, 1, 2


def mask_shape(mask_strides) -> int:
    """How the kernels load a mask with these (b, h, m, n) strides: one value per key when it is
    broadcast over the queries (stride_m == 0, e.g. key padding (B, 1, 1, Nk)), one per query when
    broadcast over the keys (stride_n == 0, e.g. (Nq, 1)), else a full tile."""
    _, _, stride_m, stride_n = mask_strides
    if stride_m == 0:
        return MASK_PER_KEY
    if stride_n == 0:
        return MASK_PER_QUERY
    return MASK_TILE


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
    def mma(a, b, acc, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
        """acc + a @ b, fp32."""
        if UPCAST:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        return tl.dot(a, b, acc, input_precision=PRECISION)

    @triton.jit
    def load_tile(ptr, rows, cols, stride_r, stride_c, n_rows, n_cols,
                  ROW_MASK: tl.constexpr, COL_MASK: tl.constexpr):
        """ptr[rows, cols] (zeros outside), masked only along the axes that may leave the tensor."""
        ptrs = ptr + rows[:, None] * stride_r + cols[None, :] * stride_c
        if ROW_MASK and COL_MASK:
            x = tl.load(ptrs, mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols), other=0.0)
        elif ROW_MASK:
            x = tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
        elif COL_MASK:
            x = tl.load(ptrs, mask=cols[None, :] < n_cols, other=0.0)
        else:
            x = tl.load(ptrs)
        return x

    @triton.jit
    def store_tile(ptr, rows, cols, stride_r, stride_c, n_rows, n_cols, x):
        """ptr[rows, cols] = x in ptr's dtype, inside (n_rows, n_cols) only: load_tile's counterpart for
        an output tile (rows and columns past the tensor belong to padding or another program)."""
        tl.store(ptr + rows[:, None] * stride_r + cols[None, :] * stride_c, x.to(ptr.dtype.element_ty),
                 mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols))

    @triton.jit
    def load_rows(ptr, rows, n, other, BOUND: tl.constexpr):
        """ptr[rows] for a per-row vector (lse, delta, counts), ``other`` past n when BOUND."""
        if BOUND:
            x = tl.load(ptr + rows, mask=rows < n, other=other)
        else:
            x = tl.load(ptr + rows)
        return x

    @triton.jit
    def tile_logits(s, qi, kj, qi_at, kj_at, Nq, Nk, mask_ptr, stride_mm, stride_mn, mask_unit,
                    MASK_KIND: tl.constexpr, MASK_SHAPE: tl.constexpr, CAUSAL_MASK: tl.constexpr,
                    KEY_BOUND: tl.constexpr):
        """Scores ``s`` of one tile with the attn_mask applied: -inf where the key does not take part
        (bool mask False, float mask -inf, past Nk when KEY_BOUND, above the bottom-right diagonal
        when CAUSAL_MASK), the float mask's finite values times ``mask_unit`` added.

        qi / kj: query and key indices broadcastable to the tile ([M, 1] and [1, N], or [1, M] and
        [N, 1] for the transposed tiles of a dK/dV kernel); qi_at / kj_at: the same indices clamped
        into the tensor, used for addresses only, so mask loads need no bounds mask. MASK_SHAPE
        (``mask_shape``): a mask broadcast over the queries (key padding) or over the keys is loaded
        as one vector, not as a tile of per-element addresses."""
        if MASK_KIND != 0:
            if MASK_SHAPE == 1:
                at = mask_ptr + kj_at * stride_mn
            elif MASK_SHAPE == 2:
                at = mask_ptr + qi_at * stride_mm
            else:
                at = mask_ptr + qi_at * stride_mm + kj_at * stride_mn
            if MASK_KIND == 1:
                s = tl.where(tl.load(at) != 0, s, float("-inf"))
            else:
                s = s + tl.load(at).to(tl.float32) * mask_unit
        if KEY_BOUND and CAUSAL_MASK:
            s = tl.where((kj < Nk) & (kj <= qi + (Nk - Nq)), s, float("-inf"))
        elif KEY_BOUND:
            s = tl.where(kj < Nk, s, float("-inf"))
        elif CAUSAL_MASK:  # key j takes part for query i iff j <= i + Nk - Nq (bottom-right aligned)
            s = tl.where(kj <= qi + (Nk - Nq), s, float("-inf"))
        return s

    @triton.jit
    def query_block(H, Nq, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
        """Where a query-block program (grid: query blocks x B*H) stands: (pid_bh, b, h, start_m, offs_m,
        qi_at, offs_d, offs_dv). qi_at: the rows clamped into [0, Nq), for addresses only (rows past Nq
        read any valid row; their results are never stored). pid_bh is int64 so that the head offsets
        of large tensors do not overflow."""
        pid_bh = tl.program_id(1).to(tl.int64)
        start_m = tl.program_id(0) * BLOCK_M
        offs_m = start_m + tl.arange(0, BLOCK_M)
        return (pid_bh, pid_bh // H, pid_bh % H, start_m, offs_m, tl.minimum(offs_m, Nq - 1),
                tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV))

    @triton.jit
    def key_block(H_kv, Nk, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
        """Where a key-block program of a dK/dV kernel (grid: key blocks x B*H_kv) stands: (pid_bkv, b,
        h_kv, start_n, offs_n, kj_at, offs_d, offs_dv), pid_bkv = b * H_kv + key/value head (int64).
        kj_at: the keys clamped into [0, Nk), for addresses only (keys past Nk read any valid key; their
        gradients are never stored)."""
        pid_bkv = tl.program_id(1).to(tl.int64)
        start_n = tl.program_id(0) * BLOCK_N
        offs_n = start_n + tl.arange(0, BLOCK_N)
        return (pid_bkv, pid_bkv // H_kv, pid_bkv % H_kv, start_n, offs_n, tl.minimum(offs_n, Nk - 1),
                tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV))

    @triton.jit
    def packed_sequence(CU_Q, CU_K, seq):
        """(start_q, Nq, start_k, Nk) of packed sequence ``seq`` from its cu_seq offsets (varlen kernels):
        the starts int64 (they multiply token strides), the lengths int32 like a dense launch's Nq / Nk."""
        start_q = tl.load(CU_Q + seq).to(tl.int64)
        start_k = tl.load(CU_K + seq).to(tl.int64)
        n_q = (tl.load(CU_Q + seq + 1) - start_q).to(tl.int32)
        n_k = (tl.load(CU_K + seq + 1) - start_k).to(tl.int32)
        return start_q, n_q, start_k, n_k

    @triton.jit
    def visible_keys(start_m, Nq, Nk, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
        """(lo, hi) for a query block [start_m, start_m + BLOCK_M): key blocks [0, lo) are whole, in
        bounds and visible to every query of the block (no masking needed); [lo, hi) holds the
        diagonal blocks and the partial last block (masked); keys from hi on are skipped."""
        if CAUSAL:
            full = tl.minimum(tl.maximum(start_m + (Nk - Nq) + 1, 0), Nk)
        else:
            full = Nk
        return (full // BLOCK_N) * BLOCK_N, causal_end(start_m, Nq, Nk, BLOCK_M, CAUSAL)

    @triton.jit
    def visible_queries(start_n, Nq, Nk, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
        """(first, mid, full) for a key block [start_n, start_n + BLOCK_N), all multiples of BLOCK_M:
        query blocks before ``first`` see none of its keys (skipped), [first, mid) are diagonal blocks
        (causal masking), [mid, full) are whole and see every key of the block, [full, Nq) is the
        partial last query block (bounds)."""
        full = (Nq // BLOCK_M) * BLOCK_M
        first = causal_start(start_n, Nq, Nk, BLOCK_M, CAUSAL)
        if CAUSAL:  # the first query that sees the block's last key, rounded up to a block
            last_key = start_n + BLOCK_N - 1 - (Nk - Nq)
            mid = tl.minimum(tl.maximum(tl.cdiv(tl.maximum(last_key, 0), BLOCK_M) * BLOCK_M, first), full)
        else:
            mid = first
        return first, tl.maximum(mid, first), tl.maximum(full, first)

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


# -- how a Triton kernel becomes a variant's "triton" backend ---------------------------------------

TRITON_PRIORITY = 20


def call_reason(q, k, v, **kw):
    """``common_reason`` for a backend call's keyword arguments."""
    return common_reason(q, k, v, attn_mask=kw.get("attn_mask"), dropout_p=kw.get("dropout_p", 0.0))


def register_triton(variant: str, fn, supports=call_reason, *, description: str, name: str = "triton",
                    priority: int = TRITON_PRIORITY, gqa: bool = False, specialize=None, extras=()) -> None:
    """Register a Triton kernel as a backend: auto picks it on CUDA tensors only (under
    TRITON_INTERPRET=1 it also runs on CPU tensors, when asked for by name, far too slowly to be a
    default); its ``supports`` says why a call is refused (``attnzoo.explain`` prints it);
    ``specialize`` binds the launches to a kept plan's signature (ops/dispatch.Backend); ``extras``: which
    of softcap, sinks and window_size ``fn`` takes (ops/logit_extras.py)."""
    from .dispatch import register_backend
    register_backend(variant, name, fn, supports=supports, priority=priority, description=description,
                     auto_devices=("cuda",), gqa=gqa, specialize=specialize, extras=extras)
