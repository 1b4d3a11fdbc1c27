"""Hopper (sm_90) variants of the softmax-family forward, dQ and dK/dV kernels: the streamed tiles (K and
V in the forward and dQ, Q and dO in dK/dV) through TMA tensor descriptors, the forward's key loop
optionally warp-specialised.

Same mathematics, units and outputs as ``softmax_fwd_kernel`` (triton_kernels.py: base-2 logits, the
L2 logits without the row constant, lse2 = +inf for rows with no key); what changes is how the key
loop reads K and V:
- ``tl.make_tensor_descriptor`` (device side) over one head's (Nk, D) keys and (Nk, Dv) values: each
  tile is one TMA bulk copy into shared memory instead of BLOCK_N x BLOCK_D per-thread addresses, and
  the copy engine zero-fills rows past Nk and columns past D, so the loads need no bounds masks;
- ``WARP_SPEC``: ``tl.range(..., warp_specialize=True)`` lets Triton split the loop into a producer
  partition (the TMA loads) and consumer warps (the two dots and the online softmax), the overlap
  FlashAttention-3 builds by hand (its producer warp and ping-pong of softmax and GEMM).
Queries are loaded once per program and the output stored once, as in the classic kernel (plain
pointer accesses: no alignment condition on q or out).

``softmax_fwd_select_kernel`` is the kernel the forward's autotuner launches when this module can be
built: the classic kernel's arguments (the packed-sequence ones, VARLEN, passed through) plus two constexprs, HOPPER (this variant) and WARP_SPEC, which
every classic configuration sets False (hopper.FORWARD_CONSTANTS), so those launch exactly the classic
kernel, and the Hopper rows are further autotune configurations (ops/triton_tuning.py ``variants``) that the host code offers only
for launches this variant supports (hopper.py decides). Flavours it does not compute (dropout, the T5
bias) never get those configurations; the static asserts below catch a host that offers them anyway.
``softmax_dq_select_kernel`` does the same for the backward's dQ launch (HOPPER only): the same key
loop as the forward with the same descriptors, so the same launches qualify.
``softmax_dkdv_select_kernel`` does it for dK / dV (HOPPER only), whose program keeps one key block
resident and streams the query blocks of the GROUP query heads sharing its key/value head: there Q
and dO come through descriptors (one pair per query head), K / V are loaded once with plain
pointers, and the lse / delta rows with plain loads (a row of one head starts at pid_bh * Nq floats,
16-byte aligned only when Nq is a multiple of 4, so no descriptor can cover them in general). Its
launches qualify when the forward's do and, besides, Q and dO are TMA-readable (hopper.py).

Capability gates (an older Triton silently keeps the classic kernel): ``TENSOR_DESCRIPTORS`` needs
``tl.make_tensor_descriptor`` and ``triton.set_allocator`` (device-side descriptors live in a
per-launch global scratch buffer the allocator provides); ``WARP_SPECIALIZE`` needs the
``warp_specialize`` keyword of ``tl.range``. Without the first, nothing here is defined.
"""
from __future__ import annotations

import inspect

from ...triton_utils import HAVE_TRITON

TENSOR_DESCRIPTORS = False
WARP_SPECIALIZE = False
if HAVE_TRITON:
    import triton
    import triton.language as tl

    TENSOR_DESCRIPTORS = hasattr(tl, "make_tensor_descriptor") and hasattr(triton, "set_allocator")
    try:
        WARP_SPECIALIZE = TENSOR_DESCRIPTORS and "warp_specialize" in inspect.signature(tl.range).parameters
    except (TypeError, ValueError):  # a signature inspect cannot read: take the loop without it
        WARP_SPECIALIZE = False

if TENSOR_DESCRIPTORS:
    from ...triton_utils import (key_block, load_rows, load_tile, mm, mma, query_block, store_tile,
                                tile_logits, visible_keys, visible_queries)
    from .triton_kernels import (LOG2E, key_terms, scores, softmax_bwd_dkdv_kernel, softmax_bwd_dq_kernel,
                                 softmax_fwd_kernel)

    @triton.jit
    def hopper_logits(q, k, offs_m, offs_n, qi_at, Nq, Nk, qk_scale, MASK, smm, smn, PREF, spn,
                      L2: tl.constexpr, MASK_KIND: tl.constexpr, MASK_SHAPE: tl.constexpr, HAS_PREF: tl.constexpr,
                      CAUSAL: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, EDGE: tl.constexpr):
        """(BLOCK_M, BLOCK_N) log2-unit logits of one tile: triton_kernels.scores without the T5 bias (its
        pointers are never read with HAS_T5 False; k arrives zero-filled past Nk, so only the logits need
        the bounds)."""
        s, _ = scores(q, k, offs_m, offs_n, qi_at, Nq, Nk, qk_scale, MASK, smm, smn, PREF, spn, PREF, 0, PREF,
                      0.0, 0.0, 0, 0, L2, MASK_KIND, MASK_SHAPE, HAS_PREF, False, CAUSAL, EDGE, UPCAST, PRECISION,
                      False, False, False)  # no softcap, sinks or window in the Hopper rows
        return s

    @triton.jit
    def hopper_fwd_step(acc, l_i, m_i, q, k_desc, v_desc, start_n, offs_m, qi_at, Nq, Nk, qk_scale,
                        MASK, smm, smn, PREF, spn,
                        BLOCK_N: tl.constexpr, L2: tl.constexpr, MASK_KIND: tl.constexpr, MASK_SHAPE: tl.constexpr,
                        HAS_PREF: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr,
                        PRECISION: tl.constexpr, EDGE: tl.constexpr):
        """One key block of the online softmax (base 2): the classic fwd_stage's body with K / V from
        the descriptors."""
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = k_desc.load([start_n, 0])
        v = v_desc.load([start_n, 0])
        s = hopper_logits(q, k, offs_m, offs_n, qi_at, Nq, Nk, qk_scale, MASK, smm, smn, PREF, spn,
                          L2, MASK_KIND, MASK_SHAPE, HAS_PREF, CAUSAL, UPCAST, PRECISION, EDGE)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet: exp2(-inf) = 0
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = mma(p.to(v.dtype), v, acc * alpha[:, None], UPCAST, PRECISION)
        return acc, l_i, m_new

    @triton.jit
    def hopper_fwd_stage(acc, l_i, m_i, q, k_desc, v_desc, lo, hi, offs_m, qi_at, Nq, Nk, qk_scale,
                         MASK, smm, smn, PREF, spn,
                         BLOCK_N: tl.constexpr, L2: tl.constexpr, MASK_KIND: tl.constexpr, MASK_SHAPE: tl.constexpr,
                         HAS_PREF: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr,
                         PRECISION: tl.constexpr, EDGE: tl.constexpr, WARP_SPEC: tl.constexpr):
        """The key blocks [lo, hi); the warp-specialised loop is a separate branch so that a Triton
        without the keyword never compiles it (WARP_SPEC is only offered where it exists)."""
        if WARP_SPEC:
            for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=True):
                acc, l_i, m_i = hopper_fwd_step(acc, l_i, m_i, q, k_desc, v_desc, start_n, offs_m, qi_at, Nq, Nk,
                                                qk_scale, MASK, smm, smn, PREF, spn, BLOCK_N, L2, MASK_KIND,
                                                MASK_SHAPE, HAS_PREF, CAUSAL, UPCAST, PRECISION, EDGE)
        else:
            for start_n in tl.range(lo, hi, BLOCK_N):
                acc, l_i, m_i = hopper_fwd_step(acc, l_i, m_i, q, k_desc, v_desc, start_n, offs_m, qi_at, Nq, Nk,
                                                qk_scale, MASK, smm, smn, PREF, spn, BLOCK_N, L2, MASK_KIND,
                                                MASK_SHAPE, HAS_PREF, CAUSAL, UPCAST, PRECISION, EDGE)
        return acc, l_i, m_i

    @triton.jit
    def softmax_fwd_hopper(
            Q, K, V, O, LSE, MASK, PREF,
            sqb, sqh, sqm, sqd, skb, skh, skn, svb, svh, svn, sob, soh, som, sod,
            smb, smh, smm, smn, spb, sph, spn,
            H, Nq, Nk, D, DV, GROUP, scale,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
            L2: tl.constexpr, MASK_KIND: tl.constexpr, MASK_SHAPE: tl.constexpr, HAS_PREF: tl.constexpr,
            CAUSAL: tl.constexpr, HEAD_MASK: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
            WARP_SPEC: tl.constexpr):
        """The forward of one query block of one head, K / V through tensor descriptors (the host
        checked: unit last stride, 16-byte aligned base and row strides)."""
        scale = tl.cast(scale, tl.float32)
        qk_scale = scale * LOG2E
        pid_bh, b, h, start_m, offs_m, qi_at, offs_d, offs_dv = query_block(H, Nq, BLOCK_M, BLOCK_D, BLOCK_DV)
        Q += b * sqb + h * sqh
        MASK += b * smb + h * smh
        PREF += b * spb + h * sph
        # one descriptor per program over its key/value head (grouped-query attention: head h // GROUP)
        k_desc = tl.make_tensor_descriptor(K + b * skb + (h // GROUP) * skh, shape=[Nk, D], strides=[skn, 1],
                                           block_shape=[BLOCK_N, BLOCK_D])
        v_desc = tl.make_tensor_descriptor(V + b * svb + (h // GROUP) * svh, shape=[Nk, DV], strides=[svn, 1],
                                           block_shape=[BLOCK_N, BLOCK_DV])
        q = load_tile(Q, offs_m, offs_d, sqm, sqd, Nq, D, True, HEAD_MASK)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
        lo, hi = visible_keys(start_m, Nq, Nk, BLOCK_M, BLOCK_N, CAUSAL)
        acc, l_i, m_i = hopper_fwd_stage(acc, l_i, m_i, q, k_desc, v_desc, 0, lo, offs_m, qi_at, Nq, Nk, qk_scale,
                                         MASK, smm, smn, PREF, spn, BLOCK_N, L2, MASK_KIND, MASK_SHAPE, HAS_PREF,
                                         CAUSAL, UPCAST, PRECISION, False, WARP_SPEC)
        acc, l_i, m_i = hopper_fwd_stage(acc, l_i, m_i, q, k_desc, v_desc, lo, hi, offs_m, qi_at, Nq, Nk, qk_scale,
                                         MASK, smm, smn, PREF, spn, BLOCK_N, L2, MASK_KIND, MASK_SHAPE, HAS_PREF,
                                         CAUSAL, UPCAST, PRECISION, True, WARP_SPEC)
        nonempty = l_i > 0.0
        out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
        lse2 = tl.where(nonempty, m_i + tl.math.log2(tl.where(nonempty, l_i, 1.0)), float("inf"))
        O += b * sob + h * soh
        store_tile(O, offs_m, offs_dv, som, sod, Nq, DV, out)
        tl.store(LSE + pid_bh * Nq + offs_m, lse2, mask=offs_m < Nq)

    @triton.jit
    def softmax_fwd_select_kernel(
            Q, K, V, O, LSE, ORES, MASK, PREF, BIAS, LUT, SEED,
            sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod,
            smb, smh, smm, smn, spb, sph, spn, slut, sbh,
            H, Nq, Nk, D, DV, GROUP, tune_nq, tune_nk, scale, dropout_p,
            SINKS, softcap, win_left, win_right,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
            L2: tl.constexpr, MASK_KIND: tl.constexpr, MASK_SHAPE: tl.constexpr, HAS_PREF: tl.constexpr,
            HAS_T5: tl.constexpr,
            CAUSAL: tl.constexpr, HEAD_MASK: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
            DROPOUT: tl.constexpr, SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr, WINDOW: tl.constexpr,
            CU_Q=None, CU_K=None, VARLEN: tl.constexpr = False, HOPPER: tl.constexpr = False,
            WARP_SPEC: tl.constexpr = False):
        """The forward the autotuner launches: the classic kernel, or (HOPPER) the descriptor variant.
        The argument list is softmax_fwd_kernel's plus HOPPER and WARP_SPEC (a test keeps them equal)."""
        if HOPPER:
            tl.static_assert(not HAS_T5 and not DROPOUT and not VARLEN,
                             "the Hopper forward computes neither T5, dropout nor packed sequences")
            tl.static_assert(not SOFTCAP and not HAS_SINKS and not WINDOW,
                             "the Hopper forward computes no softcap, sinks or window (the host declines)")
            softmax_fwd_hopper(Q, K, V, O, LSE, MASK, PREF,
                               sqb, sqh, sqm, sqd, skb, skh, skn, svb, svh, svn, sob, soh, som, sod,
                               smb, smh, smm, smn, spb, sph, spn, H, Nq, Nk, D, DV, GROUP, scale,
                               BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, L2, MASK_KIND, MASK_SHAPE, HAS_PREF,
                               CAUSAL, HEAD_MASK, UPCAST, PRECISION, WARP_SPEC)
        else:
            softmax_fwd_kernel(Q, K, V, O, LSE, ORES, MASK, PREF, BIAS, LUT, SEED,
                               sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod,
                               smb, smh, smm, smn, spb, sph, spn, slut, sbh,
                               H, Nq, Nk, D, DV, GROUP, tune_nq, tune_nk, scale, dropout_p,
                               SINKS, softcap, win_left, win_right,
                               BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, L2, MASK_KIND, MASK_SHAPE, HAS_PREF, HAS_T5,
                               CAUSAL, HEAD_MASK, UPCAST, PRECISION, DROPOUT, SOFTCAP, HAS_SINKS, WINDOW,
                               CU_Q, CU_K, VARLEN)

    # --- dQ: the backward's query-block kernel, K / V through descriptors --------------------------------

    @triton.jit
    def hopper_dq_stage(dq, q, do, lse2, delta, k_desc, v_desc, lo, hi, offs_m, qi_at, Nq, Nk, qk_scale,
                        MASK, smm, smn, PREF, spn,
                        BLOCK_N: tl.constexpr, L2: tl.constexpr, MASK_KIND: tl.constexpr, MASK_SHAPE: tl.constexpr,
                        HAS_PREF: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr,
                        PRECISION: tl.constexpr, EDGE: tl.constexpr):
        """dQ (unscaled: sum_j dS_ij k_j) over the key blocks [lo, hi): triton_kernels.dq_stage without
        dropout or T5, K / V from the descriptors."""
        for start_n in tl.range(lo, hi, BLOCK_N):
            start_n = tl.multiple_of(start_n, BLOCK_N)
            offs_n = start_n + tl.arange(0, BLOCK_N)
            k = k_desc.load([start_n, 0])
            v = v_desc.load([start_n, 0])
            s = hopper_logits(q, k, offs_m, offs_n, qi_at, Nq, Nk, qk_scale, MASK, smm, smn, PREF, spn,
                              L2, MASK_KIND, MASK_SHAPE, HAS_PREF, CAUSAL, UPCAST, PRECISION, EDGE)
            p = tl.math.exp2(s - lse2[:, None])
            dp = mm(do, tl.trans(v), UPCAST, PRECISION)
            ds = p * (dp - delta[:, None])
            dq = mma(ds.to(k.dtype), k, dq, UPCAST, PRECISION)
        return dq

    @triton.jit
    def softmax_dq_hopper(
            Q, K, V, DO, LSE, DELTA, DQ, MASK, PREF,
            sqb, sqh, sqm, sqd, skb, skh, skn, svb, svh, svn, sdob, sdoh, sdom, sdod,
            smb, smh, smm, smn, spb, sph, spn,
            H, Nq, Nk, D, DV, GROUP, scale,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
            L2: tl.constexpr, MASK_KIND: tl.constexpr, MASK_SHAPE: tl.constexpr, HAS_PREF: tl.constexpr,
            CAUSAL: tl.constexpr, HEAD_MASK: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
        """dQ of one query block of one head (softmax_bwd_dq_kernel's program), K / V through descriptors."""
        scale = tl.cast(scale, tl.float32)
        qk_scale = scale * LOG2E
        pid_bh, b, h, start_m, offs_m, qi_at, offs_d, offs_dv = query_block(H, Nq, BLOCK_M, BLOCK_D, BLOCK_DV)
        Q += b * sqb + h * sqh
        DO += b * sdob + h * sdoh
        MASK += b * smb + h * smh
        PREF += b * spb + h * sph
        k_desc = tl.make_tensor_descriptor(K + b * skb + (h // GROUP) * skh, shape=[Nk, D], strides=[skn, 1],
                                           block_shape=[BLOCK_N, BLOCK_D])
        v_desc = tl.make_tensor_descriptor(V + b * svb + (h // GROUP) * svh, shape=[Nk, DV], strides=[svn, 1],
                                           block_shape=[BLOCK_N, BLOCK_DV])
        q = load_tile(Q, offs_m, offs_d, sqm, sqd, Nq, D, True, HEAD_MASK)
        do = load_tile(DO, offs_m, offs_dv, sdom, sdod, Nq, DV, True, HEAD_MASK)
        lse2 = load_rows(LSE + pid_bh * Nq, offs_m, Nq, float("inf"), True)
        delta = load_rows(DELTA + pid_bh * Nq, offs_m, Nq, 0.0, True)
        dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        lo, hi = visible_keys(start_m, Nq, Nk, BLOCK_M, BLOCK_N, CAUSAL)
        dq = hopper_dq_stage(dq, q, do, lse2, delta, k_desc, v_desc, 0, lo, offs_m, qi_at, Nq, Nk, qk_scale,
                             MASK, smm, smn, PREF, spn, BLOCK_N, L2, MASK_KIND, MASK_SHAPE, HAS_PREF, CAUSAL,
                             UPCAST, PRECISION, False)
        dq = hopper_dq_stage(dq, q, do, lse2, delta, k_desc, v_desc, lo, hi, offs_m, qi_at, Nq, Nk, qk_scale,
                             MASK, smm, smn, PREF, spn, BLOCK_N, L2, MASK_KIND, MASK_SHAPE, HAS_PREF, CAUSAL,
                             UPCAST, PRECISION, True)
        if L2:
            dq = (2.0 * scale) * dq
        else:
            dq = scale * dq
        DQ += pid_bh * Nq * D  # contiguous (B, H, Nq, D)
        store_tile(DQ, offs_m, offs_d, D, 1, Nq, D, dq)

    @triton.jit
    def softmax_dq_select_kernel(
            Q, K, V, DO, LSE, DELTA, DQ, MASK, PREF, BIAS, LUT, SEED,
            sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sdob, sdoh, sdom, sdod,
            smb, smh, smm, smn, spb, sph, spn, slut, sbh,
            H, Nq, Nk, D, DV, GROUP, tune_nq, tune_nk, scale, dropout_p,
            SINKS, softcap, win_left, win_right,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
            L2: tl.constexpr, MASK_KIND: tl.constexpr, MASK_SHAPE: tl.constexpr, HAS_PREF: tl.constexpr,
            HAS_T5: tl.constexpr,
            CAUSAL: tl.constexpr, HEAD_MASK: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
            DROPOUT: tl.constexpr, SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr, WINDOW: tl.constexpr,
            CU_Q=None, CU_K=None, VARLEN: tl.constexpr = False, HOPPER: tl.constexpr = False):
        """The dQ launch the autotuner runs: softmax_bwd_dq_kernel, or (HOPPER) the descriptor variant.
        The argument list is softmax_bwd_dq_kernel's plus HOPPER (a test keeps them equal)."""
        if HOPPER:
            tl.static_assert(not HAS_T5 and not DROPOUT and not VARLEN,
                             "the Hopper dQ computes neither T5, dropout nor packed sequences")
            tl.static_assert(not SOFTCAP and not HAS_SINKS and not WINDOW,
                             "the Hopper dQ computes no softcap, sinks or window (the host declines)")
            softmax_dq_hopper(Q, K, V, DO, LSE, DELTA, DQ, MASK, PREF,
                              sqb, sqh, sqm, sqd, skb, skh, skn, svb, svh, svn, sdob, sdoh, sdom, sdod,
                              smb, smh, smm, smn, spb, sph, spn, H, Nq, Nk, D, DV, GROUP, scale,
                              BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, L2, MASK_KIND, MASK_SHAPE, HAS_PREF,
                              CAUSAL, HEAD_MASK, UPCAST, PRECISION)
        else:
            softmax_bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, MASK, PREF, BIAS, LUT, SEED,
                                  sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sdob, sdoh, sdom, sdod,
                                  smb, smh, smm, smn, spb, sph, spn, slut, sbh,
                                  H, Nq, Nk, D, DV, GROUP, tune_nq, tune_nk, scale, dropout_p,
                                  SINKS, softcap, win_left, win_right,
                                  BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, L2, MASK_KIND, MASK_SHAPE, HAS_PREF, HAS_T5,
                                  CAUSAL, HEAD_MASK, UPCAST, PRECISION, DROPOUT, SOFTCAP, HAS_SINKS, WINDOW,
                               CU_Q, CU_K, VARLEN)

    # --- dK / dV: the backward's key-block kernel, Q / dO through descriptors ---------------------------

    @triton.jit
    def hopper_dkdv_stage(dk, dv, ds_colsum, k, v, key_bias, q_desc, do_desc, LSE, DELTA, offs_n, kj_at, lo, hi,
                          Nq, Nk, qk_scale, MASK, smm, smn,
                          BLOCK_M: tl.constexpr, L2: tl.constexpr, MASK_KIND: tl.constexpr,
                          MASK_SHAPE: tl.constexpr, HAS_PREF: tl.constexpr, UPCAST: tl.constexpr,
                          PRECISION: tl.constexpr, CAUSAL_MASK: tl.constexpr, QUERY_BOUND: tl.constexpr):
        """dK, dV (and the column sums of dS) over the query blocks [lo, hi) on transposed (keys x
        queries) tiles: triton_kernels.dkdv_stage without dropout or T5, Q / dO from the descriptors
        (zero rows past Nq; lse = +inf there makes p = 0, so those rows add nothing)."""
        for start_m in tl.range(lo, hi, BLOCK_M):
            start_m = tl.multiple_of(start_m, BLOCK_M)
            offs_m = start_m + tl.arange(0, BLOCK_M)
            q = q_desc.load([start_m, 0])
            do = do_desc.load([start_m, 0])
            lse2 = load_rows(LSE, offs_m, Nq, float("inf"), QUERY_BOUND)
            delta = load_rows(DELTA, offs_m, Nq, 0.0, QUERY_BOUND)
            if QUERY_BOUND:
                qi_at = tl.minimum(offs_m, Nq - 1)
            else:
                qi_at = offs_m
            if L2:
                s = mm(k, tl.trans(q), UPCAST, PRECISION) * (2.0 * qk_scale)
            else:
                s = mm(k, tl.trans(q), UPCAST, PRECISION) * qk_scale
            if L2 or HAS_PREF:
                s = s + key_bias[:, None]  # also -inf for keys past Nk
            s = tile_logits(s, offs_m[None, :], offs_n[:, None], qi_at[None, :], kj_at[:, None], Nq, Nk,
                            MASK, smm, smn, LOG2E, MASK_KIND, MASK_SHAPE, CAUSAL_MASK, False)
            p = tl.math.exp2(s - lse2[None, :])
            dp = mm(v, tl.trans(do), UPCAST, PRECISION)
            dv = mma(p.to(do.dtype), do, dv, UPCAST, PRECISION)
            ds = p * (dp - delta[None, :])
            dk = mma(ds.to(q.dtype), q, dk, UPCAST, PRECISION)
            if L2 or HAS_PREF:
                ds_colsum += tl.sum(ds, 1)
        return dk, dv, ds_colsum

    @triton.jit
    def softmax_dkdv_hopper(
            Q, K, V, DO, LSE, DELTA, DK, DV_OUT, DPREF, MASK, PREF,
            sqb, sqh, sqm, skb, skh, skn, skd, svb, svh, svn, svd, sdob, sdoh, sdom,
            smb, smh, smm, smn, spb, sph, spn,
            H, Nq, Nk, D, DV, GROUP, scale,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
            L2: tl.constexpr, MASK_KIND: tl.constexpr, MASK_SHAPE: tl.constexpr, HAS_PREF: tl.constexpr,
            CAUSAL: tl.constexpr, HEAD_MASK: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
        """dK, dV of one key block of one key/value head (softmax_bwd_dkdv_kernel's program: it walks the
        GROUP query heads sharing the head), Q and dO streamed through descriptors (the host checked: unit
        last stride, 16-byte aligned base and row strides). K / V are loaded once with plain pointers."""
        scale = tl.cast(scale, tl.float32)
        qk_scale = scale * LOG2E
        H_kv = H // GROUP
        pid_bkv, b, h_kv, start_n, offs_n, kj_at, offs_d, offs_dv = key_block(H_kv, Nk, BLOCK_N, BLOCK_D, BLOCK_DV)
        # the resident key block through descriptors as well (zero past Nk and D): a TMA copy lands in
        # shared memory, where the wgmma reads it, instead of two tiles held in registers all along
        k = tl.make_tensor_descriptor(K + b * skb + h_kv * skh, shape=[Nk, D], strides=[skn, 1],
                                      block_shape=[BLOCK_N, BLOCK_D]).load([start_n, 0])
        v = tl.make_tensor_descriptor(V + b * svb + h_kv * svh, shape=[Nk, DV], strides=[svn, 1],
                                      block_shape=[BLOCK_N, BLOCK_DV]).load([start_n, 0])
        dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
        colsum = tl.zeros([BLOCK_N], tl.float32)  # sum of dS over every query of the group (L2's dK term)
        first, mid, full = visible_queries(start_n, Nq, Nk, BLOCK_M, BLOCK_N, CAUSAL)
        for g in range(0, GROUP):
            h = h_kv * GROUP + g
            pid_bh = b * H + h
            # one descriptor pair per query head (device-side: a few instructions each)
            q_desc = tl.make_tensor_descriptor(Q + b * sqb + h * sqh, shape=[Nq, D], strides=[sqm, 1],
                                               block_shape=[BLOCK_M, BLOCK_D])
            do_desc = tl.make_tensor_descriptor(DO + b * sdob + h * sdoh, shape=[Nq, DV], strides=[sdom, 1],
                                                block_shape=[BLOCK_M, BLOCK_DV])
            MASKh = MASK + b * smb + h * smh
            LSEh = LSE + pid_bh * Nq
            DELTAh = DELTA + pid_bh * Nq
            key_bias = key_terms(k, offs_n, Nk, PREF + b * spb + h * sph, spn, qk_scale, L2, HAS_PREF, True)
            ds_colsum = tl.zeros([BLOCK_N], tl.float32)
            if CAUSAL:  # diagonal blocks: causal masking
                dk, dv, ds_colsum = hopper_dkdv_stage(
                    dk, dv, ds_colsum, k, v, key_bias, q_desc, do_desc, LSEh, DELTAh, offs_n, kj_at, first, mid,
                    Nq, Nk, qk_scale, MASKh, smm, smn, BLOCK_M, L2, MASK_KIND, MASK_SHAPE, HAS_PREF, UPCAST,
                    PRECISION, True, False)
            dk, dv, ds_colsum = hopper_dkdv_stage(  # whole query blocks that see every key of the block
                dk, dv, ds_colsum, k, v, key_bias, q_desc, do_desc, LSEh, DELTAh, offs_n, kj_at, mid, full,
                Nq, Nk, qk_scale, MASKh, smm, smn, BLOCK_M, L2, MASK_KIND, MASK_SHAPE, HAS_PREF, UPCAST,
                PRECISION, False, False)
            dk, dv, ds_colsum = hopper_dkdv_stage(  # the partial last query block
                dk, dv, ds_colsum, k, v, key_bias, q_desc, do_desc, LSEh, DELTAh, offs_n, kj_at, full, Nq,
                Nq, Nk, qk_scale, MASKh, smm, smn, BLOCK_M, L2, MASK_KIND, MASK_SHAPE, HAS_PREF, UPCAST,
                PRECISION, CAUSAL, True)
            if HAS_PREF:  # the preference is the query head's own: its gradient too
                tl.store(DPREF + pid_bh * Nk + offs_n, ds_colsum, mask=offs_n < Nk)
            colsum += ds_colsum
        if L2:
            dk = 2.0 * scale * (dk - k.to(tl.float32) * colsum[:, None])
        else:
            dk = scale * dk
        DK += pid_bkv * Nk * D  # contiguous (B, H_kv, N, D)
        DV_OUT += pid_bkv * Nk * DV
        store_tile(DK, offs_n, offs_d, D, 1, Nk, D, dk)
        store_tile(DV_OUT, offs_n, offs_dv, DV, 1, Nk, DV, dv)

    @triton.jit
    def softmax_dkdv_select_kernel(
            Q, K, V, DO, LSE, DELTA, DK, DV_OUT, DPREF, DTABLE, MASK, PREF, BIAS, LUT, SEED,
            sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sdob, sdoh, sdom, sdod,
            smb, smh, smm, smn, spb, sph, spn, slut, sbh,
            H, Nq, Nk, D, DV, GROUP, tune_nq, tune_nk, scale, dropout_p,
            SINKS, softcap, win_left, win_right,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
            L2: tl.constexpr, MASK_KIND: tl.constexpr, MASK_SHAPE: tl.constexpr, HAS_PREF: tl.constexpr,
            HAS_T5: tl.constexpr,
            CAUSAL: tl.constexpr, HEAD_MASK: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
            DROPOUT: tl.constexpr, BUCKETS: tl.constexpr, SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
            WINDOW: tl.constexpr, CU_Q=None, CU_K=None, VARLEN: tl.constexpr = False, HOPPER: tl.constexpr = False):
        """The dK/dV launch the autotuner runs: softmax_bwd_dkdv_kernel, or (HOPPER) the descriptor variant.
        The argument list is softmax_bwd_dkdv_kernel's plus HOPPER (a test keeps them equal)."""
        if HOPPER:
            tl.static_assert(not HAS_T5 and not DROPOUT and not VARLEN,
                             "the Hopper dK/dV computes neither T5, dropout nor packed sequences")
            tl.static_assert(not SOFTCAP and not HAS_SINKS and not WINDOW,
                             "the Hopper dK/dV computes no softcap, sinks or window (the host declines)")
            softmax_dkdv_hopper(Q, K, V, DO, LSE, DELTA, DK, DV_OUT, DPREF, MASK, PREF,
                                sqb, sqh, sqm, skb, skh, skn, skd, svb, svh, svn, svd, sdob, sdoh, sdom,
                                smb, smh, smm, smn, spb, sph, spn, H, Nq, Nk, D, DV, GROUP, scale,
                                BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, L2, MASK_KIND, MASK_SHAPE, HAS_PREF,
                                CAUSAL, HEAD_MASK, UPCAST, PRECISION)
        else:
            softmax_bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV_OUT, DPREF, DTABLE, MASK, PREF, BIAS, LUT, SEED,
                                    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sdob, sdoh, sdom,
                                    sdod, smb, smh, smm, smn, spb, sph, spn, slut, sbh,
                                    H, Nq, Nk, D, DV, GROUP, tune_nq, tune_nk, scale, dropout_p,
                                    SINKS, softcap, win_left, win_right,
                                    BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, L2, MASK_KIND, MASK_SHAPE, HAS_PREF, HAS_T5,
                                    CAUSAL, HEAD_MASK, UPCAST, PRECISION, DROPOUT, BUCKETS, SOFTCAP, HAS_SINKS,
                                    WINDOW, CU_Q, CU_K, VARLEN)
