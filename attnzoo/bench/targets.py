"""attnzoo's own targets: a variant (spec string) run through one backend of the dispatcher.

Every backend registered for the variant's kernel (``ops.dispatch.backends``) is a target, plus
"auto". "masked" is causal attention with its ``kind`` (default softmax) through
``functional.masked``; "multihead" is the ``attnzoo.MultiheadAttention`` module (projections
included) with its ``kind`` (default softmax) and the backend passed to the module.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from .. import functional as AF
from .. import registry
from ..ops import dispatch
from .errors import Skipped, Unsupported
from .problem import Problem, make_step, qkv, randn

AUTO = dispatch.AUTO


@dataclass(frozen=True)
class VariantSpec:
    label: str                 # as given, e.g. "sinkhorn(n_iters=5)"
    name: str                  # registry name
    kwargs: dict = field(default_factory=dict)

    @property
    def kernel(self) -> str:
        """The functional whose backends run this variant."""
        if self.name in ("masked", "multihead"):
            return self.kwargs.get("kind", "softmax")
        return self.name

    @property
    def kernel_kwargs(self) -> dict:
        """Keyword arguments for the kernel's functional (kind and layer-only arguments removed)."""
        kw = {k: v for k, v in self.kwargs.items() if k != "kind"}
        if self.name == "multihead":
            kw = registry.split_layer_kwargs(self.kernel, kw)[0]
        return kw

    def causal(self, flag: bool) -> bool:
        return True if self.name == "masked" else bool(flag)

    def flop_kwargs(self) -> dict:
        kw = dict(self.kernel_kwargs)
        if self.name in ("masked", "multihead"):
            kw["kind"] = self.kernel
        return kw


def parse_variant(spec: str) -> VariantSpec:
    name, kwargs = registry.parse_spec(spec)
    if name not in ("masked", "multihead") and name not in AF.VARIANT_FUNCTIONS:
        raise ValueError(f"variant {name!r} has no functional kernel to benchmark")
    vs = VariantSpec(spec.strip(), name, kwargs)
    if vs.kernel not in AF.VARIANT_FUNCTIONS:
        raise ValueError(f"{spec!r}: kind must be one of {list(AF.VARIANT_FUNCTIONS)}, got {vs.kernel!r}")
    return vs


@dataclass
class Prepared:
    step: Callable[[], None]
    resolved: str                  # the backend that runs (differs from the target's name for "auto")
    cache_key: tuple               # two targets with one cache_key run the same kernel: measured once
    materialises: bool = False     # the eager reference: guarded by the memory estimate on CPU


class AttnzooTarget:
    kind = "attnzoo"

    def __init__(self, spec: VariantSpec, backend: str):
        self.spec = spec
        self.variant = spec.label
        self.backend = backend

    @property
    def compiles(self) -> bool:
        """attnzoo's FlexAttention backends compile per shape / mode: planned last (see runner.plan)."""
        return "flex" in self.backend

    def _resolve(self, q, k, v, causal: bool) -> str:
        """Ask the dispatcher (through attnzoo.explain) who runs this call; its reason if nobody can."""
        try:
            choice = AF.explain(self.spec.kernel, q, k, v, backend=self.backend, is_causal=causal,
                                **self.spec.kernel_kwargs)
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
        resolved = self._resolve(q, k, v, causal)
        key = ("attnzoo", self.spec.label, resolved, problem.key(), causal)
        if self.spec.name == "multihead":
            return Prepared(self._multihead_step(problem, causal), resolved, key, resolved == "reference")
        fn, kw = AF.VARIANT_FUNCTIONS[self.spec.kernel], self.spec.kernel_kwargs
        backend = None if self.backend == AUTO else self.backend

        def forward():
            return fn(q, k, v, is_causal=causal, backend=backend, **kw)
        return Prepared(make_step(forward, (q, k, v), problem), resolved, key, resolved == "reference")

    def _multihead_step(self, problem: Problem, causal: bool):
        from ..layers import MultiheadAttention
        s = problem.shape
        embed = s.heads * s.head_dim
        layer_kwargs = {k: v for k, v in self.spec.kwargs.items() if k != "kind"}
        module = MultiheadAttention(embed, s.heads, batch_first=True, kind=self.spec.kernel,
                                    backend=None if self.backend == AUTO else self.backend,
                                    device=problem.device, dtype=problem.dtype, **layer_kwargs)
        torch.manual_seed(problem.seed)
        x = randn(problem, (s.batch, s.seq_q, embed), 5)
        params = [p for p in module.parameters() if p.requires_grad]

        def forward():
            return module(x, x, x, need_weights=False, is_causal=causal)[0]
        return make_step(forward, [x, *params], problem)


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
