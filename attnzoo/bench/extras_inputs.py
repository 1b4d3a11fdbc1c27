"""A benchmark spec's softcap / sinks / window_size (layer options such as ``"softmax(softcap=30)"``)
as the functional's arguments of the timed call (see ``logit_extras`` for the baselines' side)."""
from __future__ import annotations

from .problem import Problem, randn

EXTRAS = ("softcap", "sinks", "window_size")


def extras_of(spec) -> dict:
    """The spec's softcap / sinks / window_size options (those given), e.g. {"softcap": 30}."""
    return {name: spec.kwargs[name] for name in EXTRAS
            if spec.kwargs.get(name) is not None and spec.kwargs.get(name) is not False}


def call_inputs(spec, problem: Problem) -> tuple[dict, list]:
    """The functional's keyword arguments for the spec's extras and the leaves among them: sinks=True
    becomes a learned (H,) tensor (drawn, so the sink matters), with its gradient in fwd+bwd."""
    extras = extras_of(spec)
    kw, leaves = {}, []
    if "softcap" in extras:
        kw["softcap"] = float(extras["softcap"])
    if "window_size" in extras:
        kw["window_size"] = tuple(extras["window_size"])
    if extras.get("sinks"):
        sinks = randn(problem, (problem.shape.heads,), 12).float().detach().requires_grad_(problem.needs_grad)
        kw["sinks"], leaves = sinks, [sinks]
    return kw, leaves
