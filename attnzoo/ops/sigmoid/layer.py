"""What sigmoid attention adds to the shared layer: a fixed bias and an optional learned shift."""
from __future__ import annotations

import torch

from .. import validate as V
from ..masking import key_counts, split_mask
from ..variant import LayerHook
from .reference import default_sigmoid_bias


class SigmoidHook(LayerHook):
    """``bias`` fixes b (default -log n); ``learnable_bias=True`` adds a learned per-head shift
    ``layer.bias_shift`` (initialised to 0) on top of it."""

    def setup(self, layer, *, bias=None, learnable_bias: bool = False) -> None:
        layer.fixed_bias = None if bias is None else V.check_real("bias", bias)
        learnable_bias = V.check_flag("learnable_bias", learnable_bias)
        w = layer.qkv.weight  # the layer's device and dtype (its constructor's device=/dtype=)
        layer.bias_shift = (torch.nn.Parameter(torch.zeros(layer.num_heads, device=w.device, dtype=w.dtype))
                            if learnable_bias else None)

    def kernel_kwargs(self, layer, q, k, v, *, x, attn_mask, is_causal, **forward_kwargs) -> dict:
        super().kernel_kwargs(layer, q, k, v, x=x, attn_mask=attn_mask, is_causal=is_causal, **forward_kwargs)
        if layer.bias_shift is None:
            return {"bias": layer.fixed_bias}
        if layer.fixed_bias is None:
            keep, _ = split_mask(attn_mask, is_causal, q.shape[-2], k.shape[-2], q.device)
            base = default_sigmoid_bias(key_counts(keep, k.shape[-2], q))
        else:
            base = torch.tensor(layer.fixed_bias, dtype=q.dtype, device=q.device)
        return {"bias": base + layer.bias_shift.to(q.dtype).view(1, -1, 1, 1)}

    def describe(self, layer) -> dict:
        return {"bias": layer.fixed_bias, "learnable_bias": layer.bias_shift is not None}
