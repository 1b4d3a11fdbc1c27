"""attnzoo.layers: one nn.Module per attention variant, all with timm's Attention interface (the
classes of the built-in variants are written in variants.py, their docstrings and options taken from
their records), and the wrappers MaskedAttention and MultiheadAttention. The exports are listed by
hand; tests/test_variant_lists.py checks them against the catalog of variants."""
from ..ops.fenchel.t5_buckets import t5_relative_buckets
from .base import AttentionLayer
from .masked import MaskedAttention
from .multihead import MultiheadAttention
from .variants import (FenchelAttention, L2Attention, LinearAttention, OTAttention, ReLUAttention,
                       SigmoidAttention, SinkhornAttention, SoftmaxAttention)

__all__ = ["AttentionLayer", "SoftmaxAttention", "L2Attention", "SinkhornAttention", "SigmoidAttention",
           "ReLUAttention", "LinearAttention", "MaskedAttention", "MultiheadAttention", "FenchelAttention",
           "OTAttention", "t5_relative_buckets"]
