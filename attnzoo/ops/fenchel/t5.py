"""Fenchel attention with T5's relative-position preference (paper 004 eqs 16-18) on fused kernels.

softmax_j(alpha * scale * q_i.k_j + table[bucket(j - i), h] + mask_ij) v_j can run on
- "triton": attnzoo's fused kernel, which adds the bias tile by tile and accumulates the table's
  gradient (ops/softmax/triton.py, t5_bias_attention);
- "flex":   FlexAttention with the table lookup as a score_mod (CUDA; ops/softmax/flex.py);
- any other fenchel backend: the dense (1, H, Nq, Nk) log u built by the layer (``t5_attention``
  returns None and the layer calls ``attnzoo.functional.fenchel``).
``auto`` on CUDA follows the device's measured ranking (ops/measured.py, flavour "t5"), else the
Triton kernel when it can run the call.
"""
from __future__ import annotations

from typing import Optional

from .. import dispatch, measured
from ..triton_utils import common_reason
from .t5_buckets import t5_offset_lut

FUSED = ("triton", "flex")


def _flex_reason(q, dropout_p) -> Optional[str]:
    from ..softmax.flex import flex_available
    if q.device.type != "cuda":
        return "FlexAttention runs here on CUDA tensors only (it has no backward on CPU)"
    if not flex_available():
        return "torch.nn.attention.flex_attention is not available in this torch build"
    if dropout_p > 0:
        return "FlexAttention has no dropout on the weights"
    return None


def reason(name: str, q, k, v, attn_mask, dropout_p) -> Optional[str]:
    """None when the fused T5 path ``name`` can run the call, else why not."""
    if name == "triton":
        return common_reason(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p)
    return _flex_reason(q, dropout_p)


def choose(q, k, v, *, backend=None, attn_mask=None, is_causal=False, dropout_p=0.0) -> Optional[str]:
    """"triton", "flex", or None for the dense path. A fused path named explicitly runs or raises."""
    requested = backend or dispatch.default_backend()
    if requested in FUSED:
        why = reason(requested, q, k, v, attn_mask, dropout_p)
        if why is not None:
            raise ValueError(f"backend={requested!r} cannot run this fenchel (T5) call: {why}")
        return requested
    if requested != dispatch.AUTO or q.device.type != "cuda":
        return None
    kwargs = {"attn_mask": attn_mask, "is_causal": is_causal, "dropout_p": dropout_p}
    ranked = measured.ranking("fenchel_t5", q, k, v, kwargs) or FUSED
    for name in ranked:
        if name not in FUSED:
            return None  # the dense path measured faster here
        if reason(name, q, k, v, attn_mask, dropout_p) is None:
            return name
    return None


def t5_attention(q, k, v, table, num_buckets, max_distance, bidirectional, *, attn_mask=None, is_causal=False,
                 scale, alpha=1.0, dropout_p=0.0, backend=None):
    """The fused T5 output, or None when the chosen path is the dense one."""
    name = choose(q, k, v, backend=backend, attn_mask=attn_mask, is_causal=is_causal, dropout_p=dropout_p)
    if name == "triton":
        from ..softmax import triton as fused
        return fused.t5_bias_attention(q, k, v, table, num_buckets, max_distance, bidirectional,
                                       attn_mask=attn_mask, is_causal=is_causal, scale=scale, alpha=alpha,
                                       dropout_p=dropout_p)
    if name == "flex":
        from ..softmax.flex import t5_flex
        lut = t5_offset_lut(q.shape[2], k.shape[2], num_buckets, max_distance, bool(bidirectional), q.device)
        return t5_flex(q, k, v, table, lut, attn_mask=attn_mask, is_causal=is_causal, scale=alpha * scale)
    return None
