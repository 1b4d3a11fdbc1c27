"""Fenchel attention with T5's relative-position preference (paper 004 eqs 16-18) on fused kernels.

softmax_j(alpha * scale * q_i.k_j + table[bucket(j - i), h] + mask_ij) v_j can run on
- "triton": the online-softmax kernel, which adds the bias tile by tile from a per-head vector
  bias[h, r] = table[bucket(r), h] (one scalar for a tile whose offsets share a bucket) and sums the
  table's gradient per bucket (``t5_bias_attention``);
- "flex":   FlexAttention with the table lookup as a score_mod (CUDA; kernels.py, t5_flex);
- any other fenchel backend: the dense (1, H, Nq, Nk) log u (``dense_log_u``) through the fenchel
  dispatcher (``t5_attention`` returns None).
``auto`` on CUDA follows the device's measured ranking (ops/measured.py, flavour "t5"), else the
Triton kernel when it can run the call.
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from .. import dispatch, measured
from .. import validate as V
from ..kernels.flash_softmax.triton import bucket_bias_attention, offset_lut
from ..kernels.flex import flex_reason
from ..triton_utils import common_reason
from .backends import t5_flex
from .t5_buckets import check_bucketing, t5_offset_lut
from .t5_reference import t5_log_preference

FUSED = ("triton", "flex")


class T5Bias(NamedTuple):
    """A learned T5 relative-position log-preference: ``table`` (num_buckets, H), e.g. an
    ``nn.Embedding(num_buckets, H).weight``, and the bucketing of the offsets j - i."""
    table: Tensor
    num_buckets: int = 32
    max_distance: int = 128
    bidirectional: bool = True


def dense_log_u(bias: T5Bias, nq: int, nk: int) -> Tensor:
    """log u_ij = table[bucket(j - i), h] as a (1, H, Nq, Nk) tensor (bottom-right aligned offsets)."""
    return t5_log_preference(bias.table, bias.num_buckets, bias.max_distance, bias.bidirectional, nq, nk)


def kernel_lut(nq: int, nk: int, num_buckets: int, max_distance: int, bidirectional: bool, like: Tensor) -> Tensor:
    """T5's int32 (2, Nq + Nk - 1) offset table for the fused kernels (``offset_lut``: row 0 the bucket of
    offset index j - i + Nq - 1, row 1 the end of its run of equal buckets), made once per shape and
    device in eager mode (building it is some twenty small ops); made afresh while torch.compile traces,
    where a cached real tensor cannot enter the graph."""
    build = _build_lut if type(like) is not Tensor or torch.compiler.is_compiling() else _cached_lut
    return build(nq, nk, num_buckets, max_distance, bidirectional, like.device)


def _build_lut(nq, nk, num_buckets, max_distance, bidirectional, device):
    return offset_lut(t5_offset_lut(nq, nk, num_buckets, max_distance, bidirectional, device))


_cached_lut = functools.lru_cache(maxsize=64)(_build_lut)


def check_t5_args(table, num_buckets, max_distance, q, bidirectional=True) -> None:
    H = q.shape[1]
    if not isinstance(table, Tensor) or not table.is_floating_point():
        raise TypeError(f"table must be a float tensor of shape (num_buckets, H), got {type(table).__name__}"
                        + (f" {table.dtype}" if isinstance(table, Tensor) else ""))
    check_bucketing(num_buckets, max_distance, bidirectional)
    if tuple(table.shape) != (num_buckets, H):
        raise ValueError(f"table must have shape (num_buckets={num_buckets}, H={H}), got {tuple(table.shape)}")
    if table.device != q.device:
        raise ValueError(f"table must be on {q.device} like q, got {table.device}")


def check_bias(bias, q) -> None:
    if not isinstance(bias, T5Bias):
        raise TypeError(f"relative_bias must be a T5Bias(table, num_buckets, max_distance, bidirectional), "
                        f"got {type(bias).__name__}")
    check_t5_args(bias.table, bias.num_buckets, bias.max_distance, q, bias.bidirectional)


def t5_bias_attention(q, k, v, table, num_buckets, max_distance, bidirectional, attn_mask=None,
                      is_causal=False, scale=None, *, alpha=1.0, dropout_p=0.0):
    """softmax_j(alpha * scale * q_i.k_j + table[bucket(j - i), h] + mask_ij) v_j (paper 004 eqs 16-18)
    on the Triton kernel, with dropout on those weights when ``dropout_p > 0``.

    ``table`` is (num_buckets, H), e.g. ``nn.Embedding(num_buckets, H).weight``; the bucket of the
    offset j - i (bottom-right aligned when Nq != Nk) is T5's, as in FenchelAttention. The kernel
    adds the bias tile by tile and returns the gradient to ``table`` (summed per head and bucket)."""
    V.check_qkv(q, k, v)
    V.check_mask(attn_mask, q, k)
    scale = V.resolve_scale(scale, q)
    alpha = V.check_positive("alpha", alpha)
    check_t5_args(table, num_buckets, max_distance, q, bidirectional)
    dropout_p = V.check_dropout(dropout_p)
    lut = kernel_lut(q.shape[2], k.shape[2], num_buckets, max_distance, bool(bidirectional), q)
    return bucket_bias_attention(q, k, v, table, lut, attn_mask=attn_mask, is_causal=is_causal, scale=scale * alpha,
                                 dropout_p=dropout_p)


def reason(name: str, q, k, v, attn_mask, dropout_p) -> Optional[str]:
    """None when the fused T5 path ``name`` can run the call, else why not."""
    if name == "triton":
        return common_reason(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p)
    return flex_reason(q, k, v, dropout_p=dropout_p)


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


def t5_attention(q, k, v, bias: T5Bias, *, attn_mask=None, is_causal=False, scale, alpha=1.0, dropout_p=0.0,
                 backend=None):
    """The fused T5 output, or None when the chosen path is the dense one."""
    name = choose(q, k, v, backend=backend, attn_mask=attn_mask, is_causal=is_causal, dropout_p=dropout_p)
    if name == "triton":
        return t5_bias_attention(q, k, v, bias.table, bias.num_buckets, bias.max_distance, bias.bidirectional,
                                 attn_mask=attn_mask, is_causal=is_causal, scale=scale, alpha=alpha,
                                 dropout_p=dropout_p)
    if name == "flex":
        lut = kernel_lut(q.shape[2], k.shape[2], bias.num_buckets, bias.max_distance, bool(bias.bidirectional), q)
        return t5_flex(q, k, v, bias.table, lut[0], attn_mask=attn_mask, is_causal=is_causal, scale=alpha * scale)
    return None
