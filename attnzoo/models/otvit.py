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

Two forwards for a batch where only some rows borrow (``template_mask``): the eager one gathers
those rows (``nonzero``: a size only the data knows, so a host sync), and a shape-static one for
torch.compile and CUDA graphs (``static_shapes = True``, or whenever dynamo traces the model). The
static one runs partners for a fixed number of rows, ``partner_capacity(B, partner_prob)``: the
rows that borrow come first (a stable sort of the mask), so up to that many rows get their
partner and the logits equal the eager forward's. With ``partner_prob`` unknown (None) the
capacity is the whole batch; with it (the training loop sets it from ``data.partner_prob``) the
capacity is the mean plus 6 standard deviations of Binomial(B, p): at B = 512, p = 0.5, 325 rows
instead of 512, and a batch with more borrowing rows than that (probability below 1e-9) lets the
rows past the capacity go without their partner (counted in ``partner_overflow``).
"""
from __future__ import annotations

import math
from typing import Optional, Union

import torch

from .ot_block import OTBlock
from .vit import ViT

GAMMA_RULES = ("sqrt_embed_dim", "sqrt_head_dim")
CAPACITY_SIGMAS = 6.0  # P(Binomial > mean + 6 sd) < 1e-9 for the batch sizes used here


def partner_capacity(batch: int, prob: Optional[float]) -> int:
    """How many rows of a batch of ``batch`` the shape-static forward runs partners for: all of them
    when ``prob`` is None, else ceil(mean + 6 sd) of Binomial(batch, prob), at least 1, at most batch."""
    if prob is None:
        return batch
    mean, sd = batch * prob, math.sqrt(batch * prob * (1.0 - prob))
    return max(1, min(batch, math.ceil(mean + CAPACITY_SIGMAS * sd)))


def resolve_gamma(rule: Union[str, float], embed_dim: int, num_heads: int) -> float:
    if isinstance(rule, str):
        if rule == "sqrt_embed_dim":
            return math.sqrt(embed_dim)
        if rule == "sqrt_head_dim":
            return math.sqrt(embed_dim // num_heads)
        raise ValueError(f"ot_gamma must be a finite positive number or one of {GAMMA_RULES}, got {rule!r}")
    if isinstance(rule, bool) or not isinstance(rule, (int, float)) or not 0 < rule < math.inf:
        raise ValueError(f"ot_gamma must be a finite positive number or one of {GAMMA_RULES}, got {rule!r}")
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
        if isinstance(ot_alpha, bool) or not isinstance(ot_alpha, (int, float)) or not 0 < ot_alpha < math.inf:
            raise ValueError(f"ot_alpha must be a finite number > 0, got {ot_alpha!r}")
        self.ot_alpha = float(ot_alpha)
        self.ot_gamma = resolve_gamma(ot_gamma, embed_dim, num_heads)
        self.template_tokens = template_tokens
        self.template_grad = bool(template_grad)
        self.ot_queries = ot_queries
        self.ot_backend = ot_backend
        self._depth = vit_kwargs.get("depth", 6)
        super().__init__(**vit_kwargs)
        self.static_shapes = False   # the shape-static forward in eager mode too (CUDA graphs)
        self.partner_prob: Optional[float] = None  # sizes the static forward's partner rows
        # rows that borrowed past the static forward's capacity and went without their partner
        self.register_buffer("partner_overflow", torch.zeros((), dtype=torch.int64), persistent=False)

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
        if self.static_shapes or torch.compiler.is_compiling():
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
        """The masked forward without data-dependent shapes (torch.compile, CUDA graphs): the rows
        that borrow are sorted first (stable), the first ``partner_capacity`` rows run their partner
        through the trunk and the last layer with templates, every row runs the last layer without,
        and each row keeps the output its mask asks for. The same logits as the eager forward, which
        gathers the borrowing rows (nonzero: a size only the data knows)."""
        B = images.shape[0]
        k = partner_capacity(B, self.partner_prob)
        order = torch.sort((~template_mask).to(torch.int32), stable=True).indices  # borrowing rows first
        rows = order[:k]
        borrows = template_mask[rows]
        if k < B:  # rows that borrow but fall past the capacity: none unless the batch is very unlucky
            with torch.no_grad():
                self.partner_overflow += template_mask.sum() - borrows.sum()
        x, t = self._with_partners(images, templates[rows])
        last = self._last
        own = last(x)
        lent = last(x[rows], templates=t)
        out = own.index_copy(0, rows, torch.where(borrows[:, None, None], lent, own[rows]))
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
