"""Float64 helpers the Sinkhorn test files share (their formulas are written in each file)."""
from __future__ import annotations

import torch


def lse(x, dim):
    """logsumexp over dim (keepdim) with 0 for a row of -inf only, and finite gradients there."""
    m = x.amax(dim, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    s = torch.exp(x - m).sum(dim, keepdim=True)
    return torch.where(s > 0, torch.log(torch.where(s > 0, s, torch.ones_like(s))) + m, torch.zeros_like(s))
