"""Small pieces of eager math shared by the reference implementations."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def dot_logits(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """s_ij = scale * q_i . k_j, shape (B, H, Nq, Nk)."""
    return (q * scale) @ k.transpose(-1, -2)


def sq_dist(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """||q_i - k_j||^2 via ||q||^2 + ||k||^2 - 2 q.k: O(Nq Nk) memory, not O(Nq Nk D)."""
    qq = (q * q).sum(-1, keepdim=True)
    kk = (k * k).sum(-1).unsqueeze(-2)
    return (qq + kk - 2.0 * (q @ k.transpose(-1, -2))).clamp_min(0.0)


def weights_dropout(p: torch.Tensor, dropout_p: float) -> torch.Tensor:
    return F.dropout(p, dropout_p, training=True) if dropout_p > 0 else p


def upcast(*ts):
    """Half-precision inputs are computed in float32 by the references (eager PyTorch would
    overflow exp() or lose the row sums in bf16); float32/float64 stay as they are."""
    dt = ts[0].dtype
    if dt in (torch.float16, torch.bfloat16):
        return tuple(None if t is None else t.float() for t in ts), dt
    return ts, dt
