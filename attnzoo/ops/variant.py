"""One record per attention variant, declared beside its code, and the catalog of declared variants.

A variant is a folder ``ops/<variant>/`` whose ``__init__.py`` registers its backends and declares a
:class:`Variant`: its name, the reference (the eager ground truth, registered as backend
"reference"), its public function, the layer hook (the constructor options, parameters and per-call
keyword arguments it adds to the shared attention layer), the capabilities in which it differs from
the others, and its cost formulas. The functional API, the layers, the registry and spec strings,
``attnzoo.explain``, the benchmark harness and the model adapters all read these records. A variant
declared from outside the package (``attnzoo.register_variant``) is a record like any other, and
everything that reads the catalog picks it up.

The built-in variants are also named by hand in a few places, on purpose; tests/test_variant_lists.py
checks each against this catalog:

- what ships and in which order: ops/builtin.py (imports the variant folders) and
  ``registry.BUILTIN_ORDER`` (the order of ``attnzoo.available()``);
- the public names, written out so that readers, grep and static tools find them: the classes in
  layers/variants.py and the exports of attnzoo/__init__.py, attnzoo/layers/__init__.py and
  attnzoo/functional.py;
- what a tool covers, each a choice about its own math or defaults rather than a list of all the
  variants: analysis/fields.py (the velocity field of each variant), analysis/gaussian.py and
  analysis/particles.py (closed forms, fast kernel sums), the default ``--variants`` of
  ``attnzoo analyze`` and ``attnzoo demo`` (commands/), and the variants the benchmark tries
  FlexAttention for (bench/baselines.py).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Callable, Mapping, Optional

import torch

from . import call, dispatch
from . import plan as plan_cache
from . import logit_extras
from . import validate as V
from .masking import propagate_query_nan
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
        return attend(name, q, k, v, attn_mask, is_causal, scale, dropout_p, backend, enable_gqa,
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


# -- the catalog ---------------------------------------------------------------------------------

_VARIANTS: dict[str, Variant] = {}


def declare(record: Variant) -> Variant:
    """Add ``record`` to the catalog and register its reference as the backend "reference"."""
    if not isinstance(record, Variant):
        raise TypeError(f"declare expects a Variant record, got {type(record).__name__}")
    if record.name in _VARIANTS and _VARIANTS[record.name] is not record:
        raise ValueError(f"a variant named {record.name!r} is already declared")
    _VARIANTS[record.name] = record
    dispatch.register_backend(record.name, "reference", record.reference, priority=0, extras=record.extras,
                              description="eager PyTorch, materialises the N x N weights (the ground truth)")
    return record


def remove(name: str) -> None:
    """Take a variant out of the catalog and the dispatcher."""
    _VARIANTS.pop(name, None)
    dispatch.forget(name)


def get(name: str) -> Variant:
    if name not in _VARIANTS:
        raise ValueError(f"variant must be one of {list(_VARIANTS)}, got {name!r}")
    return _VARIANTS[name]


def names() -> list[str]:
    return list(_VARIANTS)


def records() -> list[Variant]:
    return list(_VARIANTS.values())


def is_declared(name) -> bool:
    return name in _VARIANTS


# -- the call path -------------------------------------------------------------------------------

def backend_kwargs(name: str, q, k, v, attn_mask=None, is_causal=False, scale=None, dropout_p=0.0,
                   enable_gqa=False, **options) -> dict:
    """The keyword arguments ``name``'s backends receive for this call (every argument checked)."""
    record = get(name)
    kw = call.common_args(q, k, v, attn_mask, is_causal, scale, dropout_p, record.default_scale, enable_gqa)
    return {**kw, **_checked_options(record, q, k, v, kw["scale"], options)}


def _checked_options(record: Variant, q, k, v, scale, options: dict) -> dict:
    extras = {n: options[n] for n in logit_extras.BACKEND_EXTRAS if n in options}
    own = {n: a for n, a in options.items() if n not in extras}
    checked = record.check(q, k, v, scale=scale, **own) if record.check is not None else own
    if "softcap" in extras:
        checked["softcap"] = logit_extras.check_softcap(extras["softcap"])
    if "sinks" in extras:
        checked["sinks"] = logit_extras.check_sinks(extras["sinks"], q)
    return checked


def _with_extras(record: Variant, options: dict):
    """(the options with softcap / sinks only when given, the checked window or None); softcap and sinks
    are refused here for a variant that does not define them (ops/logit_extras.py)."""
    window = logit_extras.check_window_size(options.pop("window_size", None))
    for name in logit_extras.BACKEND_EXTRAS:
        if name in options and options[name] is None:
            del options[name]
    logit_extras.refuse_undefined(record, options)
    return options, window


def _windowed(name: str, backend, q, k, v, attn_mask, is_causal, scale, dropout_p, enable_gqa, options, window):
    """(a backend that takes the window itself, its arguments), or (None, the mask with the band folded in)."""
    kw = backend_kwargs(name, q, k, v, attn_mask, is_causal, scale, dropout_p, enable_gqa, **options)
    kw["window_size"] = window
    native = logit_extras.native_window_backend(name, backend, q, k, v, kw)
    if native is not None:
        return native, kw
    return None, logit_extras.mask_with_window(kw["attn_mask"], window, q.shape[-2], k.shape[-2], q.device)


def _make_plan(name: str, requested: str, q, k, v, attn_mask, is_causal, scale, dropout_p, enable_gqa,
               options: dict, key, options_per_call: bool) -> tuple[plan_cache.Plan, dict]:
    """Every check and the dispatcher's choice for this call: (its plan, its backend keyword arguments).
    ``requested``: the backend asked for, ``use_backend``'s default already read (once per call, so
    the plan's key and its choice agree whatever another thread sets meanwhile)."""
    kw = backend_kwargs(name, q, k, v, attn_mask, is_causal, scale, dropout_p, enable_gqa, **options)
    group = call.gqa_group(q, k) if enable_gqa else 1
    if group > 1:  # the backends' predicates see the heads they compute with (once per signature)
        choice = plan_cache.choose(name, requested, q, call.expand_heads(k, group), call.expand_heads(v, group),
                                   kw, key)
    else:
        choice = plan_cache.choose(name, requested, q, k, v, kw, key)
    shared = {n: kw[n] for n in ("is_causal", "scale", "dropout_p")}
    if group > 1 and choice.backend.gqa:
        shared["enable_gqa"], group = True, 0
    kept_options = None if options_per_call else {n: a for n, a in kw.items() if n not in call.SHARED_KWARGS}
    restore_nan = q.device.type in choice.backend.hides_query_nan_on
    special = None
    empty = q.shape[0] == 0 or q.shape[1] == 0  # no (batch, head) pair: no launch to bind
    if choice.backend.specialize is not None and group <= 1 and not empty:
        special = choice.backend.specialize(q, k, v, **kw, **{n: a for n, a in shared.items() if n == "enable_gqa"})
    return plan_cache.Plan(choice, shared, kept_options, restore_nan, empty, group if group > 1 else 0, special), kw


def _run_plan(record: Variant, p: plan_cache.Plan, q, k, v, attn_mask, options: dict, kw: Optional[dict] = None):
    """Run a call on its plan; ``kw`` (the first call's checked arguments) saves checking them again."""
    if kw is None:
        if attn_mask is not None:  # the value check of a float mask (eager, CPU by default)
            V.check_values("attn_mask", attn_mask)
            attn_mask = V.as_4d(attn_mask)
        kw = {"attn_mask": attn_mask, **p.shared}
        if p.options is None:
            kw.update(_checked_options(record, q, k, v, p.shared["scale"], options))
        elif p.options:
            kw.update(p.options)
    else:
        kw = {**kw, **{n: a for n, a in p.shared.items() if n == "enable_gqa"}}
    if p.empty:  # no (batch, head) pair: nothing to attend, no kernel to launch
        return call.empty_output(q, k, v)
    if p.gqa_group:
        k, v = call.expand_heads(k, p.gqa_group), call.expand_heads(v, p.gqa_group)
    out = p.fn(q, k, v, **kw)
    if p.restore_nan:
        out = propagate_query_nan(out, q)
    return out


def attend(name: str, q, k, v, attn_mask=None, is_causal=False, scale=None, dropout_p=0.0, backend=None,
           enable_gqa=False, **options):
    """Check the arguments of a ``name`` call, then run it on the backend the dispatcher picks.

    The checks and the choice are made once per call signature (``ops/plan.py``); a later call with
    the same signature does only the value checks and the kernel."""
    record = _VARIANTS.get(name) or get(name)  # get() names the variants when name is not one
    requested = backend or dispatch.default_backend()  # read once: the key and the choice see one value
    if options:
        window = options.get("window_size")
        if (options.get("softcap") is not None or options.get("sinks") is not None
                or not (window is None or (type(window) is tuple and window == (-1, -1)))):
            options, window = _with_extras(record, dict(options))
            if window is not None:
                native, found = _windowed(name, requested, q, k, v, attn_mask, is_causal, scale, dropout_p,
                                          enable_gqa, options, window)
                if native is not None:
                    return logit_extras.run_native_window(native, q, k, v, found)
                attn_mask = found
        elif "softcap" in options or "sinks" in options or "window_size" in options:
            # the common call: the functions pass the defaults (None, None, (-1, -1)), which no backend
            # needs to see; decided and dropped inline, as this runs on every call (issue 28's budget)
            options = dict(options)
            options.pop("softcap", None)
            options.pop("sinks", None)
            options.pop("window_size", None)
    key = per_call = None
    if not torch.compiler.is_compiling():
        key, per_call = plan_cache.signature(name, requested, q, k, v, attn_mask, is_causal, scale, dropout_p,
                                             enable_gqa, options)
        if key is not None:
            p = plan_cache.lookup(key)
            if p is not None:
                return _run_plan(record, p, q, k, v, attn_mask, options)
    p, kw = _make_plan(name, requested, q, k, v, attn_mask, is_causal, scale, dropout_p, enable_gqa, options,
                       key if not per_call else None, options_per_call=key is None or per_call)
    if key is not None and p.choice.reusable:
        plan_cache.keep(key, p)
    return _run_plan(record, p, q, k, v, attn_mask, options, kw)


def explain(name: str, q, k, v, backend=None, **kwargs) -> dispatch.Choice:
    """Which backend runs this call and why the others were skipped. The arguments are checked exactly
    as the variant's function checks them (an unknown keyword is a TypeError naming it); the
    function's defaults fill the options not given."""
    V.check_choice("variant", name, _VARIANTS)
    record = _VARIANTS[name]
    check_keywords(record, kwargs)
    options = {**record.options, **{n: a for n, a in kwargs.items() if n not in SHARED_ARGS},
               **{n: kwargs[n] for n in logit_extras.NAMES if n in kwargs}}
    options, window = _with_extras(record, options)
    shared = {n: kwargs[n] for n in call.SHARED_KWARGS + ("enable_gqa",) if n in kwargs}
    if window is not None:
        native, found = _windowed(name, backend, q, k, v, shared.get("attn_mask"), shared.get("is_causal", False),
                                  shared.get("scale"), shared.get("dropout_p", 0.0), shared.get("enable_gqa", False),
                                  options, window)
        if native is not None:
            return dispatch.Choice(name, native, backend or dispatch.default_backend(),
                                   notes=(f"window_size={window}: '{native.name}' skips what lies outside the band",))
        shared["attn_mask"] = found
    kw = backend_kwargs(name, q, k, v, **shared, **options)
    group = call.gqa_group(q, k)
    if group > 1:
        choice = dispatch.choose(name, backend, q, call.expand_heads(k, group), call.expand_heads(v, group), **kw)
    else:
        choice = dispatch.choose(name, backend, q, k, v, **kw)
    if group > 1:
        how = ("indexes each shared key/value head in place" if choice.backend.gqa else
               "does not index shared heads: k and v are expanded to q's heads first (a copy)")
        choice.notes = choice.notes + (f"grouped-query attention, {call.gqa_group(q, k)} query heads per key/value "
                                       f"head: '{choice.backend.name}' {how}",)
    return choice


def check_keywords(record: Variant, kwargs: Mapping[str, Any]) -> None:
    """TypeError for a keyword the variant's function does not take, with the closest one it does."""
    params = inspect.signature(record.functional).parameters
    accepted = {n for n, p in params.items() if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
    accepted.discard("q"), accepted.discard("k"), accepted.discard("v")
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        accepted |= set(record.options) | set(SHARED_ARGS)
    accepted.add("enable_gqa")
    for keyword in kwargs:
        if keyword not in accepted:
            raise TypeError(f"{record.name}() got an unexpected keyword argument {keyword!r}"
                            f"{V.close_match(keyword, accepted)}; it takes {sorted(accepted)}")
