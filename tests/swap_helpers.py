"""Shared checks for the swap tests (tests/test_swap_*.py)."""
from __future__ import annotations

import io

import pytest
import torch

import attnzoo

# every registered variant; defaults only (the parameterised forms are tested case by case)
VARIANTS = [v for v in attnzoo.available()]
OTHER_VARIANTS = [v for v in VARIANTS if v != "softmax"]


def train_steps(model, loss_fn, steps: int = 4, lr: float = 1e-2) -> list[float]:
    """Adam on a fixed batch; returns the losses (the batch lives inside loss_fn)."""
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_fn(model)
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        opt.step()
        losses.append(loss.item())
    return losses


def state_dict_roundtrip(model, fresh, forward):
    """Save model's state_dict through torch.save, load it into ``fresh`` (same swap), same outputs."""
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    fresh.load_state_dict(torch.load(buf, weights_only=True), strict=True)
    model.eval()
    fresh.eval()
    with torch.no_grad():
        torch.testing.assert_close(forward(fresh), forward(model), rtol=0, atol=1e-6)


def max_diff(a, b) -> float:
    return (a - b).abs().max().item()


@pytest.fixture(autouse=True)
def reference_kernels():
    """The swap tests check the wiring, not kernel speed: the eager references run every variant
    (fused backends are tested against them elsewhere). One thread: these small models run several
    times faster than with two on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with attnzoo.use_backend("reference"):
            yield
    finally:
        torch.set_num_threads(threads)
