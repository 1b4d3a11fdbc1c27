"""What L2 attention adds to the shared layer: ``tie_qk``."""
from __future__ import annotations

from .. import validate as V
from ..record import LayerHook


class L2Hook(LayerHook):
    """``tie_qk=True`` uses W_Q (and its bias) for the keys too, Kim et al.'s Lipschitz form; the qkv
    weight keeps its shape so timm checkpoints still load."""

    def setup(self, layer, *, tie_qk: bool = False) -> None:
        layer.tie_qk = V.check_flag("tie_qk", tie_qk)

    def keys_are_queries(self, layer) -> bool:
        return layer.tie_qk
