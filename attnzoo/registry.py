"""Names -> layer classes, and spec strings such as ``"sinkhorn(n_iters=5, eps=0.5)"``.

``create(spec, dim, num_heads=8, **kw)`` builds a layer; ``layer(spec)`` returns a class with the
spec's arguments bound, usable wherever timm takes an attention class
(``timm.create_model(..., attn_layer=attnzoo.layer("l2"))``). The names are the declared variants
(their records, ops/<variant>/), the wrappers "masked" and "multihead" (layers/wrapper.py), and
classes added with ``register(name)``. ``register_variant(record)`` adds a variant from outside the
package: its reference, hook and costs are then used everywhere a built-in variant's are.
``resolve(spec)`` says which variant's kernel a name runs, with which arguments: the benchmark and
the adapters read it instead of knowing the wrappers.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn

from .layers import variants
from .layers.base import TIMM_EXTRA, AttentionLayer
from .layers.masked import MASKED
from .layers.multihead import MULTIHEAD
from .layers.spec import split_kind, split_spec
from .layers.wrapper import Wrapper
from .ops import variant as catalog
from .ops.call import SHARED_KWARGS
from .ops.validate import close_match

_REGISTRY: dict[str, type] = {}   # name -> layer class
_INFO: dict[str, dict] = {}       # name -> what describe() returns
_WRAPPERS: dict[str, Wrapper] = {}
_LISTENERS: list[Callable[[str], None]] = []  # called with each name registered later (adapters subscribe)


def on_register(listener: Callable[[str], None]) -> None:
    """Call ``listener(name)`` whenever a name is registered from now on (the Hugging Face adapter
    registers ``attnzoo_<name>`` with transformers this way)."""
    if listener not in _LISTENERS:
        _LISTENERS.append(listener)


def register(name: str, **capabilities) -> Callable[[type], type]:
    """Class decorator: ``@attnzoo.register("mine", causal=True, ...)`` makes ``create("mine", ...)`` work."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"name must be an identifier string, got {name!r}")

    def deco(cls: type) -> type:
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise TypeError(f"register({name!r}) expects an nn.Module subclass, got {cls!r}")
        _REGISTRY[name] = cls
        _INFO[name] = {"name": name, "class": cls.__name__, **capabilities}
        for listener in list(_LISTENERS):
            listener(name)
        return cls
    return deco


def register_variant(record: catalog.Variant) -> type:
    """Declare a variant (``attnzoo.Variant``: a reference function, optionally a layer hook, costs)
    and register its layer class under its name; returns the class. It then works everywhere a
    built-in variant does: ``attnzoo.functional.VARIANT_FUNCTIONS``, ``create`` and spec strings,
    ``swap``, ``explain``, ``attnzoo bench``, masked/multihead and training."""
    if record.name in _REGISTRY:
        raise ValueError(f"{record.name!r} is already registered")
    if isinstance(record, catalog.Variant):   # anything else: declare's TypeError
        _check_reference(record)
    catalog.declare(record)
    cls = variants.variant_class(record)
    register(record.name, **record.describe())(cls)
    return cls


# the probe call of a reference at registration: cross-attention shapes with Dv != D, so an output of
# the wrong shape (the weights, q's shape, a transpose) cannot pass for (B, H, Nq, Dv)
_PROBE = {"B": 1, "H": 2, "Nq": 3, "Nk": 5, "D": 4, "Dv": 6}


def _check_reference(record: catalog.Variant) -> None:
    """What every backend call will ask of the reference, checked before it is registered (issue 31): it
    takes q, k, v and the keyword arguments of every call (signature inspection), and a tiny probe call
    on CPU with its options at their defaults returns the (B, H, Nq, Dv) output. A reference with an
    option that has no default cannot be probed and is not."""
    ref = record.reference
    where = f"register_variant({record.name!r}): the reference {getattr(ref, '__name__', ref)!r}"
    if not callable(ref):
        raise TypeError(f"{where} must be a function, got {type(ref).__name__}")
    try:
        sig = inspect.signature(ref)
    except (TypeError, ValueError):
        sig = None   # no signature to read (a builtin): the probe tells
    if sig is not None:
        params = list(sig.parameters.values())
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if len(positional) < 3 and not any(p.kind is p.VAR_POSITIONAL for p in params):
            raise TypeError(f"{where} must take q, k, v as its first three positional arguments; its signature "
                            f"is {sig}")
        named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        missing = [a for a in SHARED_KWARGS if a not in named]
        if missing and not any(p.kind is p.VAR_KEYWORD for p in params):
            raise TypeError(f"{where} must accept the keyword arguments every call passes it ("
                            f"{', '.join(SHARED_KWARGS)}); it lacks {', '.join(missing)} (signature {sig})")
        if any(p.kind is p.KEYWORD_ONLY and p.default is p.empty and p.name not in SHARED_KWARGS for p in params):
            return
    _probe(record, where)


def _probe(record: catalog.Variant, where: str) -> None:
    n = _PROBE
    g = torch.Generator().manual_seed(0)   # its own stream: registering moves no caller's random numbers
    nk = n["Nk"] if record.describe().get("cross", True) else n["Nq"]
    q = torch.randn(n["B"], n["H"], n["Nq"], n["D"], generator=g)
    k = torch.randn(n["B"], n["H"], nk, n["D"], generator=g)
    v = torch.randn(n["B"], n["H"], nk, n["Dv"], generator=g)
    scale = n["D"] ** -0.5 if record.default_scale is None else record.default_scale
    shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} on CPU, its options at their defaults"
    try:
        with torch.no_grad():
            out = record.reference(q, k, v, attn_mask=None, is_causal=False, scale=scale, dropout_p=0.0,
                                   **catalog.option_defaults(record.reference))
    except Exception as e:
        raise ValueError(f"{where} failed a probe call ({shapes}): {type(e).__name__}: {e}") from e
    want = (n["B"], n["H"], n["Nq"], n["Dv"])
    got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
    if got != want:
        raise ValueError(f"{where} must return the (B, H, Nq, Dv) output: a probe call ({shapes}) returned {got}, "
                         f"not {want}")


def unregister(name: str) -> None:
    """Remove a name added by ``register`` or ``register_variant`` (and the variant's backends)."""
    if name not in _REGISTRY:
        raise _unknown(name)
    _REGISTRY.pop(name)
    _INFO.pop(name, None)
    _WRAPPERS.pop(name, None)
    if catalog.is_declared(name):
        variants.forget(catalog.get(name))
        catalog.remove(name)


def _register_wrapper(wrapper: Wrapper) -> None:
    _WRAPPERS[wrapper.name] = wrapper
    register(wrapper.name, **{**catalog.DEFAULT_CAPABILITIES, "complexity": wrapper.complexity,
                              "parameters": wrapper.parameters, "paper": wrapper.paper})(wrapper.layer_class)


def available() -> list[str]:
    return list(_REGISTRY)


def _unknown(name: str) -> ValueError:
    return ValueError(f"unknown attention variant {name!r}{close_match(name, _REGISTRY)}. Known: {', '.join(_REGISTRY)}")


def describe(name: str) -> dict:
    name = parse_spec(name)[0]
    return dict(_INFO[name])


def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``"sinkhorn(n_iters=5, eps=0.5)"`` -> ("sinkhorn", {"n_iters": 5, "eps": 0.5}); literals only,
    and the name must be registered."""
    name, kwargs = split_spec(spec)
    if name not in _REGISTRY:
        raise _unknown(name)
    return name, kwargs


def _init_params(cls: type) -> Optional[set[str]]:
    """Every named constructor argument along the class chain, timm's extras and the variant's own
    options included; None when the class takes any keyword argument (torch-style **kwargs)."""
    names = set(TIMM_EXTRA)
    for klass in cls.__mro__:
        if klass in (nn.Module, object):
            break
        if "__init__" in vars(klass):
            params = inspect.signature(klass.__init__).parameters.values()
            if klass is cls and not issubclass(cls, AttentionLayer) and any(p.kind is p.VAR_KEYWORD for p in params):
                return None
            names |= {p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    return names - {"self"}


def _default_kind(cls: type) -> str:
    if catalog.is_declared(cls.variant):
        return cls.variant
    kind = inspect.signature(cls.__init__).parameters.get("kind")
    return kind.default if kind is not None and isinstance(kind.default, str) else "softmax"


def _unknown_layer_kwargs(cls: type, kwargs: dict) -> list[str]:
    known = _init_params(cls)
    if known is None:
        return []
    if issubclass(cls, AttentionLayer):
        kind = split_kind(kwargs.get("kind"), {})[0] or _default_kind(cls)
        if catalog.is_declared(kind):
            known |= set(catalog.get(kind).hook.options())
    return [k for k in kwargs if k not in known]


def create(spec: str, dim: int, num_heads: int = 8, **kwargs) -> nn.Module:
    """Build a layer from a name or spec string; keyword arguments override the spec's."""
    name, spec_kwargs = parse_spec(spec)
    merged = {**spec_kwargs, **kwargs}
    cls = _REGISTRY[name]
    bad = _unknown_layer_kwargs(cls, merged)
    if bad:
        raise _unknown_kwargs(name, cls, merged, bad)
    return cls(dim, num_heads, **merged)


def _unknown_kwargs(name: str, cls: type, kwargs: dict, bad: list[str]) -> ValueError:
    """"sinkhorn does not take ['n_iterz'] (did you mean 'n_iters'?); its options are [...]": a layer's
    own options (the kind's, for a wrapper), the closest one suggested among every accepted name."""
    known = _init_params(cls) or set()
    options = known
    if issubclass(cls, AttentionLayer):
        kind = split_kind(kwargs.get("kind"), {})[0] or _default_kind(cls)
        options = set(catalog.get(kind).hook.options()) if catalog.is_declared(kind) else set()
        options |= {"kind"} if name in _WRAPPERS else set()
        known = known | options
    return ValueError(f"{name} does not take {bad}{close_match(bad[0], sorted(known))}; its options are {sorted(options)} (besides timm's "
                      "constructor arguments)")


def layer(spec: str) -> type:
    """A subclass of the spec's layer with its arguments bound as defaults (for timm's attn_layer). A
    wrapper that host models see as its kind (``multihead(kind=K, ...)``) binds K's layer, the module
    attnzoo.swap puts in a timm model for the same spec: timm's layout, one module either way."""
    name, spec_kwargs = parse_spec(spec)
    wrapper = _WRAPPERS.get(name)
    if wrapper is not None and wrapper.in_host_models:
        return layer(_kind_spec(name, spec_kwargs))
    cls = _REGISTRY[name]
    bad = _unknown_layer_kwargs(cls, spec_kwargs)
    if bad:
        raise _unknown_kwargs(name, cls, spec_kwargs, bad)

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


def _kind_spec(name: str, spec_kwargs: dict) -> str:
    """``multihead(kind='sinkhorn(n_iters=5)', eps=0.5)`` -> ``"sinkhorn(n_iters=5, eps=0.5)"``."""
    kind, options = split_kind(spec_kwargs.pop("kind", "softmax"), spec_kwargs)
    if not isinstance(kind, str):
        raise TypeError(f"{name}'s kind must be a variant name, got {kind!r}")
    if kind in _WRAPPERS:
        raise ValueError(f"{name}(kind={kind!r}) wraps a wrapper; pick a kernel such as 'softmax'")
    parse_spec(kind)   # an unknown kind fails here, with a suggestion
    return kind if not options else f"{kind}({', '.join(f'{k}={v!r}' for k, v in options.items())})"


def _new_bound_instance(spec: str):
    cls = layer(spec)
    return cls.__new__(cls)


def layer_classes() -> dict[str, type]:
    """Registered name -> layer class."""
    return dict(_REGISTRY)


# -- which kernel a name runs ----------------------------------------------------------------------

@dataclass(frozen=True)
class Resolved:
    """A name (and its arguments) resolved to the variant whose kernel runs it.

    spec:    what was written; name: the registry name; kind: the variant whose functional runs;
    kwargs:  the arguments given (``kind`` removed); wrapper: the Wrapper record, for "masked" and
    "multihead" (None for a variant)."""
    spec: str
    name: str
    kind: str
    kwargs: dict = field(default_factory=dict)
    wrapper: Optional[Wrapper] = None

    @property
    def record(self) -> catalog.Variant:
        return catalog.get(self.kind)

    @property
    def kernel_kwargs(self) -> dict:
        """The arguments of the kind's functional."""
        options = self.record.options
        return {k: v for k, v in self.kwargs.items() if k in options}

    def causal(self, flag: bool) -> bool:
        return True if self.wrapper is not None and self.wrapper.causal else bool(flag)

    def forward_flops(self, shape, causal: bool, **extra):
        """Forward FLOPs of one call (the kind's formula, and what the wrapper adds around it)."""
        total = self.record.flops(shape, self.causal(causal), **{**self.kernel_kwargs, **extra})
        if self.wrapper is not None and self.wrapper.module_flops is not None:
            total += self.wrapper.module_flops(shape)
        return total

    def backward_flops(self, shape, causal: bool, **extra):
        record = self.record
        total = record.flops(shape, self.causal(causal), **{**self.kernel_kwargs, **extra}) * record.backward_factor
        if self.wrapper is not None and self.wrapper.module_flops is not None:
            total += self.wrapper.module_flops(shape) * self.wrapper.module_backward_factor
        return total


def resolve(spec: str, **overrides) -> Resolved:
    """Which variant's kernel ``spec`` runs: itself for a variant, its ``kind`` for a wrapper (or a
    class registered with ``register`` whose layer runs a variant). ValueError naming the choices
    for an unknown name or kind."""
    name, kwargs = parse_spec(spec)
    kwargs = {**kwargs, **overrides}
    wrapper = _WRAPPERS.get(name)
    if wrapper is not None:
        kind, kwargs = split_kind(kwargs.pop("kind", "softmax"), kwargs)  # kind="sinkhorn(n_iters=5)" too
        if not isinstance(kind, str) or not catalog.is_declared(kind):
            raise ValueError(f"{spec!r}: kind must be one of {catalog.names()}, got {kind!r}"
                             f"{close_match(kind, catalog.names())}")
    elif catalog.is_declared(name):
        kind = name
    else:
        cls = _REGISTRY[name]
        if not (issubclass(cls, AttentionLayer) and catalog.is_declared(cls.variant)):
            raise ValueError(f"{name!r} is registered as a class, not a variant: it has no functional kernel")
        kind = cls.variant
    return Resolved(spec.strip(), name, kind, kwargs, wrapper)


def wrappers() -> dict[str, Wrapper]:
    return dict(_WRAPPERS)


# the zoo's order in ``available()``: paper 002's attention in its section order (masked: sec 2.6,
# multihead: eq 2.7), then paper 004's; names registered later follow
BUILTIN_ORDER = ("softmax", "l2", "sinkhorn", "sigmoid", "relu", "linear", "masked", "multihead", "fenchel", "ot")


def _register_builtins() -> None:
    """The declared variants and the wrappers, in BUILTIN_ORDER (then any other declared variant)."""
    wrappers = {w.name: w for w in (MASKED, MULTIHEAD)}
    names = [n for n in BUILTIN_ORDER if n in wrappers or catalog.is_declared(n)]
    names += [n for n in catalog.names() if n not in names]
    for name in names:
        if name in wrappers:
            _register_wrapper(wrappers[name])
        else:
            record = catalog.get(name)
            register(name, **record.describe())(variants.variant_class(record))


_register_builtins()
