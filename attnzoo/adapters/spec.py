"""Resolve a swap spec once, before any model is touched.

A wrapper that host models see as its kind (``Wrapper.in_host_models``: ``multihead(kind=K, ...)``
names attnzoo.MultiheadAttention, whose kernel is K; inside a timm or Hugging Face model the same
request means "the K layer") resolves to K's layer class. Every other name resolves to its own layer
class.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .. import registry


@dataclass(frozen=True)
class Target:
    spec: str                       # what the user wrote (for reports)
    name: str                       # registry name after resolving multihead -> its kind
    kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def layer_class(self) -> type:
        return registry.layer_classes()[self.name]

    def build_layer(self, dim: int, num_heads: int, head_dim: int, **layer_kwargs):
        """A fresh attnzoo layer of this variant (timm's constructor; spec kwargs applied last)."""
        return registry.create(self.name, dim, num_heads=num_heads,
                               **{"attn_head_dim": head_dim, **layer_kwargs, **self.kwargs})


def resolve(spec: str, overrides: dict) -> Target:
    """Parse ``spec`` (unknown names raise ValueError here) and merge keyword overrides into it."""
    if isinstance(spec, type):
        raise TypeError("spec must be a variant name or spec string such as 'sinkhorn(n_iters=5)', "
                        f"got the class {spec.__name__}; use its registered name")
    name, kwargs = registry.parse_spec(spec)
    kwargs = {**kwargs, **overrides}
    wrapper = registry.wrappers().get(name)
    if wrapper is not None and wrapper.in_host_models:
        kind = kwargs.pop("kind", "softmax")
        if not isinstance(kind, str):
            raise TypeError(f"{name}'s kind must be a variant name, got {kind!r}")
        registry.parse_spec(kind)  # unknown kind fails here too
        if kind in registry.wrappers():
            raise ValueError(f"{name}(kind={kind!r}) wraps a wrapper; pick a kernel such as 'softmax'")
        name = kind
    target = Target(spec=spec, name=name, kwargs=kwargs)
    target.build_layer(8, num_heads=2, head_dim=4)  # a bad keyword argument fails now, not mid-swap
    return target
