"""Attention as a velocity field on tokens (paper 002 sec 2): Gamma_X(x) for every variant.

Paper 002 writes the score as Qx . Ky with Q, K (k, d) and 1/sqrt(k) folded into Q, K, and the
value map as V (d, d). We call attnzoo.functional with q = x Q^T, k = X K^T, v = X V^T and
scale = 1, so Gamma_X(x_i) is exactly the layer's output row i. Per variant (n = |X|):

  softmax   sum_j softmax_j(Qx . Kx_j) V x_j                         (2.2)
  l2        sum_j softmax_j(-|Qx - Kx_j|^2) V x_j                    (2.3)
  sinkhorn  (1/eps) sum_j kappa_inf(x, x_j)/n V x_j, cost |Qx-Ky|^2/(2 eps)  (2.4), kappa_inf the
            bistochastic limit: many iterations (n_iters, default 200)
  sigmoid   (1/n) sum_j sigmoid(Qx . Kx_j) V x_j                     (2.5)
  relu      (1/n) sum_j relu(Qx . Kx_j) V x_j                        (2.5)
  linear    (1/n) sum_j (Qx . Kx_j) V x_j                            (2.2, identity feature map)
  fenchel / ot: attnzoo's generalisations (paper 004) with the same q, k, v.

Multi-head (2.7, 2.9): pass Q, K of shape (H, k, d) and V of shape (H, d, d) holding W^(h) V^(h);
Gamma^MH = sum_h Gamma^(h).

``query_velocity`` evaluates the field of the fixed measure X at other points x (the map whose
Jacobian paper 002's Lemmas B.2-B.6 bound); ``self_velocity`` moves the tokens themselves.
"""
from __future__ import annotations

import torch

from .. import functional as AF
from ..ops.sinkhorn.reference import sinkhorn_logits, sinkhorn_potential

# the variants query_velocity has a field for (each its own formula below); every built-in variant
# (tests/test_variant_lists.py), and not one declared later, whose field paper 002 does not write
VARIANTS = ("softmax", "l2", "sinkhorn", "sigmoid", "relu", "linear", "fenchel", "ot")
SINKHORN_ITERS = 200


def _check(variant, x, X, Q, K, V):
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    for name, t in (("x", x), ("X", X)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise ValueError(f"{name} must be a (n, d) tensor, got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    d = X.shape[1]
    if x.shape[1] != d:
        raise ValueError(f"x and X must have the same dimension d, got {x.shape[1]} and {d}")
    heads = Q.dim() == 3
    for name, t, last in (("Q", Q, d), ("K", K, d), ("V", V, d)):
        if not isinstance(t, torch.Tensor) or t.dim() != (3 if heads else 2) or t.shape[-1] != last:
            raise ValueError(f"{name} must have shape ({'H, ' if heads else ''}rows, d={d}), got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if Q.shape != K.shape:
        raise ValueError(f"Q and K must have the same shape, got {tuple(Q.shape)} and {tuple(K.shape)}")
    if V.shape[-2] != d:
        raise ValueError(f"V must map R^d to R^d, got shape {tuple(V.shape)}")


def _heads(M):
    return M if M.dim() == 3 else M.unsqueeze(0)


def _qkv(x, X, Q, K, V):
    Qh, Kh, Vh = _heads(Q), _heads(K), _heads(V)
    q = torch.einsum("nd,hkd->hnk", x, Qh).unsqueeze(0)   # (1, H, m, k)
    k = torch.einsum("nd,hkd->hnk", X, Kh).unsqueeze(0)   # (1, H, n, k)
    v = torch.einsum("nd,hed->hne", X, Vh).unsqueeze(0)   # (1, H, n, d)
    return q, k, v


def query_velocity(variant, x, X, Q, K, V, *, eps=1.0, n_iters=SINKHORN_ITERS, alpha=1.0, solve="first_order",
                   backend=None):
    """Gamma_X(x) (m, d) at query points x (m, d) for the empirical measure of tokens X (n, d), the
    measure held fixed (for Sinkhorn the key potential g is that of X's own bistochastic plan)."""
    _check(variant, x, X, Q, K, V)
    q, k, v = _qkv(x, X, Q, K, V)
    n = X.shape[0]
    if variant == "softmax":
        out = AF.softmax(q, k, v, scale=1.0, backend=backend)
    elif variant == "l2":
        out = AF.l2(q, k, v, scale=1.0, backend=backend)
    elif variant == "sigmoid":
        out = AF.sigmoid(q, k, v, scale=1.0, bias=0.0, backend=backend) / n
    elif variant == "relu":
        out = AF.relu(q, k, v, scale=1.0, backend=backend)
    elif variant == "linear":
        out = AF.linear(q, k, v, scale=1.0, feature_map="identity", backend=backend)
    elif variant == "fenchel":
        out = AF.fenchel(q, k, v, scale=1.0, alpha=alpha, solve=solve, backend=backend)
    elif variant == "ot":
        out = AF.ot(q, k, v, scale=1.0, alpha=alpha, backend=backend)
    else:  # sinkhorn with the measure fixed: softmax_j(g_j - c_eps(x, x_j)), g from X's own plan
        qq, kk, _ = _qkv(X, X, Q, K, V)
        g = sinkhorn_potential(sinkhorn_logits(qq, kk, scale=1.0, eps=eps, cost="l2"), None, n_iters)
        out = AF.l2(q, k, v, attn_mask=g, scale=1.0 / (2.0 * eps), backend=backend) / eps
    return out[0].sum(0)


def self_velocity(variant, X, Q, K, V, *, eps=1.0, n_iters=SINKHORN_ITERS, alpha=1.0, solve="first_order",
                  chunk=None, backend=None):
    """dx_i/dt = Gamma_X(x_i) for every token (paper 002 eq 1.1), shape (n, d). ``chunk`` evaluates
    row-independent variants in blocks of queries (O(chunk * n) memory); Sinkhorn couples all rows and
    is solved on the whole cloud (see ``sinkhorn_blockwise`` for large clouds)."""
    if variant == "sinkhorn":
        _check(variant, X, X, Q, K, V)
        q, k, v = _qkv(X, X, Q, K, V)
        return AF.sinkhorn(q, k, v, scale=1.0, eps=eps, n_iters=n_iters, cost="l2", backend=backend)[0].sum(0) / eps
    if chunk is None or chunk >= X.shape[0]:
        return query_velocity(variant, X, X, Q, K, V, eps=eps, alpha=alpha, solve=solve, backend=backend)
    return torch.cat([query_velocity(variant, X[s:s + chunk], X, Q, K, V, eps=eps, alpha=alpha, solve=solve,
                                     backend=backend) for s in range(0, X.shape[0], chunk)])
