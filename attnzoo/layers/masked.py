"""Masked (causal) attention with any variant's kernel (paper 002 sec 2.6, eqs 2.6-2.8)."""
from __future__ import annotations

from ..ops import variant as catalog
from .base import AttentionLayer
from .spec import split_kind
from .wrapper import Wrapper


class MaskedAttention(AttentionLayer):
    """Causal self-attention (paper 002 sec 2.6) with any kernel: ``kind="sigmoid"``, default softmax.
    ``is_causal`` is always on; the other keyword arguments are the kind's own (e.g. n_iters). ``kind``
    may be a spec string, ``kind="sinkhorn(n_iters=5)"``; an option set both there and as a keyword
    argument is a TypeError."""
    variant = "masked"

    def __init__(self, dim, num_heads=8, *args, kind: str = "softmax", kind_kwargs=None, **kw):
        name, in_spec = split_kind(kind, {})
        if in_spec and catalog.is_declared(name):
            # the layer only warns about unknown keyword arguments (timm passes extras), but a spec's
            # options are the kind's by construction: a misspelt one is an error
            unknown = sorted(set(in_spec) - set(catalog.get(name).hook.options()))
            if unknown:
                raise TypeError(f"kind={kind!r}: {name} does not take {unknown}; its options are "
                                f"{sorted(catalog.get(name).hook.options())}")
        kind, kw = split_kind(kind, {**(kind_kwargs or {}), **kw})
        super().__init__(dim, num_heads, *args, kind=kind, **kw)

    @property
    def kind_kwargs(self) -> dict:
        return self.record.hook.describe(self)

    def attend(self, q, k, v, attn_mask=None, is_causal=False, x=None, **kwargs):
        return super().attend(q, k, v, attn_mask=attn_mask, is_causal=True, x=x, **kwargs)

    def packed_causal(self, is_causal: bool) -> bool:
        return True


MASKED = Wrapper(name="masked", layer_class=MaskedAttention, causal=True, paper="paper 002 sec 2.6, eqs (2.6)-(2.8)")
