"""Tokens as interacting particles, dx_i/dt = Gamma_X(t)(x_i) with shared weights (paper 002 eq 1.1),
integrated with our own classical RK4 (fixed step; torchdiffeq is not needed for this).

Two ways to evaluate the field:
  functional    ``fields.self_velocity``: attnzoo.functional on the whole cloud (any variant, O(n^2)
                memory unless chunked) — the ground truth.
  kernel_sums   softmax, L2 and Sinkhorn through ``kernel_sums.exp_kernel_sums`` (Taylor moment
                expansion in low dimension, exact blocks otherwise): the n >= 20000 Gaussian runs.
                Sinkhorn uses the dot-product kernel exp(Qx . Ky / eps), which has the same
                bistochastic limit as exp(-|Qx - Ky|^2 / (2 eps)) (paper 002 Remark 5.2: the
                separable terms are absorbed by the potentials), iterated in the log domain until
                the column marginals are within ``sinkhorn_tol``, warm-started from the last call.
"""
from __future__ import annotations

import torch

from .fields import self_velocity
from .kernel_sums import METHODS, TaylorKernel, exp_kernel_sums

FAST_VARIANTS = ("softmax", "l2", "sinkhorn")


class KernelSumField:
    """Callable X -> Gamma_X(X) for softmax / l2 / sinkhorn without an n x n matrix."""

    def __init__(self, variant, Q, K, V, *, eps=1.0, method="auto", tol=1e-10, sinkhorn_tol=1e-9,
                 sinkhorn_max_iter=5000):
        if variant not in FAST_VARIANTS:
            raise ValueError(f"variant must be one of {FAST_VARIANTS} for kernel sums, got {variant!r}")
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        if Q.dim() != 2:
            raise ValueError("KernelSumField takes single-head Q, K, V (sum fields for multi-head)")
        self.variant, self.Q, self.K, self.V, self.eps = variant, Q, K, V, float(eps)
        self.method, self.tol = method, tol
        self.sinkhorn_tol, self.sinkhorn_max_iter = sinkhorn_tol, sinkhorn_max_iter
        self.g = None            # Sinkhorn key potential, warm start
        self.iters = []          # Sinkhorn iterations per call

    def _sums(self, b, Y):
        if self.method == "exact":
            return lambda W: exp_kernel_sums(b, Y, W, method="exact")
        try:
            kern = TaylorKernel(b, Y, tol=self.tol)
            return kern.apply
        except ValueError:
            if self.method == "taylor":
                raise
            return lambda W: exp_kernel_sums(b, Y, W, method="exact")

    def __call__(self, X):
        q, k, v = X @ self.Q.T, X @ self.K.T, X @ self.V.T
        ones = torch.ones((X.shape[0], 1), dtype=X.dtype)
        if self.variant == "softmax":          # softmax_j(q_i . k_j)
            S, _ = self._sums(q, k)(torch.cat([ones, v], 1))
            return S[:, 1:] / S[:, :1]
        if self.variant == "l2":               # softmax_j(2 q_i . k_j - |k_j|^2)
            kk = (k * k).sum(1, keepdim=True)
            w = torch.exp(-(kk - kk.min()))
            S, _ = self._sums(2 * q, k)(torch.cat([w, w * v], 1))
            return S[:, 1:] / S[:, :1]
        return self._sinkhorn(q / self.eps, k, v)

    def _sinkhorn(self, b, y, v):
        # logits L_ij = b_i . y_j ; f_i = -log sum_j e^{L_ij + g_j}, g_j = -log sum_i e^{L_ij + f_i}
        n = b.shape[0]
        rows, cols = self._sums(b, y), self._sums(y, b)
        g = torch.zeros(n, dtype=b.dtype) if self.g is None or self.g.shape[0] != n else self.g

        def lse_rows(g):
            m = g.max()
            S, shift = rows(torch.exp(g - m).unsqueeze(1))
            return torch.log(S[:, 0]) + shift + m

        def lse_cols(f):
            m = f.max()
            S, shift = cols(torch.exp(f - m).unsqueeze(1))
            return torch.log(S[:, 0]) + shift + m

        it = 0
        for it in range(1, self.sinkhorn_max_iter + 1):
            f = -lse_rows(g)
            g_new = -lse_cols(f)
            # column marginal error of the plan e^{f + g + L}/n before the update: |e^{g - g_new} - 1|
            err = float((g - g_new).abs().max())
            g = g_new
            if err < self.sinkhorn_tol:
                break
        self.g = g
        self.iters.append(it)
        m = g.max()
        w = torch.exp(g - m).unsqueeze(1)
        S, _ = rows(torch.cat([w, w * v], 1))
        return S[:, 1:] / S[:, :1] / self.eps


def make_field(variant, Q, K, V, *, engine="functional", eps=1.0, n_iters=None, chunk=None, **kw):
    """X -> dX/dt. engine="functional" (any variant) or "kernel_sums" (softmax, l2, sinkhorn)."""
    if engine == "kernel_sums":
        return KernelSumField(variant, Q, K, V, eps=eps, **kw)
    if engine != "functional":
        raise ValueError(f"engine must be 'functional' or 'kernel_sums', got {engine!r}")
    extra = {} if n_iters is None else {"n_iters": n_iters}
    return lambda X: self_velocity(variant, X, Q, K, V, eps=eps, chunk=chunk, **extra, **kw)


def rk4(field, X0, *, t_end, n_steps, record=None, progress=False):
    """Classical RK4 with n_steps equal steps. ``record``: step indices to keep (default all).
    Returns (times list, states list)."""
    dt = float(t_end) / n_steps
    X = X0.clone()
    keep = set(range(n_steps + 1)) if record is None else set(record)
    times, states = ([0.0], [X.clone()]) if 0 in keep else ([], [])
    steps = range(1, n_steps + 1)
    if progress:
        from tqdm import tqdm
        steps = tqdm(steps, desc="particles", leave=False)
    for i in steps:
        k1 = field(X)
        k2 = field(X + dt / 2 * k1)
        k3 = field(X + dt / 2 * k2)
        k4 = field(X + dt * k3)
        X = X + dt / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
        if not torch.isfinite(X).all():
            raise FloatingPointError(f"particles left the floating-point range at t = {i * dt:g}")
        if i in keep:
            times.append(i * dt)
            states.append(X.clone())
    return times, states


def moments(X):
    """(mean, covariance with 1/n) of a cloud."""
    m = X.mean(0)
    Xc = X - m
    return m, Xc.T @ Xc / X.shape[0]
