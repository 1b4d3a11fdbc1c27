"""attnzoo.layers: one nn.Module per attention variant, all with timm's Attention interface."""
from .base import AttentionLayer
from .fenchel import FenchelAttention, t5_relative_buckets
from .multihead import MultiheadAttention
from .ot import OTAttention
from .simple import (L2Attention, LinearAttention, MaskedAttention, ReLUAttention, SigmoidAttention,
                     SinkhornAttention, SoftmaxAttention)

__all__ = ["AttentionLayer", "SoftmaxAttention", "L2Attention", "SinkhornAttention", "SigmoidAttention",
           "ReLUAttention", "LinearAttention", "MaskedAttention", "MultiheadAttention", "FenchelAttention",
           "OTAttention", "t5_relative_buckets"]
