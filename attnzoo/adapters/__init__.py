"""attnzoo.adapters: swap attention inside existing models (timm, torch.nn, Hugging Face) by name.

``swap(model, spec, include=, exclude=, strict=)``, its dry run ``plan_swap`` (or ``swap(dry_run=True)``),
``unswap(model)``, ``register_hf_attention()`` for transformers' ``attn_implementation=``, and
``from_pretrained(ModelClass, path)`` for a Hugging Face model saved after a swap.
"""
from . import hf_hook, timm
from .import_hooks import when_imported
from .report import SwapEntry, SwapReport
from .swap import plan_swap, swap, unswap


def from_pretrained(model_class, path, *args, **kwargs):
    """Load a Hugging Face model saved after attnzoo.swap, its variants and their parameters included
    (see adapters.hf_pretrained)."""
    from .hf_pretrained import from_pretrained as _load
    return _load(model_class, path, *args, **kwargs)


def register_hf_attention(spec=None, name=None):
    """Register attnzoo variants as transformers attention implementations (see adapters.hf)."""
    from .hf import register_hf_attention as _register
    return _register(spec, name)


hf_hook.install()  # attnzoo_<variant> attention implementations appear when transformers loads
when_imported("timm.layers", timm.register_fx_leaves)  # timm's FX tools treat attnzoo layers as leaves

__all__ = ["swap", "unswap", "plan_swap", "register_hf_attention", "from_pretrained", "SwapReport", "SwapEntry"]
