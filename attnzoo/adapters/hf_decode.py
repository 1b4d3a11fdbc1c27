"""Hugging Face's side of cached decoding (``generate`` with a KV cache) for kernels that read more
about the earlier positions than their keys and values: the queries of a variant that couples queries
(Sinkhorn), the key tokens of Fenchel's context preference. ``decode_state`` keeps them; this module
finds, for each call of an HF attention module, which positions came before and what identifies them.

Causal self-attention: the cache's keys after this call's update cover every position, the call's
queries the last ones. A decoder's cross-attention (its queries are causal decoder positions,
attending the encoder's tokens): the positions that came before are the decoder's self-attention
keys of the same layer, read from the ``EncoderDecoderCache`` the call carries, which a forward
pre-hook on the module records (the attention function is not handed the cache).
"""
from __future__ import annotations

import inspect
import math
import weakref
from typing import Optional

import torch

from ..layers.base import AttentionLayer
from . import decode_state

KERNEL_CHILD = "attnzoo_kernel"  # an HF attention module's attnzoo kernel (added by attnzoo.swap)
CALL_HOOK = "_attnzoo_call_hook"  # on a module: the handle of its record_call pre-hook


_SIGNATURES: dict = {}


def _call_argument(module, args, kwargs, names):
    """The first of ``names`` given to this forward call (by keyword or by position), else None."""
    for name in names:
        if kwargs.get(name) is not None:
            return kwargs[name]
    if not args:
        return None
    cls = type(module)
    if cls not in _SIGNATURES:
        _SIGNATURES[cls] = inspect.signature(cls.forward)
    try:
        bound = _SIGNATURES[cls].bind_partial(module, *args, **kwargs).arguments
    except TypeError:
        return None
    return next((bound[n] for n in names if bound.get(n) is not None), None)


# HF attention module -> weak reference to the cache its current call carries (None: no cache)
_CALL_CACHES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def record_call(module, args, kwargs):
    """Forward pre-hook: what the attention function is not handed. The key tokens (Fenchel's context
    preference reads them: the encoder's in a cross-attention) and the call's cache (a decoder's
    cross-attention learns from it which positions came before)."""
    kernel = getattr(module, KERNEL_CHILD, None)
    if kernel is not None and kernel.needs_key_tokens:
        tokens = _call_argument(module, args, kwargs, ("key_value_states", "encoder_hidden_states", "hidden_states"))
        object.__setattr__(kernel, "_tokens", tokens)
    cache = _call_argument(module, args, kwargs, ("cache", "past_key_values", "past_key_value"))
    _CALL_CACHES[module] = None if cache is None else weakref.ref(cache)


def hook(module) -> None:
    """Give ``module`` the record_call pre-hook (once)."""
    if getattr(module, CALL_HOOK, None) is None:
        object.__setattr__(module, CALL_HOOK, module.register_forward_pre_hook(record_call, with_kwargs=True))


def call_cache(module):
    """The cache this module's current call carries. A module first seen here (an
    attn_implementation="attnzoo_<variant>" model, not swapped) gets the hook now, and this first call
    is taken as one without a cache."""
    if getattr(module, CALL_HOOK, None) is None:
        hook(module)
        return None
    ref = _CALL_CACHES.get(module)
    return None if ref is None else ref()


def unhook(module) -> None:
    handle = getattr(module, CALL_HOOK, None)
    if handle is not None:
        handle.remove()
        object.__delattr__(module, CALL_HOOK)
    decode_state.forget(module)


def _what(kernel: AttentionLayer, module) -> str:
    return f"attnzoo's {kernel.kind!r} in {type(module).__name__}"


def _may_keep(module) -> bool:
    """Not a training step with gradients on: what is kept would hold that step's activations."""
    return not (module.training and torch.is_grad_enabled())


def with_earlier_positions(kernel: AttentionLayer, module, query, key, mask, tokens, window=None):
    """Causal self-attention: the queries (a variant that couples queries) and key tokens (a kernel
    that reads them) of every position in the cache, the earlier ones from decode_state.

    ``window``: the host's sliding window (HF's ``sliding_window``), None: none. Under a window the
    mask is causality AND the band AND padding. Row i's problem (ops.masking.coupled_causal_rows) is
    then over the tokens in its window, every pair of which lies inside the window, so the earlier
    positions' queries plus the step's one-row mask (which keys the new query sees) determine it; a
    sliding cache that keeps only the window's keys is followed (decode_state)."""
    new, nk = query.shape[-2], key.shape[-2]
    couples = kernel.couples_queries
    # the mask is causality plus padding (causal_and_rest): one row, and no logit bias in it (a one-row
    # T5 position bias is the bias of the new query only, not of the earlier ones). Only a variant that
    # couples queries asks: reading the values is a device sync
    windowed = couples and window is not None and mask is not None and _padding_only(mask)
    per_key = couples and (mask is None or (mask.shape[-2] == 1 and _padding_only(mask)))
    if couples and not (per_key or windowed) and nk > new:
        raise ValueError(f"{_what(kernel, module)}: a cached step of a variant that couples queries needs "
                         "the mask to be causality plus padding (and maybe the host's sliding window), and "
                         "this one is not (a position bias such as T5's, or a static cache's unused slots); "
                         f"{decode_state.ADVICE}")
    keep = None
    if windowed:
        keep = _window_keep(mask, query.shape[0], new, nk)
    elif couples and mask is not None and per_key:
        keep = mask if mask.dtype == torch.bool else mask > -math.inf
        keep = keep.expand(query.shape[0], -1, 1, nk)[:, :, 0]  # (B, Hm, Nk): False = padding
    remember = (per_key or windowed or not couples) and _may_keep(module)
    queries, tokens = decode_state.extend(module, ident=key, new=new, what=_what(kernel, module),
                                          queries=query if couples else None,
                                          tokens=tokens if kernel.needs_key_tokens else None,
                                          keep=keep, remember=remember, window=couples and window is not None)
    return (queries if couples else query), tokens


def _window_keep(mask: torch.Tensor, batch: int, new: int, nk: int) -> torch.Tensor:
    """(B, Hm, Nk) bool from a causal + band + padding mask of the call's ``new`` queries: a new position
    is kept when it sees itself (padding hides a token from every query, itself included), an earlier
    one when some new query sees it (the band may already have dropped it: decode_state then keeps the
    padding it was first kept with)."""
    keep = mask if mask.dtype == torch.bool else mask > -math.inf
    keep = keep.expand(batch, -1, new, nk)
    own = keep.diagonal(offset=nk - new, dim1=-2, dim2=-1)           # (B, Hm, new)
    seen = keep[..., : nk - new].any(-2)                              # (B, Hm, P)
    return torch.cat([seen, own], dim=-1)


def _padding_only(mask: torch.Tensor) -> bool:
    """A bool mask, or a float one whose values are only 0 (take part) and -inf (masked)."""
    return mask.dtype == torch.bool or bool(((mask == 0) | (mask == -math.inf)).all())


def with_earlier_queries(kernel: AttentionLayer, module, query, mask):
    """A decoder's cross-attention (queries: causal decoder positions) of a variant that couples
    queries: the queries of every decoder position so far. Which positions came before is read from
    the decoder's self-attention cache of the same layer, which this module's call carried."""
    cache = call_cache(module)
    if cache is None:  # no cache: this call's queries are all the positions there are
        decode_state.forget(module)
        return query, mask
    what = _what(kernel, module)
    ident = _decoder_keys(cache, module)
    if ident is None:
        raise ValueError(f"{what}: a decoder's cross-attention with a {type(cache).__name__} cannot tell which "
                         "decoder positions came before (attnzoo reads an EncoderDecoderCache's self-attention "
                         f"keys); {decode_state.ADVICE}")
    new = query.shape[-2]
    if ident.shape[-2] > new and mask is not None and mask.shape[-2] > 1:
        if not bool((mask == mask[..., :1, :]).all()):
            raise ValueError(f"{what}: a cached step needs the encoder mask to be the same for every decoder "
                             f"position (padding); {decode_state.ADVICE}")
        mask = mask[..., :1, :]
    queries, _ = decode_state.extend(module, ident=ident, new=new, what=what, queries=query,
                                     remember=_may_keep(module))
    return queries, mask


def refuse_static_cache(kernel: AttentionLayer, module) -> None:
    """A kernel that reads the relative positions j - i (Fenchel's T5 preference) takes them bottom-right
    aligned on the call's keys. A static cache hands every one of its max_cache_len slots, the unused
    ones masked, so those offsets would be shifted by the unused count: a silently other answer.
    Refused (the error names the way out) rather than computed."""
    cache = call_cache(module)
    cache = getattr(cache, "self_attention_cache", cache)  # an encoder-decoder's self-attention part
    layers = getattr(cache, "layers", None)
    index = getattr(module, "layer_idx", None)
    if layers is None or index is None or index >= len(layers):
        return
    if getattr(layers[index], "max_cache_len", None) is not None:  # transformers' StaticLayer and its kinds
        raise ValueError(f"{_what(kernel, module)} reads relative positions (fenchel's preference='t5'), and a "
                         f"static cache ({type(cache).__name__}: cache_implementation='static') hands the kernel "
                         "every cache slot, the unused ones masked, so the offsets would be shifted; use the "
                         "default dynamic cache (no cache_implementation) or use_cache=False")


def _decoder_keys(cache, module) -> Optional[torch.Tensor]:
    """The decoder self-attention keys this layer has cached (B, Hkv, positions, D), or None."""
    layers = getattr(getattr(cache, "self_attention_cache", None), "layers", None)
    index = getattr(module, "layer_idx", None)
    if layers is None or index is None or index >= len(layers):
        return None
    keys = getattr(layers[index], "keys", None)
    return keys if isinstance(keys, torch.Tensor) and keys.dim() == 4 else None
