"""attnzoo.layers: one nn.Module per attention variant, all with timm's Attention interface (the
classes of the built-in variants are made from their records in variants.py), and the wrappers
MaskedAttention and MultiheadAttention."""
from ..ops.fenchel.t5_buckets import t5_relative_buckets
from .base import AttentionLayer
from .masked import MaskedAttention
from .multihead import MultiheadAttention
from .variants import (FenchelAttention, L2Attention, LinearAttention, OTAttention, ReLUAttention,
                       SigmoidAttention, SinkhornAttention, SoftmaxAttention)

__all__ = ["AttentionLayer", "SoftmaxAttention", "L2Attention", "SinkhornAttention", "SigmoidAttention",
           "ReLUAttention", "LinearAttention", "MaskedAttention", "MultiheadAttention", "FenchelAttention",
           "OTAttention", "t5_relative_buckets"]
