"""Empirical Lipschitz constants of attention maps next to the papers' bounds.

Estimate: the spectral norm of the Jacobian, by power iteration on J^T J with torch.func.jvp / vjp
(no Jacobian is formed), maximised over inputs drawn uniformly in the ball B_R and then refined by
projected gradient ascent from the worst draw (the gradient of sigma_max(J) is u^T dJ v with u, v
its singular vectors, obtained by differentiating |J v| with v held fixed).

The map matters. Paper 002's Lemmas B.2-B.6 bound D_x Gamma_mu(x): the derivative in ONE query
point x with the measure mu (the tokens X, supported in B_R) held fixed. ``query_lipschitz`` measures
exactly that map, sup over x and over X in B_R:
  softmax   ||V|| ||A|| R^2                    Lemma B.2 (D_x Gamma = V Var_p(y) A, Var <= R^2 by B.1)
  l2        2 ||V|| ||A|| R^2                  Lemma B.3 states ||V|| ||A|| R^2, but for
            e^{-|Qx-Ky|^2} the x-derivative of the logit is 2 A^T y + const, so D_x Gamma =
            2 V Var_p(y) A; ``bounds`` returns both ("l2" corrected, "l2_paper" as printed) and the
            Lipschitz study exhibits inputs where the printed bound fails.
  sinkhorn  ||V|| ||A|| R^2 / eps^2            Lemma B.6 (eps = 1 there; Gamma has 1/eps and the
            plan's logit x^T A^T y / eps another)
  sigmoid   ||V|| ||A|| R^2 / 4                Lemma B.7 (sigmoid' <= 1/4, (1/n) sum |y|^2 <= R^2)
  multihead sum_h ||V_h|| ||A_h|| R^2          Lemma B.4 (softmax heads)
and paper 001 Cor 24 (x in E = B_R too, kernel G = exp(x^T A^T y), l1 metric, value map y -> V y
with K_l = ||V||_{1->1}): 4 d^2 K_l ||A|| R^2 exp(2 ||A|| R^2) (for A = I/sqrt(d), the paper's
a(x, y) = x.y/sqrt(d), this is 4 d^{3/2} K_l R^2 e^{2R^2/sqrt d}).
``layer_lipschitz`` measures the whole layer X -> layer(X) (every token moves), for which no
bound is stated (softmax attention is not globally Lipschitz, Kim et al. 2021).
"""
from __future__ import annotations

import math

import torch
from torch.func import jvp, vjp

from .fields import query_velocity


def jacobian_spectral_norm(fn, x, *, n_iter=100, tol=1e-7, generator=None):
    """(sigma, v): largest singular value of the Jacobian of fn at x and its right singular vector
    (shape of x), by power iteration on J^T J through jvp and vjp."""
    x = x.detach()
    v = torch.randn(x.shape, dtype=x.dtype, device=x.device, generator=generator)
    v = v / v.norm()
    _, vjp_fn = vjp(fn, x)
    sigma = 0.0
    for _ in range(n_iter):
        _, jv = jvp(fn, (x,), (v,))
        (jtjv,) = vjp_fn(jv)
        new_sigma = float(jv.detach().norm())
        nrm = jtjv.norm()
        if nrm == 0:
            return 0.0, v
        v = (jtjv / nrm).detach()
        if abs(new_sigma - sigma) <= tol * max(new_sigma, 1e-30):
            sigma = new_sigma
            break
        sigma = new_sigma
    _, jv = jvp(fn, (x,), (v,))
    return float(jv.detach().norm()), v.detach()


def project_ball(t, radius):
    """Rows of t (last dim = point) pulled back into the closed ball of the given radius."""
    nrm = t.norm(dim=-1, keepdim=True).clamp_min(1e-30)
    return t * torch.clamp(radius / nrm, max=1.0)


def sample_ball(shape, radius, *, dtype=torch.float64, generator=None):
    """Points uniform in the d-ball of the given radius, d = shape[-1]."""
    g = torch.randn(shape, dtype=dtype, generator=generator)
    g = g / g.norm(dim=-1, keepdim=True)
    r = torch.rand(shape[:-1] + (1,), dtype=dtype, generator=generator) ** (1.0 / shape[-1])
    return g * r * radius


def maximise_spectral_norm(make_fn, inputs, *, radius, n_samples=16, ascent_steps=60, lr=0.05,
                           n_iter=60, seed=0, project=None, candidates=()):
    """sup over inputs of sigma_max(J). ``make_fn(*inputs) -> (fn, x)``: the map whose Jacobian in x
    is measured, built from the inputs (x may be one of them); ``inputs`` is a tuple of shapes.
    ``candidates``: extra input tuples tried besides the n_samples uniform draws.
    Returns dict(estimate, trials (every sigma computed), worst (the maximising inputs))."""
    gen = torch.Generator().manual_seed(seed)
    project = project or (lambda t: project_ball(t, radius))
    trials, best, best_inputs = [], -1.0, None
    draws = [tuple(sample_ball(s, radius, generator=gen) for s in inputs) for _ in range(n_samples)]
    for ins in draws + [tuple(project(t.double()) for t in c) for c in candidates]:
        fn, x = make_fn(*ins)
        s, _ = jacobian_spectral_norm(fn, x, n_iter=n_iter, generator=gen)
        trials.append(s)
        if s > best:
            best, best_inputs = s, ins
    ins = [t.clone().requires_grad_(True) for t in best_inputs]
    opt = torch.optim.Adam(ins, lr=lr * radius)
    for _ in range(ascent_steps):
        fn, x = make_fn(*[t.detach() for t in ins])
        s, v = jacobian_spectral_norm(fn, x, n_iter=n_iter, generator=gen)
        trials.append(s)
        if s > best:
            best, best_inputs = s, tuple(t.detach().clone() for t in ins)
        fn, x = make_fn(*ins)
        _, jv = jvp(fn, (x,), (v,))
        opt.zero_grad()
        (-jv.norm()).backward()
        opt.step()
        with torch.no_grad():
            for t in ins:
                t.copy_(project(t))
    return {"estimate": best, "trials": trials, "worst": best_inputs}


def antipodal_candidates(Q, K, V, n_tokens, radius, *, n_random=4, seed=0):
    """Two-point measures +-R u (the extremal measures of Lemma B.1: Var = R^2 u u^T), query x = 0,
    with u the top singular directions of A = K^T Q, A^T and V, and a few random directions."""
    d = Q.shape[-1]
    Qh, Kh, Vh = (t if t.dim() == 3 else t.unsqueeze(0) for t in (Q, K, V))
    dirs = []
    for q, k, v in zip(Qh, Kh, Vh):
        for M in (k.T @ q, v):
            U, _, Vt = torch.linalg.svd(M)
            dirs += [U[:, 0], Vt[0]]
    g = torch.Generator().manual_seed(seed)
    dirs += [torch.randn(d, generator=g, dtype=torch.float64) for _ in range(n_random)]
    signs = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(n_tokens)], dtype=torch.float64)
    return [(torch.zeros(d, dtype=torch.float64), radius * signs[:, None] * (u / u.norm())[None, :]) for u in dirs]


def query_lipschitz(variant, Q, K, V, *, n_tokens, radius, n_samples=16, ascent_steps=60, seed=0, **kw):
    """sup over x in B_R and X in B_R^n of ||D_x Gamma_X(x)||_2 (the map paper 002 bounds). Besides
    uniform draws in the ball, the search starts from ``antipodal_candidates`` (n_tokens >= 2)."""
    d = Q.shape[-1]
    Q, K, V = (t.double() for t in (Q, K, V))
    kw.setdefault("backend", "reference")   # forward-mode AD: fused kernels (SDPA) do not support jvp

    def make(x, X):
        def fn(xq):
            return query_velocity(variant, xq.unsqueeze(0), X, Q, K, V, **kw)[0]
        return fn, x

    cands = antipodal_candidates(Q, K, V, n_tokens, radius, seed=seed) if n_tokens >= 2 else []
    return maximise_spectral_norm(make, ((d,), (n_tokens, d)), radius=radius, n_samples=n_samples,
                                  ascent_steps=ascent_steps, seed=seed, candidates=cands)


def layer_lipschitz(layer, *, n_tokens, radius, n_samples=8, ascent_steps=30, seed=0):
    """sup over X in B_R^n (each token in B_R) of ||D_X layer(X)||_2 for an nn.Module (B=1, N, dim)."""
    dim = next(p for p in layer.parameters()).shape[-1]
    dtype = next(layer.parameters()).dtype
    layer = layer.double().eval()
    saved = {m: m.backend for m in layer.modules() if hasattr(m, "backend")}
    for m in saved:   # forward-mode AD needs the eager reference kernels
        m.backend = "reference"

    def make(X):
        def fn(Y):
            return layer(Y.unsqueeze(0))[0]
        return fn, X

    try:
        return maximise_spectral_norm(make, ((n_tokens, dim),), radius=radius, n_samples=n_samples,
                                      ascent_steps=ascent_steps, seed=seed)
    finally:
        layer.to(dtype)
        for m, b in saved.items():
            m.backend = b


def _op(M):
    return float(torch.linalg.matrix_norm(M.double(), ord=2))


def bounds(variant, Q, K, V, *, radius, eps=1.0):
    """The papers' bounds on sup ||D_x Gamma_mu(x)||_2 for mu in B_R (dict name -> value); see the
    module docstring. Multi-head weights (H, ., .) give Lemma B.4's sum (softmax heads)."""
    R2 = radius ** 2
    heads = Q.dim() == 3
    Qh, Kh, Vh = (t.double() if heads else t.double().unsqueeze(0) for t in (Q, K, V))
    per_head = [_op(v) * _op(k.T @ q) for q, k, v in zip(Qh, Kh, Vh)]
    out = {}
    if heads:
        if variant == "softmax":
            out["lemma_B4"] = sum(per_head) * R2
        return out
    vA = per_head[0]
    if variant == "softmax":
        out["lemma_B2"] = vA * R2
        A = Kh[0].T @ Qh[0]
        d = A.shape[0]
        k_l = float(torch.linalg.matrix_norm(Vh[0], ord=1))
        a = _op(A)
        expo = 2 * a * R2
        out["cor24"] = 4 * d ** 2 * k_l * a * R2 * math.exp(expo) if expo < 700 else math.inf
    elif variant == "l2":
        out["lemma_B3"] = 2 * vA * R2
        out["lemma_B3_as_printed"] = vA * R2
    elif variant == "sinkhorn":
        out["lemma_B6"] = vA * R2 / eps ** 2
    elif variant == "sigmoid":
        out["lemma_B7"] = vA * R2 / 4
    return out


def main_bound(variant, Q, K, V, *, radius, eps=1.0):
    """The tightest valid bound (the one the acceptance test holds the estimate to), or None."""
    b = bounds(variant, Q, K, V, radius=radius, eps=eps)
    valid = [v for k, v in b.items() if not k.endswith("as_printed")]
    return min(valid) if valid else None
