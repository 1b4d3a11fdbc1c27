"""Paper 002 sec 4.5 studies of the covariance ODEs: the d = 2 behaviours drawn in the PSD cone, and
the rank of limiting covariances in d = 3, 4, 5 with K = -Q.

PSD cone coordinates (sec 4.5): [[a, c], [c, b]] -> (x, y, z) = (a - b, 2c, a + b); S_2^+ is the cone
z >= sqrt(x^2 + y^2), rank-deficient matrices on its boundary. Initial points: a grid on the slice
z = trace0 inside the cone. Trajectories are integrated with RK4 (gaussian.solve_gaussian) and
stopped at ||Sigma|| > blowup; one diverging is shown by its trace-1 projection Sigma / tr Sigma.
"""
from __future__ import annotations

import math

import torch

from .gaussian import affine_field, gaussian_rhs, solve_gaussian

DT = torch.float64


def cone_coords(S):
    """(..., 2, 2) -> (..., 3) PSD cone coordinates (a - b, 2c, a + b)."""
    return torch.stack([S[..., 0, 0] - S[..., 1, 1], 2 * S[..., 0, 1], S[..., 0, 0] + S[..., 1, 1]], -1)


def cone_grid(n=5, trace=1.0, fill=0.8):
    """Symmetric PD 2x2 matrices on a grid of the slice z = trace, within fill * the cone's radius."""
    out = []
    for x in torch.linspace(-fill, fill, n, dtype=DT):
        for y in torch.linspace(-fill, fill, n, dtype=DT):
            if x * x + y * y < fill * fill + 1e-12:
                x_, y_ = float(x) * trace, float(y) * trace
                out.append(torch.tensor([[(trace + x_) / 2, y_ / 2], [y_ / 2, (trace - x_) / 2]], dtype=DT))
    return out


def d2_configs(seed=1):
    """The three behaviours of sec 4.5 (Fig 1 a / Fig 2 c / Fig 2 a): name -> (variant, Q, K, V)."""
    g = torch.Generator().manual_seed(seed)
    I = torch.eye(2, dtype=DT)
    M = torch.randn(2, 2, generator=g, dtype=DT)
    Sneg = -(M @ M.T + 0.3 * I)
    Sneg = Sneg / torch.linalg.matrix_norm(Sneg, ord=2)          # A + A^T < 0 for A = Sneg / 2 + skew
    skew = torch.tensor([[0.0, 0.4], [-0.4, 0.0]], dtype=DT)
    A_neg = Sneg / 2 + skew
    A_pos = -A_neg.T                                             # A + A^T > 0
    V_rand = I + 0.4 * torch.randn(2, 2, generator=g, dtype=DT)   # random, near the identity
    # Q = A, K = I gives K^T Q = A
    return {"convergence": ("softmax", A_neg, I, V_rand),
            "divergence": ("l2", A_pos, I, I),
            "blowup": ("softmax", A_pos, I, I)}


def classify(sol, *, tol=1e-3):
    if sol["blowup_time"] is not None:
        return "blowup"
    S = sol["Sigmas"]
    n0, n1 = float(torch.linalg.matrix_norm(S[0], ord=2)), float(torch.linalg.matrix_norm(S[-1], ord=2))
    if n1 > 10 * n0:
        return "divergence"
    if n1 < n0:
        return "convergence"
    return "bounded"


def d2_study(name, *, n_grid=5, t_end=None, n_steps=2000, blowup=1e12, seed=1):
    """Trajectories of the covariance ODE from a grid of initial matrices for one behaviour.
    Returns dict(variant, Q, K, V, trajectories: list of dict(cone (T, 3), trace1 (T, 3), times,
    blowup_time, kind))."""
    variant, Q, K, V = d2_configs(seed)[name]
    t_end = {"convergence": 50.0, "divergence": 10.0, "blowup": 10.0}[name] if t_end is None else t_end
    alpha0 = torch.zeros(2, dtype=DT)
    trajs = []
    for S0 in cone_grid(n_grid):
        sol = solve_gaussian(variant, alpha0, S0, Q, K, V, t_end=t_end, n_steps=n_steps, blowup=blowup)
        S = sol["Sigmas"]
        tr = S[..., 0, 0] + S[..., 1, 1]
        trajs.append({"cone": cone_coords(S), "trace1": cone_coords(S / tr[:, None, None]),
                      "times": sol["times"], "blowup_time": sol["blowup_time"], "kind": classify(sol)})
    return {"variant": variant, "Q": Q, "K": K, "V": V, "trajectories": trajs}


def limit_covariance(variant, Sigma0, Q, K, V, *, t_end=1e4, max_steps=20000, h=0.05, blowup=1e6):
    """Integrate the covariance ODE to t_end with RK4 steps dt = h / rate, rate = ||M|| of the affine
    field (so steps lengthen as the dynamics slow down). Returns (Sigma, t, status) with status
    "converged" or "blowup"."""
    alpha = torch.zeros(Sigma0.shape[0], dtype=DT)
    S, t = Sigma0.clone(), 0.0

    def f(S):
        return gaussian_rhs(variant, alpha, S, Q, K, V)[1]

    for _ in range(max_steps):
        M, _ = affine_field(variant, alpha, S, Q, K, V)
        rate = float(torch.linalg.matrix_norm(M, ord=2)) + 1e-12
        dt = min(h / rate, t_end - t)
        k1 = f(S)
        k2 = f(S + dt / 2 * k1)
        k3 = f(S + dt / 2 * k2)
        k4 = f(S + dt * k3)
        S = S + dt / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
        S = (S + S.T) / 2
        t += dt
        if not torch.isfinite(S).all() or float(torch.linalg.matrix_norm(S, ord=2)) > blowup:
            return S, t, "blowup"
        if t >= t_end:
            break
    return S, t, "converged"


def numerical_rank(S, rel_tol=1e-2):
    """Number of eigenvalues above rel_tol * the largest (the decaying ones fall like 1/t)."""
    w = torch.linalg.eigvalsh(S)
    top = float(w.max())
    return int((w > rel_tol * top).sum()) if top > 0 else 0


def rank_histogram(d, *, n_points=50, v_mode="identity", variant="softmax", t_end=1e4, seed=0, progress=False):
    """Ranks of limiting covariances: Q random (floor(d/2), d), K = -Q (A = -Q^T Q, negative, rank
    floor(d/2)), V = I or random; Sigma0 random PD. Returns dict(ranks, blowups, bound=d - rk A)."""
    if v_mode not in ("identity", "random"):
        raise ValueError(f"v_mode must be 'identity' or 'random', got {v_mode!r}")
    g = torch.Generator().manual_seed(seed)
    k = d // 2
    ranks, blowups = [], 0
    it = range(n_points)
    if progress:
        from tqdm import tqdm
        it = tqdm(it, desc=f"ranks d={d} V={v_mode}", leave=False)
    for _ in it:
        Q = torch.randn(k, d, generator=g, dtype=DT)
        K = -Q
        V = torch.eye(d, dtype=DT) if v_mode == "identity" else torch.randn(d, d, generator=g, dtype=DT)
        B = torch.randn(d, d, generator=g, dtype=DT)
        S0 = B @ B.T / d + 0.1 * torch.eye(d, dtype=DT)
        S, _, status = limit_covariance(variant, S0, Q, K, V, t_end=t_end)
        if status == "blowup":
            blowups += 1
            continue
        ranks.append(numerical_rank(S))
    return {"d": d, "v_mode": v_mode, "variant": variant, "ranks": ranks, "blowups": blowups,
            "rank_A": k, "bound": d - k}


def softmax_d1_blowup_time(a, v, s0):
    """Prop 4.3: s(t) = (1/s0 - 2 v a t)^-1 blows up at t = (2 v a s0)^-1 when a v > 0."""
    return 1.0 / (2 * v * a * s0) if a * v > 0 else math.inf
