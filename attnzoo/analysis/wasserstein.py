"""Wasserstein distances between token clouds and the Wasserstein-Lipschitz ratio of a layer.

Clouds are empirical measures m(X) = (1/N) sum_i delta_{x_i}; two clouds may have different sizes
(the LP of paper 001: gamma >= 0 with marginals 1/N and 1/M). W_p uses the Euclidean ground
metric (papers 002/003) unless ``metric="cityblock"`` (the l1 metric of papers 000/001).
Exact: POT's network simplex (ot.emd2). Entropic (``method="sinkhorn"``, or "auto" above
``exact_max`` points): ot.sinkhorn2 with regularisation reg * mean cost, an upper bound on the
exact value that converges to it as reg -> 0.

The ratio W(F(mu), F(nu)) / W(mu, nu) (paper 000 Prop 18, paper 003 Def 7) is measured on pairs
(X, X') where X' is X perturbed: Gaussian noise, one or more tokens dropped, tokens added, or the
tokens permuted (ratio 0/0 is skipped). F maps a (N, d) cloud to a (N', d') cloud (a layer with
batch 1, or a measure map such as attention followed by the moment projection).
"""
from __future__ import annotations

import math

import numpy as np
import torch

METHODS = ("auto", "exact", "sinkhorn")
METRICS = ("euclidean", "cityblock")


def _np(X, name):
    if isinstance(X, torch.Tensor):
        X = X.detach().double().cpu().numpy()
    X = np.asarray(X, dtype=np.float64)
    if X.ndim != 2 or X.shape[0] == 0:
        raise ValueError(f"{name} must be a non-empty (n, d) cloud, got shape {X.shape}")
    if not np.isfinite(X).all():
        raise ValueError(f"{name} holds non-finite values")
    return X


def wasserstein(X, Y, *, p=1, method="auto", metric="euclidean", reg=0.01, exact_max=3000, weights=None):
    """W_p between the empirical measures of X (N, d) and Y (M, d); ``weights`` optional (a, b)."""
    import ot
    if p not in (1, 2):
        raise ValueError(f"p must be 1 or 2, got {p!r}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {METRICS}, got {metric!r}")
    X, Y = _np(X, "X"), _np(Y, "Y")
    if X.shape[1] != Y.shape[1]:
        raise ValueError(f"X and Y must have the same dimension, got {X.shape[1]} and {Y.shape[1]}")
    a, b = weights if weights is not None else (np.full(len(X), 1 / len(X)), np.full(len(Y), 1 / len(Y)))
    from scipy.spatial.distance import cdist
    C = cdist(X, Y, metric=metric)   # per pair (POT's euclidean uses |x|^2 + |y|^2 - 2xy: 1e-8 on the diagonal)
    if p == 2:
        C = C ** 2
    if method == "auto":
        method = "exact" if max(len(X), len(Y)) <= exact_max else "sinkhorn"
    if method == "exact":
        val = float(ot.emd2(a, b, C, numItermax=10_000_000))
    else:
        scale = float(C.mean()) or 1.0
        val = float(ot.sinkhorn2(a, b, C / scale, reg, method="sinkhorn_log", numItermax=5000)) * scale
    return max(val, 0.0) ** (1.0 / p)


PERTURBATIONS = ("noise", "drop", "add", "permute")


def perturb(X, kind, *, strength=0.1, n_tokens=1, generator=None):
    """A perturbed copy of the cloud X (N, d): Gaussian noise of std ``strength``, ``n_tokens`` tokens
    dropped, ``n_tokens`` tokens added (copies of random tokens plus noise), or a permutation."""
    if kind not in PERTURBATIONS:
        raise ValueError(f"kind must be one of {PERTURBATIONS}, got {kind!r}")
    N = X.shape[0]
    g = generator
    if kind == "noise":
        return X + strength * torch.randn(X.shape, dtype=X.dtype, generator=g)
    if kind == "drop":
        if n_tokens >= N:
            raise ValueError(f"n_tokens must be < N={N} to drop tokens, got {n_tokens}")
        keep = torch.randperm(N, generator=g)[: N - n_tokens].sort().values
        return X[keep]
    if kind == "add":
        src = torch.randint(0, N, (n_tokens,), generator=g)
        new = X[src] + strength * torch.randn((n_tokens, X.shape[1]), dtype=X.dtype, generator=g)
        return torch.cat([X, new])
    return X[torch.randperm(N, generator=g)]


def lipschitz_ratio(F, X, Y, *, p=1, metric="euclidean", method="auto"):
    """W_p(F(X), F(Y)) / W_p(X, Y) (None when W_p(X, Y) = 0)."""
    w_in = wasserstein(X, Y, p=p, metric=metric, method=method)
    if w_in <= 1e-12:
        return None
    with torch.no_grad():
        FX, FY = F(X), F(Y)
    return wasserstein(FX, FY, p=p, metric=metric, method=method) / w_in


def ratio_study(F, clouds, *, kinds=("noise", "drop", "add"), strengths=(0.01, 0.1, 0.5), p=1,
                metric="euclidean", seed=0):
    """Ratios of F on every cloud x perturbation x strength (dict rows)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for ci, X in enumerate(clouds):
        for kind in kinds:
            for s in strengths:
                Y = perturb(X, kind, strength=s, generator=g)
                r = lipschitz_ratio(F, X, Y, p=p, metric=metric)
                if r is not None:
                    rows.append({"cloud": ci, "kind": kind, "strength": s, "N": X.shape[0], "M": Y.shape[0],
                                 "ratio": r})
    return rows


def thm29_bound(d, N, M, value_lip_l1):
    """Paper 001 Thm 29 / Cor 30: W1 (l1 ground metric) Lipschitz bound of mu -> mu A_mu for the
    kernel G = exp(-||x - y||^2) (||G||_Lip = sqrt(2/e), ||G||_inf = 1), lookup l(y) = V y with
    ||l||_Lip = value_lip_l1 (= ||V||_{1->1}) and the moment projection (tau(Pi) = d)."""
    g_lip = math.sqrt(2 / math.e)
    return 2 * d * value_lip_l1 * (math.sqrt(d) * math.sqrt(math.log(min(N, M)) + 1 / (2 * math.e)) * g_lip
                                   + 1 + math.sqrt(d) + 2)


def gaussian_kernel_attention(V):
    """The measure map of paper 001 Thm 29 on a cloud: x_i -> sum_j softmax_j(-||x_i - x_j||^2) V x_j
    (L2 attention with Q = K = I and scale 1, i.e. G = exp(-||x - y||^2), then the moment projection)."""
    from .fields import query_velocity
    eye = torch.eye(V.shape[0], dtype=V.dtype)

    def F(X):
        X = X.to(V.dtype)
        return query_velocity("l2", X, X, eye, eye, V)
    return F
