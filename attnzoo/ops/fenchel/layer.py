"""What Fenchel attention adds to the shared layer: alpha, the solver and a learned preference log u.

preference="uniform": u uniform (alpha = 1 is plain softmax attention).
preference="t5":      log u_ij = b[h, bucket(j - i)], T5's relative-position buckets (paper 004
                      eqs 17-18): exact buckets for small offsets, log-spaced up to max_distance,
                      bidirectional (sign gets half the buckets) or causal (only j <= i offsets);
                      the table is ``layer.relative_bias`` (an nn.Embedding(num_buckets, H)).
preference="context": log u_j = a small MLP of the key token x_j, one output per head (paper 004
                      sec 7, "factor in the input context"), ``layer.context_net``; its last layer
                      starts at zero, so a fresh layer starts uniform.
"""
from __future__ import annotations

import torch
from torch import nn

from .. import validate as V
from ..record import LayerHook
from ..varlen_options import PerKey
from .reference import SOLVES
from .t5 import T5Bias
from .t5_buckets import check_bucketing

PREFERENCES = ("uniform", "t5", "context")


def _checked(layer, log_u, x):
    """The context preference's log u, refused with the user's own words when it holds NaN or +inf:
    the function's check would name ``log_u``, which a layer's caller never passed (issue 31). Checked
    where ``validate.check_values`` checks (eager mode, VALUE_CHECK_DEVICES), the same one read."""
    try:
        V.check_values("log_u", log_u)
    except ValueError:
        source = ("the layer's input x holds NaN or inf values" if not bool(torch.isfinite(x.detach()).all())
                  else "x is finite, so the network's weights (layer.context_net) hold NaN or inf values")
        raise ValueError(f"{type(layer).__name__}(preference='context'): the preference its context network "
                         f"computes from the input tokens x is not finite: {source}") from None
    return log_u


class FenchelHook(LayerHook):
    def setup(self, layer, *, preference: str = "uniform", alpha: float = 1.0, solve: str = "first_order",
              num_buckets: int = 32, max_distance: int = 128, bidirectional: bool = True,
              context_hidden: int = 64) -> None:
        layer.preference = V.check_choice("preference", preference, PREFERENCES)
        layer.alpha = V.check_positive("alpha", alpha)
        layer.solve = V.check_choice("solve", solve, SOLVES)
        if preference == "t5":
            check_bucketing(num_buckets, max_distance, bidirectional)
        if isinstance(context_hidden, bool) or not isinstance(context_hidden, int) or context_hidden < 1:
            raise ValueError(f"context_hidden must be an int >= 1, got {context_hidden!r}")
        layer.num_buckets, layer.max_distance, layer.bidirectional = num_buckets, max_distance, bidirectional
        layer.relative_bias = None
        layer.context_net = None
        # the layer's device and dtype (its constructor's device=/dtype=), like its projections
        dd = {"device": layer.qkv.weight.device, "dtype": layer.qkv.weight.dtype}
        if preference == "t5":
            layer.relative_bias = nn.Embedding(num_buckets, layer.num_heads, **dd)
            nn.init.zeros_(layer.relative_bias.weight)
        elif preference == "context":
            layer.context_net = nn.Sequential(nn.Linear(layer.qkv.in_features, context_hidden, **dd), nn.GELU(),
                                              nn.Linear(context_hidden, layer.num_heads, **dd))
            nn.init.zeros_(layer.context_net[-1].weight)
            nn.init.zeros_(layer.context_net[-1].bias)

    def kernel_kwargs(self, layer, q, k, v, *, x, attn_mask, is_causal, **forward_kwargs) -> dict:
        kw = super().kernel_kwargs(layer, q, k, v, x=x, attn_mask=attn_mask, is_causal=is_causal, **forward_kwargs)
        kw.update(alpha=layer.alpha, solve=layer.solve)
        if layer.relative_bias is not None:
            kw["relative_bias"] = T5Bias(layer.relative_bias.weight, layer.num_buckets, layer.max_distance,
                                         layer.bidirectional)
        elif layer.context_net is not None:
            kw["log_u"] = _checked(layer, layer.context_net(x).transpose(1, 2).unsqueeze(2), x)  # (B, H, 1, Nk)
        return kw

    def packed_kwargs(self, layer, q, k, v, *, x, is_causal, **forward_kwargs):
        """alpha, solve and the T5 table are the same for every sequence (the table reads offsets j - i
        inside each sequence); the context preference is one log u per key token x_j (T_k, dim), given
        as ``PerKey`` so that each sequence's keys get their own rows."""
        if layer.context_net is None:
            return self.kernel_kwargs(layer, q, k, v, x=x, attn_mask=None, is_causal=is_causal, **forward_kwargs)
        super().kernel_kwargs(layer, q, k, v, x=x, attn_mask=None, is_causal=is_causal, **forward_kwargs)
        return {"alpha": layer.alpha, "solve": layer.solve,
                "log_u": PerKey(_checked(layer, layer.context_net(x), x))}       # (T_k, H)

    def needs_key_tokens(self, layer) -> bool:
        return layer.context_net is not None

    def reads_positions(self, layer) -> bool:
        return layer.relative_bias is not None

    def describe(self, layer) -> dict:
        return {"alpha": layer.alpha, "solve": layer.solve, "preference": layer.preference}
