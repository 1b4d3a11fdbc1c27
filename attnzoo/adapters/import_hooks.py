"""Run a function as soon as an optional library's module has loaded, without importing it ourselves
(transformers and timm are optional, and slow to import).

``when_imported(name, fn)`` calls ``fn()`` now if ``name`` is already imported; otherwise a meta-path
finder waits for that module, lets it load normally, then calls ``fn()`` and, once nothing is left to
wait for, removes itself. A failing ``fn`` is a warning, never a broken import of the user's library.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import warnings
from typing import Callable

_WAITING: dict[str, list[Callable[[], None]]] = {}


def _call(fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception as e:  # never break the user's import because of attnzoo
        warnings.warn(f"attnzoo could not set itself up with an imported library ({fn.__qualname__}): {e}",
                      stacklevel=3)


class _Loader(importlib.abc.Loader):
    def __init__(self, inner, name: str):
        self.inner, self.name = inner, name

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        callbacks = _WAITING.pop(self.name, [])
        if not _WAITING:
            for finder in [f for f in sys.meta_path if isinstance(f, _Finder)]:
                sys.meta_path.remove(finder)
        for fn in callbacks:
            _call(fn)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in _WAITING:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is not None and spec.loader is not None and not isinstance(spec.loader, _Loader):
            spec.loader = _Loader(spec.loader, fullname)
        return spec


def when_imported(name: str, fn: Callable[[], None]) -> None:
    if name in sys.modules:
        _call(fn)
        return
    _WAITING.setdefault(name, []).append(fn)
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
