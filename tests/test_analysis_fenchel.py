"""Paper 004's dual (7): the Gaussian case (sec 5), alpha -> 0, second order (13), model diagnostic."""
import numpy as np
import pytest
import torch

from attnzoo.analysis import fenchel_dual as FD
from tests.common import randn  # float64 N(0, 1) * scale from its own seed

DT = torch.float64


def gauss_hermite_templates(mu, n=24):
    """Templates and log-weights of a tensor Gauss-Hermite rule for N(mu, I) in d = 2 (exact moments)."""
    x, w = np.polynomial.hermite_e.hermegauss(n)   # weight exp(-x^2/2)
    w = w / w.sum()
    X, Y = np.meshgrid(x, x, indexing="ij")
    t = torch.tensor(np.stack([X.ravel(), Y.ravel()], 1), dtype=DT) + mu
    logw = torch.tensor(np.log(np.outer(w, w).ravel()), dtype=DT)
    return t, logw


@pytest.mark.parametrize("alpha,seed", [(0.3, 0), (1.0, 1), (4.0, 2)])
def test_gaussian_case_closed_form(alpha, seed):
    """u = N(mu, I), evidence b = mu + z: lambda* = alpha/(alpha+1) (b - mu), h = mu/(1+alpha) + alpha b/(1+alpha)."""
    mu = randn((2,), seed, 0.5)
    t, logw = gauss_hermite_templates(mu)
    z = randn((1, 1, 3, 2), seed + 1, 0.7)
    k = t[None, None]
    lam, _, _ = FD.dual_lambdas(z, k, scale=1.0, alpha=alpha, log_u=logw.expand(1, 1, 3, -1))
    b = mu + z
    torch.testing.assert_close(lam, alpha / (alpha + 1) * (b - mu), rtol=1e-7, atol=1e-9)
    p = torch.softmax(logw + lam @ t.T, dim=-1)            # p~_i proportional to u_i e^{<t_i, lambda*>}
    h = p @ t
    torch.testing.assert_close(h, mu / (1 + alpha) + alpha * b / (1 + alpha), rtol=1e-7, atol=1e-9)


def test_first_order_limit_alpha_to_zero():
    q, k = randn((1, 2, 4, 3), 3), randn((1, 2, 6, 3), 4)
    devs = [float(FD.relative_deviation(q, k, scale=0.5, alpha=a).max()) for a in (1.0, 0.1, 0.01, 0.001)]
    assert all(b < a for a, b in zip(devs, devs[1:]))
    assert devs[-1] < 0.01   # O(alpha): ||lambda* - alpha z|| / ||lambda*|| ~ alpha ||Cov_u(k)||


@pytest.mark.parametrize("alpha,seed", [(0.05, 5), (0.2, 6), (0.5, 7)])
def test_second_order_closer_than_first(alpha, seed):
    q, k = randn((1, 1, 8, 3), seed), randn((1, 1, 10, 3), seed + 1)
    lam, lam1, lam2 = FD.dual_lambdas(q, k, scale=1.0, alpha=alpha)
    e1, e2 = (lam1 - lam).norm(dim=-1), (lam2 - lam).norm(dim=-1)
    assert bool((e2 < e1).all())


def test_dual_optimality_and_model_hooks():
    """The gradient of (7), mu + z - lambda/alpha - E_p[t], vanishes at lambda*; hooks see every layer/head."""
    q, k = randn((2, 2, 5, 4), 8), randn((2, 2, 7, 4), 9)
    lam, _, _ = FD.dual_lambdas(q, k, scale=0.5, alpha=1.0)
    p = torch.softmax(lam @ k.transpose(-1, -2), -1)
    grad = k.mean(-2, keepdim=True) + 0.5 * q - lam - p @ k
    assert float(grad.abs().max()) < 1e-6
    from timm.models.vision_transformer import VisionTransformer
    vit = VisionTransformer(img_size=8, patch_size=4, in_chans=1, num_classes=3, embed_dim=16, depth=2, num_heads=2)
    out = FD.model_deviation(vit, [torch.randn(2, 1, 8, 8)])
    assert len(out) == 2 and all(v.shape == (2, 2 * 5) for v in out.values())
    assert all(bool(torch.isfinite(v).all()) and float(v.min()) >= 0 for v in out.values())
