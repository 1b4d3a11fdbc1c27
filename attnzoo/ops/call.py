"""What every call shares on its way from a public attention function to a kernel: the argument
checks common to all variants, grouped-query heads, and the output of a call with no (batch, head)
pair.

``ops.call_path.attend`` runs these checks, the variant's own ``check`` and the dispatcher's choice
once per call signature (``ops/plan.py``) and the chosen backend on every call.
"""
from __future__ import annotations

import torch

from . import validate as V

# the keyword arguments every backend receives besides the variant's own options
SHARED_KWARGS = ("attn_mask", "is_causal", "scale", "dropout_p")


def common_args(q, k, v, attn_mask, is_causal, scale, dropout_p, default_scale=None, enable_gqa=False) -> dict:
    """Checks shared by every variant; the keyword arguments every backend receives: attn_mask as a
    4-D view, is_causal, scale (``default_scale``, else 1/sqrt(D), when None) and dropout_p."""
    V.check_qkv(q, k, v, enable_gqa=V.check_flag("enable_gqa", enable_gqa))
    V.check_mask(attn_mask, q, k)
    V.check_values("attn_mask", attn_mask)
    return {"attn_mask": V.as_4d(attn_mask), "is_causal": V.check_flag("is_causal", is_causal),
            "scale": V.resolve_scale(scale, q, default_scale), "dropout_p": V.check_dropout(dropout_p)}


def gqa_group(q, k) -> int:
    """How many query heads share each key/value head (1 without grouped-query attention)."""
    return q.shape[1] // k.shape[1] if k.shape[1] else 1


def expand_heads(t: torch.Tensor, group: int) -> torch.Tensor:
    """(B, H_kv, N, D) -> (B, H_kv * group, N, D), key/value head j serving query heads
    j * group .. j * group + group - 1 (SDPA's ``enable_gqa`` and Hugging Face's ``repeat_kv``); for
    backends that do not index the shared head themselves (autograd sums the gradient back)."""
    return t.repeat_interleave(group, dim=1)


def empty_output(q, k, v):
    """The (B, H, Nq, Dv) output when B * H == 0, attached to the graph of q, k, v (its gradients are
    the empty zeros autograd expects)."""
    out = torch.zeros(q.shape[:3] + (v.shape[3],), dtype=q.dtype, device=q.device)
    return out + (q.sum() + k.sum() + v.sum()) * 0  # sums over no elements: 0
