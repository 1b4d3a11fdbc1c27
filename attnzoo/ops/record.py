"""The variant record: everything the rest of the package knows about one attention variant (its
reference, public function, layer hook, capabilities and cost formulas), and the layer hooks.

The record sits below the call path (ops/call_path.py): a record declared with only a reference gets a
public function made here that calls the call path's ``attend``, which registers itself on import
(``use_call_path``), so nothing here imports upward. The catalog of declared records is
ops/catalog.py.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Callable, Mapping, Optional

import torch

from . import logit_extras
from .sizes import DEFAULT_BACKWARD_FACTOR, SCORE_MATMUL_FORMULA, score_matmul_flops, weights_bytes

# the arguments every variant's functional and backends share (everything else is the variant's own)
SHARED_ARGS = ("attn_mask", "is_causal", "scale", "dropout_p", "backend", "enable_gqa") + logit_extras.NAMES
DEFAULT_CAPABILITIES = {"causal": True, "cross": True, "masks": True}


class LayerHook:
    """What a variant adds to the shared attention layer (``attnzoo.layers.AttentionLayer``).

    ``setup(layer, **options)`` runs once in the layer's constructor with the variant's own
    constructor arguments (the keyword parameters of ``setup`` name them, with their defaults); it
    checks them and stores them (and any parameters) on the layer. ``kernel_kwargs`` runs on every
    call and returns the extra keyword arguments of the variant's functional (a bias, log u,
    templates, ...); it receives the forward's extra keyword arguments too. A hook holds no state
    itself: one instance serves every layer of the variant."""

    def options(self) -> dict[str, Any]:
        """The constructor options this hook takes, with their defaults."""
        sig = inspect.signature(self.setup)
        return {p.name: p.default for p in sig.parameters.values()
                if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name != "layer"}

    def setup(self, layer) -> None:
        return None

    def kernel_kwargs(self, layer, q, k, v, *, x, attn_mask, is_causal, **forward_kwargs) -> dict:
        if forward_kwargs:
            raise TypeError(f"{type(layer).__name__}.forward() got unexpected keyword arguments "
                            f"{sorted(forward_kwargs)}")
        return {}

    def packed_kwargs(self, layer, q, k, v, *, x, is_causal, **forward_kwargs) -> Optional[dict]:
        """``kernel_kwargs`` for a packed call (``ops.varlen.attend_varlen``: q (1, H, T_q, D), k, v of
        every packed sequence, ``x`` the (T_k, dim) key tokens or None): values that are the same for
        every sequence, or given per key token (``ops.varlen_options.PerKey``). None when a value
        depends on a sequence in another way (its length, its rows): the host then calls the layer per
        sequence length. Default: the per-call arguments when the hook adds none (``kernel_kwargs`` not
        overridden), else None (always correct; a hook overrides it to take the one-call route)."""
        if type(self).kernel_kwargs is not LayerHook.kernel_kwargs:
            return None
        return self.kernel_kwargs(layer, q, k, v, x=x, attn_mask=None, is_causal=is_causal, **forward_kwargs)

    def keys_are_queries(self, layer) -> bool:
        """True when the layer uses its query projection as keys (they must be the same tokens)."""
        return False

    def needs_key_tokens(self, layer) -> bool:
        """True when ``kernel_kwargs`` reads the key tokens ``x`` (a host that projects q, k, v itself
        must hand them over)."""
        return False

    def reads_positions(self, layer) -> bool:
        """True when ``kernel_kwargs`` gives the kernel a preference over relative positions j - i
        (Fenchel's T5 buckets), which needs queries and keys to be positions of one sequence."""
        return False

    def describe(self, layer) -> dict:
        """The layer's options, for its repr."""
        return {name: getattr(layer, name) for name in self.options() if hasattr(layer, name)}


def check_on_stand_ins(check: Optional[Callable], head_dim: int, scale: float, options: Mapping[str, Any]) -> None:
    """Run a variant's ``check`` on its options before any call (when a layer or module is built), on
    stand-in zeros q, k, v of shape (1, 1, 1, head_dim): a bad value fails there, not at the first
    call inside a host model."""
    if check is not None:
        stand_in = torch.zeros(1, 1, 1, head_dim)
        check(stand_in, stand_in, stand_in, scale=scale, **options)


class OptionsHook(LayerHook):
    """The hook of a variant without one of its own: every keyword argument of its functional is a
    constructor option, stored on the layer under its name and passed on every call. With the
    variant's ``check``, bad option values fail when the layer is built (on stand-in q, k, v of the
    layer's head dim), not at its first call inside a host model."""

    def __init__(self, defaults: Mapping[str, Any], check: Optional[Callable] = None):
        self.defaults = dict(defaults)
        self.check = check

    def options(self) -> dict[str, Any]:
        return dict(self.defaults)

    def setup(self, layer, **options) -> None:
        values = {**self.defaults, **options}
        check_on_stand_ins(self.check, layer.head_dim, layer.scale, values)
        for name, value in values.items():
            setattr(layer, name, value)

    def kernel_kwargs(self, layer, q, k, v, *, x, attn_mask, is_causal, **forward_kwargs) -> dict:
        if forward_kwargs:
            super().kernel_kwargs(layer, q, k, v, x=x, attn_mask=attn_mask, is_causal=is_causal, **forward_kwargs)
        return {name: getattr(layer, name) for name in self.defaults}

    def packed_kwargs(self, layer, q, k, v, *, x, is_causal, **forward_kwargs) -> Optional[dict]:
        """The constructor options: the same for every sequence (a tensor among them keeps its ordinary
        (B, H, Nq, Nk) meaning, which a packed call does not have: per length then)."""
        kw = self.kernel_kwargs(layer, q, k, v, x=x, attn_mask=None, is_causal=is_causal, **forward_kwargs)
        return None if any(isinstance(value, torch.Tensor) for value in kw.values()) else kw


@dataclass(frozen=True, eq=False)
class Variant:
    """Everything attnzoo needs to know about one attention variant.

    name:            the registry name, also the dispatcher's table and the functional's name
    reference:       ``(q, k, v, *, attn_mask, is_causal, scale, dropout_p, **options) -> out``, the
                     eager ground truth; its keyword-only parameters beyond the shared ones are the
                     variant's options when ``functional`` is not given
    functional:      the public function; default: one made from the reference's options that runs
                     the shared checks, ``check`` and the dispatcher
    check:           ``(q, k, v, *, scale, **options) -> options``: checks the variant's own arguments
                     (naming them in errors) and returns them as the backends receive them; the
                     default hook also runs it when a layer is built, on stand-in zeros (1, 1, 1, D)
    hook:            the :class:`LayerHook`; default: every option is a constructor option
    class_name/doc:  the layer class's name (default ``<Name>Attention``) and docstring
    default_scale:   the scale when none is given (None: 1/sqrt(D)); a variant without logits sets
                     1.0 and then ignores a host model's logit scale
    couples_queries: True when one query's output depends on the other queries (Sinkhorn normalises
                     columns): padded queries must be masked out and a causal decoder's queries
                     solved prefix by prefix
    capabilities:    only where the variant differs from DEFAULT_CAPABILITIES
    extras:          which of ``softcap`` and ``sinks`` (ops/logit_extras.py) the variant's math defines
                     (its reference takes them); every variant takes ``window_size`` (a mask)
    extras_refused:  for the others, why not (the error a call passing one gets)
    complexity/parameters/paper: what ``attnzoo.describe`` and ``attnzoo list`` show
    flops:           ``(shape, causal, **options) -> forward FLOPs`` (ops/sizes.py's convention)
    flop_formula:    the same in words, written into every benchmark result
    backward_factor: backward FLOPs = this x forward
    reference_bytes: ``(shape, train, causal, itemsize, **options) -> bytes``: a rough peak of the
                     eager reference, which the benchmark uses to skip calls that cannot fit
    """
    name: str
    reference: Callable
    functional: Optional[Callable] = None
    check: Optional[Callable] = None
    hook: Optional[LayerHook] = None
    class_name: Optional[str] = None
    doc: str = ""
    default_scale: Optional[float] = None
    couples_queries: bool = False
    capabilities: Mapping[str, Any] = field(default_factory=dict)
    extras: frozenset = frozenset()
    extras_refused: Mapping[str, str] = field(default_factory=dict)
    complexity: str = "O(Nq Nk D)"
    parameters: str = "none beyond qkv/proj"
    paper: str = ""
    flops: Callable = score_matmul_flops
    flop_formula: str = SCORE_MATMUL_FORMULA
    backward_factor: Fraction = DEFAULT_BACKWARD_FACTOR
    reference_bytes: Callable = weights_bytes

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise ValueError(f"name must be an identifier string, got {self.name!r}")
        if not callable(self.reference):
            raise TypeError(f"reference must be a function (q, k, v, *, attn_mask, is_causal, scale, dropout_p), "
                            f"got {self.reference!r}")
        if self.hook is not None and not isinstance(self.hook, LayerHook):
            raise TypeError(f"hook must be a LayerHook instance, got {self.hook!r}")
        if self.class_name is None:
            object.__setattr__(self, "class_name", self.name.capitalize() + "Attention")
        if self.functional is None:
            object.__setattr__(self, "functional", make_functional(self))
        if self.hook is None:
            object.__setattr__(self, "hook", OptionsHook(option_defaults(self.functional), self.check))

    @property
    def options(self) -> dict[str, Any]:
        """The variant's own keyword arguments of its functional, with their defaults."""
        return option_defaults(self.functional)

    def describe(self) -> dict:
        return {**DEFAULT_CAPABILITIES, **self.capabilities, "complexity": self.complexity,
                "parameters": self.parameters, "paper": self.paper}


def option_defaults(fn: Callable) -> dict[str, Any]:
    """Keyword-only parameters of a functional or reference beyond the shared ones, with defaults."""
    return {p.name: (None if p.default is p.empty else p.default) for p in inspect.signature(fn).parameters.values()
            if p.kind is p.KEYWORD_ONLY and p.name not in SHARED_ARGS}


_call_path: Optional[Callable] = None  # ops/call_path.py's attend, set by use_call_path on its import


def use_call_path(attend: Callable) -> None:
    """Called once by ops/call_path.py (above this module): the entry point the made functionals call."""
    global _call_path
    _call_path = attend


def make_functional(record: Variant) -> Callable:
    """The public function of a variant declared with only a reference: the reference's signature
    with ``backend=``, the shared checks, ``record.check`` (if any) and the dispatcher."""
    defaults = option_defaults(record.reference)
    name = record.name

    def functional(q, k, v, attn_mask=None, is_causal=False, scale=None, *, dropout_p=0.0, backend=None,
                   enable_gqa=False, **options):
        unknown = sorted(set(options) - set(defaults) - set(logit_extras.NAMES))
        if unknown:
            raise TypeError(f"{name}() got unexpected keyword arguments {unknown}; its options are {sorted(defaults)}")
        return _call_path(name, q, k, v, attn_mask, is_causal, scale, dropout_p, backend, enable_gqa,
                      **{**defaults, **options})

    P = inspect.Parameter
    params = [P("q", P.POSITIONAL_OR_KEYWORD), P("k", P.POSITIONAL_OR_KEYWORD), P("v", P.POSITIONAL_OR_KEYWORD),
              P("attn_mask", P.POSITIONAL_OR_KEYWORD, default=None),
              P("is_causal", P.POSITIONAL_OR_KEYWORD, default=False),
              P("scale", P.POSITIONAL_OR_KEYWORD, default=None)]
    params += [P(n, P.KEYWORD_ONLY, default=d) for n, d in defaults.items()]
    params += [P("dropout_p", P.KEYWORD_ONLY, default=0.0), P("backend", P.KEYWORD_ONLY, default=None),
               P("enable_gqa", P.KEYWORD_ONLY, default=False)]
    functional.__signature__ = inspect.Signature(params)
    functional.__name__ = functional.__qualname__ = name
    functional.__doc__ = record.reference.__doc__
    return functional

