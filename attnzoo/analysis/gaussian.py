"""Gaussian closed forms of paper 002 sec 4: on mu = N(alpha, Sigma) the velocity field of softmax,
L2 and Sinkhorn attention is affine, Gamma(x) = M x + c, so Gaussians stay Gaussian and
    d alpha / dt = Gamma(alpha) = M alpha + c,      d Sigma / dt = M Sigma + Sigma M^T.
That is eq (4.1) for softmax (M = V Sigma A), eq (4.3) for L2 (M = 2 V Sigma (I + 2 K^T K Sigma)^-1 A),
Prop 4.15 for Sinkhorn and Prop 4.9 for multi-head (sum over heads). A = K^T Q throughout.

Sinkhorn (Lemma 4.14): M = (1/eps) V A^-T Sigma^-1 C with
    C = Sigma^1/2 (Sigma^1/2 B Sigma^1/2 + eps^2/4 I)^1/2 Sigma^-1/2 - eps/2 I,
where Lemma 4.14 writes B = A^T Sigma A and Prop 4.15 writes B = A Sigma A^T. ``sinkhorn_form``
picks one ("lemma" by default). Settled numerically (tests/test_analysis_dynamics.py, README's analysis section):
the field of discrete Sinkhorn (bistochastic limit) on Gaussian samples, regressed on x, matches
Lemma 4.14's B = A^T Sigma A to sampling error, and Prop 4.15's B = A Sigma A^T is off by a factor
of several for a non-symmetric A; Prop 4.15's C is a misprint (the two agree when A is symmetric,
e.g. always in d = 1).
"""
from __future__ import annotations

import math

import torch

GAUSSIAN_VARIANTS = ("softmax", "l2", "sinkhorn")
SINKHORN_FORMS = ("lemma", "prop")


def _sym_sqrt(S):
    w, U = torch.linalg.eigh((S + S.transpose(-1, -2)) / 2)
    return (U * w.clamp_min(0).sqrt().unsqueeze(-2)) @ U.transpose(-1, -2)


def _heads(M):
    return M if M.dim() == 3 else M.unsqueeze(0)


def affine_field(variant, alpha, Sigma, Q, K, V, *, eps=1.0, sinkhorn_form="lemma"):
    """(M, c) with Gamma_mu(x) = M x + c for mu = N(alpha, Sigma) (Lemmas 4.1, 4.10, 4.14; heads summed)."""
    if variant not in GAUSSIAN_VARIANTS:
        raise ValueError(f"variant must be one of {GAUSSIAN_VARIANTS} (the others do not keep Gaussians "
                         f"Gaussian, paper 002 sec 2.5), got {variant!r}")
    if sinkhorn_form not in SINKHORN_FORMS:
        raise ValueError(f"sinkhorn_form must be one of {SINKHORN_FORMS}, got {sinkhorn_form!r}")
    d = alpha.shape[-1]
    eye = torch.eye(d, dtype=Sigma.dtype, device=Sigma.device)
    M = torch.zeros_like(Sigma)
    c = torch.zeros_like(alpha)
    for Qh, Kh, Vh in zip(_heads(Q), _heads(K), _heads(V)):
        A = Kh.T @ Qh
        if variant == "softmax":          # Lemma 4.1: V (alpha + Sigma A x)
            Mh, ch = Vh @ Sigma @ A, Vh @ alpha
        elif variant == "l2":             # Lemma 4.10: V (Sigma^-1 + 2 K^T K)^-1 (Sigma^-1 alpha + 2 A x)
            Rinv = torch.linalg.inv(eye + 2 * Sigma @ Kh.T @ Kh)   # (Sigma^-1 + 2K^TK)^-1 = Rinv Sigma,
            Mh, ch = 2 * Vh @ Rinv @ Sigma @ A, Vh @ Rinv @ alpha   # no Sigma^-1: Sigma may turn singular
        else:                             # Lemma 4.14 / Prop 4.15
            B = A.T @ Sigma @ A if sinkhorn_form == "lemma" else A @ Sigma @ A.T
            r = _sym_sqrt(Sigma)
            C = r @ _sym_sqrt(r @ B @ r + eps ** 2 / 4 * eye) @ torch.linalg.inv(r) - eps / 2 * eye
            G = torch.linalg.solve(A.T, torch.linalg.solve(Sigma, C))   # A^-T Sigma^-1 C
            Mh, ch = Vh @ G / eps, Vh @ (eye - G) @ alpha / eps
        M = M + Mh
        c = c + ch
    return M, c


def gaussian_rhs(variant, alpha, Sigma, Q, K, V, **kw):
    """(d alpha/dt, d Sigma/dt) of the Transformer PDE restricted to Gaussians."""
    M, c = affine_field(variant, alpha, Sigma, Q, K, V, **kw)
    return M @ alpha + c, M @ Sigma + Sigma @ M.T


def solve_gaussian(variant, alpha0, Sigma0, Q, K, V, *, t_end, n_steps, blowup=1e8, **kw):
    """RK4 on (alpha, Sigma) with n_steps equal steps. Stops early when max |Sigma_ij| > blowup (for a
    PSD matrix that is ||Sigma||_2 within a factor d).
    Returns dict(times (T,), alphas (T, d), Sigmas (T, d, d), blowup_time or None)."""
    dt = float(t_end) / n_steps
    a, S = alpha0.clone(), Sigma0.clone()
    times, alphas, sigmas = [0.0], [a.clone()], [S.clone()]

    def f(a, S):
        return gaussian_rhs(variant, a, S, Q, K, V, **kw)

    for i in range(n_steps):
        k1 = f(a, S)
        k2 = f(a + dt / 2 * k1[0], S + dt / 2 * k1[1])
        k3 = f(a + dt / 2 * k2[0], S + dt / 2 * k2[1])
        k4 = f(a + dt * k3[0], S + dt * k3[1])
        a = a + dt / 6 * (k1[0] + 2 * k2[0] + 2 * k3[0] + k4[0])
        S = S + dt / 6 * (k1[1] + 2 * k2[1] + 2 * k3[1] + k4[1])
        S = (S + S.T) / 2
        norm = float(S.abs().max())
        if not math.isfinite(norm) or norm > blowup:
            return {"times": torch.tensor(times), "alphas": torch.stack(alphas), "Sigmas": torch.stack(sigmas),
                    "blowup_time": (i + 1) * dt}
        times.append((i + 1) * dt)
        alphas.append(a.clone())
        sigmas.append(S.clone())
    return {"times": torch.tensor(times), "alphas": torch.stack(alphas), "Sigmas": torch.stack(sigmas),
            "blowup_time": None}
