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

from .factorised import ot_attention_factorised
from .tiles import transport_weights_tiles

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


class _TransportWeightsGemm(torch.autograd.Function):
    """The matmul part over the resolved pairs (the caller adds the rest from tiles.py)."""

    @staticmethod
    def forward(ctx, c, g, u):
        ec, eg, inv, unresolved = _parts(c, g)
        ctx.save_for_backward(c, g, u)
        ctx.mark_non_differentiable(unresolved)
        return ec * ((u * inv) @ eg), unresolved

    @staticmethod
    def backward(ctx, dw, _):
        c, g, u = ctx.saved_tensors
        ec, eg, inv, _ = _parts(c, g)
        ecdw = ec * dw
        gij = (ecdw @ eg.transpose(-1, -2)) * inv
        coef, coef_g = u * inv, u * gij * inv
        w = ec * (coef @ eg)
        dc = dw * w - ec * (coef_g @ eg)
        dg = eg * (coef.transpose(-1, -2) @ ecdw - coef_g.transpose(-1, -2) @ ec)
        du = gij.sum(-2, keepdim=True) if u.shape[-2] == 1 else gij
        return dc, dg, du


def transport_weights(c, g, u):
    """W (..., Nq, A) = sum_j u_ij softmax_t(c_it + g_jt); u is (..., Nq or 1, Nk)."""
    w, unresolved = _TransportWeightsGemm.apply(c, g, u)
    if bool(unresolved.any()):
        w = w + transport_weights_tiles(c, g, u, active=unresolved)
    return w


def ot_attention_cpu(q, k, v, *, attn_mask=None, is_causal=False, scale, alpha=1.0, gamma=None, log_u=None,
                     templates_k=None, templates_v=None, dropout_p=0.0):
    return ot_attention_factorised(transport_weights, q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                                   scale=scale, alpha=alpha, gamma=gamma, log_u=log_u,
                                   templates_k=templates_k, templates_v=templates_v)
