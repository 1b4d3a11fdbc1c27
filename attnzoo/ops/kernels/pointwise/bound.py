"""The pointwise kernels (sigmoid, ReLU / n) bound to one call signature: what a kept plan runs.

As kernels/flash_softmax/bound.py: ``specializer(sigmoid)`` is the Triton backends' ``specialize``
hook; for a signature with no bias tensor (the default -log n or a float bias; a softcap or none; a
window or none: the cap and the window are plain values of the signature) it returns a
:class:`BoundLaunch` holding the constexprs, the stand-ins, the sizes, the output shapes, the grids
and, once each kernel's first launch froze them, its tiles. Per call: the strides, the mask's layout
(one laid out unlike the bound one takes the general route), the dropout seed and ``FAST_SIGMOID``
(a module setting read at each call: a changed one takes the general route).
"""
from __future__ import annotations

import torch

from ... import triton_tuning as tuning
from ...first_order import first_order_only
from ...triton_dropout import draw_seed
from ...triton_utils import HAVE_TRITON, MASK_BOOL, MASK_FLOAT, MASK_NONE, mask_shape, stand_in
from . import triton as pointwise
from .triton_kernels import BIAS_DEFAULT, BIAS_SCALAR

if HAVE_TRITON:
    import triton


class BoundLaunch:
    """One signature's forward and backward pointwise launches."""

    def __init__(self, generic, q, k, v, attn_mask, is_causal, scale, dropout_p, sigmoid, bias, softcap=None,
                 window_size=None):
        B, H, Nq, D = q.shape
        H_kv, Nk, DV = k.shape[1], k.shape[2], v.shape[3]
        self.generic, self.generic_options = generic, ({"bias": bias} if sigmoid else {})
        if softcap is not None:
            self.generic_options["softcap"] = softcap
        if window_size is not None:
            self.generic_options["window_size"] = window_size
        self.scale, self.dropout_p, self.is_causal = float(scale), float(dropout_p), bool(is_causal)
        self.dropout = self.dropout_p > 0
        self.record_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        self.fast_sigmoid = pointwise.FAST_SIGMOID
        self.out_shape, self.rows_shape = (B, H, Nq, DV), (B, H, Nq)
        self.dq_shape, self.dk_shape, self.dv_shape = q.shape, k.shape, v.shape
        self.dtype, self.device, self.k_dtype, self.v_dtype = q.dtype, q.device, k.dtype, v.dtype
        self.expand_to = (B, H, Nq, Nk)
        self.out_strides = (H * Nq * DV, Nq * DV, DV, 1)
        self.no_mask = stand_in(q, torch.uint8)
        self.no_bias = stand_in(q, torch.float32)  # also the dbias output's placeholder
        if attn_mask is None:
            mask_kind, self.mask_layout = MASK_NONE, 0
        else:
            mask_kind = MASK_BOOL if attn_mask.dtype == torch.bool else MASK_FLOAT
            self.mask_layout = mask_shape(attn_mask.expand(self.expand_to).stride())
        self.mask_kind = mask_kind
        bias_mode, bias_scalar = (BIAS_DEFAULT, 0.0) if bias is None else (BIAS_SCALAR, float(bias))
        # the cap and the window as the op passes them (a window carries causality in its band offsets)
        launch_causal, extra_flags, band = pointwise.logit_extras(softcap, window_size, self.is_causal, Nq, Nk)
        self.meta = pointwise._launch_flags(
            D, DV, bool(sigmoid), pointwise.sigmoid_impl(q.dtype) if sigmoid else 0, bias_mode, mask_kind,
            self.mask_layout, launch_causal, self.dropout, q.dtype,
            q.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32, *extra_flags)
        sizes = (H, Nq, Nk, D, DV, H // H_kv, tuning.n_bucket(Nq), tuning.n_bucket(Nk))
        # bias strides (no tensor), sizes, scalars, the band's offsets (0, 0 and unread without a window)
        self.tail = (0, 0, 0, *sizes, self.scale, bias_scalar, *band, self.dropout_p)
        self.shape_key = (D, DV, sizes[6], sizes[7], tuple(self.meta.values()))
        self.tiles = dict(dtype=q.dtype, block_d=self.meta["BLOCK_D"], block_dv=self.meta["BLOCK_DV"],
                          dropout=self.dropout)
        self.grid_q = lambda META: (triton.cdiv(Nq, META["BLOCK_M"]), B * H)
        self.grid_k = lambda META: (triton.cdiv(Nk, META["BLOCK_N"]), B * H_kv)
        self.bound = {}  # TunedKernel.run_bound's launches, bound once their tiles froze

    def __call__(self, q, k, v, *, attn_mask=None, **_):
        if tuning._pinned or torch._C._len_torch_dispatch_stack() or pointwise.FAST_SIGMOID is not self.fast_sigmoid:
            return self.generic(q, k, v, attn_mask=attn_mask, is_causal=self.is_causal, scale=self.scale,
                                dropout_p=self.dropout_p, **self.generic_options)
        if attn_mask is None:
            m, ms = self.no_mask, (0, 0, 0, 0)
        else:
            m = attn_mask.expand(self.expand_to)
            ms = m.stride()
            if (1 if ms[2] == 0 else 2 if ms[3] == 0 else 0) != self.mask_layout:  # laid out unlike the bound one
                return self.generic(q, k, v, attn_mask=attn_mask, is_causal=self.is_causal, scale=self.scale,
                                    dropout_p=self.dropout_p, **self.generic_options)
            if self.mask_kind == MASK_BOOL:
                m = m.view(torch.uint8)
        if self.record_grad:
            return _Attention.apply(q, k, v, m, ms, self)
        return self.forward(q, k, v, m, ms)[0]

    def forward(self, q, k, v, m, ms):
        out = torch.empty(self.out_shape, dtype=self.dtype, device=self.device)
        n_rows = torch.empty(self.rows_shape, dtype=torch.float32, device=self.device)
        seed = draw_seed(self.device) if self.dropout else m
        pointwise.FORWARD.run_bound(self.bound, self.grid_q,
                                    (q, k, v, out, n_rows, m, self.no_bias, seed, *q.stride(), *k.stride(),
                                     *v.stride(), *self.out_strides, *ms, *self.tail), self.meta,
                                    shape_key=self.shape_key, **self.tiles)
        return out, n_rows, seed

    def backward(self, grad_out, q, k, v, n_rows, m, ms, seed):
        dq = torch.empty(self.dq_shape, dtype=self.dtype, device=self.device)
        dk = torch.empty(self.dk_shape, dtype=self.k_dtype, device=self.device)
        dv = torch.empty(self.dv_shape, dtype=self.v_dtype, device=self.device)
        strides = (*q.stride(), *k.stride(), *v.stride(), *grad_out.stride(), *ms)
        # dK/dV: one program per key block of a key/value head, walking the query heads that share it
        pointwise.KEYS_BACKWARD.run_bound(self.bound, self.grid_k,
                                          (q, k, v, grad_out, n_rows, m, self.no_bias, dk, dv, seed, *strides,
                                           *self.tail), self.meta, shape_key=self.shape_key, **self.tiles)
        pointwise.QUERIES_BACKWARD.run_bound(self.bound, self.grid_q,
                                             (q, k, v, grad_out, n_rows, m, self.no_bias, dq, self.no_bias, seed,
                                              *strides, *self.tail), self.meta, shape_key=self.shape_key, **self.tiles)
        return dq, dk, dv


def _backward(ctx, grad_out):
    q, k, v, n_rows, m, seed = ctx.saved_tensors
    dq, dk, dv = ctx.launch.backward(grad_out, q, k, v, n_rows, m, ctx.mask_strides, seed)
    return dq, dk, dv, None, None, None


class _Attention(torch.autograd.Function):
    """The bound launches as one autograd node: the row counts and the seed saved for the backward."""

    @staticmethod
    def forward(ctx, q, k, v, m, ms, launch):
        out, n_rows, seed = launch.forward(q, k, v, m, ms)
        ctx.save_for_backward(q, k, v, n_rows, m, seed)
        ctx.launch, ctx.mask_strides = launch, ms
        return out

    backward = staticmethod(first_order_only(_backward, "the backward of attnzoo::pointwise_fwd"))


def specializer(sigmoid: bool):
    """The ``specialize`` hook of the sigmoid (``sigmoid=True``) or relu Triton backend: a
    :class:`BoundLaunch` for signatures without a bias tensor, else None."""
    def specialize(q, k, v, *, attn_mask=None, is_causal=False, scale, dropout_p=0.0, enable_gqa=False, bias=None,
                   softcap=None, window_size=None, **others):
        if (not HAVE_TRITON or isinstance(bias, torch.Tensor) or others or type(q) is not torch.Tensor
                or torch.compiler.is_compiling()):
            return None  # a bias tensor (its gradient), or torch.compile tracing: the ops
        generic = pointwise.sigmoid_attention if sigmoid else pointwise.relu_attention
        return BoundLaunch(generic, q, k, v, attn_mask, is_causal, scale, dropout_p, sigmoid, bias, softcap,
                           window_size)
    return specialize
