"""TopoLip (paper 003): change rates, permutation invariance, CNN feature maps as clouds."""
import numpy as np
import pytest
import torch

from attnzoo.analysis import topolip as T


def _cloud(n, d, seed):
    return np.random.default_rng(seed).normal(size=(n, d))


def test_change_rates_formula():
    wd = [2.0, 3.0, 1.5, 6.0]
    want = [abs((3 - 2) / 2), abs((1.5 - 3) / 3), abs((6 - 1.5) / 1.5)]
    np.testing.assert_allclose(T.change_rates(wd), want, rtol=1e-12)


def test_diagram_distance_zero_on_same_cloud_and_h0_of_three_points():
    X = _cloud(12, 3, 0)
    d = T.diagrams(X)
    assert T.diagram_distance(d, T.diagrams(X[::-1].copy())) == pytest.approx(0.0, abs=1e-12)
    # H0 of three collinear points at 0, 1, 3: finite bars die at the merge distances 1 and 2
    h0 = T.diagrams(np.array([[0.0], [1.0], [3.0]]), maxdim=0)[0]
    np.testing.assert_allclose(sorted(h0[:, 1]), [1.0, 2.0])


@pytest.mark.parametrize("seed", [0, 1])
def test_topolip_invariant_to_token_permutation(seed):
    rng = np.random.default_rng(seed)
    clouds = [_cloud(15, 4, seed + i) * (1 + i) for i in range(4)]
    base = T.topolip_of_clouds(clouds)
    perm = [c[rng.permutation(len(c))] for c in clouds]
    got = T.topolip_of_clouds(perm)
    assert got["topolip"] == pytest.approx(base["topolip"], rel=1e-12)
    np.testing.assert_allclose(got["wd"], base["wd"], rtol=1e-12)
    assert base["rate_depth"] == pytest.approx([1 / 3, 2 / 3])


def test_model_topolip_on_vit_and_feature_maps():
    from timm.models.vision_transformer import VisionTransformer
    vit = VisionTransformer(img_size=8, patch_size=2, in_chans=1, num_classes=3, embed_dim=8, depth=3, num_heads=2)
    x = torch.randn(2, 1, 8, 8)
    res = T.model_topolip(vit, x, list(vit.blocks))
    assert len(res["per_input"]) == 2 and np.isfinite(res["topolip"]) and len(res["rates"]) == 1
    # permuting patches (and their position embeddings) permutes the tokens: TopoLip unchanged
    clouds = T.as_clouds(torch.randn(2, 5, 3, 3))
    assert clouds[0].shape == (9, 5)
    for kind in T.CORRUPTIONS:
        assert T.corrupt(x, kind).shape == x.shape
