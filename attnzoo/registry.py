"""Names -> layer classes, and spec strings such as ``"sinkhorn(n_iters=5, eps=0.5)"``.

``create(spec, dim, num_heads=8, **kw)`` builds a layer; ``layer(spec)`` returns a class with the
spec's arguments bound, usable wherever timm takes an attention class
(``timm.create_model(..., attn_layer=attnzoo.layer("l2"))``); ``register(name)`` adds a variant.
"""
from __future__ import annotations

import ast
import difflib
import inspect
from typing import Any, Callable

from torch import nn

from . import functional as AF
from .layers import (FenchelAttention, L2Attention, LinearAttention, MaskedAttention, MultiheadAttention,
                     OTAttention, ReLUAttention, SigmoidAttention, SinkhornAttention, SoftmaxAttention)

_REGISTRY: dict[str, type] = {}
_INFO: dict[str, dict] = {}


def register(name: str, **capabilities) -> Callable[[type], type]:
    """Class decorator: ``@attnzoo.register("mine", causal=True, ...)`` makes ``create("mine", ...)`` work."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"name must be an identifier string, got {name!r}")

    def deco(cls: type) -> type:
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise TypeError(f"register({name!r}) expects an nn.Module subclass, got {cls!r}")
        _REGISTRY[name] = cls
        _INFO[name] = {"name": name, "class": cls.__name__, **capabilities}
        return cls
    return deco


def available() -> list[str]:
    return list(_REGISTRY)


def _unknown(name: str) -> ValueError:
    close = difflib.get_close_matches(name, list(_REGISTRY), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return ValueError(f"unknown attention variant {name!r}{hint} Known: {', '.join(_REGISTRY)}")


def describe(name: str) -> dict:
    name = parse_spec(name)[0]
    return dict(_INFO[name])


def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``"sinkhorn(n_iters=5, eps=0.5)"`` -> ("sinkhorn", {"n_iters": 5, "eps": 0.5}); literals only."""
    if not isinstance(spec, str):
        raise TypeError(f"spec must be a string such as 'sinkhorn(n_iters=5)', got {type(spec).__name__}")
    text = spec.strip()
    try:
        node = ast.parse(text, mode="eval").body
    except SyntaxError as e:
        raise ValueError(f"spec {spec!r} is not of the form name or name(key=value, ...): {e.msg}") from None
    if isinstance(node, ast.Name):
        name, kwargs = node.id, {}
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args:
        name = node.func.id
        kwargs = {}
        for kw in node.keywords:
            if kw.arg is None:
                raise ValueError(f"spec {spec!r}: **kwargs are not allowed")
            try:
                kwargs[kw.arg] = ast.literal_eval(kw.value)
            except ValueError:
                raise ValueError(f"spec {spec!r}: the value of {kw.arg!r} must be a literal "
                                 f"(number, string, bool, None, tuple/list/dict)") from None
    else:
        raise ValueError(f"spec {spec!r} is not of the form name or name(key=value, ...) (keyword arguments only)")
    if name not in _REGISTRY:
        raise _unknown(name)
    return name, kwargs


def _init_params(cls: type) -> set[str]:
    """Every named constructor argument along the class chain (timm's extras included)."""
    from .layers.base import _TIMM_EXTRA
    names = set(_TIMM_EXTRA)
    for klass in cls.__mro__:
        if klass in (nn.Module, object):
            break
        if "__init__" in vars(klass):
            names |= {p.name for p in inspect.signature(klass.__init__).parameters.values()
                      if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    return names - {"self"}


def create(spec: str, dim: int, num_heads: int = 8, **kwargs) -> nn.Module:
    """Build a layer from a name or spec string; keyword arguments override the spec's."""
    name, spec_kwargs = parse_spec(spec)
    merged = {**spec_kwargs, **kwargs}
    cls = _REGISTRY[name]
    if cls is MultiheadAttention:
        return cls(dim, num_heads, **merged)
    bad = _unknown_layer_kwargs(name, cls, merged)
    if bad:
        raise ValueError(f"{name} does not take {bad}")
    return cls(dim, num_heads=num_heads, **merged)


def _unknown_layer_kwargs(name, cls, kwargs):
    known = _init_params(cls)
    if name == "masked":
        known |= _kernel_params(kwargs.get("kind", "softmax"))
    return [k for k in kwargs if k not in known]


def _kernel_params(kind: str) -> set[str]:
    fn = AF.VARIANT_FUNCTIONS.get(kind)
    if fn is None:
        return set()
    return {p.name for p in inspect.signature(fn).parameters.values()
            if p.kind is p.KEYWORD_ONLY and p.name not in ("dropout_p", "backend")}


def split_layer_kwargs(kind: str, kwargs: dict) -> tuple[dict, dict]:
    """Split MaskedAttention's keyword arguments into the wrapped kernel's and the layer's."""
    kernel = _kernel_params(kind)
    return ({k: v for k, v in kwargs.items() if k in kernel},
            {k: v for k, v in kwargs.items() if k not in kernel})


def layer(spec: str) -> type:
    """A subclass of the spec's layer with its arguments bound as defaults (for timm's attn_layer)."""
    name, spec_kwargs = parse_spec(spec)
    cls = _REGISTRY[name]
    bad = _unknown_layer_kwargs(name, cls, spec_kwargs) if cls is not MultiheadAttention else []
    if bad:
        raise ValueError(f"{name} does not take {bad}")

    def __init__(self, *args, **kw):
        cls.__init__(self, *args, **{**spec_kwargs, **kw})

    def __reduce_ex__(self, protocol):
        # the class is made at run time, so pickle (torch.save(model), deepcopy) cannot find it by
        # name: rebuild it from the spec instead, then restore the instance's state
        return _new_bound_instance, (spec,), self.__dict__

    bound = type(f"{cls.__name__}_{name}", (cls,), {"__init__": __init__, "__module__": cls.__module__,
                                                     "spec": spec, "__doc__": cls.__doc__,
                                                     "__reduce_ex__": __reduce_ex__})
    return bound


def _new_bound_instance(spec: str):
    cls = layer(spec)
    return cls.__new__(cls)


_CAPS = {
    "softmax": dict(causal=True, cross=True, masks=True, complexity="O(N^2 D) time, O(N) memory fused",
                    parameters="none beyond qkv/proj", paper="Vaswani et al. 2017; paper 002 eq (2.2)"),
    "l2": dict(causal=True, cross=True, masks=True, complexity="O(N^2 D)",
               parameters="tie_qk=True ties W_Q = W_K", paper="paper 002 sec 2.3; Kim et al. 2021"),
    "sinkhorn": dict(causal=True, cross=True, masks=True,
                     complexity="O(n_iters N^2 D); causal = Sinkhorn on every prefix, O(n_iters N^3)",
                     parameters="n_iters, eps, cost", paper="paper 002 sec 2.4 and A.2; Sander et al. 2022"),
    "sigmoid": dict(causal=True, cross=True, masks=True, complexity="O(N^2 D), no row statistics",
                    parameters="optional learnable per-head bias shift", paper="paper 002 eq (2.5); Ramapuram et al. 2024"),
    "relu": dict(causal=True, cross=True, masks=True, complexity="O(N^2 D), no row statistics",
                 parameters="none", paper="paper 002 eq (2.5)"),
    "linear": dict(causal=True, cross=True, masks=True,
                   complexity="O(N D Dv) without a general mask; a general mask needs O(N^2)",
                   parameters="feature_map", paper="paper 002 eq (2.2); Katharopoulos et al. 2020"),
    "masked": dict(causal=True, cross=True, masks=True, complexity="that of its kind",
                   parameters="kind", paper="paper 002 sec 2.6, eqs (2.6)-(2.8)"),
    "multihead": dict(causal=True, cross=True, masks=True, complexity="that of its kind",
                      parameters="nn.MultiheadAttention's", paper="paper 002 eq (2.7)/(2.9); paper 001 (multi-head)"),
    "fenchel": dict(causal=True, cross=True, masks=True,
                    complexity="first_order O(N^2 D); second_order/exact add O(N D^3) per query",
                    parameters="preference=uniform|t5|context, alpha, solve", paper="paper 004 eqs (7), (13), (16)-(18)"),
    "ot": dict(causal=True, cross=True, masks=True, complexity="O(Nq Nk |A| D) time",
               parameters="alpha, gamma; forward(templates=)", paper="paper 004 sec 9, eq (22)"),
}
for _name, _cls in (("softmax", SoftmaxAttention), ("l2", L2Attention), ("sinkhorn", SinkhornAttention),
                    ("sigmoid", SigmoidAttention), ("relu", ReLUAttention), ("linear", LinearAttention),
                    ("masked", MaskedAttention), ("multihead", MultiheadAttention),
                    ("fenchel", FenchelAttention), ("ot", OTAttention)):
    register(_name, **_CAPS[_name])(_cls)
