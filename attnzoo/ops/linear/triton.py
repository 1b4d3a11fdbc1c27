"""Causal linear attention in Triton: the chunked parallel form (kernels: triton_kernels.py).

Chunks of C rows: inside a chunk a quadratic tril(phi(Q) phi(K)^T) V on the tensor cores, across chunks
an fp32 state H_c = s0 + sum of earlier chunks' phi(K)^T V written by a scan (one program per
(batch x head, state tile) walking the chunks), then one program per (batch x head, chunk, column tile)
for the output: parallel over B x H x chunks, as flash-linear-attention's ``chunk_linear_attn``.
The feature map, the scale, the elu/relu normaliser (fp32: phi(q_i) . z_c plus the intra-chunk row
sums) and the identity map's 1/n_i are fused into the kernels, so the unmasked self-attention call
reads q, k, v once and writes out: no fp32 copies of the inputs, no (N, D, Dv) prefix sums.
The backward recomputes the states (memory: one (N/C, D, Dv) state buffer, never two at a time in
the forward) and runs a reverse scan for the state gradients, then parallel dv and dq/dk kernels.
Forward and backward are the torch custom ops ``attnzoo::linear_causal_fwd`` / ``_bwd``
(triton_utils.kernel_op, tied by register_autograd, like the softmax family): on a GPU torch.compile
records their launches in its graph, under the interpreter they are opaque ops; either way a layer
traces as one graph.

Host-side (plain autograd, O(N D) work) are the rarer forms of ``reference.py``:
- a key mask: phi(scale q) and exp(mask_j) keep_j phi(k_j) are computed here and handed to the kernels
  as features (identity: with the 1/n_i of kept keys folded into q);
- bottom-right causal with Nk > Nq: the first Nk - Nq keys are seen by every query, their
  phi(K)^T V (fp32) is the initial state s0 (and their phi(K) sum the normaliser's z0);
- Nq > Nk: the first Nq - Nk queries see no key and return zeros.
Non-causal calls run their own kernels (noncausal.py: the keys' state S = sum_j phi(k_j) v_j^T,
then phi(q_i)^T S, every form above fused in).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import triton_kernels as ck
from .factorised import _causal_count, _key_weights
from .launch import FEATURES, KERNEL_DTYPES, dtype_reason  # noqa: F401 (dtype_reason: the backend's check)
from .launch import bhn as _bhn, device_index as _device_index, flags as _flags, pow2 as _pow2
from .launch import unit_columns as _unit_columns
from .noncausal import linear_noncausal
from .reference import EPS, feature_map_fn
from ..triton_utils import HAVE_TRITON, INTERPRETED, kernel_op, launcher, tracing_only

if HAVE_TRITON:
    import triton

# GPU tiles. CHUNK rows per chunk: the intra-chunk part costs C per row and the states N/C * D * Dv
# memory traffic, 64 balances them for D = 64..128 (flash-linear-attention's choice too).
CHUNK = 64
# Under the interpreter: 16-row chunks and 16-wide head-dim tiles, so tiny test shapes still cross
# several chunks (a partial last one) and, from D or Dv = 17 on, several tiles.
INTERPRETER_TILE = 16
# Input dtypes whose stored states are means (H_c / keys summed): fp16's range (65504) is too small for
# a sum of N outer products (v with a mean over a long sequence); bf16 has fp32's range.
MEAN_STATE_DTYPES = (torch.float16,)
# Input dtypes whose normalised forward also writes its output unrounded (fp32) for the backward (issue 21):
# the normaliser gradient c_i = -r_i dO_i . out_i cancels against other terms of dq (triton_kernels).
EXACT_OUT_DTYPES = (torch.float16, torch.bfloat16)




def launch_config(d, dv, dtype):
    """Per kernel: tile constexprs and launch options (fixed, chosen by the reasoning below; the
    sm_90 build check, benchmarks/compile_triton_kernels.py, compiles exactly these).

    - scans (``states``, ``reverse``): one program per (BK, BV) state tile walking the chunks; 64 x 64
      fp32 is 32 registers a thread at 4 warps and makes 2 x 2 programs per head at D = Dv = 128
      (8 warps for rows that are no multiple of 16 bytes);
    - ``output`` and ``dv``: a (C, BV) accumulator plus the (C, C) weights; BV up to 128 for half
      inputs so D = Dv = 128 computes the weights once per chunk (8 warps hold both);
    - ``dqk``: three accumulators ((C, BK) dq, dk and the (C, C) weight gradient): 8 warps (at 4 the
      fp32 and fp64 ones spilled);
    fp32 inputs take exact fp32 products (CUDA cores unless TF32 is allowed) and fp64 inputs (tests)
    fp64 ones: their dot operands live in registers, and 64-wide tiles spilled (sm_90 build check),
    so both run 32-row chunks and 32-wide tiles.
    """
    if INTERPRETED:
        t = INTERPRETER_TILE
        tiles = dict(CHUNK=t, BK=t, BV=t)
        return {**{name: dict(tiles) for name in ("states", "output", "reverse", "dv", "dqk")},
                "grad": dict(CHUNK=t, BV=t)}
    half = dtype in (torch.float16, torch.bfloat16)
    chunk, width = (CHUNK, 64) if half else (32, 32)
    bk, bv = min(width, _pow2(d)), min(width, _pow2(dv))
    wide_v = min(128 if half else width, _pow2(dv))
    # rows that are no multiple of 16 bytes load element by element: the scans then spilled at 4 warps
    aligned = (d * torch.finfo(dtype).bits // 8) % 16 == 0 and (dv * torch.finfo(dtype).bits // 8) % 16 == 0
    scan = dict(CHUNK=chunk, BK=bk, BV=bv, num_warps=4 if aligned else 8, num_stages=2)
    out = dict(CHUNK=chunk, BK=bk, BV=wide_v, num_warps=8 if chunk * wide_v > 64 * 64 else 4, num_stages=2)
    return {
        "states": scan, "reverse": dict(scan), "output": out, "dv": dict(out),
        "dqk": dict(CHUNK=chunk, BK=bk, BV=bv, num_warps=8, num_stages=2),
        "grad": dict(CHUNK=chunk, BV=bv, num_warps=4, num_stages=1),
    }






def _states(k, v, s0, z0, prefix_rows, scale, feature, normalised, cfg, flags):
    """(HS, ZS): the state before every chunk (input dtype for half inputs: the dtype its matmul
    operand takes anyway; fp32/fp64 otherwise) and the normaliser's z_c (accumulator dtype)."""
    B, H, N, D = k.shape
    DV = v.shape[-1]
    c = cfg["states"]
    acc = torch.float64 if flags["FP64"] else torch.float32
    state_dtype = k.dtype if k.dtype in (torch.float16, torch.bfloat16) else acc
    n_chunks = triton.cdiv(N, c["CHUNK"])
    hs = torch.empty(B * H, n_chunks, D, DV, dtype=state_dtype, device=k.device)
    zs = torch.empty(B * H, n_chunks, D if normalised else 0, dtype=acc, device=k.device)
    dummy = k.new_empty(0, dtype=acc)
    grid = (B * H * triton.cdiv(D, c["BK"]) * triton.cdiv(DV, c["BV"]),)
    launcher(ck._states_kernel)[grid](k, v, dummy if s0 is None else s0, dummy if z0 is None else z0, hs, zs,
                                      N, D, DV, H, scale, prefix_rows, *_bhn(k), *_bhn(v), FEATURE=feature,
                                      NORMALISED=normalised, HAS_S0=s0 is not None,
                                      MEAN_STATE=k.dtype in MEAN_STATE_DTYPES, **flags, **c)
    return hs, zs


# The chunked form as two torch custom ops (triton_utils.kernel_op: ``triton_op``s whose launches
# torch.compile records on a GPU, opaque ops under the interpreter) tied by register_autograd. Both
# take q, k, v of shape (B, H, N, .) with unit column stride; s0 (B, H, D, Dv) and z0 (B, H, D) in the
# accumulator dtype, or None; eps_bh (B * H,) the normaliser's epsilon per head, or None for 1e-6;
# prefix_rows the keys summed in s0. ``scale`` reaches the kernels as a Python float, which inductor
# types fp64: the kernels cast it to their accumulator dtype (triton_kernels._scalar).
if HAVE_TRITON:
    @kernel_op("attnzoo::linear_causal_fwd", mutates_args=())
    def linear_causal_fwd(q: Tensor, k: Tensor, v: Tensor, s0: Optional[Tensor], z0: Optional[Tensor],
                          eps_bh: Optional[Tensor], prefix_rows: int, scale: float, feature: int, mode: int,
                          count_offset: int) -> tuple[Tensor, Tensor, Tensor]:
        """(out (B, H, N, Dv) in q's dtype, rden (B * H, N) accumulator dtype: the normaliser's r_i,
        kept for the backward; (B * H, 0) unless mode is MODE_NORMALISED, exact: out before its
        rounding (fp32, (B, H, N, Dv)) for half inputs in MODE_NORMALISED, else (0,): the backward's
        normaliser gradient takes dO . out from it), with
        out_i = r_i phi(q_i)^T (s0 + sum_{j <= i} phi(k_j) v_j^T) (r_i: see triton_kernels)."""
        B, H, N, D = q.shape
        DV = v.shape[-1]
        cfg, flags = launch_config(D, DV, q.dtype), _flags(q.dtype)
        normalised = mode == ck.MODE_NORMALISED
        acc = torch.float64 if flags["FP64"] else torch.float32
        out = torch.empty(B, H, N, DV, dtype=q.dtype, device=q.device)
        rden = torch.empty(B * H, N if normalised else 0, dtype=acc, device=q.device)
        store_exact = normalised and q.dtype in EXACT_OUT_DTYPES
        exact = torch.empty(out.shape if store_exact else (0,), dtype=acc, device=q.device)
        if tracing_only(q):
            return out, rden, exact
        with torch.cuda.device(_device_index(q)):   # launch on q's GPU, not the current one
            hs, zs = _states(k, v, s0, z0, prefix_rows, scale, feature, normalised, cfg, flags)
            c = cfg["output"]
            grid = (B * H * triton.cdiv(DV, c["BV"]), triton.cdiv(N, c["CHUNK"]))
            launcher(ck._output_kernel)[grid](q, k, v, hs, zs, out, exact if store_exact else out, rden,
                                              rden if eps_bh is None else eps_bh, N, D,
                                              DV, H, scale, count_offset, prefix_rows, *_bhn(q), *_bhn(k), *_bhn(v),
                                              FEATURE=feature, MODE=mode, EPS_PER_HEAD=eps_bh is not None,
                                              MEAN_STATE=q.dtype in MEAN_STATE_DTYPES, STORE_EXACT=store_exact,
                                              **flags, **c)
        return out, rden, exact

    @kernel_op("attnzoo::linear_causal_bwd", mutates_args=())
    def linear_causal_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, rden: Tensor,
                          s0: Optional[Tensor], z0: Optional[Tensor], prefix_rows: int, scale: float, feature: int,
                          mode: int, count_offset: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """(dq, dk, dv, ds0, dz0) for ``do`` in q's dtype with unit column stride; ds0 / dz0 are empty
        when s0 / z0 are None. The states are recomputed, not saved by the forward."""
        B, H, N, D = q.shape
        DV = v.shape[-1]
        cfg, flags = launch_config(D, DV, q.dtype), _flags(q.dtype)
        normalised = mode == ck.MODE_NORMALISED
        acc = torch.float64 if flags["FP64"] else torch.float32
        dummy = q.new_empty(0, dtype=acc)
        dq = torch.empty(B, H, N, D, dtype=q.dtype, device=q.device)
        dk = torch.empty(B, H, N, D, dtype=q.dtype, device=q.device)
        dv = torch.empty(B, H, N, DV, dtype=q.dtype, device=q.device)
        ds0 = torch.empty((B, H, D, DV) if s0 is not None else (0,), dtype=acc, device=q.device)
        dz0 = torch.empty((B, H, D) if z0 is not None else (0,), dtype=acc, device=q.device)
        if tracing_only(q):
            return dq, dk, dv, ds0, dz0
        with torch.cuda.device(_device_index(q)):
            hs, zs = _states(k, v, s0, z0, prefix_rows, scale, feature, normalised, cfg, flags)
            cg = torch.empty(B * H, N if normalised else 0, dtype=acc, device=q.device)
            if normalised:
                c = cfg["grad"]
                launcher(ck._normaliser_grad_kernel)[(B * H, triton.cdiv(N, c["CHUNK"]))](
                    do, out, rden, cg, N, DV, FP64=flags["FP64"], **c)
            dhs, dzs = torch.empty_like(hs), torch.empty_like(zs)
            c = cfg["reverse"]
            grid = (B * H * triton.cdiv(D, c["BK"]) * triton.cdiv(DV, c["BV"]),)
            launcher(ck._reverse_states_kernel)[grid](q, do, rden, cg, dhs, dzs, ds0 if s0 is not None else dummy,
                                                      dz0 if z0 is not None else dummy, N, D, DV, H, scale,
                                                      count_offset, *_bhn(q), FEATURE=feature, MODE=mode,
                                                      HAS_S0=s0 is not None, **flags, **c)
            c = cfg["dv"]
            grid = (B * H * triton.cdiv(DV, c["BV"]), triton.cdiv(N, c["CHUNK"]))
            launcher(ck._dv_kernel)[grid](q, k, do, dhs, rden, dv, N, D, DV, H, scale, count_offset, *_bhn(q),
                                          *_bhn(k), FEATURE=feature, MODE=mode, **flags, **c)
            c = cfg["dqk"]
            grid = (B * H * triton.cdiv(D, c["BK"]), triton.cdiv(N, c["CHUNK"]))
            launcher(ck._dqk_kernel)[grid](q, k, v, do, hs, zs, dhs, dzs, rden, cg, dq, dk, N, D, DV, H, scale,
                                           count_offset, prefix_rows, *_bhn(q), *_bhn(k), *_bhn(v), FEATURE=feature,
                                           MODE=mode, MEAN_STATE=q.dtype in MEAN_STATE_DTYPES, **flags, **c)
        return dq, dk, dv, ds0, dz0

    def _setup_context(ctx, inputs, output):
        q, k, v, s0, z0, eps_bh, prefix_rows, scale, feature, mode, count_offset = inputs
        out, rden, exact = output
        # the backward reads out only for c_i = -r_i dO_i . out_i: the unrounded one where it was rounded
        ctx.save_for_backward(q, k, v, exact if exact.numel() else out, rden, s0, z0)
        ctx.args = (prefix_rows, scale, feature, mode, count_offset)

    def _backward(ctx, dout, _drden, _dexact):
        q, k, v, out, rden, s0, z0 = ctx.saved_tensors
        dq, dk, dv, ds0, dz0 = linear_causal_bwd(dout.to(q.dtype).contiguous(), q, k, v, out, rden, s0, z0,
                                                 *ctx.args)
        return (dq, dk, dv, ds0 if s0 is not None else None, dz0 if z0 is not None else None,
                None, None, None, None, None, None)

    linear_causal_fwd.register_autograd(_backward, setup_context=_setup_context)


def _causal(q, k, v, attn_mask, scale, feature_map):
    nq, nk = q.shape[-2], k.shape[-2]
    off = nk - nq
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    normalised = feature_map != "identity"
    phi = feature_map_fn(feature_map)
    # weight = exp(mask - shift) keep (shift = the largest finite mask entry, when factorised.py shifts)
    weight, keep, *rest = _key_weights(attn_mask, nk, acc)
    shift = rest[0] if rest else None
    if q.dtype == torch.float64 and scale != 1.0:
        q, scale = q * scale, 1.0          # the kernels take scale as an fp32 scalar
    if weight is None:                     # the kernels apply phi, the normaliser or 1 / (i + offset)
        q_in, k_in, kscale, feature = q, k, scale, FEATURES[feature_map]
        mode = ck.MODE_NORMALISED if normalised else ck.MODE_COUNT
        k_prefix = phi(k[..., :max(off, 0), :].to(acc)) if off > 0 else None
    else:                                  # features with the key weights (and 1/n_i) computed here
        fq = phi(q.to(acc) * scale)
        fk = phi(k.to(acc)) * weight
        if not normalised:
            fq = fq / _causal_count(keep, nq, nk, acc, q.device).clamp_min(1.0)
        q_in, k_in, kscale, feature = fq.to(q.dtype), fk.to(q.dtype), 1.0, ck.FEATURE_NONE
        mode = ck.MODE_NORMALISED if normalised else ck.MODE_PLAIN
        k_prefix = fk[..., :off, :] if off > 0 else None
    eps_bh = None
    if shift is not None and normalised:
        # num e^-shift / (den e^-shift + EPS e^-shift); the floor keeps a row whose keys are all masked
        # at 0 / eps (out 0, finite gradients) where EPS e^-shift underflows
        eps = (EPS * torch.exp(-shift.to(acc))).clamp_min(torch.finfo(acc).tiny ** 0.5)
        eps_bh = eps.expand(q.shape[:2] + (1, 1)).reshape(-1).contiguous()
    s0 = z0 = None
    if off > 0:                            # keys every query sees: the initial state
        with torch.autocast(q.device.type, enabled=False):
            s0 = (k_prefix.transpose(-1, -2) @ v[..., :off, :].to(acc)).contiguous()
        z0 = k_prefix.sum(-2).contiguous() if normalised else None
        k_in, v = k_in[..., off:, :], v[..., off:, :]
    elif off < 0:                          # queries that see no key
        q_in = q_in[..., -off:, :]
    q_in, k_in, v = (_unit_columns(t) for t in (q_in, k_in, v))
    out, _, _ = linear_causal_fwd(q_in, k_in, v, s0, z0, eps_bh, max(off, 0), float(kscale), feature, mode,
                               1 + max(off, 0))
    if shift is not None and not normalised:
        out = (out.to(acc) * torch.exp(shift)).to(q.dtype)
    if off < 0:
        out = torch.nn.functional.pad(out, (0, 0, -off, 0))   # not cat: CPU autocast's cat rejects fp64/fp16
    return out


def linear_attention_triton(q, k, v, *, attn_mask=None, is_causal=False, scale=1.0, feature_map="elu",
                            dropout_p=0.0):
    if not is_causal:   # its own kernels (noncausal.py); backend "cpu" runs the two torch matmuls
        return linear_noncausal(q, k, v, attn_mask, scale, feature_map)
    return _causal(q, k, v, attn_mask, scale, feature_map)
