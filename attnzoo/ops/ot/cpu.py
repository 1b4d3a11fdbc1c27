"""OT attention for CPU: the transport weights as matmuls, exact tiles where floating point needs them.

exp(C_it + G_jt) separates into exp(C_it - mc_i) * exp(G_jt - mg_j) * const_ij (mc_i, mg_j row
maxima), so with ec = exp(C - mc), eg = exp(G - mg) every sum over the template set is a matmul:

    s_ij = sum_t ec_it eg_jt                    (softmax normaliser of pair (i, j), up to const_ij)
    W    = ec * ((u / s) @ eg)
    g_ij = ((ec * dW) @ eg^T)_ij / s_ij         (= du_ij = sum_t P_ijt dW_it)
    dC   = dW * W - ec * ((u g / s) @ eg)
    dG   = eg * ((u / s)^T @ (ec * dW) - (u g / s)^T @ ec)

O(Nq Nk |A|) multiply-adds at matmul speed and O((Nq + Nk)|A| + Nq Nk) memory: the Gram term G is
query-independent and enters only through eg. The shift by the two row maxima is exact unless the
best template for pair (i, j) scores far below mc_i + mg_j; then s_ij underflows and loses digits.
Such pairs (s_ij below ``SAFE_NORMALISER``, e.g. with huge logits) are recomputed with an ordinary
per-pair max-shifted softmax by the exact blockwise path (tiles.py), which never forms the
(Nq, Nk, |A|) tensor either and skips every tile without such a pair.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..first_order import first_order_only

from .factorised import ot_attention_factorised
from .tiles import tiles_backward, tiles_forward

# s_ij >= this (about 2^-90 in fp32, 2^-900 in fp64) keeps every term that matters normal
SAFE_NORMALISER = {torch.float32: 2.0 ** -90, torch.float64: 2.0 ** -900}


def _parts(c, g):
    mc = c.amax(-1, keepdim=True)
    mc = torch.where(torch.isfinite(mc), mc, torch.zeros_like(mc))
    ec = torch.exp(c - mc)                                         # 0 for removed templates
    eg = torch.exp(g - g.amax(-1, keepdim=True))
    s = ec @ eg.transpose(-1, -2)
    empty = (ec == 0).all(-1, keepdim=True)                        # query i has no template: P = 0
    resolved = (s > SAFE_NORMALISER.get(c.dtype, 2.0 ** -90)) | empty
    inv = torch.where(resolved & ~empty, 1.0 / torch.where(resolved & ~empty, s, torch.ones_like(s)),
                      torch.zeros_like(s))
    return ec, eg, inv, ~resolved


def _forward(c, g, u):
    ec, eg, inv, unresolved = _parts(c, g)
    w = ec * ((u * inv) @ eg)
    if bool(unresolved.any()):   # inside an opaque custom op: no graph break under torch.compile
        w = w + tiles_forward(c, g, u, active=unresolved)
    return w


def _backward(dw, c, g, u):
    ec, eg, inv, unresolved = _parts(c, g)
    ecdw = ec * dw
    gij = (ecdw @ eg.transpose(-1, -2)) * inv
    coef, coef_g = u * inv, u * gij * inv
    w = ec * (coef @ eg)
    dc = dw * w - ec * (coef_g @ eg)
    dg = eg * (coef.transpose(-1, -2) @ ecdw - coef_g.transpose(-1, -2) @ ec)
    du = gij.sum(-2, keepdim=True) if u.shape[-2] == 1 else gij
    if bool(unresolved.any()):
        dc2, dg2, du2 = tiles_backward(dw, c, g, u, active=unresolved)
        if u.shape[-2] == 1:
            du2 = du2.sum(-2, keepdim=True)
        dc, dg, du = dc + dc2, dg + dg2, du + du2
    return dc, dg, du.reshape(u.shape)


# Custom ops so that torch.compile sees one opaque node (the resolution check above is a
# data-dependent branch; the tiles loop over Python ints) and differentiates it by _backward.
@torch.library.custom_op("attnzoo::ot_transport_weights", mutates_args=())
def _transport_weights_op(c: Tensor, g: Tensor, u: Tensor) -> Tensor:
    return _forward(c, g, u)


@_transport_weights_op.register_fake
def _(c, g, u):
    return torch.empty_like(c)


@torch.library.custom_op("attnzoo::ot_transport_weights_backward", mutates_args=())
def _transport_weights_backward_op(dw: Tensor, c: Tensor, g: Tensor, u: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return _backward(dw, c, g, u)


@_transport_weights_backward_op.register_fake
def _(dw, c, g, u):
    return torch.empty_like(c), torch.empty_like(g), torch.empty(u.shape, dtype=u.dtype, device=u.device)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _autograd_backward(ctx, dw):
    c, g, u = ctx.saved_tensors
    return _transport_weights_backward_op(dw.contiguous(), c, g, u)


# the backward op has no derivative of its own: double backward is refused with the way out
_transport_weights_op.register_autograd(first_order_only(_autograd_backward, "the OT transport-weights backward "
                                                                             "(backend 'cpu')"),
                                        setup_context=_setup_context)


def transport_weights(c, g, u):
    """W (..., Nq, A) = sum_j u_ij softmax_t(c_it + g_jt); u is (..., Nq or 1, Nk)."""
    return _transport_weights_op(c.contiguous(), g.contiguous(), u.contiguous())


def ot_attention_cpu(q, k, v, *, attn_mask=None, is_causal=False, scale, alpha=1.0, gamma=None, log_u=None,
                     templates_k=None, templates_v=None, dropout_p=0.0):
    return ot_attention_factorised(transport_weights, q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                                   scale=scale, alpha=alpha, gamma=gamma, log_u=log_u,
                                   templates_k=templates_k, templates_v=templates_v)
