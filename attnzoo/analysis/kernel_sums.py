"""Sums S_i = sum_j exp(b_i . y_j) W_j for every query i, the one operation behind softmax, L2 and
Sinkhorn particles (n queries x n keys), without forming the n x n kernel.

exact   blockwise over queries, O(n m) time and O(block m) memory (the reference).
taylor  the moment (Taylor) expansion: with keys centred at c and scaled to the unit ball,
        exp(b . y) = exp(b . c) sum_alpha (rho b)^alpha / alpha! * yhat^alpha, truncated at total
        degree M, so S = exp(b . c) * Phi(rho b) @ (Psi(yhat)^T @ W): O((n + m) P) with
        P = C(M + p, p) monomials. The truncation error relative to S (W >= 0) is at most
        e^{2r} r^{M+1} / (M+1)!, r = rho max_i |b_i|; M is the smallest degree that makes it < tol.
        Meant for low dimension (p <= 3); "auto" falls back to exact when P would be large.
Both return (S, log_shift) with the true sums equal to S * exp(log_shift)[:, None], so that callers
normalising by another such sum never overflow.
"""
from __future__ import annotations

import math
from itertools import product

import torch

METHODS = ("auto", "exact", "taylor")


def _exact(b, Y, W, block):
    c = Y.mean(0)
    shift = b @ c
    Yc = Y - c
    out = torch.empty((b.shape[0], W.shape[1]), dtype=W.dtype)
    for s in range(0, b.shape[0], block):
        out[s:s + block] = torch.exp(b[s:s + block] @ Yc.T) @ W
    return out, shift


def taylor_degree(r, tol):
    """Smallest M with e^{2r} r^{M+1} / (M+1)! <= tol."""
    M = 0
    log_term = 2 * r + math.log(max(r, 1e-300))   # log(e^{2r} r^{M+1}/(M+1)!) at M = 0
    while log_term > math.log(tol) and M < 400:
        M += 1
        log_term += math.log(max(r, 1e-300)) - math.log(M + 1)
    return M


def _multi_indices(p, M):
    return [a for a in product(range(M + 1), repeat=p) if sum(a) <= M]


def n_monomials(p, M):
    return math.comb(M + p, p)


def _features(z, idx, M, factorial):
    """(n, P): prod_k z_k^{a_k} (/ a_k! when factorial) for every multi-index a."""
    e = torch.arange(M + 1, dtype=z.dtype)
    pw = z.unsqueeze(-1) ** e                                   # (n, p, M+1)
    if factorial:
        pw = pw / torch.exp(torch.lgamma(e + 1))
    idx_t = torch.tensor(idx, dtype=torch.long)                 # (P, p)
    cols = [pw[:, k, idx_t[:, k]] for k in range(z.shape[1])]   # each (n, P)
    out = cols[0]
    for col in cols[1:]:
        out = out * col
    return out


class TaylorKernel:
    """The expansion for fixed queries b (n, p) and keys Y (m, p): ``apply(W)`` costs two thin matmuls,
    so iterative schemes (Sinkhorn) reuse the features."""

    def __init__(self, b, Y, *, tol=1e-10, max_monomials=4000):
        c = Y.mean(0)
        rho = float((Y - c).norm(dim=1).max()) or 1.0
        r = rho * float(b.norm(dim=1).max())
        self.degree = taylor_degree(r, tol)
        p = b.shape[1]
        if n_monomials(p, self.degree) > max_monomials:
            raise ValueError(f"taylor kernel sum needs degree {self.degree} in dimension {p} "
                             f"({n_monomials(p, self.degree)} monomials > max_monomials={max_monomials}); "
                             f"use method='exact'")
        idx = _multi_indices(p, self.degree)
        self.phi = _features(b * rho, idx, self.degree, factorial=True)       # (n, P)
        self.psi = _features((Y - c) / rho, idx, self.degree, factorial=False)  # (m, P)
        self.shift = b @ c
        self.radius = r

    def apply(self, W):
        return self.phi @ (self.psi.T @ W), self.shift


def exp_kernel_sums(b, Y, W, *, method="auto", tol=1e-10, block=1024, max_monomials=4000):
    """(S, log_shift): sum_j exp(b_i . y_j) W_j = S_i * exp(log_shift_i). b (n, p), Y (m, p), W (m, c)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if b.dim() != 2 or Y.dim() != 2 or b.shape[1] != Y.shape[1]:
        raise ValueError(f"b (n, p) and Y (m, p) must share p, got {tuple(b.shape)} and {tuple(Y.shape)}")
    if W.dim() != 2 or W.shape[0] != Y.shape[0]:
        raise ValueError(f"W must have shape (m={Y.shape[0]}, c), got {tuple(W.shape)}")
    if method == "exact":
        return _exact(b, Y, W, block)
    try:
        return TaylorKernel(b, Y, tol=tol, max_monomials=max_monomials).apply(W)
    except ValueError:
        if method == "taylor":
            raise
        return _exact(b, Y, W, block)
