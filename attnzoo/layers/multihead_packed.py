"""attnzoo.MultiheadAttention on ``torch.nested`` jagged tensors: query (B, j_q, E), key and value
(B, j_k, E) of layout torch.jagged (``batch_first=True``), each batch entry its own attention problem
(``ops/varlen.py``), the output a jagged tensor with the query's offsets. The projections run once over
the packed tokens; the kernel in one ``attend_varlen`` call for every sequence (per sequence length
when a subclass replaced ``_attend`` or a kind option is a tensor)."""
from __future__ import annotations

import torch

from ..ops import varlen


def _refuse(module, why: str):
    raise ValueError(f"{type(module).__name__} with nested (jagged) inputs: {why}")


def _runs_its_kind(module) -> bool:
    """The module's kernel is its kind's function with its kind_kwargs (no subclass replaced ``_attend``),
    none of them a tensor (whose (B, H, Nq, Nk) layout a packed call does not have): one
    ``attend_varlen`` call then serves every sequence."""
    defines = [c for c in type(module).__mro__ if "_attend" in vars(c)]
    return len(defines) == 1 and not any(isinstance(value, torch.Tensor) for value in module.kind_kwargs.values())


def forward_nested(module, query, key, value, key_padding_mask, need_weights, attn_mask, is_causal):
    """``MultiheadAttention.forward`` for jagged inputs (see the module); returns (output, None)."""
    if not all(isinstance(t, torch.Tensor) and t.is_nested and t.layout == torch.jagged and t.dim() == 3
               for t in (query, key, value)):
        _refuse(module, "query, key and value must all be (B, j, E) nested tensors of layout torch.jagged")
    if not module.batch_first:
        _refuse(module, "build the module with batch_first=True (a jagged tensor is (B, j, E))")
    if need_weights:
        _refuse(module, "pass need_weights=False (there is no (B, L, S) weight tensor for ragged lengths; "
                        "torch's own nested path requires it too)")
    if key_padding_mask is not None or attn_mask is not None:
        _refuse(module, "pass no key_padding_mask or attn_mask (the offsets already keep the sequences apart)")
    if module.bias_k is not None or module.add_zero_attn:
        _refuse(module, "add_bias_kv and add_zero_attn are not supported")
    if key.offsets() is not value.offsets() and not torch.equal(key.offsets(), value.offsets()):
        _refuse(module, "key and value must share their offsets")
    H, hd = module.num_heads, module.head_dim
    q, k, v = module._project(query.values(), key.values(), value.values())
    q, k, v = (t.reshape(t.shape[0], H, hd) for t in (q, k, v))
    cu_q, cu_k = query.offsets(), key.offsets()
    max_q, max_k = int(cu_q.diff().max()), int(cu_k.diff().max())
    _, _, offsets_q, offsets_k = varlen.check(q, k, v, cu_q, cu_k, max_q, max_k)
    dropout_p = module.dropout if module.training else 0.0

    def attend(q, k, v):
        return module._attend(q, k, v, None, is_causal, dropout_p)

    if _runs_its_kind(module):
        out = varlen.attend_varlen(module.kind, q, k, v, cu_q, cu_k, max_q, max_k, is_causal=is_causal,
                                   dropout_p=dropout_p, backend=module.backend, **module.kind_kwargs)
    elif offsets_q is None:                                   # torch.compile: read outside the graph
        out = varlen.per_sequence_reading_offsets(attend, q, k, v, cu_q, cu_k, {})
    else:
        out = varlen.per_sequence(attend, q, k, v, offsets_q, offsets_k, {})
    out = module.out_proj(out.reshape(out.shape[0], module.embed_dim))
    return torch.nested.nested_tensor_from_jagged(out, cu_q), None
