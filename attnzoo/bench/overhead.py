"""``attnzoo bench --overhead``: what one call costs beyond the math, on the CPU at tiny shapes.

At B 1, H 2, N 16, D 8 the arithmetic of attention is a few thousand multiply-adds, so the time of a
call is the work around it: argument checks, the backend choice, Python and dispatch. Two groups of
candidates, each timed forward + backward (``torch.autograd.grad`` of a fixed cotangent, so nothing
accumulates) on one thread:

- ``functional``: the functional a name or spec runs (``attnzoo.functional.<variant>(q, k, v)``;
  ``masked``: its kind with ``is_causal=True``) against ``F.scaled_dot_product_attention`` (causal for
  a causal spec); ``multihead``, a module around the kernel, is timed in the layer group only;
- ``layer``: ``attnzoo.create(name, 64, 2)`` against timm's ``Attention(64, 2)`` (``is_causal=True``
  for a causal spec), input (1, 16, 64).
Every registered name by default (``variants``: names or spec strings).

Measurements are interleaved: in each round every candidate of a group is timed once (``inner``
calls back to back, the per-call mean is the round's sample), the order rotating from round to round,
so that machine noise (other jobs, frequency changes) hits every candidate alike. Each candidate's
figure is the median over rounds; its ratio is the median over rounds of its sample divided by its
reference's sample in the same round. Speed claims live here, never in timed tests.
"""
from __future__ import annotations

import datetime
import inspect
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from .. import registry
from . import environment, errors
from .progress import progress_bar
from .runner import all_variants
from .schema import OVERHEAD_SCHEMA, validate_overhead
from .targets import parse_variant
from .timing import p20_p80

SDPA, SDPA_CAUSAL = "F.scaled_dot_product_attention", "F.scaled_dot_product_attention (causal)"
TIMM, TIMM_CAUSAL = "timm Attention(64, 2)", "timm Attention(64, 2) (causal)"


@dataclass
class OverheadConfig:
    batch: int = 1
    heads: int = 2
    seq_len: int = 16
    head_dim: int = 8
    dim: int = 64              # the layers' width (heads of dim // heads each)
    layer_heads: int = 2
    rounds: int = 200
    inner: int = 5             # calls per sample: short samples are rarely cut by the scheduler on a busy machine
    warmup: int = 5
    threads: int = 1
    seed: int = 0
    variants: Optional[list[str]] = None   # names or spec strings; None: every registered name

    def validate(self) -> "OverheadConfig":
        for name in ("batch", "heads", "seq_len", "head_dim", "dim", "layer_heads", "rounds", "inner", "threads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"warmup must be an int >= 0, got {self.warmup!r}")
        if self.dim % self.layer_heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by layer_heads ({self.layer_heads})")
        for spec in self.variants or []:
            parse_variant(spec)   # attnzoo.create's own error for a bad spec
        return self

    def specs(self) -> list[str]:
        return list(self.variants) if self.variants is not None else all_variants()


@dataclass
class Candidate:
    group: str
    name: str
    reference: str          # the name of the candidate it is compared with (itself for a reference)
    call: Optional[Callable[[], None]] = None
    error: Optional[tuple[str, str]] = None


def _grad_call(forward: Callable[[], torch.Tensor], inputs: list) -> Callable[[], None]:
    """forward + torch.autograd.grad of a fixed cotangent with respect to ``inputs``."""
    cot = []

    def call() -> None:
        out = forward()
        if not cot:
            cot.append(torch.randn_like(out))
        torch.autograd.grad(out, inputs, cot[0], allow_unused=True)
    return call


def _functional_label(spec) -> str:
    """attnzoo.functional.<kind>, with the spec's options and causality as they reach the call."""
    args = [f"{k}={v!r}" for k, v in spec.kernel_kwargs.items()] + (["is_causal=True"] if spec.causal(False) else [])
    return f"attnzoo.functional.{spec.kernel}" + (f"({', '.join(args)})" if args else "")


def _functional_candidates(c: OverheadConfig) -> list[Candidate]:
    g = torch.Generator().manual_seed(c.seed)
    q, k, v = (torch.randn(c.batch, c.heads, c.seq_len, c.head_dim, generator=g).requires_grad_() for _ in range(3))
    out = [Candidate("functional", SDPA, SDPA, _grad_call(lambda: F.scaled_dot_product_attention(q, k, v), [q, k, v])),
           Candidate("functional", SDPA_CAUSAL, SDPA_CAUSAL,
                     _grad_call(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), [q, k, v]))]
    for name in c.specs():
        spec = parse_variant(name)
        if spec.timed_module is not None:  # a module around the kernel (multihead): the layer group times it
            continue
        fn, kw, causal = spec.resolved.record.functional, spec.kernel_kwargs, spec.causal(False)
        out.append(Candidate("functional", _functional_label(spec), SDPA_CAUSAL if causal else SDPA,
                             _grad_call(lambda fn=fn, kw=kw, causal=causal: fn(q, k, v, is_causal=causal, **kw),
                                        [q, k, v])))
    return out


def _layer_candidates(c: OverheadConfig) -> list[Candidate]:
    from timm.layers import Attention
    g = torch.Generator().manual_seed(c.seed + 1)
    x = torch.randn(c.batch, c.seq_len, c.dim, generator=g).requires_grad_()
    torch.manual_seed(c.seed)
    timm_layer = Attention(c.dim, c.layer_heads)
    params = [x, *timm_layer.parameters()]
    out = [Candidate("layer", TIMM, TIMM, _grad_call(lambda: timm_layer(x), params)),
           Candidate("layer", TIMM_CAUSAL, TIMM_CAUSAL, _grad_call(lambda: timm_layer(x, is_causal=True), params))]
    for name in c.specs():
        label = f"attnzoo.create({name!r}, {c.dim}, {c.layer_heads})"
        reference = TIMM_CAUSAL if parse_variant(name).causal(False) else TIMM
        layer = registry.create(name, c.dim, c.layer_heads)
        if "query" in inspect.signature(layer.forward).parameters:  # torch.nn.MultiheadAttention's interface
            def forward(layer=layer):
                return layer(x, x, x, need_weights=False)[0]
        else:
            def forward(layer=layer):
                return layer(x)
        out.append(Candidate("layer", label, reference, _grad_call(forward, [x, *layer.parameters()])))
    return out


def _unique(candidates: list[Candidate]) -> list[Candidate]:
    """One candidate per name: samples are kept by name, so a repeated spec (``--variants softmax softmax``,
    or two spellings of one call) would put two samples a round under one name and misalign its ratios."""
    first: dict[str, Candidate] = {}
    for x in candidates:
        first.setdefault(x.name, x)
    return list(first.values())


def _interleaved(candidates: list[Candidate], c: OverheadConfig, advance: Callable[[], None]) -> dict[str, list]:
    """Per candidate name, its per-call seconds in every round (rounds rotate the order)."""
    runnable = [x for x in candidates if x.call is not None]
    samples: dict[str, list] = {x.name: [] for x in runnable}
    for r in range(c.rounds):
        shift = r % len(runnable)
        for x in runnable[shift:] + runnable[:shift]:
            start = time.perf_counter()
            for _ in range(c.inner):
                x.call()
            samples[x.name].append((time.perf_counter() - start) / c.inner)
        advance()
    return samples


def _warm(candidates: list[Candidate], warmup: int) -> None:
    for x in candidates:
        if x.call is None:
            continue
        try:
            for _ in range(max(1, warmup)):
                x.call()
        except Exception as e:  # noqa: BLE001 - recorded
            x.call, x.error = None, errors.classify(e)


def _rows(candidates: list[Candidate], samples: dict[str, list]) -> list[dict]:
    rows = []
    for x in candidates:
        row = {"group": x.group, "name": x.name, "reference": x.reference, "status": errors.OK, "reason": None}
        ref = samples.get(x.reference)
        if x.call is None or ref is None:
            status, reason = x.error or (errors.ERROR, f"its reference {x.reference} could not run")
            rows.append({**row, "status": status, "reason": reason})
            continue
        mine = samples[x.name]
        ratios = [a / b for a, b in zip(mine, ref)]
        (p20, p80), (ratio_p20, ratio_p80) = p20_p80(mine), p20_p80(ratios)
        us, ref_us = statistics.median(mine) * 1e6, statistics.median(ref) * 1e6
        rows.append({**row, "us": us, "p20_us": p20 * 1e6, "p80_us": p80 * 1e6,
                     "reference_us": ref_us, "extra_us": us - ref_us, "ratio": statistics.median(ratios),
                     "ratio_p20": ratio_p20, "ratio_p80": ratio_p80, "rounds": len(mine)})
    return rows


METHODS = {
    "call": "forward + torch.autograd.grad of a fixed cotangent (w.r.t. q, k, v; a layer's input and parameters)",
    "interleaving": "in each round every candidate of a group is timed once (inner calls back to back, per-call "
                    "mean), the order rotating from round to round; figures are medians over rounds",
    "ratio": "median over rounds of (candidate's sample / its reference's sample in the same round)",
    "extra_us": "candidate's median microseconds minus its reference's",
}


def run(config: OverheadConfig, progress: bool = True) -> dict:
    """Both groups, interleaved within each group; returns the JSON-ready result."""
    c = config.validate()
    threads = torch.get_num_threads()
    torch.set_num_threads(c.threads)
    start = time.perf_counter()
    try:
        groups = [_unique(_functional_candidates(c)), _unique(_layer_candidates(c))]
        rows = []
        with progress_bar(progress, "overhead") as bar:
            task = bar.add_task("", total=c.rounds * len(groups))
            for candidates in groups:
                bar.update(task, description=candidates[0].group)
                _warm(candidates, c.warmup)
                rows += _rows(candidates, _interleaved(candidates, c, lambda: bar.advance(task)))
    finally:
        torch.set_num_threads(threads)
    env = {**environment.collect("cpu"), "torch_threads": c.threads}
    return validate_overhead({
        "schema": OVERHEAD_SCHEMA,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "environment": env, "settings": {**asdict(c), "run_seconds": round(time.perf_counter() - start, 1)},
        "methods": METHODS, "results": rows})
