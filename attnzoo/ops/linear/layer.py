"""What linear attention adds to the shared layer: the feature map."""
from __future__ import annotations

from .. import validate as V
from ..variant import LayerHook
from .reference import FEATURE_MAPS


class LinearHook(LayerHook):
    def setup(self, layer, *, feature_map: str = "elu") -> None:
        layer.feature_map = V.check_choice("feature_map", feature_map, FEATURE_MAPS)

    def kernel_kwargs(self, layer, q, k, v, *, x, attn_mask, is_causal, **forward_kwargs) -> dict:
        super().kernel_kwargs(layer, q, k, v, x=x, attn_mask=attn_mask, is_causal=is_causal, **forward_kwargs)
        return {"feature_map": layer.feature_map}
