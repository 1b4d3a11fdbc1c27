"""Packed (varlen) linear attention on the Triton kernels: every sequence of a packed call in one launch
per kernel, its sums and causal prefixes restarting at its start (``ops/varlen.py``'s layout and
semantics; the route there reaches this through ``ops/varlen_triton.py``).

q (T_q, H, D), k and v (T_k, H_kv, .) are read in place through their strides; ``cu_seq_q`` and
``cu_seq_k`` (N + 1 offsets) are read by the kernels at their entry, never on the host, so a call costs
the sum over sequences of n_i (D Dv), never a padded N x max block. The kernels are the dense ones with
``VARLEN=True`` (triton_kernels.py, noncausal_kernels.py): a program's batch index is its sequence, k
and v's head is h // (H / H_kv) (grouped heads are read, not copied), and the buffers one row per token
(out, r_i, dq, dk, dv) are head-major (H, T, .):

- non-causal: programs per (sequence, head, head-dim tile, key range) reduce the sequence's keys into
  its S = sum_j phi(k_j) v_j^T and z = sum_j phi(k_j) (ranges of max_k split as the dense path splits
  when sequences x heads leave the GPU idle, their partial states summed), then the query blocks of
  every sequence read their own state; the backward mirrors it;
- causal: a sequence of n_q queries and n_k keys is the causal square of L = max(n_q, n_k) positions
  (bottom-right aligned: key j at position j + max(n_q - n_k, 0), query i at i + max(n_k - n_q, 0), so
  query i sees key j iff j <= i + n_k - n_q), cut into chunks; its states occupy chunks
  [(q_0 + k_0) // C + s, + cdiv(L, C)) of an (H, (T_q + T_k) // C + N, D, Dv) buffer (q_0, k_0 its
  first tokens, s its index: disjoint ranges without a host read of the lengths). The grid's chunk
  axis covers the longest sequence; programs past a sequence's end return at once.

The feature maps, the scale, the 1e-6 and the identity map's 1 / n are the dense kernels' own. Forward
and backward are the custom ops ``attnzoo::linear_varlen_fwd`` / ``_bwd`` (first order only, as the dense
ones).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .. import dispatch, logit_extras
from .. import validate as V
from ..triton_utils import HAVE_TRITON, INTERPRETED, MASK_NONE, kernel_op, launcher, stand_in, tracing_only
from . import triton_kernels as ck
from .launch import FEATURES, KERNEL_DTYPES, accumulator_dtype, device_index, flags

if HAVE_TRITON:
    import triton

    from . import noncausal as nc
    from . import noncausal_kernels as nk
    from . import triton as lt


def _heads_first(t: torch.Tensor) -> torch.Tensor:
    """(T, H, D) -> the (1, H, T, D) view the kernels' (batch, head, row) strides read."""
    return t.transpose(0, 1)[None]


def _strides(t4: torch.Tensor):
    return t4.stride(0), t4.stride(1), t4.stride(2)


def _sum_groups(g: torch.Tensor, h_kv: int) -> torch.Tensor:
    """(H, T, D) per query head -> (T, H_kv, D): the heads sharing a key head add up."""
    H, T, D = g.shape
    if H != h_kv:
        g = g.view(h_kv, H // h_kv, T, D).sum(1)
    return g.transpose(0, 1)


class _Layout:
    """What a packed call's launches share (decided once per call from shapes alone)."""

    def __init__(self, q, k, v, cu_q, cu_k, max_q, max_k, scale, feature, causal):
        self.T_q, self.H, self.D = q.shape
        self.T_k, self.H_kv, self.DV = k.shape[0], k.shape[1], v.shape[-1]
        self.group = self.H // self.H_kv
        self.n_seq = cu_q.numel() - 1
        self.cu_q, self.cu_k, self.max_q, self.max_k = cu_q, cu_k, max_q, max_k
        self.scale, self.feature, self.causal = scale, feature, causal
        self.normalised = feature != ck.FEATURE_NONE
        self.flags, self.acc = flags(q.dtype), accumulator_dtype(q.dtype)
        self.dtype, self.device = q.dtype, q.device


# ---- causal: the chunked kernels over each sequence's causal square
def _causal_config(L: _Layout):
    cfg = lt.launch_config(L.D, L.DV, L.dtype)
    chunk = cfg["states"]["CHUNK"]
    assert all(c["CHUNK"] == chunk for c in cfg.values()), "the state buffer's chunks are every kernel's"
    return cfg, chunk, (L.T_q + L.T_k) // chunk + L.n_seq


def _causal_states(L: _Layout, k4, v4, cfg, chunk_total):
    c = cfg["states"]
    state_dtype = L.dtype if L.dtype in (torch.float16, torch.bfloat16) else L.acc
    hs = torch.empty(L.H, chunk_total, L.D, L.DV, dtype=state_dtype, device=L.device)
    zs = torch.empty(L.H, chunk_total, L.D if L.normalised else 0, dtype=L.acc, device=L.device)
    absent = stand_in(k4, L.acc)
    grid = (L.n_seq * L.H * triton.cdiv(L.D, c["BK"]) * triton.cdiv(L.DV, c["BV"]),)
    launcher(ck._states_kernel)[grid](
        k4, v4, absent, absent, hs, zs, 0, L.D, L.DV, L.H, L.scale, 0, *_strides(k4), *_strides(v4),
        FEATURE=L.feature, NORMALISED=L.normalised, HAS_S0=False, MEAN_STATE=L.dtype in lt.MEAN_STATE_DTYPES,
        **L.flags, **c, CU_Q=L.cu_q, CU_K=L.cu_k, CT=chunk_total, GROUP=L.group, VARLEN=True)
    return hs, zs


def _chunks(L: _Layout, chunk: int) -> int:
    """The grid's chunk axis: the longest sequence's causal square, max(n_q, n_k) <= max(max_q, max_k)."""
    return triton.cdiv(max(L.max_q, L.max_k), chunk)


def _causal_forward(L: _Layout, q4, k4, v4):
    cfg, chunk, chunk_total = _causal_config(L)
    mode = ck.MODE_NORMALISED if L.normalised else ck.MODE_COUNT
    out = torch.empty(L.H, L.T_q, L.DV, dtype=L.dtype, device=L.device)
    rden = torch.empty(L.H, L.T_q if L.normalised else 0, dtype=L.acc, device=L.device)
    store_exact = L.normalised and L.dtype in lt.EXACT_OUT_DTYPES
    exact = torch.empty(out.shape if store_exact else (0,), dtype=L.acc, device=L.device)
    hs, zs = _causal_states(L, k4, v4, cfg, chunk_total)
    c = cfg["output"]
    grid = (L.n_seq * L.H * triton.cdiv(L.DV, c["BV"]), _chunks(L, chunk))
    launcher(ck._output_kernel)[grid](
        q4, k4, v4, hs, zs, out, exact if store_exact else out, rden, rden, 0, L.D, L.DV, L.H, L.scale, 0, 0,
        *_strides(q4), *_strides(k4), *_strides(v4), FEATURE=L.feature, MODE=mode, EPS_PER_HEAD=False,
        MEAN_STATE=L.dtype in lt.MEAN_STATE_DTYPES, STORE_EXACT=store_exact, **L.flags, **c,
        CU_Q=L.cu_q, CU_K=L.cu_k, CT=chunk_total, GROUP=L.group, TQ=L.T_q, VARLEN=True)
    return out, rden, exact


def _causal_backward(L: _Layout, q4, k4, v4, do, out, rden):
    """(dq (H, T_q, D), dk (H, T_k, D), dv (H, T_k, Dv)) per query head; ``do`` and ``out`` (H, T_q, Dv)."""
    cfg, chunk, chunk_total = _causal_config(L)
    mode = ck.MODE_NORMALISED if L.normalised else ck.MODE_COUNT
    hs, zs = _causal_states(L, k4, v4, cfg, chunk_total)
    cg = torch.empty(L.H, L.T_q if L.normalised else 0, dtype=L.acc, device=L.device)
    if L.normalised:   # c_i = -r_i dO_i . out_i is per row: the packed rows as one (H, T_q) problem
        c = cfg["grad"]
        launcher(ck._normaliser_grad_kernel)[(L.H, triton.cdiv(L.T_q, c["CHUNK"]))](
            do, out, rden, cg, L.T_q, L.DV, FP64=L.flags["FP64"], **c)
    dhs, dzs = torch.empty_like(hs), torch.empty_like(zs)
    absent = stand_in(q4, L.acc)
    c = cfg["reverse"]
    grid = (L.n_seq * L.H * triton.cdiv(L.D, c["BK"]) * triton.cdiv(L.DV, c["BV"]),)
    launcher(ck._reverse_states_kernel)[grid](
        q4, do, rden, cg, dhs, dzs, absent, absent, 0, L.D, L.DV, L.H, L.scale, 0, *_strides(q4),
        FEATURE=L.feature, MODE=mode, HAS_S0=False, **L.flags, **c,
        CU_Q=L.cu_q, CU_K=L.cu_k, CT=chunk_total, TQ=L.T_q, VARLEN=True)
    dq = torch.empty(L.H, L.T_q, L.D, dtype=L.dtype, device=L.device)
    dk = torch.empty(L.H, L.T_k, L.D, dtype=L.dtype, device=L.device)
    dv = torch.empty(L.H, L.T_k, L.DV, dtype=L.dtype, device=L.device)
    packed = dict(CU_Q=L.cu_q, CU_K=L.cu_k, CT=chunk_total, GROUP=L.group, TQ=L.T_q, TK=L.T_k, VARLEN=True)
    c = cfg["dv"]
    grid = (L.n_seq * L.H * triton.cdiv(L.DV, c["BV"]), _chunks(L, chunk))
    launcher(ck._dv_kernel)[grid](
        q4, k4, do, dhs, rden, dv, 0, L.D, L.DV, L.H, L.scale, 0, *_strides(q4), *_strides(k4),
        FEATURE=L.feature, MODE=mode, **L.flags, **c, **packed)
    c = cfg["dqk"]
    grid = (L.n_seq * L.H * triton.cdiv(L.D, c["BK"]), _chunks(L, chunk))
    launcher(ck._dqk_kernel)[grid](
        q4, k4, v4, do, hs, zs, dhs, dzs, rden, cg, dq, dk, 0, L.D, L.DV, L.H, L.scale, 0, 0,
        *_strides(q4), *_strides(k4), *_strides(v4), FEATURE=L.feature, MODE=mode,
        MEAN_STATE=L.dtype in lt.MEAN_STATE_DTYPES, **L.flags, **c, **packed)
    return dq, dk, dv


# ---- non-causal: one key state per (sequence, head), then the queries
def _noncausal_forward(L: _Layout, q4, k4, v4):
    cfg = nc.launch_config(L.D, L.DV, L.dtype)
    width = nc._width(L.D, L.DV, L.normalised, False, False)
    none = stand_in(q4, torch.uint8)
    # split into key ranges of every sequence (noncausal._splits, on max_k) when sequences x heads alone
    # leave the GPU idle; a range past a sequence's end adds a zero partial state
    state = nc._reduce(nk._keys_state_kernel, lambda part: (k4, v4, none, part, L.max_k, L.D, L.DV, L.H),
                       (*_strides(k4), *_strides(v4), 0, 0, 0), L.n_seq * L.H, L.D, width, L.max_k, {
                           **cfg["state"], "FEATURE": L.feature, "NORMALISED": L.normalised, "MASK_KIND": MASK_NONE,
                           "COUNT": False, **L.flags, "CU_K": L.cu_k, "GROUP": L.group, "VARLEN": True},
                       L.acc, L.device)
    out = torch.empty(L.H, L.T_q, L.DV, dtype=L.dtype, device=L.device)
    rden = torch.empty(L.H, L.T_q if L.normalised else 0, dtype=L.acc, device=L.device)
    c = cfg["output"]
    single_k = L.D <= c["BK"]
    block_rows = nc._block_rows(L.max_q, L.n_seq * L.H, c["BLOCK_M"], single_k)
    launcher(nk._queries_output_kernel)[(L.n_seq * L.H * triton.cdiv(L.max_q, block_rows),)](
        q4, state, out, rden if L.normalised else none, L.max_q, L.max_k, L.D, L.DV, L.H, L.scale, block_rows,
        width, *_strides(q4), FEATURE=L.feature, NORMALISED=L.normalised, MASK_KIND=MASK_NONE, COUNT=False,
        SINGLE_K=single_k, **L.flags, **c, CU_Q=L.cu_q, CU_K=L.cu_k, TQ=L.T_q, VARLEN=True)
    return out, rden, state


def _noncausal_backward(L: _Layout, q4, k4, v4, do, out, rden, state):
    cfg = nc.launch_config(L.D, L.DV, L.dtype)
    width = nc._width(L.D, L.DV, L.normalised, False, False)
    none = stand_in(q4, torch.uint8)
    dq = torch.empty(L.H, L.T_q, L.D, dtype=L.dtype, device=L.device)
    dk = torch.empty(L.H, L.T_k, L.D, dtype=L.dtype, device=L.device)
    dv = torch.empty(L.H, L.T_k, L.DV, dtype=L.dtype, device=L.device)
    dstate = nc._reduce(nk._queries_grad_kernel,
                        lambda part: (q4, do, out if L.normalised else do, rden if L.normalised else none, state,
                                      part, dq, L.max_q, L.max_k, L.D, L.DV, L.H, L.scale, width),
                        _strides(q4), L.n_seq * L.H, L.D, width, L.max_q, {
                            **cfg["dstate"], "FEATURE": L.feature, "NORMALISED": L.normalised,
                            "MASK_KIND": MASK_NONE, "COUNT": False, "WIDE_ROWS": L.dtype == torch.float16,
                            **L.flags, "CU_Q": L.cu_q, "CU_K": L.cu_k, "TQ": L.T_q, "VARLEN": True},
                        L.acc, L.device)
    c = cfg["dkv"]
    single_k = L.D <= c["BK"]
    block_rows = nc._block_rows(L.max_k, L.n_seq * L.H, c["BLOCK_N"], single_k)
    launcher(nk._keys_grad_kernel)[(L.n_seq * L.H * triton.cdiv(L.max_k, block_rows),)](
        k4, v4, none, state, dstate, dk, dv, none, L.max_k, L.D, L.DV, L.H, block_rows, width, width,
        *_strides(k4), *_strides(v4), 0, 0, 0, FEATURE=L.feature, NORMALISED=L.normalised, MASK_KIND=MASK_NONE,
        COUNT=False, MASK_GRAD=False, SINGLE_K=single_k, **L.flags, **c, CU_K=L.cu_k, GROUP=L.group, TK=L.T_k,
        VARLEN=True)
    return dq, dk, dv


# The packed form as two torch custom ops tied by register_autograd (triton_utils.kernel_op, as the dense
# ops in triton.py / noncausal.py): on a GPU torch.compile records their launches (the offsets stay
# tensors, max_q / max_k are Python ints), under the interpreter they are opaque ops; eager calls skip
# the dispatcher. q, k, v: (T, H, D) with unit column stride; cu_q, cu_k: (N + 1,) offsets.
if HAVE_TRITON:
    @kernel_op("attnzoo::linear_varlen_fwd", mutates_args=())
    def linear_varlen_fwd(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int,
                          scale: float, feature: int, causal: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(out (H, T_q, Dv) in q's dtype, r (H, T_q) (normalised maps, else (H, 0)), exact (causal, half
        inputs: out unrounded for the backward's normaliser gradient, else (0,)), state (non-causal:
        (N * H, width), each sequence's S and z; else (0,)))."""
        L = _Layout(q, k, v, cu_q, cu_k, max_q, max_k, scale, feature, causal)
        if tracing_only(q):
            exact = causal and L.normalised and L.dtype in lt.EXACT_OUT_DTYPES
            width = nc._width(L.D, L.DV, L.normalised, False, False)
            return (q.new_empty(L.H, L.T_q, L.DV), q.new_empty(L.H, L.T_q if L.normalised else 0, dtype=L.acc),
                    q.new_empty((L.H, L.T_q, L.DV) if exact else (0,), dtype=L.acc),
                    q.new_empty((0,) if causal else (L.n_seq * L.H, width), dtype=L.acc))
        q4, k4, v4 = (_heads_first(t) for t in (q, k, v))
        with torch.cuda.device(device_index(q)):   # launch on q's GPU, not the current one
            if causal:
                out, rden, exact = _causal_forward(L, q4, k4, v4)
                return out, rden, exact, q.new_empty(0, dtype=L.acc)
            out, rden, state = _noncausal_forward(L, q4, k4, v4)
            return out, rden, q.new_empty(0, dtype=L.acc), state

    @kernel_op("attnzoo::linear_varlen_bwd", mutates_args=())
    def linear_varlen_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, out: Tensor,
                          rden: Tensor, state: Tensor, max_q: int, max_k: int, scale: float, feature: int,
                          causal: bool) -> tuple[Tensor, Tensor, Tensor]:
        """(dq (H, T_q, D), dk (H, T_k, D), dv (H, T_k, Dv)), per query head, for ``do`` (H, T_q, Dv)
        contiguous in q's dtype; ``out`` the forward's (unrounded where it kept it)."""
        L = _Layout(q, k, v, cu_q, cu_k, max_q, max_k, scale, feature, causal)
        if tracing_only(q):
            return q.new_empty(L.H, L.T_q, L.D), q.new_empty(L.H, L.T_k, L.D), q.new_empty(L.H, L.T_k, L.DV)
        q4, k4, v4 = (_heads_first(t) for t in (q, k, v))
        with torch.cuda.device(device_index(q)):
            if causal:
                return _causal_backward(L, q4, k4, v4, do, out, rden)
            return _noncausal_backward(L, q4, k4, v4, do, out, rden, state)

    def _setup_context(ctx, inputs, output):
        q, k, v, cu_q, cu_k, max_q, max_k, scale, feature, causal = inputs
        out, rden, exact, state = output
        ctx.save_for_backward(q, k, v, cu_q, cu_k, exact if exact.numel() else out, rden, state)
        ctx.args = (max_q, max_k, scale, feature, causal)

    def _backward(ctx, dout, _drden, _dexact, _dstate):
        q, k, v, cu_q, cu_k, out, rden, state = ctx.saved_tensors
        if dout.dtype != q.dtype:
            dout = dout.to(q.dtype)
        dq, dk, dv = linear_varlen_bwd(dout.contiguous(), q, k, v, cu_q, cu_k, out, rden, state, *ctx.args)
        h_kv = k.shape[1]
        return (dq.transpose(0, 1), _sum_groups(dk, h_kv), _sum_groups(dv, h_kv),
                None, None, None, None, None, None, None)

    linear_varlen_fwd.register_autograd(_backward, setup_context=_setup_context)


def linear_varlen_triton(q, k, v, cu_seq_q, cu_seq_k, max_q: int, max_k: int, *, is_causal: bool, scale: float,
                         feature_map: str) -> torch.Tensor:
    """Packed linear attention -> (T_q, H, Dv); the caller has checked the layout, the offsets' shape,
    dtype and device, the heads (H a multiple of H_kv) and the options (ops/varlen.py)."""
    if q.dtype == torch.float64 and scale != 1.0:
        q, scale = q * scale, 1.0          # the kernels take scale as an fp32 scalar (as triton.py)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    # the kernels read offset s at cu + s: a strided view of offsets (cu[::2]) is copied
    cu_seq_q, cu_seq_k = (c if c.is_contiguous() else c.contiguous() for c in (cu_seq_q, cu_seq_k))
    out, *_ = linear_varlen_fwd(q, k, v, cu_seq_q, cu_seq_k, int(max_q), int(max_k), float(scale),
                                FEATURES[feature_map], bool(is_causal))
    return out.transpose(0, 1)                                          # (T_q, H, Dv)


def supports(q, backend: str, dropout_p, options: dict):
    """None when a packed call can take these kernels, else why not (the caller then runs the sequences
    per length through the variant's own function, which checks and explains the rest)."""
    if not HAVE_TRITON:
        return "triton is not installed"
    if backend not in ("triton", dispatch.AUTO):
        return f"backend {backend!r} asked for"
    if backend == dispatch.AUTO and not q.is_cuda:
        return "auto takes the Triton kernels on CUDA tensors only"
    if not q.is_cuda and not INTERPRETED:
        return "CPU tensors run the Triton kernels only under TRITON_INTERPRET=1"
    if q.dtype not in KERNEL_DTYPES:
        return f"the Triton linear kernels take float16, bfloat16, float32 or float64 inputs, got {q.dtype}"
    if dropout_p != 0.0:
        return "dropout runs on the weights of the N x N form"
    if set(options) - {"feature_map"} or options.get("feature_map", "elu") not in FEATURES:
        return "options other than a known feature_map"
    return None


def route(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, is_causal, kwargs: dict):
    """The packed route (ops/varlen_triton.py): the kernels above when ``supports`` accepts the
    call, else None. The shared arguments are checked here as the variant's function would check them."""
    options = dict(kwargs)
    backend = options.pop("backend", None) or dispatch.default_backend()
    dropout_p = options.pop("dropout_p", 0.0)
    scale, enable_gqa = options.pop("scale", None), options.pop("enable_gqa", False)
    for name, absent in (("softcap", logit_extras.check_softcap), ("window_size", logit_extras.check_window_size)):
        if name in options and absent(options[name]) is None:   # the default: nothing to compute
            del options[name]
    if options.get("sinks", 0) is None:
        del options["sinks"]
    if supports(q, backend, dropout_p, options) is not None:
        return None
    q4, k4, v4 = (_heads_first(t) for t in (q, k, v))
    V.check_qkv(q4, k4, v4, V.check_flag("enable_gqa", enable_gqa))
    return linear_varlen_triton(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k,
                                is_causal=V.check_flag("is_causal", is_causal),
                                scale=V.resolve_scale(scale, q4, default=1.0),
                                feature_map=options.get("feature_map", "elu"))
