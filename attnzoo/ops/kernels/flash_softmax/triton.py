"""The online-softmax (FlashAttention-2 style) Triton kernels as torch custom ops, and their entry points.

Used by the softmax, l2 and fenchel variants (their ``triton`` backends) and by Sinkhorn's final row
pass. Entry points (all take q (B, H, Nq, D), k (B, H, Nk, D), v (B, H, Nk, Dv) like SDPA):
- ``softmax_attention`` / ``l2_attention`` / ``fenchel_attention``: the kernels behind the ``triton``
  backends that ops/softmax, ops/l2 and ops/fenchel register;
- ``preference_attention(q, k, v, log_pref)``: out_i = sum_j softmax_j(l_ij + g_j) v_j with a per-key
  log-preference g (B|1, H|1, Nk) and its gradient (Sinkhorn's final row pass is this with
  g = the column potential);
- ``bucket_bias_attention(q, k, v, table, lut)``: softmax(scale q.k + table[lut[j - i + Nq - 1], h])
  with the gradient to the (num_buckets, H) table, no (Nq, Nk) bias ever built (T5's relative
  positions: ops/fenchel/t5.py).

The kernels live in triton_kernels.py; the ops ``attnzoo::softmax_family_fwd`` / ``_bwd`` are
``torch.library.triton_op``s on a GPU, so torch.compile sees through them (under the interpreter they
are opaque custom ops: triton_utils.kernel_op), and autograd uses the fused backward. No (Nq, Nk)
tensor is allocated: masks are passed broadcast (stride 0), the offset bias as an (Nq + Nk - 1)
offset -> bucket vector plus the table.

softcap, sinks and window_size (ops/logit_extras.py) are fused in the kernels for the three backends
(``FUSED_EXTRAS``): ``extras_args`` turns them into the kernels' arguments and switches, the window's
unbounded sides into bounds past every key and is_causal into its right bound; the backward returns
delta, from which ``sinks_grad`` reduces dsinks with lse.

Dropout on the weights (``dropout_p > 0``) happens in the kernels (see ops/triton_dropout.py): each
forward call draws one seed from torch's generator of q's device and the backward regenerates the
same keep-mask from it; ``dropout_p == 0`` launches the kernels without any dropout code.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from ... import validate as V
from ...triton_dropout import call_seed, dropout_flag
from ...triton_logit_extras import band_bounds
from ... import triton_tuning as tuning
from ...triton_utils import (HAVE_TRITON, INTERPRETED, broadcast_rows, common_reason, dot_precision, kernel_mask,
                            kernel_op, launcher, mask_shape, reduce_to_shape, stand_in, tracing_only)

if HAVE_TRITON:
    import triton

    from . import hopper
    from .triton_kernels import (softmax_bwd_delta_kernel, softmax_bwd_dkdv_kernel, softmax_bwd_dq_kernel,
                                 softmax_fwd_kernel)

    # what the autotuner keys on besides the tensor dtypes, which Triton adds itself
    TUNING_KEY = ["tune_nq", "tune_nk", "D", "DV", "L2", "MASK_KIND", "MASK_SHAPE", "HAS_PREF", "HAS_T5", "CAUSAL",
                  "DROPOUT", "PRECISION", "SOFTCAP", "HAS_SINKS", "WINDOW"]
    # on Triton versions that can build it, the forward is a selector between the classic kernel and
    # the Hopper variant, whose rows a launch offers the autotuner when hopper.forward_variants says so
    FORWARD = tuning.TunedKernel(hopper.forward_kernel(softmax_fwd_kernel), tuning.FORWARD, tuning.FORWARD_DROPOUT,
                                 TUNING_KEY, variants=hopper.FORWARD_VARIANTS,
                                 constants=hopper.FORWARD_CONSTANTS)
    KEYS_BACKWARD = tuning.TunedKernel(hopper.keys_backward_kernel(softmax_bwd_dkdv_kernel), tuning.KEYS_BACKWARD,
                                       tuning.KEYS_BACKWARD_DROPOUT, TUNING_KEY,
                                       variants=hopper.KEYS_BACKWARD_VARIANTS,
                                       constants=hopper.KEYS_BACKWARD_CONSTANTS)
    QUERIES_BACKWARD = tuning.TunedKernel(hopper.queries_backward_kernel(softmax_bwd_dq_kernel),
                                          tuning.QUERIES_BACKWARD, tuning.QUERIES_BACKWARD_DROPOUT, TUNING_KEY,
                                          variants=hopper.QUERIES_BACKWARD_VARIANTS,
                                          constants=hopper.QUERIES_BACKWARD_CONSTANTS)


def window_args(window_left: int, window_right: int, is_causal: bool, Nq: int, Nk: int):
    """(WINDOW, left, right, is_causal) as the kernels take them: without a window (-1, -1) the causal
    flag as it is; with one, an unbounded side becomes a bound past every key (Nq + Nk) and is_causal is
    folded into ``right`` (the band then holds the causal triangle), so the kernels' causal path is off."""
    if window_left < 0 and window_right < 0:
        return False, 0, 0, is_causal
    left, right = band_bounds((window_left, window_right), is_causal, Nq, Nk)
    return True, left, right, False


def extras_args(q, sinks, softcap: float, window_left: int, window_right: int, is_causal: bool, Nq: int, Nk: int):
    """(the kernels' SINKS, softcap, left, right arguments, their SOFTCAP / HAS_SINKS / WINDOW flags, the
    causal flag to launch with)."""
    window, left, right, causal = window_args(window_left, window_right, is_causal, Nq, Nk)
    sinks_arg = sinks.to(torch.float32).contiguous() if sinks is not None else stand_in(q, torch.float32)
    flags = dict(SOFTCAP=softcap > 0, HAS_SINKS=sinks is not None, WINDOW=window)
    return (sinks_arg, float(softcap), left, right), flags, causal


def sinks_grad(sinks, lse, delta):
    """d loss / d sinks[h] = -sum_{b, i} p_sink(b, h, i) delta(b, h, i), p_sink = exp(sink_h - lse_i) (the
    sink's weight in the row; its value is 0, so its dP is 0 and dS_sink = p_sink (0 - delta)). lse is the
    kernels' base-2 one; rows with no key have lse = the sink and delta = 0."""
    log2e = 1.4426950408889634
    p_sink = torch.exp2(sinks.to(torch.float32)[None, :, None] * log2e - lse)
    return -(p_sink * delta).sum((0, 2))


def _prepare(q, k, mask, pref, table, lut):
    """Everything the three kernels share: broadcast views, stand-ins and their strides."""
    B, H, Nq, _ = q.shape
    Nk = k.shape[2]
    m, mask_kind, mask_strides = kernel_mask(mask, B, H, Nq, Nk)
    if m is None:
        m = stand_in(q, torch.uint8)
    p = broadcast_rows(pref, B, H, Nk)
    pref_strides = tuple(p.stride()) if p is not None else (0, 0, 0)
    if p is None:
        p = stand_in(q, torch.float32)
    has_t5 = table is not None
    if has_t5:
        # the kernels read bias[h, r] = table[bucket(r), h] (H, Nq + Nk - 1): one tiny gather here, then one
        # scalar per tile (per run of equal buckets near the diagonal) instead of a bucket load then a
        # table load per score
        bias = table.t().index_select(1, lut[0])
        table, table_strides = bias, (lut.stride(0), bias.stride(0))  # the LUT's run-end row, a head's bias
    else:
        table, table_strides, lut = stand_in(q, torch.float32), (0, 0), stand_in(q, torch.int32)
    flags = dict(MASK_KIND=mask_kind, MASK_SHAPE=mask_shape(mask_strides), HAS_PREF=pref is not None, HAS_T5=has_t5)
    return m, mask_strides, p, pref_strides, table, table_strides, lut, flags


@functools.lru_cache(maxsize=1024)
def _launch_flags(D, DV, is_causal, l2, dropout, dtype, allow_tf32):
    """The constexprs every launch of a call shares (tiles come from ops/triton_tuning.py), decided once
    per head dims and flavour."""
    bd, bdv = max(16, triton.next_power_of_2(D)), max(16, triton.next_power_of_2(DV))
    return dict(BLOCK_D=bd, BLOCK_DV=bdv, L2=bool(l2), CAUSAL=bool(is_causal), HEAD_MASK=(bd != D or bdv != DV),
                UPCAST=INTERPRETED, PRECISION=dot_precision(dtype), DROPOUT=bool(dropout))


def _flags(q, v, is_causal, l2, dropout):
    # TF32 (a global switch) matters for fp32 operands only: read it only for them
    tf32 = q.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32
    return _launch_flags(q.shape[-1], v.shape[-1], bool(is_causal), bool(l2), bool(dropout), q.dtype, tf32)


def _sizes(q, k, v):
    """H, Nq, Nk, D, DV, the query heads per key/value head, and the autotuning key's length buckets,
    in the kernels' argument order."""
    _, H, Nq, D = q.shape
    return _sizes_of(H, k.shape[1], Nq, k.shape[2], D, v.shape[3])


@functools.lru_cache(maxsize=1024)
def _sizes_of(H, H_kv, Nq, Nk, D, DV):
    return H, Nq, Nk, D, DV, H // H_kv, tuning.n_bucket(Nq), tuning.n_bucket(Nk)


def _shape_key(meta, flags, sizes):
    """What the autotuner keys on for these launches (ops/triton_tuning.TunedKernel.run freezes it)."""
    return (sizes[3], sizes[4], sizes[6], sizes[7], meta["L2"], meta["CAUSAL"], meta["PRECISION"],
            flags["MASK_KIND"], flags["MASK_SHAPE"], flags["HAS_PREF"], flags["HAS_T5"], flags["SOFTCAP"],
            flags["HAS_SINKS"], flags["WINDOW"])


def _keeps_residual(q, table) -> bool:
    """Whether the forward writes out's rounding residual: T5 (whose table gradient needs it) with half inputs."""
    return table is not None and q.dtype in (torch.float16, torch.bfloat16)  # the kernel's own test


DELTA_ROWS = 64  # rows of dO . O per program of the backward's first launch
# what the softmax / l2 / fenchel Triton backends take from ops/logit_extras.py, fused in the kernels
FUSED_EXTRAS = ("softcap", "sinks", "window_size")


if HAVE_TRITON:
    @kernel_op("attnzoo::softmax_family_fwd", mutates_args=())
    def softmax_family_fwd(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], pref: Optional[Tensor],
                           table: Optional[Tensor], lut: Optional[Tensor], scale: float, is_causal: bool,
                           l2: bool, dropout_p: float = 0.0, seed: Optional[Tensor] = None,
                           sinks: Optional[Tensor] = None, softcap: float = 0.0, window_left: int = -1,
                           window_right: int = -1) -> tuple[Tensor, Tensor, Tensor]:
        """(out (B, H, Nq, Dv) in q's dtype, lse (B, H, Nq) fp32 in base 2: log2 sum_j exp(l_ij), the
        kernels' units (l the logits; the L2 logits without the row constant -scale ||q_i||^2 unless a cap
        or sinks need it, see triton_kernels.py); +inf for rows with no key (the sink's logit with sinks,
        which also joins every row's sum); residual: with a T5 table and half inputs the
        rounding residual of out (the unrounded output minus out, in q's dtype, for the backward's
        delta), else an empty placeholder. With dropout_p > 0, ``seed`` (1-element int64)
        picks the keep-mask; lse is the undropped one. k and v may hold fewer heads than q (grouped-query
        attention: query head h reads key/value head h // (H / H_kv)). ``sinks`` (H,): each head's sink
        logit joins the normaliser (and lse); ``softcap`` > 0: the logits capped; ``window_left`` /
        ``window_right`` >= 0: the sliding window (ops/logit_extras.py), fused: key blocks outside the
        band are never visited. One launch."""
        B, H, Nq, D = q.shape
        DV = v.shape[3]
        out = torch.empty((B, H, Nq, DV), dtype=q.dtype, device=q.device)
        lse = torch.empty((B, H, Nq), dtype=torch.float32, device=q.device)
        # T5 with half inputs: the table gradient needs delta = dO . O from the unrounded output (its
        # dS sums over a bucket cancel to delta's error); the other flavours keep FlashAttention's rounded O
        residual = torch.empty(out.shape if _keeps_residual(q, table) else (0,), dtype=q.dtype, device=q.device)
        m, ms, p, ps, t, ts, lut, flags = _prepare(q, k, mask, pref, table, lut)
        extras, extra_flags, is_causal = extras_args(q, sinks, softcap, window_left, window_right, is_causal, Nq,
                                                     k.shape[2])
        flags.update(extra_flags)
        dropout = dropout_flag(dropout_p, seed)
        meta = _flags(q, v, is_causal, l2, dropout)
        if tracing_only(q):
            return out, lse, residual
        sizes = _sizes(q, k, v)
        FORWARD.run(lambda META: (triton.cdiv(Nq, META["BLOCK_M"]), B * H),
                    (q, k, v, out, lse, residual if residual.numel() else out, m, p, t, lut, seed if dropout else lut,
                     *q.stride(), *k.stride(), *v.stride(), *out.stride(), *ms, *ps, *ts, *sizes, scale, dropout_p,
                     *extras),
                    {**meta, **flags}, dtype=q.dtype, block_d=meta["BLOCK_D"], block_dv=meta["BLOCK_DV"],
                    dropout=dropout, shape_key=_shape_key(meta, flags, sizes),
                    variants=hopper.forward_variants(q, k, v, meta, flags))
        return out, lse, residual

    @kernel_op("attnzoo::softmax_family_bwd", mutates_args=())
    def softmax_family_bwd(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                           residual: Tensor, mask: Optional[Tensor], pref: Optional[Tensor], table: Optional[Tensor],
                           lut: Optional[Tensor], scale: float, is_causal: bool, l2: bool,
                           dropout_p: float = 0.0, seed: Optional[Tensor] = None, sinks: Optional[Tensor] = None,
                           softcap: float = 0.0, window_left: int = -1,
                           window_right: int = -1) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        """(dq, dk, dv, dpref (B, H, Nk) fp32 or empty, dtable fp32 like table or empty, delta (B, H, Nq)
        fp32: dO . O per row, from which the caller reduces dsinks with lse, ``sinks_grad``). Three launches:
        delta = rowsum(dO * O) (O plus ``residual``, the forward's third output, where that is not
        empty), then dK/dV (one program per key block of a key/value head, walking the
        query heads that share it), then dQ."""
        B, H, Nq, D = q.shape
        H_kv, Nk, DV = k.shape[1], k.shape[2], v.shape[3]
        delta = torch.empty((B, H, Nq), dtype=torch.float32, device=q.device)
        dq = torch.empty((B, H, Nq, D), dtype=q.dtype, device=q.device)
        dk = torch.empty((B, H_kv, Nk, D), dtype=k.dtype, device=q.device)
        dv = torch.empty((B, H_kv, Nk, DV), dtype=v.dtype, device=q.device)
        m, ms, p, ps, t, ts, lut, flags = _prepare(q, k, mask, pref, table, lut)
        extras, extra_flags, is_causal = extras_args(q, sinks, softcap, window_left, window_right, is_causal, Nq, Nk)
        flags.update(extra_flags)
        dpref = (torch.empty((B, H, Nk), dtype=torch.float32, device=q.device) if flags["HAS_PREF"]
                 else torch.empty(0, dtype=torch.float32, device=q.device))
        dropout = dropout_flag(dropout_p, seed)
        meta = _flags(q, v, is_causal, l2, dropout)
        buckets, partials = 1, p
        if flags["HAS_T5"]:
            # the table gradient per (key block, batch, bucket, head), each row written by one program,
            # summed below in a fixed order (deterministic). The dK/dV launch runs its default tiles: their
            # BLOCK_N sizes the rows before the launch (an autotuner would pick it only at the launch)
            buckets = triton.next_power_of_2(table.shape[0])
            key_tiles = KEYS_BACKWARD.launch(q.dtype, meta["BLOCK_D"], meta["BLOCK_DV"], dropout, tune=False)[1]
            partials = torch.empty((triton.cdiv(Nk, key_tiles["BLOCK_N"]), B, buckets, H), dtype=torch.float32,
                                   device=q.device)
        if tracing_only(q):
            dtable = (torch.empty(table.shape, dtype=torch.float32, device=q.device) if flags["HAS_T5"]
                      else torch.empty(0, dtype=torch.float32, device=q.device))
            return dq, dk, dv, dpref, dtable, delta
        # delta_i = dO_i . O_i, also with dropout (O is the dropped output; proof in triton_kernels.py)
        rows = 16 if INTERPRETED else DELTA_ROWS
        launcher(softmax_bwd_delta_kernel)[(triton.cdiv(Nq, rows), B * H)](
            out, residual if residual.numel() else out, grad_out, delta, *out.stride(), *grad_out.stride(), H, Nq,
            DV, BLOCK_M=rows, BLOCK_DV=meta["BLOCK_DV"], RESIDUAL=residual.numel() > 0)
        seed_ptr = seed if dropout else lut
        sizes = _sizes(q, k, v)
        common = (*q.stride(), *k.stride(), *v.stride(), *grad_out.stride(), *ms, *ps, *ts, *sizes, scale, dropout_p,
                  *extras)
        shape_key = _shape_key(meta, flags, sizes)
        tiles = dict(dtype=q.dtype, block_d=meta["BLOCK_D"], block_dv=meta["BLOCK_DV"], dropout=dropout)
        dq_variants = hopper.forward_variants(q, k, v, meta, flags)  # one answer for both launches below
        KEYS_BACKWARD.run(lambda META: (triton.cdiv(Nk, META["BLOCK_N"]), B * H_kv),
                          (q, k, v, grad_out, lse, delta, dk, dv, dpref if flags["HAS_PREF"] else p,
                           partials, m, p, t, lut, seed_ptr, *common),
                          {**meta, **flags, "BUCKETS": buckets}, tune=not flags["HAS_T5"],
                          shape_key=shape_key, variants=hopper.keys_backward_variants(q, grad_out, dq_variants),
                          **tiles)
        QUERIES_BACKWARD.run(lambda META: (triton.cdiv(Nq, META["BLOCK_M"]), B * H),
                             (q, k, v, grad_out, lse, delta, dq, m, p, t, lut, seed_ptr, *common),
                             {**meta, **flags}, shape_key=shape_key,
                             variants=dq_variants, **tiles)
        dtable = (partials.sum((0, 1))[:table.shape[0]] if flags["HAS_T5"]
                  else torch.empty(0, dtype=torch.float32, device=q.device))
        return dq, dk, dv, dpref, dtable, delta

    def _setup_context(ctx, inputs, output):
        (q, k, v, mask, pref, table, lut, scale, is_causal, l2, dropout_p, seed, sinks, softcap, window_left,
         window_right) = inputs
        out, lse, residual = output
        # the seed regenerates Z
        ctx.save_for_backward(q, k, v, out, lse, residual, mask, pref, table, lut, seed, sinks)
        ctx.scale, ctx.is_causal, ctx.l2, ctx.dropout_p = scale, is_causal, l2, dropout_p
        ctx.softcap, ctx.window = softcap, (window_left, window_right)

    def _backward(ctx, grad_out, grad_lse, grad_residual):
        q, k, v, out, lse, residual, mask, pref, table, lut, seed, sinks = ctx.saved_tensors
        dq, dk, dv, dpref, dtable, delta = softmax_family_bwd(
            grad_out, q, k, v, out, lse, residual, mask, pref, table, lut, ctx.scale, ctx.is_causal, ctx.l2,
            ctx.dropout_p, seed, sinks, ctx.softcap, *ctx.window)
        g_pref = reduce_to_shape(dpref, pref.shape).to(pref.dtype) if pref is not None else None
        g_table = dtable.to(table.dtype) if table is not None else None  # (num_buckets, H) already
        g_sinks = sinks_grad(sinks, lse, delta).to(sinks.dtype) if sinks is not None else None
        return dq, dk, dv, None, g_pref, g_table, None, None, None, None, None, None, g_sinks, None, None, None

    softmax_family_fwd.register_autograd(_backward, setup_context=_setup_context)


# --- host-side checks and the public entry points ---------------------------------------------------

def _check_runnable(q, k, v, attn_mask, dropout_p=0.0):
    why = common_reason(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p)
    if why is not None:
        raise ValueError(f"the Triton softmax kernel cannot run this call: {why}")


def _run(q, k, v, attn_mask, is_causal, scale, l2=False, pref=None, table=None, lut=None, dropout_p=0.0,
         softcap=None, sinks=None, window_size=None):
    seed = call_seed(q, dropout_p)
    left, right = window_size if window_size is not None else (-1, -1)
    if softcap is not None and l2 and pref is not None:  # the kernels' one column sum serves one of the two
        raise ValueError("softcap with L2 logits and a per-key preference together is not implemented in the "
                         "Triton kernels")
    out, _, _ = softmax_family_fwd(q, k, v, attn_mask, pref, table, lut, float(scale), bool(is_causal), bool(l2),
                                   float(dropout_p), seed, sinks, float(softcap or 0.0), int(left), int(right))
    return out


def key_preference(log_u, q, k):
    """log_u broadcastable to (B, H, Nq, Nk) that does not vary with the query -> (B|1, H|1, Nk|1),
    or None when it does (the kernel takes per-key preferences only)."""
    if log_u is None:
        return None
    lu = log_u.reshape((1,) * (4 - log_u.dim()) + tuple(log_u.shape)) if log_u.dim() < 4 else log_u
    if lu.shape[2] != 1:
        return None
    return lu[:, :, 0, :]


# The backends below are reached through the dispatcher, whose ``supports`` check (common_reason and
# the variant's own) already accepted the call: they do not check again. enable_gqa: k and v may hold
# fewer heads than q; the kernels index the shared head.

def softmax_attention(q, k, v, *, attn_mask=None, is_causal=False, scale, dropout_p=0.0, enable_gqa=False,
                      softcap=None, sinks=None, window_size=None):
    """Backend ``triton`` of the ``softmax`` variant; softcap, sinks and window_size fused."""
    return _run(q, k, v, attn_mask, is_causal, scale, dropout_p=dropout_p, softcap=softcap, sinks=sinks,
                window_size=window_size)


def l2_attention(q, k, v, *, attn_mask=None, is_causal=False, scale, dropout_p=0.0, enable_gqa=False,
                 softcap=None, sinks=None, window_size=None):
    """Backend ``triton`` of the ``l2`` variant: softmax_j(cap(-scale ||q_i - k_j||^2) + mask) v_j (with a cap
    or sinks the kernels keep the row constant -scale ||q_i||^2, which then no longer cancels)."""
    return _run(q, k, v, attn_mask, is_causal, scale, l2=True, dropout_p=dropout_p, softcap=softcap, sinks=sinks,
                window_size=window_size)


def fenchel_attention(q, k, v, *, attn_mask=None, is_causal=False, scale, log_u=None, alpha=1.0,
                      solve="first_order", dropout_p=0.0, enable_gqa=False, softcap=None, sinks=None,
                      window_size=None):
    """Backend ``triton`` of the ``fenchel`` variant, first order only: softmax(alpha s_ij + log u_j)."""
    if solve != "first_order":
        raise ValueError(f"the Triton kernel computes solve='first_order' only, got solve={solve!r}")
    pref = key_preference(log_u, q, k)
    if log_u is not None and pref is None:
        raise ValueError(f"log_u of shape {tuple(log_u.shape)} varies with the query; the Triton kernel takes "
                         "a per-key preference (B|1, H|1, 1, Nk) (T5 tables: ops/fenchel/t5.py)")
    return _run(q, k, v, attn_mask, is_causal, scale * alpha, pref=pref, dropout_p=dropout_p, softcap=softcap,
                sinks=sinks, window_size=window_size)


def preference_attention(q, k, v, log_pref, *, attn_mask=None, is_causal=False, scale=None, l2=False,
                         dropout_p=0.0):
    """out_i = sum_j softmax_j(l_ij + g_j) v_j, with l_ij = scale q_i.k_j (or -scale ||q_i - k_j||^2 when
    ``l2``) plus the mask, and g = ``log_pref`` broadcastable to (B, H, Nk) (-inf removes a key).
    Differentiable in q, k, v and log_pref; no (Nq, Nk) tensor is stored. ``dropout_p`` drops weights
    in the kernel (the kept ones scaled by 1 / (1 - dropout_p))."""
    V.check_qkv(q, k, v)
    V.check_mask(attn_mask, q, k)
    scale = V.resolve_scale(scale, q)
    B, H, _, _ = q.shape
    V.check_broadcast("log_pref", log_pref, (B, H, k.shape[2]), q, allow_bool=False)
    if log_pref is None:
        raise ValueError("log_pref must be a float tensor broadcastable to (B, H, Nk), got None")
    dropout_p = V.check_dropout(dropout_p)
    _check_runnable(q, k, v, attn_mask, dropout_p)
    return _run(q, k, v, attn_mask, is_causal, scale, l2=l2, pref=log_pref, dropout_p=dropout_p)


def offset_lut(buckets: Tensor) -> Tensor:
    """The int32 (2, Nq + Nk - 1) offset table ``bucket_bias_attention`` takes, from the bucket of each
    offset index r = j - i + Nq - 1 (``buckets``, (Nq + Nk - 1,) ints): row 0 the bucket, row 1 the last
    index of the run of equal buckets r belongs to. With the runs a kernel sees from a tile's two
    extreme offsets whether all its pairs share one bucket (one bias, one gradient sum for the tile)
    and walks the few runs of the others. Build it once per shape (ops/fenchel/t5.py caches T5's)."""
    b = buckets.reshape(-1).to(torch.int32)
    at = torch.arange(b.numel(), device=b.device)
    last = torch.ones(b.numel(), dtype=torch.bool, device=b.device)
    last[:-1] = b[1:] != b[:-1]
    ends = at[last]
    return torch.stack([b, ends[torch.searchsorted(ends, at)].to(torch.int32)])


def bucket_bias_attention(q, k, v, table, lut, *, attn_mask=None, is_causal=False, scale, dropout_p=0.0):
    """softmax_j(scale q_i.k_j + table[lut[0, j - i + Nq - 1], h] + mask_ij) v_j: a per-head bias looked up
    by the query-key offset (``table`` (num_buckets, H) float, ``lut`` the int32 (2, Nq + Nk - 1) table of
    ``offset_lut``), added tile by tile; the gradient reaches ``table`` (summed per head and bucket).

    The kernels read bias[h, r] = table[lut[0, r], h], gathered once per call on the host (H x (Nq + Nk - 1)
    floats): a tile whose offsets lie in one run of equal buckets adds one scalar, the others one scalar per
    run they span (where the offset falls in it). The backward sums dS per bucket in registers (one tile sum per run the tile spans) and writes
    one row of partial sums per key block; the host adds the rows. Arguments are checked by the caller
    (ops/fenchel/t5.py builds and caches T5's lut, t5.reason checked the call)."""
    return _run(q, k, v, attn_mask, is_causal, scale, table=table, lut=lut, dropout_p=dropout_p)


__all__ = ["softmax_attention", "l2_attention", "fenchel_attention", "preference_attention", "bucket_bias_attention",
           "offset_lut", "key_preference"]
