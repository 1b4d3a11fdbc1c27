"""attnzoo: drop-in attention layers (softmax, L2, Sinkhorn, sigmoid, ReLU, linear, masked,
multi-head, Fenchel-dual preference-weighted, optimal-transport) behind one interface."""
from . import functional
from .functional import explain
from .layers import (AttentionLayer, FenchelAttention, L2Attention, LinearAttention, MaskedAttention,
                     MultiheadAttention, OTAttention, ReLUAttention, SigmoidAttention, SinkhornAttention,
                     SoftmaxAttention)
from .ops.dispatch import use_backend
from .ops.variant import LayerHook, Variant
from .registry import available, create, describe, layer, parse_spec, register, register_variant, unregister
from .adapters import from_pretrained, plan_swap, register_hf_attention, swap, unswap

__version__ = "0.1.0"

__all__ = ["functional", "explain", "use_backend", "available", "create", "describe", "layer", "parse_spec",
           "register", "register_variant", "unregister", "Variant", "LayerHook", "AttentionLayer",
           "SoftmaxAttention", "L2Attention", "SinkhornAttention", "SigmoidAttention", "ReLUAttention",
           "LinearAttention", "MaskedAttention", "MultiheadAttention", "FenchelAttention", "OTAttention",
           "swap", "unswap", "plan_swap", "register_hf_attention", "from_pretrained"]
