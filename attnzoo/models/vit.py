"""A small Vision Transformer (Dosovitskiy et al. 2021) for 28x28 / 32x32 images, as in paper 004
sec 9: patch embedding, a class token, learned position embeddings, ``depth`` timm Blocks whose
attention is any attnzoo spec string, a final LayerNorm and a linear head on the class token."""
from __future__ import annotations

import math

import torch
from timm.layers import PatchEmbed, trunc_normal_
from timm.models.vision_transformer import Block
from torch import nn

from .. import registry


def timm_attention_class(spec: str) -> type:
    """The class to hand timm's ``Block(attn_layer=...)`` for an attnzoo spec string ("multihead(kind=K)":
    K's layer, as attnzoo.swap makes it)."""
    return registry.layer(spec)


class ViT(nn.Module):
    def __init__(self, *, img_size: int = 32, patch_size: int = 4, in_chans: int = 3, num_classes: int = 10,
                 embed_dim: int = 256, depth: int = 6, num_heads: int = 8, mlp_ratio: float = 2.0,
                 dropout: float = 0.2, attn_dropout: float = 0.0, qkv_bias: bool = True,
                 attention: str = "softmax") -> None:
        super().__init__()
        for name, value in (("img_size", img_size), ("patch_size", patch_size), ("in_chans", in_chans),
                            ("num_classes", num_classes), ("embed_dim", embed_dim), ("depth", depth),
                            ("num_heads", num_heads)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if img_size % patch_size:
            raise ValueError(f"img_size ({img_size}) must be a multiple of patch_size ({patch_size})")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        # timm's MLP is int(embed_dim * mlp_ratio) wide: at least one unit, or torch fails on a negative size
        if isinstance(mlp_ratio, bool) or not isinstance(mlp_ratio, (int, float)) or not (
                math.isfinite(mlp_ratio) and int(embed_dim * mlp_ratio) >= 1):
            raise ValueError(f"mlp_ratio must be a finite number with int(embed_dim * mlp_ratio) >= 1 "
                             f"(embed_dim {embed_dim}), got {mlp_ratio!r}")
        self.attention = attention
        self.num_classes = num_classes
        self.embed_dim = embed_dim
        self.patch_embed = PatchEmbed(img_size=img_size, patch_size=patch_size, in_chans=in_chans,
                                      embed_dim=embed_dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, self.patch_embed.num_patches + 1, embed_dim))
        self.pos_drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(self._block(i, attention, embed_dim, num_heads, mlp_ratio, dropout,
                                                attn_dropout, qkv_bias) for i in range(depth))
        self.norm = nn.LayerNorm(embed_dim)
        self.head = nn.Linear(embed_dim, num_classes)
        self._init_weights()

    def _block(self, index, attention, dim, num_heads, mlp_ratio, dropout, attn_dropout, qkv_bias) -> nn.Module:
        return Block(dim, num_heads, mlp_ratio=mlp_ratio, qkv_bias=qkv_bias, proj_drop=dropout,
                     attn_drop=attn_dropout, attn_layer=timm_attention_class(attention))

    def _init_weights(self) -> None:
        trunc_normal_(self.pos_embed, std=0.02)
        trunc_normal_(self.cls_token, std=0.02)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    def tokens(self, images: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) images -> (B, 1 + num_patches, embed_dim) tokens entering the first block."""
        if images.dim() != 4:
            raise ValueError(f"images must have shape (B, C, H, W), got {tuple(images.shape)}")
        x = self.patch_embed(images)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        return self.pos_drop(x + self.pos_embed)

    def classify(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(x)[:, 0])

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.tokens(images)
        for block in self.blocks:
            x = block(x)
        return self.classify(x)
