"""Sinkhorn attention (paper 002 sec 2.4 and A.2; Sander et al. 2022): log-domain Sinkhorn on the
kernel exp(-scale ||q_i - k_j||^2 / (2 eps)), n_iters (row, column) rounds, then a final row
normalisation; causal = Sinkhorn on every prefix.

Backends:
- "cpu": blockwise PyTorch (cpu.py), O(N) memory, unrolled backward; auto on CPU from Nq * Nk >= 2^21
  on, and for every causal call. benchmarks/fused_sinkhorn.py --steady (warm, 1 thread, B*H = 4):
  about the reference's time up to N = 1024 (the reference reuses its N x N buffers there), clearly
  faster from N = 2048; its memory is always lower (1/12 at N = 2048, 1/60 at N = 4096). It computes
  ``softcap`` in every pass (forward and the unrolled backward, causal calls included), and takes
  ``window_size`` itself: a non-causal window's passes visit only the tiles that meet the band
  (O(n_iters N w)); a causal window (no mask or key padding) solves each row's window problem in
  batches (causal_window.py).
- "triton": the same passes as Triton kernels (triton.py, docs/kernels_sinkhorn.md); auto on CUDA only.
  It computes ``softcap`` in its kernels, and takes ``window_size`` itself: every pass skips the tiles
  outside the band, and a causal window solves each row's window problem in batches (causal_window.py).
- "reference" (the definition, softcap included) and the implicit backends get a window folded into the
  mask: the implicit gradient needs every row and column of a problem to keep an entry, which the batched
  windows' padding does not. The implicit backends decline softcap (their gradient is the fixed point's,
  computed on uncapped logits).
- packed calls (ops/varlen.py) with backend "triton" (or auto on CUDA): every sequence in one launch per
  pass (varlen.py); causal: prefix i of every sequence in one launch set; a window runs per length.
- "cpu_implicit", "triton_implicit": the same forward with the implicit-differentiation backward
  (gradient of the Sinkhorn fixed point); never chosen by auto, only by name.
"""
from __future__ import annotations

import functools

import torch

from .. import varlen_triton
from ..dispatch import all_of, register_backend
from ..masking import split_mask
from ..triton_utils import HAVE_TRITON
from ..catalog import declare
from ..record import Variant
from . import cpu
from .cost import FORMULA, sinkhorn_flops, sinkhorn_reference_bytes
from .functional import check, sinkhorn
from .layer import SinkhornHook
from .reference import sinkhorn_attention

if HAVE_TRITON:  # the kernels import triton at module level; the CPU backends do not need it
    from . import bound as sinkhorn_bound
    from . import triton as sinkhorn_triton
    from . import varlen as sinkhorn_varlen


def _common_reason(q, attn_mask=None, dropout_p=0.0):
    if dropout_p > 0:
        return "dropout on the transport plan needs the N x N weights (use backend='reference')"
    if attn_mask is not None and attn_mask.requires_grad:
        return "no gradient is computed for a float attn_mask (use backend='reference')"
    return None


def _cpu_supports(q, k, v, attn_mask=None, dropout_p=0.0, **_):
    return _common_reason(q, attn_mask, dropout_p)


def _triton_supports(q, k, v, attn_mask=None, dropout_p=0.0, **_):
    return sinkhorn_triton.unsupported_reason(q, attn_mask, dropout_p, v=v)


def _implicit_reason(q, k, v, attn_mask=None, is_causal=False, **_):
    """The implicit backward differentiates the fixed point where every row sums to 1 and every column
    to Nq/Nk. A query row or key column with no entry left (key padding, a fully masked row, or a
    causal prefix that does not reach a masked key) has marginals no plan can meet: the forward still
    converges, but that fixed-point identity fails and the gradient would be silently wrong."""
    if attn_mask is None:
        return None
    why = ("the implicit gradient needs every query row and key column of each Sinkhorn problem to keep an entry; "
           "this attn_mask removes {} (use backend='cpu' or 'triton', the unrolled gradient)")
    if torch.compiler.is_compiling():  # no data-dependent check while tracing: refuse what may be wrong
        return why.format("keys, or may (masks are not read while torch.compile traces)")
    keep, _ = split_mask(attn_mask, False, q.shape[2], k.shape[2], q.device)
    if keep is None:
        return None
    keep = keep.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    if is_causal:
        return None if bool(keep.all()) else why.format("entries under is_causal (each prefix is its own problem)")
    if not bool(keep.any(-1).all()):
        return why.format("every key of a query row")
    if not bool(keep.any(-2).all()):
        return why.format("a key from every query (a key column)")
    return None


AUTO_MIN_LOGITS = 1 << 21  # Nq * Nk per head from which the streaming CPU path is also faster


def _cpu_auto_prefers(q, k, v, is_causal=False, **_):
    """Consulted by auto only (naming "cpu" always runs it)."""
    if not is_causal and q.shape[-2] * k.shape[-2] < AUTO_MIN_LOGITS:
        return (f"Nq * Nk = {q.shape[-2] * k.shape[-2]} < {AUTO_MIN_LOGITS}: the eager reference was measured "
                "faster at this size (benchmarks/fused_sinkhorn.py --sweep); name backend='cpu' for O(N) memory")
    return None


def _backend(fn, grad_mode):
    @functools.wraps(fn)
    def run(q, k, v, *, attn_mask, is_causal, scale, dropout_p, n_iters=3, eps=1.0, cost="l2", **extras):
        # extras: the softcap (and window_size), passed only to a backend registered with it (dispatch declines
    # the others)
        return fn(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, dropout_p=dropout_p,
                  n_iters=n_iters, eps=eps, cost=cost, grad_mode=grad_mode, **extras)
    return run


register_backend("sinkhorn", "cpu", _backend(cpu.sinkhorn_attention, "unrolled"), _cpu_supports, priority=10,
                 auto_devices=("cpu",), auto_prefers=_cpu_auto_prefers, extras=("softcap", "window_size"),
                 description="blockwise PyTorch, O(N) memory, backward unrolled through the streaming passes")
register_backend("sinkhorn", "cpu_implicit", _backend(cpu.sinkhorn_attention, "implicit"),
                 all_of(_cpu_supports, _implicit_reason),
                 priority=1, auto_devices=(), reads_values=True,
                 description="blockwise PyTorch, O(N) memory, implicit (fixed-point) backward")
if HAVE_TRITON:
    register_backend("sinkhorn", "triton", _backend(sinkhorn_triton.sinkhorn_attention, "unrolled"),
                     _triton_supports, priority=20, auto_devices=("cuda",), specialize=sinkhorn_bound.specialize,
                     extras=("softcap", "window_size"),
                     description="Triton kernels (logsumexp passes on the tensor cores), O(N) memory, backward "
                                 "unrolled through the passes")
    register_backend("sinkhorn", "triton_implicit",
                     _backend(sinkhorn_triton.sinkhorn_attention, "implicit"),
                     all_of(_triton_supports, _implicit_reason), priority=2, auto_devices=(), reads_values=True,
                     description="Triton streaming kernels, O(N) memory, implicit (fixed-point) backward")
    # packed calls: every sequence in one launch per pass (varlen.py)
    varlen_triton.register_route("sinkhorn", sinkhorn_varlen.route)


RECORD = declare(Variant(
    name="sinkhorn", reference=sinkhorn_attention, functional=sinkhorn, check=check, hook=SinkhornHook(),
    extras=frozenset({"softcap"}),
    extras_refused={"sinks": "its rows and columns are normalised in turn, and a key with no value would need a column "
                                "marginal of its own, which the papers do not define"},
    couples_queries=True,
    complexity="O(n_iters N^2 D); causal = Sinkhorn on every prefix, O(n_iters N^3); "
               "a window of w on triton: O(n_iters N w D); causal on triton or cpu: O(n_iters N w^2 D)",
    parameters="n_iters, eps, cost", paper="paper 002 sec 2.4 and A.2; Sander et al. 2022",
    flops=sinkhorn_flops, flop_formula=FORMULA, reference_bytes=sinkhorn_reference_bytes,
))
