"""FlashAttention's test rule, shared by every test of a low-precision result (bf16 / fp16 inputs, autocast).

The tested path's error against the float64 result of the same inputs (rounded to the dtype first, so
the input rounding is not counted) is at most twice the error of the eager reference run in the same
precision against that float64 result, plus a floor:

    max |got - want|  <=  2 max |low - want|  +  floor

``low`` is attnzoo's reference backend on the same low-precision inputs (or under the same autocast:
``autocast_triples``); or a test's own formula run as that reference runs it (fp32 arithmetic on the
half inputs, the result stored in the dtype: ``yardstick_dtype``); or, where the tested path is the
reference itself, ``rounded(want, dtype)`` (``reference_or_rounded``): the float64 result stored in the
dtype, the least error any result in that dtype can have. (FlashAttention's own tests run their
reference entirely in bf16; attnzoo's reference computes in fp32, so its bar is tighter, and a pure-bf16
formula would be too loose to see a 5% error at logits of 1e4.)

The floor, for a tensor whose largest float64 entry is ``scale``:
- bf16 / fp16: ``FLOOR_ULPS`` ulps of the dtype at that scale. Storing the result costs up to half an ulp
  of its largest entry by itself, so a path that is exact up to its final rounding needs about one ulp
  (its own half plus the reference's, which may happen to round better). Plus ``eps(fp32) * logit_size``
  relative: the kernels form the logits in fp32, and rounding logits of size s shifts every weight by
  ~eps32 s (the eager reference rounds them differently, so 2x its error need not cover that). Plus the
  dtype's smallest normal number, under which a value keeps fewer bits.
- float32 (the interpreter's kernels): 2e-5 (or eps32 * logit_size) relative, and absolute below 1.

A rule whose bound is a sizable share of the tensor would pass wrong results, so ``assert_flash_rule``
also checks, for low-precision dtypes, that the bound leaves room to see an error of ``SEES`` (5%) of
each tensor's scale: a result scaled by 0.95 must fail. ``scale_grad`` and ``flash_rule_failures`` let
a test perturb a result on purpose and watch the rule catch it.
"""
from __future__ import annotations

import copy

import torch

FLOOR_ULPS = 1.0
SEES = 0.05
LOW_PRECISION = (torch.bfloat16, torch.float16)


def yardstick_dtype(dtype):
    """The arithmetic the eager reference uses for inputs of ``dtype``: attnzoo's references compute bf16 /
    fp16 inputs in fp32 and store the result in the input dtype (ops/common.upcast). A test's own formula
    run this way, its result and gradients then stored in ``dtype``, is the rule's ``low``."""
    return torch.float32 if dtype in LOW_PRECISION else dtype


def max_error(a, b) -> float:
    return float((a.detach().double() - b.detach().double()).abs().max()) if a.numel() else 0.0


def scale_of(want) -> float:
    return float(want.detach().abs().max()) if want.numel() else 0.0


def rounded(want, dtype):
    """The float64 result stored in ``dtype``: the baseline for the reference implementation itself."""
    return want.detach().to(dtype)


def _tiny(dtype) -> float:
    return torch.finfo(dtype).tiny if dtype in LOW_PRECISION else 0.0


def reference_or_rounded(got, low, want, dtype, formula=None) -> list:
    """The rule's ``low`` for each tensor: the reference's results, or, where the tested path returned
    exactly those bits (it is the reference, e.g. ``auto`` chose it, and comparing it with itself would
    prove nothing), ``formula()`` (a test's own formula run as the reference runs it, see
    ``yardstick_dtype``) or else the float64 results stored in ``dtype``."""
    if all(torch.equal(g, lo) for g, lo in zip(got, low)):
        return list(formula()) if formula else [rounded(w, dtype) for w in want]
    return list(low)


def floor_of(dtype, scale: float, logit_size: float = 1.0) -> float:
    eps32 = torch.finfo(torch.float32).eps
    if dtype in LOW_PRECISION:
        info = torch.finfo(dtype)
        return (FLOOR_ULPS * info.eps + eps32 * logit_size) * scale + info.tiny
    return max(2e-5, eps32 * logit_size) * max(1.0, scale)


def bound_of(dtype, low, want, logit_size: float = 1.0) -> float:
    return 2 * max_error(low, want) + floor_of(dtype, scale_of(want), logit_size)


def flash_rule_failures(label: str, dtype, logit_size: float, triples) -> list[str]:
    """One message per (name, tested result, eager reference in ``dtype``, float64 truth) that breaks the rule."""
    failures = []
    for name, got, low, want in triples:
        bound, err = bound_of(dtype, low, want, logit_size), max_error(got, want)
        if not err <= bound:  # NaN fails too
            ref_err = max_error(low, want)
            failures.append(f"{label} {dtype}: {name} error {err:.3g} > bound {bound:.3g} (reference's error "
                            f"{ref_err:.3g}, ratio {err / ref_err if ref_err else float('inf'):.3g}, "
                            f"scale {scale_of(want):.3g})")
    return failures


def flash_rule_blind_spots(label: str, dtype, logit_size: float, triples, sees: float = SEES) -> list[str]:
    """One message per tensor where a result off by ``sees`` of its scale could still pass."""
    spots = []
    for name, got, low, want in triples:
        scale = scale_of(want)
        if sees * scale <= _tiny(dtype):  # an error that small is under the dtype's smallest normal
            continue
        bound, err = bound_of(dtype, low, want, logit_size), max_error(got, want)
        if not bound + err < sees * scale:
            spots.append(f"{label} {dtype}: {name}'s bound {bound:.3g} (+ error {err:.3g}) cannot see a "
                         f"{sees:.0%} error of its scale {scale:.3g}")
    return spots


def assert_flash_rule(label: str, dtype, logit_size: float, triples, sees: float = SEES) -> None:
    """``triples``: (name, tested result, same math in ``dtype``, float64 truth) per output / gradient."""
    triples = list(triples)
    failures = flash_rule_failures(label, dtype, logit_size, triples)
    assert not failures, "\n".join(failures)
    if dtype in LOW_PRECISION:
        spots = flash_rule_blind_spots(label, dtype, logit_size, triples, sees)
        assert not spots, "\n".join(spots)


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def scale_grad(x, factor: float):
    """``x`` unchanged in the forward; its gradient multiplied by ``factor``: a wrong dq, made on purpose."""
    return _ScaleGrad.apply(x, factor)


# --- modules under autocast ---------------------------------------------------------------------------

def on_reference(module):
    """A deep copy of ``module`` whose attnzoo layers (and any test module with a ``backend`` attribute)
    run the eager reference backend."""
    twin = copy.deepcopy(module)
    for m in twin.modules():
        if hasattr(m, "backend"):
            m.backend = "reference"
    return twin


def _cast(x, dtype):
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.detach().to(dtype).requires_grad_(x.requires_grad)
    return x


def autocast_triples(module, args, kwargs=None, *, device, tested=None, loss=None):
    """FlashAttention's rule for ``module`` under bf16 autocast: (name, tested result, eager reference
    under the same autocast, float64 truth) for the output, every parameter's gradient and the gradient
    of each input that requires grad. ``tested`` (default ``module``; e.g. ``torch.compile(module)``)
    shares ``module``'s parameters; the reference and the float64 truth are copies running attnzoo's
    reference backend (the float64 one without autocast). ``loss``: output -> scalar (sum of squares)."""
    kwargs = kwargs or {}
    loss = loss or (lambda out: out.double().square().sum())

    def run(call, owner, dtype, autocast):
        a = [_cast(x, dtype) for x in args]
        kw = {n: _cast(x, dtype) for n, x in kwargs.items()}
        inputs = [x for x in a if isinstance(x, torch.Tensor) and x.requires_grad]
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            out = call(*a, **kw)
        return [out] + list(torch.autograd.grad(loss(out), list(owner.parameters()) + inputs))

    reference, truth = on_reference(module), on_reference(module).double()
    want = run(truth, truth, torch.float64, False)
    low = run(reference, reference, torch.float32, True)
    got = run(module if tested is None else tested, module, torch.float32, True)
    names = ["out"] + [n for n, _ in module.named_parameters()] + \
        [f"input {i}" for i, x in enumerate(args) if isinstance(x, torch.Tensor) and x.requires_grad]
    return list(zip(names, got, low, want))
