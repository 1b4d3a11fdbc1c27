"""ViT and OT-ViT (paper 004 sec 9) built from timm blocks with attnzoo attention layers."""
from .factory import build_model, count_parameters
from .ot_block import OTBlock
from .otvit import OTViT
from .vit import ViT, timm_attention_class

__all__ = ["ViT", "OTViT", "OTBlock", "build_model", "count_parameters", "timm_attention_class"]
