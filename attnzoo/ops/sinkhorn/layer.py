"""What Sinkhorn attention adds to the shared layer: n_iters, eps and cost, passed on every call."""
from __future__ import annotations

from ..record import LayerHook
from .functional import check


class SinkhornHook(LayerHook):
    def setup(self, layer, *, n_iters: int = 3, eps: float = 1.0, cost: str = "l2") -> None:
        checked = check(None, None, None, scale=None, n_iters=n_iters, eps=eps, cost=cost)
        layer.n_iters, layer.eps, layer.cost = checked["n_iters"], checked["eps"], checked["cost"]

    def kernel_kwargs(self, layer, q, k, v, *, x, attn_mask, is_causal, **forward_kwargs) -> dict:
        super().kernel_kwargs(layer, q, k, v, x=x, attn_mask=attn_mask, is_causal=is_causal, **forward_kwargs)
        return {"n_iters": layer.n_iters, "eps": layer.eps, "cost": layer.cost}

    def packed_kwargs(self, layer, q, k, v, *, x, is_causal, **forward_kwargs):
        """Constructor options only: the same for every sequence."""
        return self.kernel_kwargs(layer, q, k, v, x=x, attn_mask=None, is_causal=is_causal, **forward_kwargs)
