"""The softmax-family kernels bound to one call signature: what a kept plan (ops/plan.py) runs.

``specialize(q, k, v, **kw)`` is the Triton backends' ``specialize`` hook: for a signature the bound
form serves (no per-key preference, no T5 table: softmax, l2 and fenchel without log u; softcap, sinks
and window_size included: the cap and the window are plain values of the signature, the sinks a tensor
read per call, its gradient returned by the bound backward), it returns
a :class:`BoundLaunch` holding everything the signature fixes: the launch constexprs, the stand-ins
for the absent inputs, the kernels' size arguments, the output shapes, the grids, whether a gradient
is recorded and, after the first launch of each kernel, its tile choice (frozen by
``TunedKernel.run``: the autotuner's on a GPU, the interpreter's tiles in CI). A call then does:
allocate the outputs, launch. Its backward (:class:`_Attention`) reuses what the forward bound.

What a signature does not fix is read per call: q, k, v and dO strides (a view of the same shape may
be strided otherwise), the mask's strides (and with them how the kernels load it: per key, per
query or a tile; a mask laid out unlike the bound one takes the general route), the dropout seed,
and, where the Hopper rows may run, whether K and V are TMA-readable (their addresses). The general
route (``triton.py``'s ops) still serves torch.compile, dispatch modes (a FLOP counter sees the op),
pinned tile configurations (tests) and the signatures bound here does not cover.
"""
from __future__ import annotations

import torch

from ... import triton_tuning as tuning
from ...first_order import first_order_only
from ...triton_dropout import draw_seed
from ...triton_utils import HAVE_TRITON, INTERPRETED, MASK_BOOL, MASK_FLOAT, MASK_NONE, mask_shape, stand_in
from . import hopper
from . import triton as flash

if HAVE_TRITON:
    import triton

    from .triton_kernels import softmax_bwd_delta_kernel


class BoundLaunch:
    """One signature's forward and backward launches (see the module docstring)."""

    def __init__(self, generic, q, k, v, attn_mask, is_causal, scale, dropout_p, l2, softcap=None, sinks=None,
                 window_size=None):
        B, H, Nq, D = q.shape
        H_kv, Nk, DV = k.shape[1], k.shape[2], v.shape[3]
        self.generic = generic  # the backend itself: the general route
        self.l2 = bool(l2)
        self.scale, self.dropout_p, self.is_causal = float(scale), float(dropout_p), bool(is_causal)
        self.softcap, self.window_size = softcap, window_size
        self.dropout = self.dropout_p > 0
        self.record_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad or (
            sinks is not None and sinks.requires_grad))
        # softcap, sinks, window: their flags and scalars (the sinks tensor itself is read per call)
        left, right = window_size if window_size is not None else (-1, -1)
        extras, extra_flags, launch_causal = flash.extras_args(q, sinks, float(softcap or 0.0), left, right,
                                                                self.is_causal, Nq, Nk)
        self.has_sinks, self.extra_scalars = sinks is not None, extras[1:]
        self.out_shape, self.lse_shape = (B, H, Nq, DV), (B, H, Nq)
        self.dq_shape, self.dk_shape, self.dv_shape = q.shape, k.shape, v.shape
        self.dtype, self.device, self.k_dtype, self.v_dtype = q.dtype, q.device, k.dtype, v.dtype
        self.expand_to = (B, H, Nq, Nk)
        self.out_strides = (H * Nq * DV, Nq * DV, DV, 1)
        self.lut = stand_in(q, torch.int32)  # also the seed pointer without dropout (never read)
        self.no_mask = stand_in(q, torch.uint8)
        self.absent = stand_in(q, torch.float32)  # preference, T5 bias and the dpref / partials outputs
        sizes = flash._sizes(q, k, v)
        self.meta = flash._flags(q, v, launch_causal, l2, self.dropout)
        if attn_mask is None:
            self.mask_kind, self.mask_layout = MASK_NONE, None
        else:
            self.mask_kind = MASK_BOOL if attn_mask.dtype == torch.bool else MASK_FLOAT
            self.mask_layout = mask_shape(attn_mask.expand(self.expand_to).stride())
        flags = dict(MASK_KIND=self.mask_kind, MASK_SHAPE=self.mask_layout or 0, HAS_PREF=False, HAS_T5=False,
                     **extra_flags)
        self.kw = {**self.meta, **flags}
        self.keys_kw = {**self.kw, "BUCKETS": 1}
        self.tail = (0, 0, 0, 0, 0, *sizes, self.scale, self.dropout_p)  # pref (3) and T5 (2) strides: absent
        self.shape_key = flash._shape_key(self.meta, flags, sizes)
        self.tiles = dict(dtype=q.dtype, block_d=self.meta["BLOCK_D"], block_dv=self.meta["BLOCK_DV"],
                          dropout=self.dropout)
        # the Hopper rows: device and flavour are the signature's; K / V addresses are per call
        self.hopper = bool(hopper.FORWARD_VARIANTS) and not any(extra_flags.values()) and hopper.device_ready(
            q.device) and hopper.flavour_ready(
            q.dtype, self.meta["BLOCK_D"], self.meta["BLOCK_DV"], self.dropout, False, flags["MASK_KIND"],
            flags["MASK_SHAPE"])
        self.grid_q = lambda META: (triton.cdiv(Nq, META["BLOCK_M"]), B * H)
        self.grid_k = lambda META: (triton.cdiv(Nk, META["BLOCK_N"]), B * H_kv)
        rows = 16 if INTERPRETED else flash.DELTA_ROWS
        self.delta_grid = (triton.cdiv(Nq, rows), B * H)
        self.delta_kw = dict(BLOCK_M=rows, BLOCK_DV=self.meta["BLOCK_DV"], RESIDUAL=False)
        self.delta_sizes = (H, Nq, DV)
        self.bound = {}  # TunedKernel.run_bound's launches, bound once their tiles froze

    def _general(self, q, k, v, attn_mask, sinks):
        return self.generic(q, k, v, attn_mask=attn_mask, is_causal=self.is_causal, scale=self.scale,
                            dropout_p=self.dropout_p, softcap=self.softcap, sinks=sinks, window_size=self.window_size)

    def __call__(self, q, k, v, *, attn_mask=None, sinks=None, **_):
        if tuning._pinned or torch._C._len_torch_dispatch_stack():
            return self._general(q, k, v, attn_mask, sinks)
        if attn_mask is None:
            m, ms = self.no_mask, (0, 0, 0, 0)
        else:
            m = attn_mask.expand(self.expand_to)
            ms = m.stride()
            if (1 if ms[2] == 0 else 2 if ms[3] == 0 else 0) != self.mask_layout:  # laid out unlike the bound one
                return self._general(q, k, v, attn_mask, sinks)
            if self.mask_kind == MASK_BOOL:
                m = m.view(torch.uint8)
        extras = (sinks.to(torch.float32).contiguous() if self.has_sinks else self.absent, *self.extra_scalars)
        if self.record_grad:
            return _Attention.apply(q, k, v, sinks, m, ms, extras, self)
        return self.forward(q, k, v, m, ms, extras)[0]

    def forward(self, q, k, v, m, ms, extras):
        out = torch.empty(self.out_shape, dtype=self.dtype, device=self.device)
        lse = torch.empty(self.lse_shape, dtype=torch.float32, device=self.device)
        seed = draw_seed(self.device) if self.dropout else self.lut
        variants = self.hopper and hopper.forward_variants(q, k, v, self.meta, self.kw)
        flash.FORWARD.run_bound(self.bound, self.grid_q,
                                (q, k, v, out, lse, out, m, self.absent, self.absent, self.lut, seed, *q.stride(),
                                 *k.stride(), *v.stride(), *self.out_strides, *ms, *self.tail, *extras), self.kw,
                                shape_key=self.shape_key, variants=variants, **self.tiles)
        return out, lse, seed

    def backward(self, grad_out, q, k, v, out, lse, m, ms, seed, extras):
        delta = torch.empty(self.lse_shape, dtype=torch.float32, device=self.device)
        dq = torch.empty(self.dq_shape, dtype=self.dtype, device=self.device)
        dk = torch.empty(self.dk_shape, dtype=self.k_dtype, device=self.device)
        dv = torch.empty(self.dv_shape, dtype=self.v_dtype, device=self.device)
        # delta_i = dO_i . O_i, also with dropout (O is the dropped output; proof in triton_kernels.py)
        softmax_bwd_delta_kernel[self.delta_grid](out, out, grad_out, delta, *self.out_strides, *grad_out.stride(),
                                                  *self.delta_sizes, **self.delta_kw)
        common = (*q.stride(), *k.stride(), *v.stride(), *grad_out.stride(), *ms, *self.tail, *extras)
        dq_variants = self.hopper and hopper.forward_variants(q, k, v, self.meta, self.kw)
        flash.KEYS_BACKWARD.run_bound(self.bound, self.grid_k,
                                      (q, k, v, grad_out, lse, delta, dk, dv, self.absent, self.absent, m, self.absent,
                                       self.absent, self.lut, seed, *common), self.keys_kw, shape_key=self.shape_key,
                                      variants=dq_variants and hopper.keys_backward_variants(q, grad_out, dq_variants),
                                      **self.tiles)
        flash.QUERIES_BACKWARD.run_bound(self.bound, self.grid_q,
                                         (q, k, v, grad_out, lse, delta, dq, m, self.absent, self.absent, self.lut,
                                          seed, *common), self.kw, shape_key=self.shape_key, variants=dq_variants,
                                         **self.tiles)
        return dq, dk, dv, delta


def _backward(ctx, grad_out):
    q, k, v, sinks, out, lse, m, seed = ctx.saved_tensors
    dq, dk, dv, delta = ctx.launch.backward(grad_out, q, k, v, out, lse, m, ctx.mask_strides, seed, ctx.extras)
    dsinks = flash.sinks_grad(sinks, lse, delta).to(sinks.dtype) if sinks is not None else None
    return dq, dk, dv, dsinks, None, None, None, None


class _Attention(torch.autograd.Function):
    """The bound launches as one autograd node: the forward's outputs and seed saved for the backward."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, m, ms, extras, launch):
        out, lse, seed = launch.forward(q, k, v, m, ms, extras)
        ctx.save_for_backward(q, k, v, sinks, out, lse, m, seed)
        ctx.launch, ctx.mask_strides, ctx.extras = launch, ms, extras
        return out

    backward = staticmethod(first_order_only(_backward, "the backward of attnzoo::softmax_family_fwd"))


def specializer(l2: bool = False):
    """The ``specialize`` hook of a softmax-family Triton backend (``l2``: the L2 logits): a
    :class:`BoundLaunch` for signatures without a preference or a T5 table, else None."""
    def specialize(q, k, v, *, attn_mask=None, is_causal=False, scale, dropout_p=0.0, enable_gqa=False,
                   log_u=None, alpha=1.0, solve="first_order", relative_bias=None, softcap=None, sinks=None,
                   window_size=None, **others):
        if (not HAVE_TRITON or log_u is not None or relative_bias is not None or solve != "first_order" or others
                or type(q) is not torch.Tensor or torch.compiler.is_compiling()):
            return None  # while torch.compile traces, the ops (a call that is never kept)
        generic = flash.l2_attention if l2 else flash.softmax_attention
        return BoundLaunch(generic, q, k, v, attn_mask, is_causal, scale * alpha, dropout_p, l2, softcap, sinks,
                           window_size)
    return specialize
