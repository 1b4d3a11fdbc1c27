"""Register attnzoo's attention implementations with transformers as soon as transformers loads its
attention interface, without importing transformers ourselves (``import_hooks``). So
``from_config(cfg, attn_implementation="attnzoo_sigmoid")`` works after ``import attnzoo`` whichever
of the two was imported first.
"""
from __future__ import annotations

import warnings

from .import_hooks import when_imported

WATCHED = "transformers.modeling_utils"


def _register(_name=None) -> None:
    """Register every attnzoo implementation with transformers, and again whenever a name is added to
    attnzoo's registry later (``attnzoo.register_variant``)."""
    try:
        import torch

        from .. import registry
        from .hf import register_hf_attention
        # building the probe layers (hf._adds_parameters, spec.resolve) must not move the caller's
        # random stream: registering a variant would otherwise change what a seeded run draws next
        with torch.random.fork_rng(devices=[]):
            register_hf_attention()
        registry.on_register(_register)
    except Exception as e:  # never break the user's transformers import (or register_variant) because of attnzoo
        warnings.warn(f"attnzoo could not register its attention implementations with transformers: {e}",
                      stacklevel=2)


def install() -> None:
    when_imported(WATCHED, _register)
