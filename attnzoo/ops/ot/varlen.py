"""Packed (varlen) OT attention on the Triton kernels: every sequence of a packed call in one launch set,
each sequence its own transport problem (``ops/varlen.py``'s layout and semantics; the route there
reaches this through ``ops/varlen_triton.py``).

Sequence s's template set A is its own keys, its mass u uniform over them, gamma the call's (default
sqrt(D)): out_i = sum_{t in A_s} v_t sum_{j in A_s} (1 / n_k) softmax_{t in A_s}((alpha q_i.k_t + k_j.k_t) /
gamma) (paper 004 eq 22), causal bottom-right inside each sequence (key j for query i iff j <= i + n_k - n_q).

Layout. The kernels of triton_kernels.py run with their VARLEN flag: a pair index is a (sequence, head)
pair, the size arguments are max_q and max_k, and each program reads its sequence's n_q, n_k from the
offsets at its entry and returns when its tile lies past them, so no tile crossing a sequence's end is
computed and the offsets are never read on the host (torch.compile takes them as tensors, max_q / max_k
as ints). The inputs are gathered into one zero-padded (N * H, max, D) block per (sequence, head) pair
first (device ops: a scatter, the grouped key heads repeated), because the kernels' temporaries (EC, EG,
R, BAD, and the backward's EDW, RG, dC, dG) and the backward's dq, dk, d a_k matmuls (triton.py) are laid
out per pair with the maxima: N H (max_q + max_k) max_k + N H max_q max_k elements per chunk of pairs
(triton.CHUNK_BYTES bounds a chunk, counted in (sequence, head) pairs), against the sum over sequences of
(n_q + n_k) n_k + n_q n_k that exact per-sequence blocks would take. The work (tiles computed) is per
sequence; the memory is that of the padded batch. The outputs are gathered back to packed order.

Not here (the route returns None and the sequences run per length through ``attnzoo.functional.ot``):
extra templates (``templates_k`` / ``templates_v``: per batch entry, which a packed call does not have),
``log_u``, dropout, ``window_size``, ``softcap`` and ``sinks`` (refused by the variant there, with its
reason), float64 and the other dtypes and head dims the dense Triton backend refuses
(``triton.supports_ot_triton``).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .. import dispatch, logit_extras
from .. import validate as V
from ..triton_utils import HAVE_TRITON, kernel_op, tracing_only
from ..varlen import _token_index as token_index
from .functional import check as check_options
from .triton import backward_chunks, forward_chunks, supports_ot_triton

# the options a packed call of the kernels takes; any other (log_u, templates, an unknown name) -> None
_OPTIONS = ("alpha", "gamma")


def _pad(t: Tensor, cu: Tensor, longest: int, heads: int) -> Tensor:
    """Packed (T, H_t, D) -> (N * heads, longest, D): sequence s's rows at the front of its pairs'
    blocks, zeros after; a key head shared by heads // H_t query heads repeated for each of them."""
    n_seq = cu.shape[0] - 1
    seq, pos = token_index(cu, t.shape[0])
    blocks = t.new_zeros((n_seq, longest) + tuple(t.shape[1:])).index_put((seq, pos), t)  # (N, longest, H_t, D)
    if t.shape[1] != heads:
        blocks = blocks.repeat_interleave(heads // t.shape[1], dim=2)
    # contiguous: the kernels read rows D apart, blocks longest * D apart (for N = 1 reshape is a strided view)
    return blocks.transpose(1, 2).reshape(n_seq * heads, longest, t.shape[2]).contiguous()


def _unpad(blocks: Tensor, cu: Tensor, total: int, heads: int) -> Tensor:
    """(N * heads, longest, D) per-pair blocks -> packed (total, heads, D), the rows past each
    sequence's end dropped."""
    seq, pos = token_index(cu, total)
    return blocks.view(-1, heads, blocks.shape[1], blocks.shape[2]).transpose(1, 2)[seq, pos]


if HAVE_TRITON:
    @kernel_op("attnzoo::ot_gemm_varlen_fwd", mutates_args=())
    def ot_gemm_varlen_fwd(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, heads: int, causal: bool,
                           sc: float, sg: float) -> Tensor:
        """out (N * H, max_q, Dv) in q's dtype (rows past a sequence's end unwritten) of q (N * H, max_q, D),
        k (N * H, max_k, D), v (N * H, max_k, Dv) in per-pair blocks (``_pad``); A = the sequence's keys."""
        n, max_q, _ = q.shape
        if tracing_only(q):
            return torch.empty((n, max_q, v.shape[2]), dtype=q.dtype, device=q.device)
        uniform = torch.zeros((n, k.shape[1]), dtype=torch.float32, device=q.device)   # log u = 0: u uniform
        return forward_chunks(q, k, k, v, uniform, None, heads, causal, sc, sg, offsets=(cu_q, cu_k))

    @kernel_op("attnzoo::ot_gemm_varlen_bwd", mutates_args=())
    def ot_gemm_varlen_bwd(dout: Tensor, out: Tensor, q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor,
                           heads: int, causal: bool, sc: float, sg: float) -> tuple[Tensor, Tensor, Tensor]:
        """(dq, dk, dv) in the blocks of q, k, v (rows past a sequence's end: garbage, never read); k's
        gradient adds its two roles, sources and templates."""
        if tracing_only(q):
            return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        uniform = torch.zeros((q.shape[0], k.shape[1]), dtype=torch.float32, device=q.device)
        dq, dk, dak, dv, _ = backward_chunks(dout, out, q, k, k, v, uniform, None, heads, causal, sc, sg, False,
                                             offsets=(cu_q, cu_k))
        return dq, dk + dak, dv

    def _setup_context(ctx, inputs, output):
        q, k, v, cu_q, cu_k, heads, causal, sc, sg = inputs
        ctx.save_for_backward(output, q, k, v, cu_q, cu_k)
        ctx.args = (heads, causal, sc, sg)

    def _backward(ctx, dout):
        out, q, k, v, cu_q, cu_k = ctx.saved_tensors
        dq, dk, dv = ot_gemm_varlen_bwd(dout.contiguous().to(out.dtype), out, q, k, v, cu_q, cu_k, *ctx.args)
        return dq, dk, dv, None, None, None, None, None, None

    ot_gemm_varlen_fwd.register_autograd(_backward, setup_context=_setup_context)


def ot_varlen_triton(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int, *,
                     is_causal: bool, alpha: float, gamma: float) -> Tensor:
    """Packed q (T_q, H, D), k (T_k, H_kv, D), v (T_k, H_kv, Dv) -> (T_q, H, Dv), each sequence's eq (22)
    (see the module). The caller (``route``) has checked the call."""
    heads = q.shape[1]
    # the kernels read offset s at cu + s: a strided view of offsets (cu[::2]) is copied
    cu_q, cu_k = (c if c.is_contiguous() else c.contiguous() for c in (cu_q, cu_k))
    blocks = ot_gemm_varlen_fwd(_pad(q, cu_q, max_q, heads), _pad(k, cu_k, max_k, heads), _pad(v, cu_k, max_k, heads),
                                cu_q, cu_k, heads, bool(is_causal), float(alpha / gamma), float(1.0 / gamma))
    return _unpad(blocks, cu_q, q.shape[0], heads)


def _declines(q, k, v, backend, dropout_p, options) -> bool:
    """Whether the packed kernels decline the call (the sequences then run per length, where the
    variant's own function checks and explains it)."""
    if not HAVE_TRITON or backend not in ("triton", dispatch.AUTO) or q.shape[1] == 0:
        return True
    if dropout_p != 0.0 or set(options) - set(_OPTIONS):
        return True
    return supports_ot_triton(q, k, v) is not None


def route(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, is_causal, kwargs: dict):
    """The packed route (ops/varlen_triton.py): the kernels above, or None for what they do not take. The
    shared arguments and alpha / gamma are checked here as the variant's function checks them."""
    options = dict(kwargs)
    backend = options.pop("backend", None) or dispatch.default_backend()
    dropout_p = options.pop("dropout_p", 0.0)
    scale, enable_gqa = options.pop("scale", None), options.pop("enable_gqa", False)
    # the defaults of the extras and of OT's own optional tensors mean "absent"
    for name, absent in (("softcap", logit_extras.check_softcap), ("window_size", logit_extras.check_window_size)):
        if name in options and absent(options[name]) is None:
            del options[name]
    for name in ("sinks", "log_u", "templates_k", "templates_v"):
        if name in options and options[name] is None:
            del options[name]
    if _declines(q, k, v, backend, dropout_p, options):
        return None
    q4, k4, v4 = (t.transpose(0, 1)[None] for t in (q, k, v))             # (1, H, T, D) views
    V.check_qkv(q4, k4, v4, V.check_flag("enable_gqa", enable_gqa))
    checked = check_options(q4, k4, v4, scale=V.resolve_scale(scale, q4), **options)
    return ot_varlen_triton(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=V.check_flag("is_causal", is_causal),
                            alpha=checked["alpha"], gamma=checked["gamma"])
