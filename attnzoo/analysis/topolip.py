"""TopoLip (paper 003): how much the topology of the token cloud changes from layer to layer.

Protocol (paper 003 sec 5): model in eval mode; for each input, collect every layer's output as a
point cloud; persistence diagrams (ripser, H0 and H1 by default, infinite bars dropped); the
Wasserstein distance WD_l between the diagrams of adjacent layers l, l+1 (persim.wasserstein, one
per homology degree, summed); the change rate r_l = |(WD_{l+1} - WD_l) / WD_l|; TopoLip = max_l r_l.
Depth is rescaled to [0, 1] so models of different depths share one axis. Curves are averaged over
inputs; TopoLip is reported as the mean over inputs of the per-input maximum.

Point clouds: a transformer block output (B, N, D) gives, per input, N points in R^D (tokens);
a CNN feature map (B, C, H, W) gives H*W points in R^C (one point per spatial position: its
channel vector), so both are clouds of "tokens" in feature space. ``max_points`` subsamples
(deterministically, evenly spaced) larger clouds.
"""
from __future__ import annotations

import warnings

import numpy as np
import torch


def as_clouds(t):
    """(B, N, D) token tensor or (B, C, H, W) feature map -> list of B numpy clouds (n, dim)."""
    if t.dim() == 4:
        B, C, H, W = t.shape
        t = t.reshape(B, C, H * W).transpose(1, 2)
    if t.dim() != 3:
        raise ValueError(f"layer output must be (B, N, D) or (B, C, H, W), got {tuple(t.shape)}")
    return [c.detach().double().cpu().numpy() for c in t]


def diagrams(cloud, *, maxdim=1, max_points=None):
    """Persistence diagrams [H0, ..., H_maxdim] of a cloud (n, dim), infinite bars removed."""
    from ripser import ripser
    X = np.asarray(cloud, dtype=np.float64)
    if X.ndim != 2:
        raise ValueError(f"cloud must be (n, dim), got shape {X.shape}")
    if max_points is not None and len(X) > max_points:
        X = X[np.linspace(0, len(X) - 1, max_points).round().astype(int)]
    with warnings.catch_warnings():   # ripser warns when a cloud has fewer points than dimensions: expected here
        warnings.simplefilter("ignore", UserWarning)
        dgms = ripser(X, maxdim=maxdim)["dgms"]
    return [d[np.isfinite(d).all(axis=1)] if len(d) else np.zeros((0, 2)) for d in dgms]


def diagram_distance(d1, d2):
    """sum over homology degrees of persim's Wasserstein distance (empty diagrams handled)."""
    import persim
    total = 0.0
    for a, b in zip(d1, d2):
        if len(a) == 0 and len(b) == 0:
            continue
        if len(a) == 0 or len(b) == 0:  # distance to the empty diagram: every bar matched to the diagonal
            c = a if len(a) else b
            total += float(np.sum((c[:, 1] - c[:, 0]) / 2.0))
            continue
        total += float(persim.wasserstein(a, b))
    return total


def change_rates(wd):
    """r_l = |(WD_{l+1} - WD_l) / WD_l| for a sequence of adjacent-layer distances."""
    wd = np.asarray(wd, dtype=np.float64)
    if wd.ndim != 1 or len(wd) < 2:
        raise ValueError(f"need at least two adjacent-layer distances, got {wd.shape}")
    return np.abs((wd[1:] - wd[:-1]) / np.maximum(np.abs(wd[:-1]), 1e-12))


def topolip_of_clouds(clouds, *, maxdim=1, max_points=None):
    """One input's clouds (list over layers, each (n_l, dim_l)) -> dict(wd, rates, topolip, depth)."""
    if len(clouds) < 3:
        raise ValueError(f"need at least 3 layers (2 distances, 1 rate), got {len(clouds)}")
    dg = [diagrams(c, maxdim=maxdim, max_points=max_points) for c in clouds]
    wd = [diagram_distance(dg[i], dg[i + 1]) for i in range(len(dg) - 1)]
    rates = change_rates(wd)
    depth = np.linspace(0.0, 1.0, len(clouds))
    return {"wd": wd, "rates": rates.tolist(), "topolip": float(rates.max()),
            "wd_depth": ((depth[:-1] + depth[1:]) / 2).tolist(),
            "rate_depth": depth[1:-1].tolist()}


@torch.no_grad()
def collect_layer_outputs(model, images, modules):
    """Forward ``images`` once; return the outputs of ``modules`` (list) in order."""
    outs = [None] * len(modules)
    hooks = [m.register_forward_hook(lambda mod, a, o, i=i: outs.__setitem__(i, o.detach()))
             for i, m in enumerate(modules)]
    was = model.training
    model.eval()
    try:
        model(images)
    finally:
        for h in hooks:
            h.remove()
        model.train(was)
    return outs


def model_topolip(model, images, modules, *, maxdim=1, max_points=None, progress=False):
    """TopoLip of ``model`` on a batch: per-input results and their mean curves."""
    outs = collect_layer_outputs(model, images, modules)
    per_layer = [as_clouds(o) for o in outs]
    B = len(per_layer[0])
    it = range(B)
    if progress:
        from tqdm import tqdm
        it = tqdm(it, desc="topolip", leave=False)
    results = [topolip_of_clouds([layer[b] for layer in per_layer], maxdim=maxdim, max_points=max_points)
               for b in it]
    return {"per_input": results,
            "topolip": float(np.mean([r["topolip"] for r in results])),
            "wd": np.mean([r["wd"] for r in results], axis=0).tolist(),
            "rates": np.mean([r["rates"] for r in results], axis=0).tolist(),
            "wd_depth": results[0]["wd_depth"], "rate_depth": results[0]["rate_depth"]}


CORRUPTIONS = ("clean", "gaussian_noise", "blur", "pixelate")


def corrupt(images, kind, *, severity=1.0, generator=None):
    """CIFAR-10-C-like corruptions of (B, C, H, W) images in their normalised scale."""
    if kind not in CORRUPTIONS:
        raise ValueError(f"kind must be one of {CORRUPTIONS}, got {kind!r}")
    if kind == "clean":
        return images
    if kind == "gaussian_noise":
        return images + 0.5 * severity * torch.randn(images.shape, generator=generator, dtype=images.dtype)
    if kind == "blur":
        from torchvision.transforms.functional import gaussian_blur
        k = 2 * int(round(1 + severity)) + 1
        return gaussian_blur(images, [k, k], [1.0 * severity + 0.5] * 2)
    H, W = images.shape[-2:]
    f = max(2, int(round(2 + 2 * severity)))
    small = torch.nn.functional.interpolate(images, size=(max(1, H // f), max(1, W // f)), mode="area")
    return torch.nn.functional.interpolate(small, size=(H, W), mode="nearest")
