"""The Triton Sinkhorn passes bound to one call signature: what a kept plan (ops/plan.py) runs.

As ops/kernels/flash_softmax/bound.py: ``specialize`` is the "triton" backend's hook. For the
signatures it serves it returns a :class:`BoundSinkhorn` that holds, per pass of triton.py's
``TritonEngine.forward`` and ``backward_unrolled``, the launch (the kernel indexed with its grid),
its constexprs and tile, and every scalar argument (sizes, the logit factor A, the shifts, the mask's
strides, the length buckets). A call then allocates the potentials' stacks and outputs and launches
the passes in the engine's order with the same arguments: the numbers are the engine's.

Served: non-causal calls (the causal prefix loop makes a new shape per prefix), with or without a
window (its band's two offsets are bound into every pass; g^0 and delta then come from a row-dot launch
before the pass that reads them, as in the engine), the unrolled
backward, n_iters >= 1, k and v in q's dtype, and sizes where no launch autotunes and the O(N)
vectors are folded into the first passes (B*H*Nq*Nk < AUTOTUNE_MIN_WORK = FOLD_BELOW: every launch
takes its kind's first tile, as triton.py's ``_launch`` does there). What a signature does not fix
is checked per call: a mask laid out otherwise (other strides) than the bound one, a pinned tile
(tests) or a dispatch mode (a FLOP counter sees the ops) take the general route (triton.py's ops),
which also serves torch.compile and everything not listed above.
"""
from __future__ import annotations

import torch

from ..first_order import first_order_only
from ..triton_utils import HAVE_TRITON, INTERPRETED

if HAVE_TRITON:
    import triton

    from . import triton as st
    from . import triton_kernels as K


def _tile(kind, width, dtype, meta):
    """triton.py ``_launch``'s untuned choice: (BLOCK_X, launch options with the tile constexprs)."""
    masked = meta["MASK_KIND"] != 0 and meta["MASK_SHAPE"] == 0
    bx, by, warps, stages = st.candidates(kind, width, dtype, masked)[0]
    opts = {} if INTERPRETED else dict(num_warps=warps, num_stages=stages)
    return bx, {**meta, "BLOCK_X": bx, "BLOCK_Y": by, **opts}


class BoundSinkhorn:
    """One signature's forward and unrolled backward passes (see the module docstring)."""

    def __init__(self, q, k, v, attn_mask, scale, n_iters, eps, cost, window=None):
        B, H, nq, D = q.shape
        nk, DV = k.shape[2], v.shape[3]
        self.generic_kw = dict(is_causal=False, scale=scale, n_iters=n_iters, eps=eps, cost=cost, dropout_p=0.0,
                               grad_mode="unrolled", window_size=window)
        self.record_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        p = st._problem(q, k, v, attn_mask, scale, eps, cost == "l2", True, 0.0, *(window or (-1, -1)))
        s = st.ENGINE._setup(p)  # the engine's shapes, logit factor and mask orientation
        self.T, self.c, self.A = int(n_iters), float(p.col_target), s["A"]
        A = self.A
        self.dtype, self.device, self.split_p = q.dtype, q.device, s["split_p"]
        self.F_shape, self.G_shape = (self.T, B, H, nq), (self.T + 1, B, H, nk)
        self.lse_shape, self.out_shape = (B, H, nq), (B, H, nq, DV)
        self.XF_shape, self.UF_shape, self.fast_shape = (B, H, nq, 2 * self.T), (B, H, nk, 2 * self.T), (self.T, B * H)
        self.expand_to = (B, H, nq, nk)
        self.mask_kind = s["meta"]["MASK_KIND"]
        self.mask_strides = s["rows"] if attn_mask is not None else None
        self.no_mask = s["mask"] if attn_mask is None else None  # the stand-in
        bq, bk = st.length_bucket(nq), st.length_bucket(nk)
        rows = (*s["rows"], bq, bk)   # a row pass: X = q, Y = k
        cols = (*s["cols"], bk, bq)   # a column pass: X = k, Y = q
        meta_rows = dict(s["meta"], MASK_SHAPE=s["shape_rows"], **s["band_rows"])
        meta_cols = dict(s["meta"], MASK_SHAPE=s["shape_cols"], **s["band_cols"])
        bh = B * H

        def bind(kernel, kind, width, nx, meta):
            bx, kw = _tile(kind, width, q.dtype, meta)
            return kernel[(triton.cdiv(nx, bx), bh)], kw

        wide = max(D, DV)
        scan = dict(MIN_SUM=st.MIN_SUM, SPREAD_MAX=st.SPREAD_MAX)
        # folded (module doc): g^0 written by the first row pass; under a band (whose first program does not
        # walk every key) a row-dot launch writes it first (l2) or it is zeroed (dot), as the engine does
        self.banded = window is not None
        g0_mode = 0 if self.banded else 1 if cost == "dot" else 2
        self.g0 = None
        if self.banded and cost == "l2":
            self.g0 = self._row_dot(B * H * nk, D, -s["a"])
        self.delta_dot = self._row_dot(B * H * nq, DV, 1.0) if self.banded else None
        self.first_row = (*bind(K._lse_kernel, "scan", D, nq, dict(meta_rows, BOUNDED=False, G0_MODE=g0_mode,
                                                                   **scan)),
                          (H, nq, nk, D, A, 0.0, 0.0, *rows))
        self.col = (*bind(K._lse_kernel, "scan", D, nk, dict(meta_cols, BOUNDED=True, G0_MODE=0, **scan)),
                    (H, nk, nq, D, A, 0.0, self.c, *cols))
        self.row = (*bind(K._lse_kernel, "scan", D, nq, dict(meta_rows, BOUNDED=True, G0_MODE=0, **scan)),
                    (H, nq, nk, D, A, self.c, 0.0, *rows))
        self.attend = (*bind(K._attend_kernel, "attend", wide, nq,
                             dict(meta_rows, BLOCK_DV=st._block(DV), BOUNDED=q.dtype != torch.float16,
                                  SPLIT_P=self.split_p, **scan)),
                       (H, nq, nk, D, DV, A, self.c, *rows))
        # fp16: SPREAD_MAX -1 (triton.py's grad_v_and_bias says why)
        self.grad_v = (*bind(K._grad_v_kernel, "grad_v", wide, nk,
                             dict(meta_cols, BLOCK_DV=st._block(DV), DELTA_HERE=not self.banded, SPLIT_P=self.split_p,
                                  SPREAD_MAX=-1.0 if q.dtype == torch.float16 else st.SPREAD_MAX)),
                       (H, nk, nq, D, DV, A, *cols))
        spread = dict(SPREAD_MAX=st.SPREAD_MAX)
        self.wsum_row = (*bind(K._wsum_kernel, "scan", D, nq, dict(meta_rows, **spread)),
                         (H, nq, nk, D, A, -self.c, -1.0, *rows))
        self.wsum_col = (*bind(K._wsum_kernel, "scan", D, nk, dict(meta_cols, **spread)),
                         (H, nk, nq, D, A, 0.0, -1.0, *cols))
        block = 16 if INTERPRETED else 1024
        self.factors = (K._factors_kernel[(self.T, bh)],
                        dict(FACTOR_MAX=st.FACTOR_MAX, BLOCK=block, **({} if INTERPRETED else dict(num_warps=4))),
                        (self.T, nq, nk, self.c))
        self.grad_qk = (*bind(K._grad_qk_kernel, "grad_qk", wide, nk,
                              dict(meta_cols, L2=cost == "l2", BLOCK_DV=st._block(DV), KT=st.FACTOR_COLUMNS)),
                        (H, nk, nq, D, DV, A, *cols))

    @staticmethod
    def _row_dot(rows, width, scale):
        """(launch, kwargs, tail) of triton.py's row_dot over ``rows`` rows of ``width``: scale * sum a * b."""
        block = 16 if INTERPRETED else 64
        opts = {} if INTERPRETED else dict(num_warps=4)
        return (K._row_dot_kernel[(triton.cdiv(rows, block),)], dict(BLOCK_R=block, BLOCK_D=st._block(width), **opts),
                (rows, width, float(scale)))

    def __call__(self, q, k, v, *, attn_mask=None, **_):
        if st._PINNED or torch._C._len_torch_dispatch_stack():
            return st.sinkhorn_attention(q, k, v, attn_mask=attn_mask, **self.generic_kw)
        if attn_mask is None:
            m = self.no_mask
        else:
            m = attn_mask.expand(self.expand_to)
            if m.stride() != self.mask_strides:  # laid out unlike the bound one
                return st.sinkhorn_attention(q, k, v, attn_mask=attn_mask, **self.generic_kw)
            if self.mask_kind == 1:
                m = m.view(torch.uint8)  # same item size: a view, broadcast strides kept
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        if self.record_grad:
            return _Sinkhorn.apply(q, k, v, m, self)
        return self.forward(q, k, v, m)[0]

    def forward(self, q, k, v, m):
        """(out, lse, F, G, the output the backward's delta reads): TritonEngine.forward's passes."""
        F = torch.empty(self.F_shape, dtype=torch.float32, device=self.device)
        G = torch.empty(self.G_shape, dtype=torch.float32, device=self.device)
        f, g = F.unbind(0), G.unbind(0)
        if self.g0 is not None:
            launch, kw, tail = self.g0
            launch(k, k, g[0], *tail, **kw)
        elif self.banded:
            g[0].zero_()
        launch, kw, tail = self.first_row
        launch(q, k, g[0], f[0], f[0], m, *tail, **kw)
        col, col_kw, col_tail = self.col
        row, row_kw, row_tail = self.row
        T = self.T
        for t in range(1, T + 1):
            col(k, q, f[t - 1], g[t - 1], g[t], m, *col_tail, **col_kw)
            if t < T:
                row(q, k, g[t], f[t - 1], f[t], m, *row_tail, **row_kw)
        out = torch.empty(self.out_shape, dtype=self.dtype, device=self.device)
        lse = torch.empty(self.lse_shape, dtype=torch.float32, device=self.device)
        exact = torch.empty(self.out_shape, dtype=torch.float32, device=self.device) if self.split_p else out
        launch, kw, tail = self.attend
        launch(q, k, v, g[T], f[T - 1], out, exact, lse, m, *tail, **kw)
        return out, lse, F, G, exact

    def backward(self, dout, q, k, v, m, out, lse, F, G):
        """(dq, dk, dv): TritonEngine.backward_unrolled's passes (``out``: the unrounded output)."""
        T, dev = self.T, self.device
        dout = dout.contiguous()
        delta = torch.empty(self.lse_shape, dtype=torch.float32, device=dev)
        DG = torch.empty(self.F_shape[:1] + self.G_shape[1:], dtype=torch.float32, device=dev)
        DF = torch.empty(self.F_shape, dtype=torch.float32, device=dev)
        f, g, dg, df = F.unbind(0), G.unbind(0), DG.unbind(0), DF.unbind(0)
        dv = torch.empty_like(v)
        if self.delta_dot is not None:  # banded: delta = dout.out before the pass (its first program walks a band)
            launch, kw, tail = self.delta_dot
            launch(dout, out, delta, *tail, **kw)
        launch, kw, tail = self.grad_v
        launch(k, q, v, dout, out, g[T], lse, delta, dv, dg[T - 1], m, *tail, **kw)
        row, row_kw, row_tail = self.wsum_row
        col, col_kw, col_tail = self.wsum_col
        for t in range(T - 1, -1, -1):
            row(q, k, f[t], g[t + 1], dg[t], df[t], m, *row_tail, **row_kw)
            if t > 0:
                col(k, q, g[t], f[t], df[t], dg[t - 1], m, *col_tail, **col_kw)
        XF = torch.empty(self.XF_shape, dtype=torch.float32, device=dev)
        UF = torch.empty(self.UF_shape, dtype=torch.float32, device=dev)
        fast = torch.empty(self.fast_shape, dtype=torch.int32, device=dev)
        launch, kw, tail = self.factors
        launch(F, G, lse, DF, DG, XF, UF, fast, *tail, **kw)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=dev)
        dk = torch.empty_like(k)
        launch, kw, tail = self.grad_qk
        launch(k, q, v, dout, G, lse, delta, F, DG, DF, XF, UF, fast, T, self.c, dq, dk, m, *tail, **kw)
        dq = dq.mul_(self.A)
        return (dq if self.dtype == torch.float32 else dq.to(self.dtype)), dk, dv


def _backward(ctx, dout):
    q, k, v, m, out, lse, F, G = ctx.saved_tensors
    return (*ctx.launch.backward(dout, q, k, v, m, out, lse, F, G), None, None)


class _Sinkhorn(torch.autograd.Function):
    """The bound passes as one autograd node: what the backward reads saved by the forward."""

    @staticmethod
    def forward(ctx, q, k, v, m, launch):
        out, lse, F, G, exact = launch.forward(q, k, v, m)
        ctx.save_for_backward(q, k, v, m, exact, lse, F, G)
        ctx.launch = launch
        return out

    backward = staticmethod(first_order_only(_backward, "the backward of attnzoo::sinkhorn_fwd"))


def specialize(q, k, v, *, attn_mask=None, is_causal=False, scale, dropout_p=0.0, n_iters=3, eps=1.0, cost="l2",
               enable_gqa=False, **others):
    """The "triton" backend's ``specialize`` hook: a :class:`BoundSinkhorn` for the signatures it
    serves (module docstring), else None (the general route)."""
    window = others.pop("window_size", None)
    if (not HAVE_TRITON or others or is_causal or dropout_p or int(n_iters) < 1 or type(q) is not torch.Tensor
            or k.dtype != q.dtype or v.dtype != q.dtype or torch.compiler.is_compiling()
            or q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] >= min(st.AUTOTUNE_MIN_WORK, st.FOLD_BELOW)):
        return None
    return BoundSinkhorn(q, k, v, attn_mask, 1.0 / q.shape[-1] ** 0.5 if scale is None else scale, n_iters, eps,
                         cost, window)
