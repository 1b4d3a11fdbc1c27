"""timm's EVA attention (``timm.models.eva.EvaAttention``, fused-qkv form) on attnzoo layers.

EVA differs from timm's Attention in three places, all before the kernel: the fused qkv Linear has no
bias and the bias is q_bias / 0 / v_bias (k_bias is a zero buffer); rotary embeddings (``rope=``) turn
q and k for the non-prefix tokens; and its forward takes ``rope``. ``EvaLayout`` adds exactly that to
any attnzoo layer class, so every variant's kernel runs on EVA's q, k, v.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..layers import tracing

_CLASSES: dict[type, type] = {}


class EvaLayout:
    """Mixin placed before an attnzoo layer class (see ``eva_class``)."""
    num_prefix_tokens: int
    rotate_half: bool

    def raw_qkv(self, x):
        B, N, _ = x.shape
        bias = None if self.q_bias is None else torch.cat((self.q_bias, self.k_bias, self.v_bias))
        qkv = F.linear(x, self.qkv.weight, bias)
        return qkv.reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)

    def project_qkv(self, x):
        from timm.layers import apply_rot_embed_cat
        q, k, v = self.raw_qkv(x)
        if self.keys_are_queries:
            k = q
        q, k = self.q_norm(q), self.k_norm(k)
        rope = self._rope
        if rope is not None:
            n = self.num_prefix_tokens
            q = torch.cat([q[:, :, :n], apply_rot_embed_cat(q[:, :, n:], rope, half=self.rotate_half)], 2).type_as(v)
            k = torch.cat([k[:, :, :n], apply_rot_embed_cat(k[:, :, n:], rope, half=self.rotate_half)], 2).type_as(v)
        return q, k, v

    def forward(self, x, rope: Optional[torch.Tensor] = None, attn_mask=None, is_causal: bool = False):
        proxy = tracing.fx_proxy(x, rope, attn_mask)
        if proxy is not None:  # torch.fx symbolic tracing: one call of the graph, rope included
            return tracing.record_as_one_call(self, proxy, (x,), dict(rope=rope, attn_mask=attn_mask,
                                                                     is_causal=is_causal))
        self._rope = rope
        try:
            return super().forward(x, attn_mask=attn_mask, is_causal=is_causal)
        finally:
            self._rope = None


def eva_class(layer_class: type) -> type:
    if layer_class not in _CLASSES:
        _CLASSES[layer_class] = type(f"Eva{layer_class.__name__}", (EvaLayout, layer_class),
                                     {"__module__": __name__, "__doc__": layer_class.__doc__})
    return _CLASSES[layer_class]


def __getattr__(name: str):
    """Lets pickle find ``EvaSoftmaxAttention`` & co. (made on demand) in a fresh process."""
    if name.startswith("Eva"):
        from .. import registry
        for cls in registry.layer_classes().values():
            if cls.__name__ == name[3:]:
                return eva_class(cls)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def is_eva(module: nn.Module) -> bool:
    return type(module).__name__ == "EvaAttention" and type(module).__module__.startswith("timm")


def adopt(src: nn.Module, dst: nn.Module) -> list[str]:
    """Turn attnzoo layer ``dst`` into its EVA form and move ``src``'s EVA-only state onto it."""
    dst.__class__ = eva_class(type(dst))
    dst.num_prefix_tokens = src.num_prefix_tokens
    dst.rotate_half = getattr(src, "rotate_half", False)
    dst._rope = None
    return move_biases(src, dst)


def move_biases(src: nn.Module, dst: nn.Module) -> list[str]:
    dst.q_bias, dst.v_bias = src.q_bias, src.v_bias
    if src.q_bias is None:
        dst.k_bias = None
    else:
        dst.register_buffer("k_bias", src.k_bias, persistent=False)
    return [] if src.q_bias is None else ["q_bias", "v_bias"]


def rebuild(layer: nn.Module, cls: type, **kw) -> nn.Module:
    """The EvaAttention ``layer`` came from, with shapes from ``layer`` (weights are moved in after)."""
    old = cls(layer.qkv.in_features, num_heads=layer.num_heads, qkv_bias=layer.q_bias is not None,
              qkv_fused=True, num_prefix_tokens=layer.num_prefix_tokens, attn_head_dim=layer.head_dim,
              qk_norm=False, scale_norm=False, rotate_half=layer.rotate_half, **kw)
    move_biases(layer, old)
    return old
