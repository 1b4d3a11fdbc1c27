"""What OT attention adds to the shared layer: alpha, gamma, and ``forward(x, templates=)``."""
from __future__ import annotations

from typing import Optional

from .. import validate as V
from ..record import LayerHook


class OTHook(LayerHook):
    """``templates`` (B, M, dim), a keyword argument of the layer's forward, are extra tokens (OT-ViT's
    same-class templates) projected with the layer's key and value weights (and k_norm) and added to
    the template set A. gamma defaults to sqrt(head_dim)."""

    def setup(self, layer, *, alpha: float = 1.0, gamma: Optional[float] = None) -> None:
        layer.alpha = V.check_positive("alpha", alpha)
        layer.gamma = None if gamma is None else V.check_positive("gamma", gamma)

    def kernel_kwargs(self, layer, q, k, v, *, x, attn_mask, is_causal, templates=None) -> dict:
        tk = tv = None
        if templates is not None:
            if templates.dim() != 3 or templates.shape[0] != x.shape[0] or templates.shape[2] != x.shape[2]:
                raise ValueError(f"templates must have shape (B={x.shape[0]}, M, dim={x.shape[2]}), "
                                 f"got {tuple(templates.shape)}")
            if templates.shape[1] > 0:
                _, tk, tv = layer.raw_qkv(templates)
                tk = layer.k_norm(tk)
        return {"alpha": layer.alpha, "gamma": layer.gamma, "templates_k": tk, "templates_v": tv}

    def packed_kwargs(self, layer, q, k, v, *, x, is_causal, templates=None):
        """alpha and gamma are the same for every sequence; templates are per batch entry, which a packed
        call does not have (None: per length, where each stacked sequence is refused or served alike)."""
        if templates is not None:
            return None
        return {"alpha": layer.alpha, "gamma": layer.gamma, "templates_k": None, "templates_v": None}
