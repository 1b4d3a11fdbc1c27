"""A layer's attention on packed sequences, the one place a packed host call (a layer's packed forward,
MultiheadAttention's jagged inputs, the Hugging Face packed route) picks its route:

* one call: ``ops.varlen.attend_varlen`` with the layer's per-call arguments, when its hook can give
  them for the whole packed batch (``LayerHook.packed_kwargs``: values the same in every sequence, or
  one per key token). attend_varlen then runs all sequences in one blockwise call on CPU (softmax, l2,
  fenchel, sigmoid, relu; ``ops/varlen_blockwise.py`` says when) and whatever packed kernels the device
  has; otherwise it stacks the sequences of each length itself;
* per length: the hook's value depends on a sequence in another way (sigmoid's learned shift on its
  default -log n_i, one value per row; OT's templates; a variant declared outside the package whose
  hook does not say): the sequences of each (n_q, n_k) are stacked and run through ``layer.attend``.

Either way each sequence is its own attention problem; the two routes give the same numbers.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..ops import varlen


def _owner(cls, name: str):
    return next(c for c in cls.__mro__ if name in vars(c))


def attend(layer, q, k, v, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int,
           offsets_q: Optional[list], offsets_k: Optional[list], *, is_causal: bool,
           tokens: Optional[torch.Tensor] = None, scale: Optional[float] = None, dropout_p: Optional[float] = None,
           enable_gqa: bool = False, extras: Optional[dict] = None, forward_kwargs: Optional[dict] = None
           ) -> torch.Tensor:
    """Packed q (T_q, H, D), k, v (T_k, H_kv, D / Dv) -> (T_q, H, Dv) through ``layer``'s variant (see
    the module). ``offsets_q`` / ``offsets_k``: the offsets as ints, checked (``varlen.check``), or
    None while torch.compile traces; ``tokens``: the (T_k, dim) key tokens, or None when the host has
    none; ``scale`` / ``dropout_p``: None for the layer's own; ``extras``: the call's softcap / sinks /
    window_size; ``forward_kwargs``: the layer forward's extra keyword arguments (its hook's)."""
    forward_kwargs = forward_kwargs or {}
    extras = extras or {}
    q4, k4, v4 = (t.transpose(0, 1)[None] for t in (q, k, v))
    options = None
    if _owner(type(layer), "attend") is _owner(type(layer), "packed_causal"):   # else attend's change is unseen
        options = layer.record.hook.packed_kwargs(layer, q4, k4, v4, x=tokens, is_causal=is_causal,
                                                  **forward_kwargs)
    if dropout_p is None:
        dropout_p = layer.attn_drop.p if layer.training else 0.0
    if options is not None:
        if enable_gqa:
            options["enable_gqa"] = True
        return varlen.attend_varlen(layer.kind, q, k, v, cu_q, cu_k, max_q, max_k,
                                    is_causal=layer.packed_causal(is_causal),
                                    scale=layer.scale if scale is None else scale, dropout_p=dropout_p,
                                    backend=layer.backend, **options, **layer.logit_extras(**extras))

    def each(q, k, v, x=None):
        return layer.attend(q, k, v, is_causal=is_causal, x=x, scale=scale, dropout_p=dropout_p,
                            enable_gqa=enable_gqa, **extras, **forward_kwargs)

    if offsets_q is None:                                     # torch.compile: read outside the graph
        return varlen.per_sequence_reading_offsets(each, q, k, v, cu_q, cu_k, {}, key_tokens=tokens)
    return varlen.per_sequence(each, q, k, v, offsets_q, offsets_k, {}, key_tokens=tokens)
