"""What ``attnzoo.swap`` writes into a Hugging Face model's config, so that a saved swapped model says
what it is.

``save_pretrained`` writes the config's attributes to config.json. A swap adds two:

* ``attnzoo_swap``: ``{module name: spec string}`` for every swapped attention module (names relative
  to the model given to ``swap``), which ``attnzoo.from_pretrained`` swaps in again before it loads the
  kernels' parameters (``hf_pretrained``);
* ``attn_implementation = "attnzoo"``: transformers reads it back as the loaded config's
  implementation, so a plain ``from_pretrained`` of the saved folder runs attnzoo's dispatcher, which
  finds no kernel on a module and warns, naming the spec (``warn_if_dropped``), instead of silently
  running SDPA without the saved parameters. Without ``import attnzoo`` transformers refuses the
  unknown implementation; ``attn_implementation="sdpa"`` loads the plain model on purpose.

Modules of a model that went through ``swap`` (swapped or left out by include=/exclude=) are marked,
so only a model loaded without its kernels warns.
"""
from __future__ import annotations

import warnings
from typing import Optional

from torch import nn

from .. import registry

RECORD = "attnzoo_swap"
IMPLEMENTATION_KEY = "attn_implementation"
DISPATCH_NAME = "attnzoo"
_SEEN_BY_SWAP = "_attnzoo_seen_by_swap"   # on modules (object attribute: not in the state_dict or config)


def spec_string(name: str, kwargs: dict) -> Optional[str]:
    """A spec string that ``registry.parse_spec`` reads back as (name, kwargs); None when an argument is
    no literal (a tensor, a function) and cannot be written down."""
    text = name if not kwargs else f"{name}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())})"
    try:
        same = registry.parse_spec(text) == (name, kwargs)
    except Exception:  # a repr that does not parse, or values whose == is no bool (tensors)
        same = False
    return text if same else None


def record(root: nn.Module, name: str, module: nn.Module, name_and_kwargs: tuple[str, dict]) -> None:
    """Note on the module's config that ``name`` (relative to ``root``) runs this spec, and mark every
    module of ``root`` that shares the config as belonging to a swapped model."""
    config = module.config
    entries = dict(getattr(config, RECORD, None) or {})
    entries[name] = spec_string(*name_and_kwargs)
    setattr(config, RECORD, entries)
    setattr(config, IMPLEMENTATION_KEY, DISPATCH_NAME)
    for m in root.modules():
        if getattr(m, "config", None) is config:
            object.__setattr__(m, _SEEN_BY_SWAP, True)


def forget(module: nn.Module, name: str) -> None:
    """After an unswap of ``name``: drop its entry, and the record when no entry is left."""
    config = module.config
    entries = dict(getattr(config, RECORD, None) or {})
    entries.pop(name, None)
    if entries:
        setattr(config, RECORD, entries)
        return
    for key in (RECORD, IMPLEMENTATION_KEY):
        if key in config.__dict__:
            delattr(config, key)


def entries(config) -> dict:
    """The record a config carries ({} when none)."""
    found = getattr(config, RECORD, None)
    return dict(found) if isinstance(found, dict) else {}


def describe_specs(found: dict) -> str:
    specs = sorted({s for s in found.values() if s is not None})
    unwritten = sum(s is None for s in found.values())
    text = ", ".join(repr(s) for s in specs)
    if unwritten:
        text += (", and " if text else "") + f"{unwritten} module(s) with a spec that has non-literal arguments"
    return text


def warn_if_dropped(module: nn.Module) -> None:
    """Called by the dispatcher for a module without a kernel: warns when the module's config says the
    model was saved swapped but this model never went through ``swap`` (a plain ``from_pretrained``)."""
    if module.__dict__.get(_SEEN_BY_SWAP, False):
        return
    found = entries(getattr(module, "config", None))
    if not found:
        return
    object.__setattr__(module, _SEEN_BY_SWAP, True)   # one warning per module, not per forward
    warnings.warn(
        f"this model was saved after attnzoo.swap ({describe_specs(found)}) but loaded without its attnzoo "
        "kernels: its attention runs SDPA and the kernels' saved parameters were not loaded (transformers "
        "lists them as UNEXPECTED). Load it with attnzoo.from_pretrained(ModelClass, path), which swaps the "
        "recorded spec in and loads them", stacklevel=3)
