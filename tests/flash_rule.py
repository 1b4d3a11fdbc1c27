"""FlashAttention's test rule, shared by the kernel tests: a kernel's error against the float64
reference is at most ~2x the error of the same math run in the kernel's dtype, plus a small floor."""
from __future__ import annotations

import torch


def max_error(a, b) -> float:
    return float((a.detach().double() - b.detach().double()).abs().max()) if a.numel() else 0.0


def assert_flash_rule(label: str, dtype, logit_size: float, triples) -> None:
    """``triples``: (name, kernel result, same math in ``dtype``, float64 reference) per output/gradient."""
    eps = torch.finfo(dtype).eps
    floor = max(2e-5 if dtype == torch.float32 else eps, eps * logit_size)
    for name, got, low, want in triples:
        bound = 2 * max_error(low, want) + floor * max(1.0, float(want.detach().abs().max()))
        err = max_error(got, want)
        assert err <= bound, f"{label} {dtype}: {name} error {err:.3g} > {bound:.3g}"
