"""One benchmark problem (shape, dtype, device, mode, causal) and the callables timed on it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .flops import Shape


@dataclass(frozen=True)
class Problem:
    shape: Shape
    dtype: torch.dtype
    device: torch.device
    mode: str          # "fwd" (inference, under torch.no_grad) or "fwd+bwd" (forward + every gradient)
    causal: bool
    seed: int = 0

    @property
    def needs_grad(self) -> bool:
        return self.mode == "fwd+bwd"

    def key(self) -> tuple:
        s = self.shape
        return (s.batch, s.heads, s.seq_q, s.nk, s.head_dim, s.dv, str(self.dtype), self.device.type,
                self.mode, self.causal)


def generator(problem: Problem, salt: int = 0) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(problem.seed * 1000003 + salt)
    return g


def randn(problem: Problem, shape: Sequence[int], salt: int) -> torch.Tensor:
    """Seeded standard normal drawn on the CPU (same numbers on every device), then moved."""
    t = torch.randn(tuple(shape), generator=generator(problem, salt), dtype=torch.float32)
    return t.to(device=problem.device, dtype=problem.dtype).requires_grad_(problem.needs_grad)


def qkv(problem: Problem) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    s = problem.shape
    return (randn(problem, (s.batch, s.heads, s.seq_q, s.head_dim), 1),
            randn(problem, (s.batch, s.heads, s.nk, s.head_dim), 2),
            randn(problem, (s.batch, s.heads, s.nk, s.dv), 3))


def make_step(forward: Callable[[], torch.Tensor], grad_inputs: Sequence[torch.Tensor], problem: Problem
              ) -> Callable[[], None]:
    """The timed unit: forward under no_grad ("fwd"), or forward then torch.autograd.grad of a fixed
    random cotangent with respect to ``grad_inputs`` ("fwd+bwd"; no .grad accumulation)."""
    if problem.mode == "fwd":
        def step() -> None:
            with torch.no_grad():
                forward()
        return step

    # the cotangent is drawn now, outside any timed or tracked call; every target here returns an
    # output shaped like its first input (Dv = D), a different shape is redrawn on the first call
    first = grad_inputs[0]
    grad_out = [randn(Problem(problem.shape, first.dtype, first.device, "fwd", problem.causal, problem.seed),
                      first.shape, 4)]

    def step() -> None:
        out = forward()
        if out.shape != grad_out[0].shape:
            grad_out[0] = randn(Problem(problem.shape, out.dtype, out.device, "fwd", problem.causal, problem.seed),
                                out.shape, 4)
        torch.autograd.grad(out, list(grad_inputs), grad_out[0])
    return step


def synchronize(device: torch.device) -> Callable[[], None]:
    if torch.device(device).type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None
