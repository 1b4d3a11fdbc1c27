"""attnzoo.functional: one function per attention variant, laid out like
``F.scaled_dot_product_attention``: q (B, H, Nq, D), k (B, H, Nk, D), v (B, H, Nk, Dv) ->
(B, H, Nq, Dv).

Shared arguments: ``attn_mask`` (bool, True = take part, or float added to the logits; broadcastable
to (B, H, Nq, Nk)), ``is_causal`` (key j takes part for query i when j <= i + Nk - Nq: bottom-right
aligned, see ``ops.masking.causal_keep``), ``scale`` (default 1/sqrt(D)), ``dropout_p`` (on the
attention weights, like SDPA: pass 0 at eval) and ``backend`` (``"auto"`` by default, see
``attnzoo.explain``). A query row left with no key returns zeros. The math of each variant lives in
``attnzoo/ops/<variant>/reference.py``; faster kernels register themselves as backends.

Masks, biases and preferences of fewer than 4 dims are read as broadcast from the right (like
SDPA) and handed to every backend as 4-D views (no copy). A float mask, ``log_u`` or a tensor
``bias`` holding NaN or +inf is a ValueError naming the argument (checked in eager mode on CPU
tensors; see ``ops/validate.py`` for why not on CUDA by default). NaN in q, k or v propagates to
the output rows it takes part in. A batch or head count of 0 gives an empty output.
"""
from __future__ import annotations


import torch

from .ops import dispatch
from .ops import validate as V
from .ops.fenchel.reference import SOLVES, fenchel_attention
from .ops.l2.reference import l2_attention
from .ops.linear.reference import FEATURE_MAPS, linear_attention
from .ops.masking import propagate_query_nan
from .ops.ot.reference import ot_attention
from .ops.pointwise.reference import relu_attention, sigmoid_attention
from .ops.sinkhorn.reference import sinkhorn_attention
from .ops.softmax.reference import softmax_attention

_REFERENCES = {
    "softmax": softmax_attention,
    "l2": l2_attention,
    "sinkhorn": sinkhorn_attention,
    "sigmoid": sigmoid_attention,
    "relu": relu_attention,
    "linear": linear_attention,
    "fenchel": fenchel_attention,
    "ot": ot_attention,
}
for _name, _fn in _REFERENCES.items():
    dispatch.register_backend(_name, "reference", _fn, priority=0,
                              description="eager PyTorch, materialises the N x N weights (the ground truth)")


def _common(q, k, v, attn_mask, is_causal, scale, dropout_p, default_scale=None):
    """Checks shared by every variant: (attn_mask as a 4-D view, is_causal, scale, dropout_p)."""
    V.check_qkv(q, k, v)
    V.check_mask(attn_mask, q, k)
    V.check_values("attn_mask", attn_mask)
    return (V.as_4d(attn_mask), V.check_flag("is_causal", is_causal), V.resolve_scale(scale, q, default_scale),
            V.check_dropout(dropout_p))


# SDPA's fused CPU kernel returns a zero row for a query holding NaN (its running max skips NaN
# scores); attnzoo's rule is that NaN in q reaches the output row of that query, on every backend.
# On CUDA the repair would cost a pass over q and the output per call; whether cuDNN/FlashAttention
# keep the NaN is checked by benchmarks/gpu_speed.py's correctness pass ("nan-query" rows).
_HIDES_QUERY_NAN = {("softmax", "torch"), ("l2", "torch"), ("fenchel", "torch")}
_HIDES_QUERY_NAN_DEVICES = ("cpu",)


def _run(variant, backend, q, k, v, **kw):
    choice = dispatch.choose(variant, backend, q, k, v, **kw)  # an unknown or refusing backend raises here
    if q.shape[0] == 0 or q.shape[1] == 0:  # no (batch, head) pair: nothing to attend, no kernel to launch
        return _empty_output(q, k, v)
    out = choice.backend.fn(q, k, v, **kw)
    if (variant, choice.backend.name) in _HIDES_QUERY_NAN and q.device.type in _HIDES_QUERY_NAN_DEVICES:
        out = propagate_query_nan(out, q)
    return out


def _empty_output(q, k, v):
    """The (B, H, Nq, Dv) output when B * H == 0, attached to the graph of q, k, v (its gradients are
    the empty zeros autograd expects)."""
    out = torch.zeros(q.shape[:3] + (v.shape[3],), dtype=q.dtype, device=q.device)
    return out + (q.sum() + k.sum() + v.sum()) * 0  # sums over no elements: 0


def softmax(q, k, v, attn_mask=None, is_causal=False, scale=None, *, dropout_p=0.0, backend=None):
    """softmax_j(scale * q_i . k_j) v_j."""
    attn_mask, is_causal, scale, dropout_p = _common(q, k, v, attn_mask, is_causal, scale, dropout_p)
    return _run("softmax", backend, q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                scale=scale, dropout_p=dropout_p)


def l2(q, k, v, attn_mask=None, is_causal=False, scale=None, *, dropout_p=0.0, backend=None):
    """softmax_j(-scale * ||q_i - k_j||^2) v_j (paper 002 sec 2.3; Kim et al. 2021)."""
    attn_mask, is_causal, scale, dropout_p = _common(q, k, v, attn_mask, is_causal, scale, dropout_p)
    return _run("l2", backend, q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                scale=scale, dropout_p=dropout_p)


def sinkhorn(q, k, v, attn_mask=None, is_causal=False, scale=None, *, n_iters=3, eps=1.0, cost="l2",
             dropout_p=0.0, backend=None):
    """Log-domain Sinkhorn on exp(-scale ||q_i - k_j||^2 / (2 eps)) (cost="dot": exp(s_ij / eps)),
    n_iters (row, column) rounds then a final row normalisation (paper 002 sec 2.4)."""
    attn_mask, is_causal, scale, dropout_p = _common(q, k, v, attn_mask, is_causal, scale, dropout_p)
    if isinstance(n_iters, bool) or not isinstance(n_iters, int) or n_iters < 0:
        raise ValueError(f"n_iters must be an int >= 0, got {n_iters!r}")
    eps = V.check_positive("eps", eps)
    V.check_choice("cost", cost, ("l2", "dot"))
    return _run("sinkhorn", backend, q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                n_iters=n_iters, eps=eps, cost=cost, dropout_p=dropout_p)


def sigmoid(q, k, v, attn_mask=None, is_causal=False, scale=None, *, bias=None, dropout_p=0.0, backend=None):
    """sum_j sigmoid(s_ij + b) v_j with b = -log(n_i) by default (n_i = keys taking part in row i);
    ``bias``: a real number or a float tensor broadcastable to (B, H, Nq, Nk)."""
    attn_mask, is_causal, scale, dropout_p = _common(q, k, v, attn_mask, is_causal, scale, dropout_p)
    if bias is not None:
        if isinstance(bias, torch.Tensor):
            V.check_broadcast("bias", bias, (q.shape[0], q.shape[1], q.shape[2], k.shape[2]), q, allow_bool=False)
            V.check_values("bias", bias, what="-inf (weight 0) but no NaN or +inf")
            bias = V.as_4d(bias)
        else:
            bias = V.check_real("bias", bias)
            if not V.is_finite(bias):
                raise ValueError(f"bias must be finite, got {bias}")
    return _run("sigmoid", backend, q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                bias=bias, dropout_p=dropout_p)


def relu(q, k, v, attn_mask=None, is_causal=False, scale=None, *, dropout_p=0.0, backend=None):
    """sum_j relu(s_ij) v_j / n_i (n_i = keys taking part in row i, Nk without a mask)."""
    attn_mask, is_causal, scale, dropout_p = _common(q, k, v, attn_mask, is_causal, scale, dropout_p)
    return _run("relu", backend, q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                dropout_p=dropout_p)


def linear(q, k, v, attn_mask=None, is_causal=False, scale=None, *, feature_map="elu", dropout_p=0.0,
           backend=None):
    """phi(q_i) . sum_j phi(k_j) v_j^T / (phi(q_i) . sum_j phi(k_j) + 1e-6), phi = elu + 1;
    feature_map="identity": (1/n_i) sum_j (q_i . k_j) v_j. scale defaults to 1 here (no logits)."""
    attn_mask, is_causal, scale, dropout_p = _common(q, k, v, attn_mask, is_causal, scale, dropout_p,
                                                     default_scale=1.0)
    V.check_choice("feature_map", feature_map, FEATURE_MAPS)
    return _run("linear", backend, q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                feature_map=feature_map, dropout_p=dropout_p)


def fenchel(q, k, v, attn_mask=None, is_causal=False, scale=None, *, log_u=None, alpha=1.0,
            solve="first_order", dropout_p=0.0, backend=None):
    """Paper 004 eq (16): weights proportional to u_ij exp(alpha s_ij), u = exp(log_u)
    (broadcastable to (B, H, Nq, Nk), -inf = masked); solve="second_order" uses eq (13),
    solve="exact" maximises the dual (7) per query."""
    attn_mask, is_causal, scale, dropout_p = _common(q, k, v, attn_mask, is_causal, scale, dropout_p)
    V.check_broadcast("log_u", log_u, (q.shape[0], q.shape[1], q.shape[2], k.shape[2]), q, allow_bool=False)
    V.check_values("log_u", log_u)
    log_u = V.as_4d(log_u)
    alpha = V.check_positive("alpha", alpha)
    V.check_choice("solve", solve, SOLVES)
    return _run("fenchel", backend, q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                log_u=log_u, alpha=alpha, solve=solve, dropout_p=dropout_p)


def ot(q, k, v, attn_mask=None, is_causal=False, scale=None, *, alpha=1.0, gamma=None, log_u=None,
       templates_k=None, templates_v=None, dropout_p=0.0, backend=None):
    """Paper 004 eq (22) with M(a, b) = -a.b + C:
    out_i = sum_{t in A} v_t sum_{j in T} u_j softmax_{t in A}((alpha q_i.k_t + k_j.k_t) / gamma);
    gamma defaults to 1/scale = sqrt(D); templates_k (B, H, M, D) / templates_v (B, H, M, Dv) extend A."""
    attn_mask, is_causal, scale, dropout_p = _common(q, k, v, attn_mask, is_causal, scale, dropout_p)
    B, H, _, D = q.shape
    V.check_broadcast("log_u", log_u, (B, H, k.shape[2]), q, allow_bool=False)
    V.check_values("log_u", log_u)
    if log_u is not None and log_u.dim() < 3:  # (B|1, H|1, Nk) view
        log_u = log_u[(None,) * (3 - log_u.dim())]
    if (templates_k is None) != (templates_v is None):
        raise ValueError("templates_k and templates_v must be given together")
    if templates_k is not None:
        for name, t, last in (("templates_k", templates_k, D), ("templates_v", templates_v, v.shape[-1])):
            if not isinstance(t, torch.Tensor) or t.dim() != 4 or t.shape[0] != B or t.shape[1] != H or t.shape[3] != last:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"{name} must have shape (B={B}, H={H}, M, {last}), got {got}")
            if t.dtype != q.dtype or t.device != q.device:
                raise TypeError(f"{name} must match q's dtype/device ({q.dtype}, {q.device}), got ({t.dtype}, {t.device})")
        if templates_k.shape[2] != templates_v.shape[2]:
            raise ValueError(f"templates_k and templates_v must hold the same number M of templates, got "
                             f"{templates_k.shape[2]} and {templates_v.shape[2]}")
    alpha = V.check_positive("alpha", alpha)
    if gamma is None and scale == 0:
        raise ValueError("scale must be nonzero for ot when gamma is not given (gamma defaults to 1/scale)")
    gamma = 1.0 / scale if gamma is None else V.check_positive("gamma", gamma)
    if not gamma > 0:
        raise ValueError(f"gamma must be > 0 (it defaults to 1/scale), got scale={scale}")
    return _run("ot", backend, q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                alpha=alpha, gamma=gamma, log_u=log_u, templates_k=templates_k, templates_v=templates_v,
                dropout_p=dropout_p)


VARIANT_FUNCTIONS = {
    "softmax": softmax, "l2": l2, "sinkhorn": sinkhorn, "sigmoid": sigmoid, "relu": relu,
    "linear": linear, "fenchel": fenchel, "ot": ot,
}


def masked(q, k, v, attn_mask=None, scale=None, *, kind="softmax", **kwargs):
    """Causal (masked) attention with any kernel: ``kind``'s function with is_causal=True."""
    V.check_choice("kind", kind, VARIANT_FUNCTIONS)
    return VARIANT_FUNCTIONS[kind](q, k, v, attn_mask=attn_mask, is_causal=True, scale=scale, **kwargs)


def explain(variant: str, q, k, v, backend=None, **kwargs) -> dispatch.Choice:
    """Which kernel runs this call and why the others were skipped; ``print()`` it."""
    V.check_choice("variant", variant, VARIANT_FUNCTIONS)
    kwargs["attn_mask"] = V.as_4d(kwargs.get("attn_mask"))  # as the functionals hand it to the backends
    for name in ("log_u", "bias"):
        if variant in ("fenchel", "sigmoid") and isinstance(kwargs.get(name), torch.Tensor):
            kwargs[name] = V.as_4d(kwargs[name])
    kwargs.setdefault("is_causal", False)
    default_scale = 1.0 if variant == "linear" else None
    kwargs["scale"] = V.resolve_scale(kwargs.get("scale"), q, default_scale)
    kwargs.setdefault("dropout_p", 0.0)
    return dispatch.choose(variant, backend, q, k, v, **kwargs)


# fused kernels register themselves as backends of the variants above
from .ops import backends_linear_ot, backends_sinkhorn, backends_softmax_family, backends_triton_family  # noqa: E402,F401,I001
