"""Model construction from the ``model:`` section of a training config."""
from __future__ import annotations

from torch import nn

from .otvit import OTViT
from .vit import ViT

MODELS = {"vit": ViT, "otvit": OTViT}
_OT_ONLY = ("ot_alpha", "ot_gamma", "template_tokens", "template_grad", "ot_queries", "ot_backend")


def build_model(name: str, **kwargs) -> nn.Module:
    """``build_model("vit" | "otvit", img_size=..., in_chans=..., num_classes=..., ...)``."""
    if name not in MODELS:
        raise ValueError(f"model name must be one of {sorted(MODELS)}, got {name!r}")
    if name == "vit":
        kwargs = {k: v for k, v in kwargs.items() if k not in _OT_ONLY}
    return MODELS[name](**kwargs)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
