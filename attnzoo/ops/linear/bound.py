"""The causal linear kernels bound to one call signature: what a kept plan runs.

As ops/kernels/flash_softmax/bound.py: ``specialize`` is the Triton backend's hook. It binds the
common causal call (no mask, Nq == Nk, not float64 with a scale other than 1, which the host folds
into q) to a :class:`BoundCausalLinear` holding the tile constexprs and launch options
(``triton.launch_config``), the grids, the output and state shapes and the flavour (feature map,
normaliser mode, whether the unrounded output is kept). A call allocates and launches the states and
output kernels; its backward reuses the binding for the state recomputation, the normaliser gradient,
the reverse scan and the dv / dq-dk kernels. Absent inputs (s0, z0, the per-head epsilon, the
identity map's normaliser rows) get one stand-in each instead of a zero-sized allocation per call.
The other forms (masks, Nq != Nk, non-causal) keep the general route (triton.py, noncausal.py).
"""
from __future__ import annotations

import torch

from ..first_order import first_order_only
from ..triton_utils import HAVE_TRITON, stand_in
from . import triton_kernels as ck
from . import triton as lt
from .launch import FEATURES, device_index, flags

if HAVE_TRITON:
    import triton


class BoundCausalLinear:
    """One signature's causal chunked launches (see the module docstring)."""

    def __init__(self, q, k, v, scale, feature_map):
        B, H, N, D = q.shape
        DV = v.shape[-1]
        self.generic_args = (scale, feature_map)
        self.scale = float(scale)
        self.record_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        cfg, self.flags = lt.launch_config(D, DV, q.dtype), flags(q.dtype)
        self.normalised = feature_map != "identity"
        self.feature = FEATURES[feature_map]
        self.mode = ck.MODE_NORMALISED if self.normalised else ck.MODE_COUNT
        self.acc = torch.float64 if self.flags["FP64"] else torch.float32
        self.store_exact = self.normalised and q.dtype in lt.EXACT_OUT_DTYPES
        self.mean_state = q.dtype in lt.MEAN_STATE_DTYPES
        self.dtype, self.device, self.device_index = q.dtype, q.device, device_index(q)
        self.out_shape, self.grad_shape, self.rows_shape = (B, H, N, DV), (B, H, N, D), (B * H, N)
        self.absent = stand_in(q, self.acc)  # s0, z0, eps, ds0, dz0 and the identity map's rows
        self.sizes = (N, D, DV, H)
        c = cfg["states"]
        n_chunks = triton.cdiv(N, c["CHUNK"])
        state_dtype = q.dtype if q.dtype in (torch.float16, torch.bfloat16) else self.acc
        self.hs_shape, self.zs_shape, self.state_dtype = (B * H, n_chunks, D, DV), (B * H, n_chunks, D), state_dtype
        self.states = ((B * H * triton.cdiv(D, c["BK"]) * triton.cdiv(DV, c["BV"]),),
                       dict(FEATURE=self.feature, NORMALISED=self.normalised, HAS_S0=False,
                            MEAN_STATE=self.mean_state, **self.flags, **c))
        c = cfg["output"]
        self.output = ((B * H * triton.cdiv(DV, c["BV"]), triton.cdiv(N, c["CHUNK"])),
                       dict(FEATURE=self.feature, MODE=self.mode, EPS_PER_HEAD=False, MEAN_STATE=self.mean_state,
                            STORE_EXACT=self.store_exact, **self.flags, **c))
        c = cfg["grad"]
        self.grad = ((B * H, triton.cdiv(N, c["CHUNK"])), dict(FP64=self.flags["FP64"], **c))
        c = cfg["reverse"]
        self.reverse = ((B * H * triton.cdiv(D, c["BK"]) * triton.cdiv(DV, c["BV"]),),
                        dict(FEATURE=self.feature, MODE=self.mode, HAS_S0=False, **self.flags, **c))
        c = cfg["dv"]
        self.dv = ((B * H * triton.cdiv(DV, c["BV"]), triton.cdiv(N, c["CHUNK"])),
                   dict(FEATURE=self.feature, MODE=self.mode, **self.flags, **c))
        c = cfg["dqk"]
        self.dqk = ((B * H * triton.cdiv(D, c["BK"]), triton.cdiv(N, c["CHUNK"])),
                    dict(FEATURE=self.feature, MODE=self.mode, MEAN_STATE=self.mean_state, **self.flags, **c))

    def __call__(self, q, k, v, *, attn_mask=None, **_):
        if torch._C._len_torch_dispatch_stack():  # a dispatch mode (a FLOP counter) sees the ops
            return lt.linear_attention_triton(q, k, v, attn_mask=attn_mask, is_causal=True,
                                              scale=self.generic_args[0], feature_map=self.generic_args[1])
        # the kernels need unit column stride
        q = q if q.stride(-1) == 1 else q.contiguous()
        k = k if k.stride(-1) == 1 else k.contiguous()
        v = v if v.stride(-1) == 1 else v.contiguous()
        if self.device_index >= 0:  # launch on q's GPU, not the current one
            with torch.cuda.device(self.device_index):
                return _CausalLinear.apply(q, k, v, self) if self.record_grad else self.forward(q, k, v)[0]
        return _CausalLinear.apply(q, k, v, self) if self.record_grad else self.forward(q, k, v)[0]

    def _states(self, k, v):
        hs = torch.empty(self.hs_shape, dtype=self.state_dtype, device=self.device)
        zs = torch.empty(self.zs_shape, dtype=self.acc, device=self.device) if self.normalised else self.absent
        grid, kw = self.states
        ck._states_kernel[grid](k, v, self.absent, self.absent, hs, zs, *self.sizes, self.scale, 0,
                                *k.stride()[:3], *v.stride()[:3], **kw)
        return hs, zs

    def forward(self, q, k, v):
        out = torch.empty(self.out_shape, dtype=self.dtype, device=self.device)
        rden = torch.empty(self.rows_shape, dtype=self.acc, device=self.device) if self.normalised else self.absent
        exact = torch.empty(self.out_shape, dtype=self.acc, device=self.device) if self.store_exact else out
        hs, zs = self._states(k, v)
        grid, kw = self.output
        ck._output_kernel[grid](q, k, v, hs, zs, out, exact, rden, rden, *self.sizes, self.scale, 1, 0,
                                *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], **kw)
        return out, rden, exact

    def backward(self, do, q, k, v, out, rden):
        dq = torch.empty(self.grad_shape, dtype=self.dtype, device=self.device)
        dk = torch.empty(self.grad_shape, dtype=self.dtype, device=self.device)
        dv = torch.empty(self.out_shape, dtype=self.dtype, device=self.device)
        hs, zs = self._states(k, v)
        cg = self.absent
        if self.normalised:
            cg = torch.empty(self.rows_shape, dtype=self.acc, device=self.device)
            grid, kw = self.grad
            ck._normaliser_grad_kernel[grid](do, out, rden, cg, self.sizes[0], self.sizes[2], **kw)
        dhs = torch.empty_like(hs)
        dzs = torch.empty_like(zs) if self.normalised else self.absent
        grid, kw = self.reverse
        ck._reverse_states_kernel[grid](q, do, rden, cg, dhs, dzs, self.absent, self.absent, *self.sizes, self.scale,
                                        1, *q.stride()[:3], **kw)
        grid, kw = self.dv
        ck._dv_kernel[grid](q, k, do, dhs, rden, dv, *self.sizes, self.scale, 1, *q.stride()[:3], *k.stride()[:3],
                            **kw)
        grid, kw = self.dqk
        ck._dqk_kernel[grid](q, k, v, do, hs, zs, dhs, dzs, rden, cg, dq, dk, *self.sizes, self.scale, 1, 0,
                             *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], **kw)
        return dq, dk, dv


def _backward(ctx, dout):
    q, k, v, out, rden = ctx.saved_tensors
    launch = ctx.launch
    do = dout.to(launch.dtype).contiguous()
    if launch.device_index >= 0:
        with torch.cuda.device(launch.device_index):
            dq, dk, dv = launch.backward(do, q, k, v, out, rden)
    else:
        dq, dk, dv = launch.backward(do, q, k, v, out, rden)
    return dq, dk, dv, None


class _CausalLinear(torch.autograd.Function):
    """The bound launches as one autograd node (the states are recomputed in the backward)."""

    @staticmethod
    def forward(ctx, q, k, v, launch):
        out, rden, exact = launch.forward(q, k, v)
        # the backward reads out only for c_i = -r_i dO_i . out_i: the unrounded one where it was rounded
        ctx.save_for_backward(q, k, v, exact, rden)
        ctx.launch = launch
        return out

    backward = staticmethod(first_order_only(_backward, "the backward of attnzoo::linear_causal_fwd"))


def specialize(q, k, v, *, attn_mask=None, is_causal=False, scale=1.0, feature_map="elu", dropout_p=0.0, **others):
    """The Triton backend's ``specialize`` hook: a :class:`BoundCausalLinear` for a causal call with no
    mask and Nq == Nk (not float64 with scale != 1), else None (the general route)."""
    if (not HAVE_TRITON or not is_causal or attn_mask is not None or q.shape[-2] != k.shape[-2] or others
            or (q.dtype == torch.float64 and scale != 1.0) or type(q) is not torch.Tensor
            or torch.compiler.is_compiling()):
        return None
    return BoundCausalLinear(q, k, v, scale, feature_map)
