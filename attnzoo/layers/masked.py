"""Masked (causal) attention with any variant's kernel (paper 002 sec 2.6, eqs 2.6-2.8)."""
from __future__ import annotations

from .base import AttentionLayer
from .wrapper import Wrapper


class MaskedAttention(AttentionLayer):
    """Causal self-attention (paper 002 sec 2.6) with any kernel: ``kind="sigmoid"``, default softmax.
    ``is_causal`` is always on; the other keyword arguments are the kind's own (e.g. n_iters)."""
    variant = "masked"

    def __init__(self, dim, num_heads=8, *args, kind: str = "softmax", kind_kwargs=None, **kw):
        super().__init__(dim, num_heads, *args, kind=kind, **{**(kind_kwargs or {}), **kw})

    @property
    def kind_kwargs(self) -> dict:
        return self.record.hook.describe(self)

    def attend(self, q, k, v, attn_mask=None, is_causal=False, x=None, **kwargs):
        return super().attend(q, k, v, attn_mask=attn_mask, is_causal=True, x=x, **kwargs)


MASKED = Wrapper(name="masked", layer_class=MaskedAttention, causal=True, paper="paper 002 sec 2.6, eqs (2.6)-(2.8)")
