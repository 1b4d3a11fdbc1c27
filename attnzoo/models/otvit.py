"""OT-ViT (paper 004 sec 9): the ViT whose final transformer layer uses OT attention (eq 22 with
M(a, b) = -a.b + C, alpha = 1, gamma = sqrt(hidden dim)).

What a template is here (the paper leaves it open): the tokens entering the last layer. An image's
own templates are its tokens there (class token included: they are the keys of that layer). A
training image may borrow the templates of a same-class partner image: the partner goes through
the same network up to the last layer (``template_grad`` says whether gradients flow through
that pass; ``template_tokens`` whether its class token counts as a template or only its patches)
and its tokens join the last layer's template set A through ``OTAttention(templates=...)``.
At test time the model is called without ``templates``: only the input's own.

``ot_queries="cls"`` (default) runs the last layer for the class token only: the head reads nothing
else, so the logits are the same as with ``"all"`` while the OT attention does 1/N of the work.
"""
from __future__ import annotations

import math
from typing import Optional, Union

import torch

from .ot_block import OTBlock
from .vit import ViT

GAMMA_RULES = ("sqrt_embed_dim", "sqrt_head_dim")


def resolve_gamma(rule: Union[str, float], embed_dim: int, num_heads: int) -> float:
    if isinstance(rule, str):
        if rule == "sqrt_embed_dim":
            return math.sqrt(embed_dim)
        if rule == "sqrt_head_dim":
            return math.sqrt(embed_dim // num_heads)
        raise ValueError(f"ot_gamma must be a positive number or one of {GAMMA_RULES}, got {rule!r}")
    if isinstance(rule, bool) or not isinstance(rule, (int, float)) or not rule > 0:
        raise ValueError(f"ot_gamma must be a positive number or one of {GAMMA_RULES}, got {rule!r}")
    return float(rule)


class OTViT(ViT):
    def __init__(self, *, ot_alpha: float = 1.0, ot_gamma: Union[str, float] = "sqrt_embed_dim",
                 template_tokens: str = "all", template_grad: bool = True, ot_queries: str = "cls",
                 ot_backend: Optional[str] = None, **vit_kwargs) -> None:
        if ot_queries not in ("cls", "all"):
            raise ValueError(f"ot_queries must be 'cls' or 'all', got {ot_queries!r}")
        if template_tokens not in ("all", "patches"):
            raise ValueError(f"template_tokens must be 'all' or 'patches', got {template_tokens!r}")
        embed_dim = vit_kwargs.get("embed_dim", 256)
        num_heads = vit_kwargs.get("num_heads", 8)
        self.ot_alpha = float(ot_alpha)
        self.ot_gamma = resolve_gamma(ot_gamma, embed_dim, num_heads)
        self.template_tokens = template_tokens
        self.template_grad = bool(template_grad)
        self.ot_queries = ot_queries
        self.ot_backend = ot_backend
        self._depth = vit_kwargs.get("depth", 6)
        super().__init__(**vit_kwargs)

    def _block(self, index, attention, dim, num_heads, mlp_ratio, dropout, attn_dropout, qkv_bias):
        if index < self._depth - 1:
            return super()._block(index, attention, dim, num_heads, mlp_ratio, dropout, attn_dropout, qkv_bias)
        return OTBlock(dim, num_heads, alpha=self.ot_alpha, gamma=self.ot_gamma, backend=self.ot_backend,
                       mlp_ratio=mlp_ratio,
                       qkv_bias=qkv_bias, proj_drop=dropout, attn_drop=attn_dropout)

    def trunk(self, images: torch.Tensor) -> torch.Tensor:
        """Tokens entering the last (OT) layer: the templates of ``images``."""
        x = self.tokens(images)
        for block in self.blocks[:-1]:
            x = block(x)
        return x

    def _last(self, x, templates=None):
        return self.blocks[-1](x, templates=templates, n_queries=1 if self.ot_queries == "cls" else None)

    def forward(self, images: torch.Tensor, templates: Optional[torch.Tensor] = None,
                template_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``templates``: (B, C, H, W) partner images whose templates join row b's template set
        where ``template_mask[b]`` is True (all rows when the mask is None)."""
        last = self._last
        if templates is None:
            return self.classify(last(self.trunk(images)))
        self._check_templates(images, templates, template_mask)
        if template_mask is None:   # every row borrows its partner's templates
            x, t = self._with_partners(images, templates)
            return self.classify(last(x, templates=t))
        if torch.compiler.is_compiling():
            return self._static_forward(images, templates, template_mask)
        rows = template_mask.nonzero().squeeze(1)
        if rows.numel() == 0:
            return self.classify(last(self.trunk(images)))
        x, t = self._with_partners(images, templates[rows])
        others = _complement(rows, images.shape[0])
        out = torch.cat([last(x[rows], templates=t), last(x[others])])
        order = torch.argsort(torch.cat([rows, others]))
        return self.classify(out[order])

    def _with_partners(self, images, partners):
        """(tokens of images, templates of partners) entering the last layer."""
        if self.template_grad:  # one pass over inputs and partners together
            both = self.trunk(torch.cat([images, partners]))
            x, t = both[:images.shape[0]], both[images.shape[0]:]
        else:
            x = self.trunk(images)
            with torch.no_grad():
                t = self.trunk(partners)
        return x, (t[:, 1:] if self.template_tokens == "patches" else t)

    def _static_forward(self, images, templates, template_mask):
        """The masked forward without data-dependent shapes, for torch.compile: every partner goes
        through the trunk and the last layer runs with and without templates for every row (one
        query each), ``template_mask`` picks per row. Same logits as the eager forward, which
        gathers the rows that borrow (nonzero: a size only the data knows)."""
        x, t = self._with_partners(images, templates)
        last = self._last
        out = torch.where(template_mask[:, None, None], last(x, templates=t), last(x))
        return self.classify(out)

    @staticmethod
    def _check_templates(images, templates, template_mask) -> None:
        if not isinstance(templates, torch.Tensor) or templates.shape != images.shape:
            got = tuple(templates.shape) if isinstance(templates, torch.Tensor) else type(templates).__name__
            raise ValueError(f"templates must be partner images shaped like images {tuple(images.shape)}, got {got}")
        if template_mask is not None and (template_mask.dtype != torch.bool
                                          or template_mask.shape != (images.shape[0],)):
            raise ValueError(f"template_mask must be a bool tensor of shape ({images.shape[0]},), got "
                             f"{template_mask.dtype} {tuple(template_mask.shape)}")


def _complement(rows: torch.Tensor, n: int) -> torch.Tensor:
    keep = torch.ones(n, dtype=torch.bool, device=rows.device)
    keep[rows] = False
    return keep.nonzero().squeeze(1)
