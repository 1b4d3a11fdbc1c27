"""What sigmoid attention adds to the shared layer: a fixed bias and an optional learned shift."""
from __future__ import annotations

import torch

from .. import validate as V
from ..masking import key_counts, split_mask
from ..record import LayerHook
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
        shift = layer.bias_shift.to(q.dtype).view(1, -1, 1, 1)
        if layer.fixed_bias is not None:  # a Python float added on the device: no host-to-device copy
            return {"bias": shift + layer.fixed_bias}
        return {"bias": shift + default_bias_rows(attn_mask, is_causal, q, k)}

    def packed_kwargs(self, layer, q, k, v, *, x, is_causal, **forward_kwargs):
        """A fixed bias, the default, or a learned shift on a fixed bias (per head): the same in every
        sequence. A learned shift on the default -log n_i is a value per row of each sequence: None."""
        if layer.bias_shift is not None and layer.fixed_bias is None:
            super().kernel_kwargs(layer, q, k, v, x=x, attn_mask=None, is_causal=is_causal, **forward_kwargs)
            return None
        return self.kernel_kwargs(layer, q, k, v, x=x, attn_mask=None, is_causal=is_causal, **forward_kwargs)

    def describe(self, layer) -> dict:
        return {"bias": layer.fixed_bias, "learnable_bias": layer.bias_shift is not None}


_DEFAULT_ROWS: dict = {}


def default_bias_rows(attn_mask, is_causal, q, k):
    """-log n_i as a (Nq|1, 1) tensor (or (..., Nq, 1) with a mask). Without a mask n_i depends only on
    the shape and causality, so it is made once per (device, dtype, Nq, Nk, is_causal) in eager mode
    and reused; a mask's counts are read on every call."""
    nq, nk = q.shape[-2], k.shape[-2]
    cacheable = attn_mask is None and not torch.compiler.is_compiling()
    key = (q.device, q.dtype, nq, nk, bool(is_causal))
    if cacheable and key in _DEFAULT_ROWS:
        return _DEFAULT_ROWS[key]
    keep, _ = split_mask(attn_mask, is_causal, nq, nk, q.device)
    rows = default_sigmoid_bias(key_counts(keep, nk, q))
    if cacheable:
        if len(_DEFAULT_ROWS) >= 256:
            _DEFAULT_ROWS.clear()
        _DEFAULT_ROWS[key] = rows
    return rows
