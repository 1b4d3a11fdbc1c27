"""Paper 002 sec 4: Gaussian closed forms vs particles, blow-up, the Sinkhorn misprint, d = 2 study."""
import math

import pytest
import torch

from attnzoo.analysis import dynamics, gaussian, kernel_sums, particles
from attnzoo.analysis.fields import self_velocity
from tests.common import randn  # float64 N(0, 1) * scale from its own seed

DT = torch.float64
torch.set_default_dtype(torch.float32)


def _spd(d, seed):
    B = randn((d, d), seed)
    return B @ B.T / d + 0.3 * torch.eye(d, dtype=DT)


# ---- closed-form right-hand sides against the paper's equations, written out here ---------------
def paper_rhs(variant, alpha, S, Q, K, V, eps=1.0):
    I = torch.eye(S.shape[0], dtype=DT)
    if variant == "softmax":      # eq (4.1) and Prop 4.2's mean
        A = K.T @ Q
        return V @ (I + S @ A) @ alpha, V @ S @ A @ S + S @ A.T @ S @ V.T
    if variant == "l2":           # eq (4.3) and Prop 4.11's mean
        A = K.T @ Q
        Minv = torch.linalg.inv(I + 2 * K.T @ K @ S)
        dS = 2 * V @ S @ Minv @ A @ S + 2 * S @ A.T @ Minv.T @ S @ V.T
        da = V @ torch.linalg.inv(torch.linalg.inv(S) + 2 * K.T @ K) @ (torch.linalg.inv(S) + 2 * A) @ alpha
        return da, dS
    if variant == "multihead":    # Prop 4.9, V holds W^(h) V^(h)
        da, dS = 0, 0
        for q, k, v in zip(Q, K, V):
            A = k.T @ q
            da = da + v @ (I + S @ A) @ alpha
            dS = dS + v @ S @ A @ S + S @ A.T @ S @ v.T
        return da, dS
    raise AssertionError(variant)


@pytest.mark.parametrize("variant,d,seed", [("softmax", 2, 0), ("softmax", 3, 1), ("l2", 2, 2), ("l2", 4, 3),
                                            ("multihead", 3, 4)])
def test_rhs_matches_paper_equations(variant, d, seed):
    heads = variant == "multihead"
    shape = (2, d, d) if heads else (d, d)
    Q, K, V = randn(shape, seed, 0.5), randn(shape, seed + 10, 0.5), randn(shape, seed + 20)
    alpha, S = randn((d,), seed + 30), _spd(d, seed + 40)
    got = gaussian.gaussian_rhs("softmax" if heads else variant, alpha, S, Q, K, V)
    want = paper_rhs(variant, alpha, S, Q, K, V)
    torch.testing.assert_close(got[0], want[0], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got[1], want[1], rtol=1e-10, atol=1e-12)


def test_sinkhorn_mean_moves_alone():
    """Prop 4.15: d alpha/dt = V alpha / eps whatever Sigma."""
    Q, K, V = randn((2, 2), 1, 0.5), randn((2, 2), 2, 0.5), randn((2, 2), 3)
    alpha = randn((2,), 4)
    for eps in (0.5, 2.0):
        da, _ = gaussian.gaussian_rhs("sinkhorn", alpha, _spd(2, 5), Q, K, V, eps=eps)
        torch.testing.assert_close(da, V @ alpha / eps, rtol=1e-9, atol=1e-12)


# ---- the fast kernel sums against the exact ones and against attnzoo.functional ----------------
@pytest.mark.parametrize("p,scale", [(1, 1.0), (2, 0.7), (3, 0.15)])
def test_taylor_kernel_sums_match_exact(p, scale):
    b, Y, W = randn((50, p), 1, scale), randn((60, p), 2), randn((60, 3), 3).abs()
    want = torch.exp(b @ Y.T) @ W                       # direct float64 sum
    for method in ("exact", "taylor"):
        S, shift = kernel_sums.exp_kernel_sums(b, Y, W, method=method, tol=1e-11)
        torch.testing.assert_close(S * torch.exp(shift)[:, None], want, rtol=1e-9, atol=0)


@pytest.mark.parametrize("variant", ["softmax", "l2", "sinkhorn"])
def test_kernel_sum_field_matches_functional(variant):
    X = randn((12, 2), 7, 0.7)
    Q, K, V = randn((2, 2), 8, 0.6), randn((2, 2), 9, 0.6), randn((2, 2), 10)
    fast = particles.KernelSumField(variant, Q, K, V, sinkhorn_tol=1e-12)(X)
    ref = self_velocity(variant, X, Q, K, V, n_iters=200)
    torch.testing.assert_close(fast, ref, rtol=1e-7, atol=1e-9)


# ---- Lemma 4.14 vs Prop 4.15 --------------------------------------------------------------------
def test_sinkhorn_closed_form_lemma_not_prop():
    """Regress discrete Sinkhorn's field on x: the linear part is Lemma 4.14's (B = A^T Sigma A)."""
    n = 4000
    L = torch.tensor([[1.0, 0.0], [0.6, 0.35]], dtype=DT) * 0.8
    X = torch.tensor([0.3, -0.2], dtype=DT) + randn((n, 2), 11) @ L.T
    Q = torch.tensor([[0.8, 0.3], [-0.2, 0.5]], dtype=DT)
    K = torch.tensor([[0.4, -0.6], [0.7, 0.2]], dtype=DT)
    V = torch.tensor([[1.0, 0.3], [-0.2, 0.8]], dtype=DT)
    G = particles.KernelSumField("sinkhorn", Q, K, V)(X)
    Z = torch.cat([X, torch.ones(n, 1, dtype=DT)], 1)
    M_emp = torch.linalg.lstsq(Z, G).solution[:2].T
    m, S = particles.moments(X)
    err = {f: float((gaussian.affine_field("sinkhorn", m, S, Q, K, V, sinkhorn_form=f)[0] - M_emp).norm()
                    / M_emp.norm()) for f in ("lemma", "prop")}
    assert err["lemma"] < 0.02, err
    assert err["prop"] > 0.5, err


# ---- acceptance: n = 20000 particles follow the Gaussian ODE -------------------------------------
N_BIG = 20000


@pytest.mark.timeout(300)
@pytest.mark.parametrize("variant,a_scale,v_scale", [("softmax", 1.0, 2.0), ("l2", 0.5, 2.0), ("sinkhorn", 1.0, 2.0)])
def test_particles_follow_gaussian_ode(variant, a_scale, v_scale):
    A = torch.tensor([[-0.35, 0.45], [-0.15, -0.25]], dtype=DT) * a_scale     # non-symmetric
    Q, K = A.clone(), torch.eye(2, dtype=DT)                                  # K^T Q = A
    V = v_scale * torch.tensor([[1.0, 0.3], [-0.2, 0.8]], dtype=DT)
    L = torch.tensor([[1.0, 0.0], [0.6, 0.35]], dtype=DT) * 0.6
    X0 = torch.tensor([0.1, -0.05], dtype=DT) + randn((N_BIG, 2), 12) @ L.T
    m0, S0 = particles.moments(X0)
    field = particles.KernelSumField(variant, Q, K, V, tol=1e-7)
    times, states = particles.rk4(field, X0, t_end=1.0, n_steps=2)
    sol = gaussian.solve_gaussian(variant, m0, S0, Q, K, V, t_end=1.0, n_steps=200)
    # sampling error: empirical covariance ~ sqrt(2/n) relative, mean ~ sqrt(lambda_max / n)
    tol_S = 3 * math.sqrt(2 / N_BIG)
    for t, X in zip(times[1:], states[1:]):
        i = round(t / 1.0 * 200)
        m, S = particles.moments(X)
        S_ode, a_ode = sol["Sigmas"][i], sol["alphas"][i]
        tol_m = 4 * math.sqrt(float(torch.linalg.eigvalsh(S_ode).max()) / N_BIG)
        assert float((S - S_ode).norm() / S_ode.norm()) < tol_S
        assert float((m - a_ode).norm()) < tol_m
    # the test can fail: by t = 1 the cloud moved by much more than the tolerance
    assert float((S - S0).norm() / S_ode.norm()) > 4 * tol_S
    if variant == "sinkhorn":   # Prop 4.15's covariance equation misses the particles
        wrong = gaussian.solve_gaussian(variant, m0, S0, Q, K, V, t_end=1.0, n_steps=200, sinkhorn_form="prop")
        S = particles.moments(states[-1])[1]
        assert float((S - wrong["Sigmas"][-1]).norm() / S.norm()) > 3 * tol_S


# ---- d = 1: softmax blows up at (2 v a s0)^-1, L2 never does --------------------------------------
@pytest.mark.parametrize("a,v,s0", [(0.5, 1.0, 1.0), (-1.0, -0.7, 2.0)])
def test_softmax_d1_blowup_time(a, v, s0):
    t_star = 1.0 / (2 * v * a * s0)
    Q, K, V = torch.tensor([[a]], dtype=DT), torch.tensor([[1.0]], dtype=DT), torch.tensor([[v]], dtype=DT)
    sol = gaussian.solve_gaussian("softmax", torch.zeros(1, dtype=DT), torch.tensor([[s0]], dtype=DT), Q, K, V,
                                  t_end=1.5 * t_star, n_steps=600, blowup=1e6)
    assert sol["blowup_time"] is not None
    assert abs(sol["blowup_time"] - t_star) < 0.01 * t_star
    i = 200   # t = t_star / 2: s = (1/s0 - 2 v a t)^-1 = 2 s0
    assert abs(float(sol["Sigmas"][i, 0, 0]) - 1 / (1 / s0 - 2 * v * a * float(sol["times"][i]))) < 1e-6 * s0
    assert dynamics.softmax_d1_blowup_time(a, v, s0) == pytest.approx(t_star)


def test_softmax_d1_particles_follow_blowup_curve():
    a, v, s0, n = 0.5, 1.0, 0.5, N_BIG
    t_star = 1 / (2 * v * a * s0)
    X = randn((n, 1), 13) * math.sqrt(s0)
    s_emp0 = float(particles.moments(X)[1])
    field = particles.KernelSumField("softmax", torch.tensor([[a]], dtype=DT), torch.eye(1, dtype=DT),
                                     torch.tensor([[v]], dtype=DT), tol=1e-8)
    t = 0.5 * t_star
    _, states = particles.rk4(field, X, t_end=t, n_steps=8, record=[8])
    want = 1 / (1 / s_emp0 - 2 * v * a * t)
    assert abs(float(particles.moments(states[-1])[1]) - want) < 3 * math.sqrt(2 / n) * want


@pytest.mark.parametrize("a,v,k,s0", [(0.5, 1.0, 1.0, 1.0), (2.0, 0.3, 0.5, 0.5), (1.0, 1.0, 0.7, 1.0)])
def test_l2_d1_never_blows_up(a, v, k, s0):
    """Prop 4.13 / Lemma 4.12: s' = 4 a v s^2 / (1 + 2 k^2 s) (a = q k) has a global solution;
    check it against the implicit solution -1/s + 2 k^2 ln s = 4 a v t + const."""
    q = a / k
    t_soft = 1 / (2 * v * a * s0)
    T = 3 * t_soft   # well past the time softmax with the same a, v, s0 blows up
    sol = gaussian.solve_gaussian("l2", torch.zeros(1, dtype=DT), torch.tensor([[s0]], dtype=DT),
                                  torch.tensor([[q]], dtype=DT), torch.tensor([[k]], dtype=DT),
                                  torch.tensor([[v]], dtype=DT), t_end=T, n_steps=600, blowup=1e12)
    assert sol["blowup_time"] is None
    s = sol["Sigmas"][:, 0, 0]
    G = -1 / s + 2 * k * k * torch.log(s)
    torch.testing.assert_close(G - G[0], 4 * a * v * sol["times"].to(DT), rtol=1e-6, atol=1e-6)


def test_l2_d2_no_blowup_where_softmax_blows_up():
    variant, Q, K, V = dynamics.d2_configs()["blowup"]
    S0 = torch.eye(2, dtype=DT) * 0.5
    soft = gaussian.solve_gaussian("softmax", torch.zeros(2, dtype=DT), S0, Q, K, V, t_end=20, n_steps=400, blowup=1e8)
    assert soft["blowup_time"] is not None
    T = 3 * soft["blowup_time"]
    l2 = gaussian.solve_gaussian("l2", torch.zeros(2, dtype=DT), S0, Q, K, V, t_end=T, n_steps=400, blowup=1e30)
    assert l2["blowup_time"] is None and bool(torch.isfinite(l2["Sigmas"]).all())


# ---- d = 2 behaviours and limit ranks --------------------------------------------------------------
@pytest.mark.parametrize("name", ["convergence", "divergence", "blowup"])
def test_d2_behaviours(name):
    study = dynamics.d2_study(name, n_grid=3, n_steps=400)
    kinds = {t["kind"] for t in study["trajectories"]}
    assert kinds == {name}, kinds
    for t in study["trajectories"]:   # every point stays in the PSD cone z >= sqrt(x^2 + y^2)
        c = t["cone"]
        assert bool((c[:, 2] + 1e-9 >= c[:, :2].norm(dim=1)).all())


@pytest.mark.parametrize("d", [3, 4])
def test_limit_rank_bounded_for_identity_V(d):
    """Prop 4.4 / 4.8 (V = I, A = -Q^T Q): limit rank <= d - rk A."""
    h = dynamics.rank_histogram(d, n_points=4, v_mode="identity", t_end=1e3, seed=d)
    assert h["blowups"] == 0 and len(h["ranks"]) == 4
    assert max(h["ranks"]) <= d - d // 2


@pytest.mark.parametrize("variant", ["softmax", "l2", "sinkhorn", "sigmoid", "relu", "linear", "fenchel", "ot",
                                     "multihead"])
def test_every_variant_moves_particles(variant):
    """One RK4 step of the functional field equals the RK4 formula applied by hand to self_velocity."""
    heads = variant == "multihead"
    shape = (2, 2, 3) if heads else (2, 3)
    Q, K, V = randn(shape, 1, 0.5), randn(shape, 2, 0.5), randn((2, 3, 3) if heads else (3, 3), 3, 0.5)
    base = "softmax" if heads else variant
    X = randn((6, 3), 4)
    kw = {"n_iters": 20} if variant == "sinkhorn" else {}
    f = particles.make_field(base, Q, K, V, **kw)
    _, states = particles.rk4(f, X, t_end=0.1, n_steps=1)

    def g(Z):
        return self_velocity(base, Z, Q, K, V, **kw)
    k1 = g(X)
    k2 = g(X + 0.05 * k1)
    k3 = g(X + 0.05 * k2)
    k4 = g(X + 0.1 * k3)
    torch.testing.assert_close(states[-1], X + 0.1 / 6 * (k1 + 2 * k2 + 2 * k3 + k4), rtol=1e-12, atol=1e-12)
    assert float((states[-1] - X).abs().max()) > 0
