"""W1/W2 between token clouds (POT) and Wasserstein-Lipschitz ratios."""
import itertools
import math

import pytest
import torch

from attnzoo.analysis import wasserstein as W
from tests.common import randn  # float64 N(0, 1) * scale from its own seed

DT = torch.float64


def brute_force_w(X, Y, p):
    """Equal sizes: the optimal plan is a permutation (Birkhoff), so enumerate them."""
    n = X.shape[0]
    C = torch.cdist(X, Y) ** p
    return min(float(sum(C[i, s[i]] for i in range(n))) / n for s in itertools.permutations(range(n))) ** (1 / p)


@pytest.mark.parametrize("n,d,seed", [(5, 2, 0), (7, 3, 1), (20, 4, 2)])
def test_cloud_with_itself_is_zero(n, d, seed):
    X = randn((n, d), seed)
    for p, tol in ((1, 1e-12), (2, 1e-7)):   # W2 = sqrt(cost): rounding 1e-16 in the cost -> 1e-8
        assert W.wasserstein(X, X, p=p) == pytest.approx(0.0, abs=tol)
        assert W.wasserstein(X, X[torch.randperm(n)], p=p) == pytest.approx(0.0, abs=tol)


@pytest.mark.parametrize("n,m,d,seed", [(6, 6, 2, 0), (10, 7, 3, 1), (30, 45, 2, 2)])
def test_shifted_cloud_is_the_shift(n, m, d, seed):
    X = randn((n, d), seed)
    shift = randn((d,), seed + 1) * 3
    for p in (1, 2):
        # translation: W_p(X, X + s) = |s| (equality: any plan moves mass by s on average; identity attains it)
        assert W.wasserstein(X, X + shift, p=p) == pytest.approx(float(shift.norm()), rel=1e-9)


@pytest.mark.parametrize("n,seed", [(5, 0), (6, 1)])
def test_exact_matches_brute_force(n, seed):
    X, Y = randn((n, 2), seed), randn((n, 2), seed + 10)
    for p in (1, 2):
        assert W.wasserstein(X, Y, p=p, method="exact") == pytest.approx(brute_force_w(X, Y, p), rel=1e-9)


def test_different_sizes_one_point_and_entropic():
    X = randn((9, 3), 3)
    y = randn((1, 3), 4)
    # to a single point every plan is the product: W1 = mean distance, W2 = sqrt(mean squared distance)
    assert W.wasserstein(X, y, p=1) == pytest.approx(float((X - y).norm(dim=1).mean()), rel=1e-9)
    assert W.wasserstein(X, y, p=2) == pytest.approx(math.sqrt(float((X - y).pow(2).sum(1).mean())), rel=1e-9)
    A, B = randn((60, 2), 5), randn((50, 2), 6) + 1.0
    exact = W.wasserstein(A, B, p=2, method="exact")
    ent = W.wasserstein(A, B, p=2, method="sinkhorn", reg=1e-3)
    assert exact <= ent * (1 + 1e-6) and ent < exact * 1.05


@pytest.mark.parametrize("bad,match", [(dict(p=3), "p must"), (dict(method="x"), "method"), (dict(metric="x"), "metric")])
def test_bad_arguments(bad, match):
    with pytest.raises(ValueError, match=match):
        W.wasserstein(randn((3, 2), 0), randn((3, 2), 1), **bad)


def test_ratio_of_a_translation_map_is_one_and_drop_add_work():
    X = randn((12, 2), 7)
    F = lambda Z: 2.0 * Z + 1.0   # noqa: E731  W(F mu, F nu) = 2 W(mu, nu) exactly
    rows = W.ratio_study(F, [X], kinds=("noise", "drop", "add"), strengths=(0.1, 0.5))
    assert {r["kind"] for r in rows} == {"noise", "drop", "add"}
    assert any(r["M"] == 11 for r in rows) and any(r["M"] == 13 for r in rows)
    for r in rows:
        assert r["ratio"] == pytest.approx(2.0, rel=1e-7)


def test_thm29_bound_holds_for_gaussian_kernel_attention():
    """Paper 001 Thm 29 (l1 ground metric): empirical ratios of x -> softmax(-|x - y|^2) V y stay below."""
    V = torch.eye(2, dtype=DT) * 0.8 + 0.1
    F = W.gaussian_kernel_attention(V)
    X = randn((10, 2), 8)
    rows = W.ratio_study(F, [X], kinds=("noise", "drop", "add"), strengths=(0.05, 0.5), metric="cityblock")
    k_l = float(torch.linalg.matrix_norm(V, ord=1))
    for r in rows:
        assert r["ratio"] <= W.thm29_bound(2, r["N"], r["M"], k_l)
