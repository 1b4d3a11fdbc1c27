"""Register attnzoo's attention implementations with transformers as soon as transformers loads its
attention interface, without importing transformers ourselves (it is optional, and slow to import).

If ``transformers.modeling_utils`` is already imported, registration happens now; otherwise a
meta-path finder waits for that module, lets it load normally, then registers and removes itself.
So ``from_config(cfg, attn_implementation="attnzoo_sigmoid")`` works after ``import attnzoo``
whichever of the two was imported first.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import warnings

WATCHED = "transformers.modeling_utils"


def _register(_name=None) -> None:
    """Register every attnzoo implementation with transformers, and again whenever a name is added to
    attnzoo's registry later (``attnzoo.register_variant``)."""
    try:
        from .. import registry
        from .hf import register_hf_attention
        register_hf_attention()
        registry.on_register(_register)
    except Exception as e:  # never break the user's transformers import because of attnzoo
        warnings.warn(f"attnzoo could not register its attention implementations with transformers: {e}",
                      stacklevel=2)


class _Loader(importlib.abc.Loader):
    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        for finder in [f for f in sys.meta_path if isinstance(f, _Finder)]:
            sys.meta_path.remove(finder)  # one shot
        _register()


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != WATCHED:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is not None and spec.loader is not None and not isinstance(spec.loader, _Loader):
            spec.loader = _Loader(spec.loader)
        return spec


def install() -> None:
    if WATCHED in sys.modules:
        _register()
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
