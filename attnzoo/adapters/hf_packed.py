"""Packed sequences in a Hugging Face model (padding-free fine-tuning: transformers'
``DataCollatorWithFlattening``, TRL's ``padding_free=True``): several sequences in one row of a batch of
one, each attending only to itself, each its own attention problem for every variant (Sinkhorn's
marginals, relu's 1/n, ... per sequence), all of a layer's sequences in one ``ops.varlen.attend_varlen``
call when the kernel's per-call values allow it (``layers/packed_attend.py`` says when; the work is the
sum over sequences of n_i^2, not T^2).

The attention function finds the sequences in the first of these that it is handed (as transformers'
flash path does):

1. ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (and ``max_length_q`` / ``max_length_k``), what
   ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` sends, even when a cache object is
   present (transformers then builds a plain causal mask, which would let the sequences see each other);
2. ``position_ids`` of a batch of one that restart (a new sequence starts where the position is the
   row's smallest, as ``transformers.modeling_flash_attention_utils.prepare_fa_kwargs_from_position_ids``
   reads them);
3. a block-diagonal mask (causal inside each block for a causal module) of a batch of one, e.g. the one
   transformers builds from restarting position ids, or one a user passes as a 4-D mask.

Only self-attention with no earlier (cached) positions is packed: a cached decoding step is unchanged
(after a packed prefill it attends to every cached token, as transformers' flash path does).
A mask handed with routes 1 and 2 must keep every pair the packed sequences keep (it may keep more: the
plain causal mask); one that also masks inside a sequence (padding in a packed row) is an error, not a
silently dropped mask.
"""
from __future__ import annotations

import math
import weakref
from typing import NamedTuple, Optional

import torch

from ..layers import packed_attend
from ..ops import varlen
from .kernel import check_key_tokens, host_scale, keys_and_values


class Packed(NamedTuple):
    cu_seq_q: torch.Tensor
    cu_seq_k: torch.Tensor
    max_q: int
    max_k: int


# per kind of question: (weak reference to the tensor read, its version and the question, the answer)
_MEMO: dict = {}


def _once(kind: str, tensor: torch.Tensor, question, compute):
    """compute(), remembered for the last tensor read: every layer of a forward gets the same position
    ids and mask, and reading them is a device sync on a GPU (once per forward, not per layer)."""
    slot = (tensor._version, question)
    last = _MEMO.get(kind)
    if last is not None and last[0]() is tensor and last[1] == slot:
        return last[2]
    answer = compute()
    _MEMO[kind] = (weakref.ref(tensor), slot, answer)
    return answer


def _structure(cu: torch.Tensor, total: int, causal: bool, window: Optional[int] = None) -> torch.Tensor:
    """(T, T) bool: query i may see key j (same sequence; j <= i too when causal; j > i - window with a
    sliding window, which the kernel then applies itself as window_size)."""
    token = torch.arange(total, device=cu.device)
    seq = torch.searchsorted(cu[1:].to(torch.int64), token, right=True)
    keep = seq[:, None] == seq[None, :]
    if window is not None:
        keep = keep & (token[None, :] > token[:, None] - window)
    return keep & (token[None, :] <= token[:, None]) if causal else keep


def _from_offsets(cu: torch.Tensor) -> Packed:
    lengths = cu.diff()
    longest = int(lengths.max())
    return Packed(cu, cu, longest, longest)


def _from_positions(position_ids: torch.Tensor) -> Optional[Packed]:
    pos = position_ids.reshape(-1)
    starts = (pos == pos.min()).nonzero().view(-1)
    if starts.numel() < 2 or int(starts[0]) != 0:   # one sequence, or not a packed row (left padding's ids)
        return None
    end = torch.tensor([pos.numel()], device=pos.device)
    return _from_offsets(torch.cat([starts, end]).to(torch.int32))


def _keep(mask: torch.Tensor) -> torch.Tensor:
    return mask if mask.dtype == torch.bool else mask > -math.inf


def _from_block_mask(mask: torch.Tensor, causal: bool, window: Optional[int] = None) -> Optional[Packed]:
    keep = _keep(mask)[0, 0]
    total = keep.shape[-1]
    first = keep.int().argmax(-1)                       # each row's first key: its sequence's start when packed
    starts = (first == torch.arange(total, device=keep.device)).nonzero().view(-1)
    if starts.numel() < 2 or int(starts[0]) != 0:
        return None
    cu = torch.cat([starts, torch.tensor([total], device=keep.device)]).to(torch.int32)
    if not bool((keep == _structure(cu, total, causal, window)).all()):
        return None
    if mask.dtype != torch.bool and not bool((mask.masked_fill(~keep, 0) == 0).all()):
        return None                                     # a float bias inside the blocks is not packing
    return _from_offsets(cu)


def _check_mask_keeps(mask: Optional[torch.Tensor], packed: Packed, causal: bool, route: str,
                      window: Optional[int] = None) -> None:
    if mask is None:
        return
    if mask.shape[-2] != mask.shape[-1]:
        raise ValueError(f"packed sequences ({route}) need a square self-attention mask, got {tuple(mask.shape)}")
    keep = _keep(mask)
    inside = _structure(packed.cu_seq_q, mask.shape[-1], causal, window)
    ok = bool((keep | ~inside).all())
    if ok and mask.dtype != torch.bool:
        ok = bool((mask.masked_fill(~inside, 0) == 0).all())
    if not ok:
        raise ValueError(f"packed sequences ({route}) came with an attention mask that also masks (or biases) "
                         "pairs inside a sequence, e.g. padding in the packed row: attnzoo computes each packed "
                         "sequence whole and would drop that mask. Remove the padding from the packed row, or "
                         "pass a padded batch without the packing arguments")


def find(query, key, attention_mask: Optional[torch.Tensor], causal: bool, cross: bool, kwargs: dict,
         window: Optional[int] = None) -> Optional[Packed]:
    """The packed sequences of this call (see the module), or None for an ordinary call. ``window``: the
    model's sliding window (keys j > i - window), which the kernel applies as window_size, so a mask that
    holds it is not taken for padding inside a sequence."""
    total = query.shape[-2]
    if (cross or query.shape[0] != 1 or total < 2 or total != key.shape[-2]
            or kwargs.get("position_bias") is not None):
        # a cached decoding step (one new token) is never packed: decided from shapes, before any read of
        # position ids or masks (each a device sync on a GPU, once per generated token otherwise)
        return None
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None or cu_k is not None:
        if cu_q is None or cu_k is None:
            raise ValueError("packed sequences need both cu_seq_lens_q and cu_seq_lens_k (transformers' flash "
                             f"kwargs); got only {'cu_seq_lens_q' if cu_k is None else 'cu_seq_lens_k'}")
        max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
        packed = Packed(cu_q, cu_k, int(cu_q.diff().max()) if max_q is None else int(max_q),
                        int(cu_k.diff().max()) if max_k is None else int(max_k))
        if attention_mask is not None:
            _once("mask", attention_mask, ("kwargs", id(cu_q), causal, window),
                  lambda: _check_mask_keeps(attention_mask, packed, causal, "cu_seq_lens_q/k", window))
        return packed
    position_ids = kwargs.get("position_ids")
    if position_ids is not None and position_ids.shape[0] == 1 and position_ids.shape[-1] == total:
        packed = _once("positions", position_ids, None, lambda: _from_positions(position_ids))
        if packed is not None:
            if attention_mask is not None:
                _once("mask", attention_mask, ("positions", id(position_ids), causal, window),
                      lambda: _check_mask_keeps(attention_mask, packed, causal, "restarting position_ids", window))
            return packed
    if (attention_mask is not None and attention_mask.dim() == 4 and attention_mask.shape[:2] == (1, 1)
            and tuple(attention_mask.shape[-2:]) == (total, total)):
        return _once("mask", attention_mask, ("block", causal, window),
                     lambda: _from_block_mask(attention_mask, causal, window))
    return None


def run(kernel, query, key, value, packed: Packed, *, causal: bool, dropout_p: float, scale, tokens,
        extras: Optional[dict] = None):
    """(1, H, T, D) q, k, v -> (1, T, H, Dv): every packed sequence its own problem, in one
    ``attend_varlen`` call when the kernel's per-call values allow it (``layers/packed_attend.py``)."""
    key, value = keys_and_values(kernel, query, key, value)
    x = None if tokens is None else tokens[0]
    check_key_tokens(kernel, x)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    # every layer of a forward gets the same offsets: checked and read once (a host sync on a GPU)
    _, _, offsets_q, offsets_k = _once("offsets", packed.cu_seq_q, (
        id(packed.cu_seq_k), packed.cu_seq_k._version, q.shape, k.shape, v.shape, packed.max_q, packed.max_k,
        torch.compiler.is_compiling()),
        lambda: varlen.check(q, k, v, packed.cu_seq_q, packed.cu_seq_k, packed.max_q, packed.max_k))
    out = packed_attend.attend(kernel, q, k, v, packed.cu_seq_q, packed.cu_seq_k, packed.max_q, packed.max_k,
                               offsets_q, offsets_k, is_causal=causal, tokens=x, scale=host_scale(kernel, scale),
                               dropout_p=float(dropout_p), enable_gqa=k.shape[1] != q.shape[1], extras=extras)
    return out[None]
