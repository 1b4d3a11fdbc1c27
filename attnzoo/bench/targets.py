"""attnzoo's own targets: a variant (spec string) run through one backend of the dispatcher.

Every backend registered for the variant's kernel (``ops.dispatch.backends``) is a target, plus
"auto". A wrapper runs its ``kind`` (``registry.resolve``): "masked" through the kind's functional
with is_causal=True; a wrapper that adds work around the kernel ("multihead": the projections of
attnzoo.MultiheadAttention) is timed as its whole module, with the backend passed to the module.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .. import registry
from ..functional import explain
from ..ops import dispatch
from .errors import Skipped, Unsupported
from .extras_inputs import call_inputs
from .flops import flops
from .problem import Problem, qkv, randn

AUTO = dispatch.AUTO


@dataclass(frozen=True)
class VariantSpec:
    label: str                    # as given, e.g. "sinkhorn(n_iters=5)"
    resolved: registry.Resolved   # which variant's kernel runs it, with which arguments

    @property
    def name(self) -> str:
        """The registry name."""
        return self.resolved.name

    @property
    def kwargs(self) -> dict:
        return self.resolved.kwargs

    @property
    def kernel(self) -> str:
        """The variant whose backends run this spec."""
        return self.resolved.kind

    @property
    def kernel_kwargs(self) -> dict:
        """Keyword arguments for the kernel's functional (kind and layer-only arguments removed)."""
        return self.resolved.kernel_kwargs

    @property
    def timed_module(self):
        wrapper = self.resolved.wrapper
        return None if wrapper is None else wrapper.timed_module

    def causal(self, flag: bool) -> bool:
        return self.resolved.causal(flag)

    def flop_kwargs(self) -> dict:
        kw = dict(self.kernel_kwargs)
        if self.resolved.wrapper is not None:
            kw["kind"] = self.kernel
        return kw


# the layer built to check a spec's options (any size every built-in layer takes)
CHECK_DIM, CHECK_HEADS = 64, 2


def check_spec(spec: str) -> None:
    """Refuse a spec that ``attnzoo.create`` refuses, with create's own message (ValueError or
    TypeError): an unknown option (``"l2(foo=1)"``) or a bad value (``"sinkhorn(n_iters=-1)"``).
    The benchmark runs a variant's functional with the spec's kernel options, which alone would drop
    an unknown option (timing the defaults under the bad label) or fail on every row; building the
    layer once runs the registry's and the variant's own checks before any work."""
    registry.create(spec, CHECK_DIM, CHECK_HEADS)


def parse_variant(spec: str) -> VariantSpec:
    try:
        resolved = registry.resolve(spec)
    except ValueError as e:
        if "not a variant" in str(e):
            raise ValueError(f"variant {registry.parse_spec(spec)[0]!r} has no functional kernel to benchmark") from None
        raise
    check_spec(spec)
    return VariantSpec(spec.strip(), resolved)


@dataclass
class Prepared:
    """A case made ready for one problem: ``forward()`` is exactly the timed call, ``leaves`` the
    tensors that get gradients ("fwd+bwd"); ``problem.make_step`` turns the pair into the timed unit."""
    forward: Callable[[], torch.Tensor]
    leaves: list
    resolved: str                  # the backend that runs (differs from the case's backend for "auto")
    cache_key: tuple               # two cases with one cache_key run the same kernel: measured once
    materialises: bool = False     # the eager reference: guarded by the memory estimate on CPU


def no_inputs(problem: Problem) -> tuple[dict, list]:
    return {}, []


@dataclass(frozen=True)
class Flavour:
    """The call's inputs beyond q, k, v: ``inputs(problem) -> (keyword arguments, leaves)``, e.g. a
    float mask or a per-key log u (the GPU measurement times each variant in such flavours)."""
    name: str = "plain"
    inputs: Callable[[Problem], tuple[dict, list]] = no_inputs


PLAIN = Flavour()


class Case:
    """The one case type of the grid: a variant spec through one backend (attnzoo's, or a baseline
    library's) with a flavour of inputs. ``prepare(problem) -> Prepared``, or one of errors.Unsupported,
    Unavailable, Skipped saying why not. ``label`` names its row in the GPU measurement,
    ``table_variant`` its key in the measured ranking table (None: not ranked), ``applies(problem)``
    which problems the GPU measurement gives it."""
    kind = "attnzoo"
    compiles = False   # each new shape / mode costs a torch.compile: planned last

    def __init__(self, spec: VariantSpec, backend: str, flavour: Flavour = PLAIN, label: Optional[str] = None,
                 table_variant: Optional[str] = None, applies: Callable[[Problem], bool] = lambda problem: True):
        self.spec = spec
        self.variant = spec.label
        self.backend = backend
        self.flavour = flavour
        self.label = label or f"{spec.label}/{backend}"
        self.table_variant = table_variant
        self.applies = applies

    def flops(self, problem: Problem) -> int:
        """FLOPs of one call of this case on ``problem`` (its mode), by the variant's own formula."""
        return flops(self.spec.name, problem.shape, problem.mode, causal=self.spec.causal(problem.causal),
                     **self.spec.flop_kwargs())

    def prepare(self, problem: Problem) -> Prepared:  # pragma: no cover - overridden
        raise NotImplementedError


class AttnzooTarget(Case):
    """The spec's functional through one dispatcher backend (or "auto")."""

    @property
    def compiles(self) -> bool:
        """attnzoo's FlexAttention backends compile per shape / mode: planned last (see runner.plan)."""
        return "flex" in self.backend

    def _resolve(self, q, k, v, causal: bool, extra: dict) -> str:
        """Ask the dispatcher (through attnzoo.explain) who runs this call; its reason if nobody can."""
        try:
            choice = explain(self.spec.kernel, q, k, v, backend=self.backend, is_causal=causal,
                             **self.spec.kernel_kwargs, **extra)
        except ValueError as e:
            raise Unsupported(str(e)) from None
        name = choice.backend.name
        if q.device.type == "cpu" and "triton" in name and _interpreted() and not _allow_interpreter():
            raise Skipped(f"'{name}' would run in the Triton interpreter (TRITON_INTERPRET=1 on CPU tensors), which "
                          f"times the interpreter, not the kernel; set ATTNZOO_BENCH_INTERPRETER=1 to time it anyway")
        return name

    def prepare(self, problem: Problem) -> Prepared:
        causal = self.spec.causal(problem.causal)
        q, k, v = qkv(problem)
        extra, extra_leaves = self.flavour.inputs(problem)
        if self.spec.timed_module is None:  # the spec's softcap / sinks / window_size go into the call
            spec_extra, spec_leaves = call_inputs(self.spec, problem)
            extra, extra_leaves = {**extra, **spec_extra}, [*extra_leaves, *spec_leaves]
        resolved = self._resolve(q, k, v, causal, extra)
        key = ("attnzoo", self.spec.label, self.flavour.name, resolved, problem.key(), causal)
        if self.spec.timed_module is not None:
            return Prepared(*self._module_call(problem, causal), resolved, key, resolved == "reference")
        fn, kw = self.spec.resolved.record.functional, self.spec.kernel_kwargs
        backend = None if self.backend == AUTO else self.backend

        def forward():
            return fn(q, k, v, is_causal=causal, backend=backend, **kw, **extra)
        return Prepared(forward, [q, k, v, *extra_leaves], resolved, key, resolved == "reference")

    def _module_call(self, problem: Problem, causal: bool):
        s = problem.shape
        embed = s.heads * s.head_dim
        module_forward, params = self.spec.timed_module(
            embed, s.heads, kind=self.spec.kernel, backend=None if self.backend == AUTO else self.backend,
            device=problem.device, dtype=problem.dtype, **self.spec.kwargs)
        torch.manual_seed(problem.seed)
        x = randn(problem, (s.batch, s.seq_q, embed), 5)

        def forward():
            return module_forward(x, causal)
        return forward, [x, *params]


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _allow_interpreter() -> bool:
    return os.environ.get("ATTNZOO_BENCH_INTERPRETER") == "1"


def attnzoo_targets(spec: VariantSpec, backends: Optional[list[str]] = None) -> list[AttnzooTarget]:
    """One target per backend registered for the spec's kernel, then "auto" (filtered by ``backends``)."""
    names = dispatch.backends(spec.kernel) + [AUTO]
    if backends:
        names = [n for n in names if n in backends]
    return [AttnzooTarget(spec, n) for n in names]
