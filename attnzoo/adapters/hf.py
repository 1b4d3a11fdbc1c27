"""Hugging Face transformers (5.x): attnzoo variants as attention implementations.

Two ways in, both through transformers' ``AttentionInterface`` (the HF attention modules attnzoo
recognises call ``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, ...)(self, q, k, v,
mask, ...)``; a model whose attention does not, such as Falcon, is reported unsupported):

* ``register_hf_attention()`` registers ``"attnzoo_<variant>"`` for every variant, each with its mask
  function in ``AttentionMaskInterface`` (transformers builds the mask per implementation; without one
  the padding/causal mask would be missing). Then ``model.set_attn_implementation("attnzoo_sigmoid")``
  or ``from_config(cfg, attn_implementation="attnzoo_sigmoid")`` works. Variants with extra parameters
  cannot be a bare function: they need ``attnzoo.swap``.
* ``attnzoo.swap(model, spec)`` attaches a bare attnzoo layer as a child ``attnzoo_kernel`` of each
  selected HF attention module (holding the variant's extra parameters: sigmoid's bias shift,
  Fenchel's preference, ...) and sets the model's implementation to ``"attnzoo"``, which runs a module's
  ``attnzoo_kernel`` when it has one and SDPA otherwise (layers excluded by include=/exclude=). The HF
  module keeps its own q/k/v/out projections, so every original state_dict key is unchanged.

The mask transformers builds for these implementations is its SDPA mask with the causal shortcut off:
a bool (B, 1, Nq, Nk) tensor, True = take part (attnzoo's own convention), or None when nothing is
masked. In a causal module that mask holds causality AND padding (AND maybe a sliding window or
packed sequences' blocks); the kernel gets causality as ``is_causal=True`` with the padding as a
(B, 1, 1, Nk) mask, or with the mask itself when it has more structure (``kernel.causal_and_rest``),
so that Sinkhorn solves each row's problem as ``ops.masking.coupled_causal_rows`` defines and no later
token moves an earlier output. Under torch.compile a kernel whose queries do not couple gets the mask
alone (the same answer, without the split's host sync and graph break). Grouped key/value heads go
to the kernel as they are, with ``enable_gqa=True``. Cached decoding (what a kernel reads about the
earlier positions beyond HF's keys and values) is in ``hf_decode``.
"""
from __future__ import annotations

import inspect
import math
import warnings
import weakref
from typing import Optional

import torch
from torch import nn

from .. import registry
from ..layers.base import AttentionLayer
from . import hf_decode, hf_packed, hf_record
from .common import Change, describe_new_parameters, param_names
from .kernel import causal_and_rest, kernel_layer, run_kernel
from .spec import Target, resolve

KERNEL_CHILD = hf_decode.KERNEL_CHILD
DISPATCH_NAME = hf_record.DISPATCH_NAME
# on a swapped module: the implementation its config had before attnzoo.swap set "attnzoo" (kept on the
# module, not the config: save_pretrained would write a config attribute into config.json)
_PREVIOUS_IMPLEMENTATION = "_attnzoo_previous_implementation"


def available() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


# -- the attention function transformers calls -----------------------------------------------------
def _mask_for_kernel(attention_mask: Optional[torch.Tensor], position_bias: Optional[torch.Tensor]):
    """HF's float masks use finfo.min for 'masked'; attnzoo wants -inf (or False) so that masked keys
    are removed, not just down-weighted (ReLU/sigmoid/OT count the keys taking part)."""
    mask = attention_mask
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.masked_fill(mask <= torch.finfo(mask.dtype).min / 2, -math.inf)
    if position_bias is not None:
        if mask is None:
            mask = position_bias
        elif mask.dtype == torch.bool:
            mask = position_bias.masked_fill(~mask, -math.inf)
        else:
            mask = position_bias + mask
    return mask


def _is_cross(module) -> bool:
    return ("Cross" in type(module).__name__ or bool(getattr(module, "is_cross_attention", False))
            or (getattr(module, "is_decoder", False) is True and getattr(module, "is_causal", True) is False))


def _logit_extras(kwargs: dict, causal: bool, nq: int, nk: int) -> dict:
    """HF's softcap (Gemma 2), s_aux (gpt-oss's learned sinks, the module's own parameter, so its
    gradient reaches it) and sliding_window as the kernel's softcap / sinks / window_size. HF's window
    keeps the sliding_window keys up to the query itself (kv > q - sliding_window). It goes to the kernel
    (which may then skip what lies outside the band) in a causal call without cache offsets (Nq == Nk),
    where bottom-right and HF's positions agree; elsewhere, e.g. a static cache's unused slots, HF's mask
    alone carries the window, as it always does."""
    extras = {}
    if kwargs.get("softcap") is not None:
        extras["softcap"] = kwargs["softcap"]
    sinks = kwargs.get("s_aux") if kwargs.get("s_aux") is not None else kwargs.get("sinks")
    if sinks is not None:
        extras["sinks"] = sinks
    window = kwargs.get("sliding_window")
    if window is not None and causal and nq == nk:
        extras["window_size"] = (int(window) - 1, 0)
    return extras


_COLLECTOR = []  # transformers' collector of output_attentions, looked up once (the first call)


def _attentions_requested() -> bool:
    """True when the running HF forward collects attention weights (output_attentions=True): one
    ContextVar read per call; the import that finds it runs once."""
    if not _COLLECTOR:
        try:
            from transformers.utils.output_capturing import _active_collector
        except ImportError:
            _active_collector = None
        _COLLECTOR.append(_active_collector)
    if _COLLECTOR[0] is None:
        return False
    try:
        collected = _COLLECTOR[0].get()
    except LookupError:
        return False
    return isinstance(collected, dict) and "attentions" in collected


def _run(kernel: AttentionLayer, module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs):
    if _attentions_requested():
        warnings.warn("output_attentions=True: attnzoo's kernels never form the attention weights, so the "
                      "returned attentions are None; build the model with attn_implementation='eager' to get "
                      "them (for softmax attention)", UserWarning, stacklevel=2)
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", False))
    extras = _logit_extras(kwargs, causal, query.shape[-2], key.shape[-2])
    packed = hf_packed.find(query, key, attention_mask, causal, _is_cross(module), kwargs,
                            window=extras.get("window_size", (-1, -1))[0] + 1 or None)
    if packed is not None:  # packed sequences (padding-free fine-tuning): each sequence on its own
        return hf_packed.run(kernel, query, key, value, packed, causal=causal,
                             dropout_p=dropout if module.training else 0.0, scale=scaling,
                             tokens=getattr(kernel, "_tokens", None), extras=extras), None
    mask = _mask_for_kernel(attention_mask, kwargs.get("position_bias"))
    if mask is not None and causal:
        if kernel.couples_queries or kernel.needs_key_tokens or not torch.compiler.is_compiling():
            # HF's mask holds causality AND padding (AND maybe a window or packed blocks): causality goes
            # to the kernel as is_causal (see causal_and_rest); one split per forward, as every layer gets
            # the same mask
            mask, causal = _split_once(attention_mask, mask, kwargs.get("position_bias"), query.shape[-2],
                                       key.shape[-2], extras.get("window_size"))
        else:
            # while torch.compile traces, a kernel whose rows do not couple (nor read the earlier positions'
            # tokens) gets the mask alone: it already removes every key causality would, and the split's
            # data-dependent answer would break the graph (and sync the host) on every forward
            causal = False
    tokens = getattr(kernel, "_tokens", None)
    # HF has separate classes for cross-attention (BertCrossAttention), flags it on the module, or
    # (BART & co.) marks a decoder's cross-attention as the decoder's module that is not causal
    cross = _is_cross(module)
    # a decoder's cross-attention: its queries are causal positions (they must not see each other's future)
    causal_queries = cross and (getattr(module, "is_decoder", False) is True
                                or bool(getattr(module, "is_cross_attention", False))
                                or bool(getattr(getattr(module, "config", None), "is_decoder", False)))
    if kernel.reads_positions and not cross:
        hf_decode.refuse_static_cache(kernel, module)
    new = query.shape[-2]
    # a cached step: what the kernel reads about the earlier positions beyond HF's keys and values
    if causal and not cross and (kernel.couples_queries or kernel.needs_key_tokens):
        query, tokens = hf_decode.with_earlier_positions(kernel, module, query, key, mask, tokens,
                                                         window=kwargs.get("sliding_window"))
    elif causal_queries and kernel.couples_queries:
        query, mask = hf_decode.with_earlier_queries(kernel, module, query, mask)
    self_attention = query.shape[-2] == key.shape[-2] and not cross
    # grouped-query attention (Llama & co.: fewer key/value heads than query heads) goes to the kernel
    # as it is: enable_gqa=True, each key/value head serving H / H_kv query heads (SDPA's convention)
    call = dict(is_causal=causal, dropout_p=dropout if module.training else 0.0, scale=scaling,
                enable_gqa=key.shape[1] != query.shape[1], causal_queries=causal_queries, extras=extras)
    if query.shape[-2] > new and mask is not None and mask.shape[-2] > 1:
        out = _each_new_row(kernel, query, key, value, mask, tokens, new, call)
    else:
        out = run_kernel(kernel, query, key, value, attn_mask=mask, x=tokens, self_attention=self_attention,
                         last_rows=new, **call)
    return out.transpose(1, 2).contiguous(), None


def _each_new_row(kernel: AttentionLayer, query, key, value, mask, tokens, new: int, call: dict):
    """A cached step of several new positions under a sliding window (the only per-row mask
    with_earlier_positions lets through with earlier queries), for a variant that couples queries: each
    new row r as a one-row step over the positions up to it, with its own row of the mask (the keys in
    its window, not padding), which is then its whole problem (hf_decode.with_earlier_positions)."""
    past, out = query.shape[-2] - new, []
    for r in range(new):
        upto = past + r + 1
        out.append(run_kernel(kernel, query[..., :upto, :], key[..., :upto, :], value[..., :upto, :],
                              attn_mask=mask[..., r:r + 1, :upto], x=None if tokens is None else tokens[:, :upto],
                              self_attention=True, last_rows=1, **call))
    return torch.cat(out, dim=-2)


_LAST_SPLIT: list = [None]  # (weak reference to an HF mask, its version and sizes, causal_and_rest's answer)


def _split_once(attention_mask, mask, position_bias, nq: int, nk: int, window=None):
    """causal_and_rest(mask), remembered for the last HF mask tensor: the layers of one forward share
    it, and the split reads the mask's values (a device sync on a GPU) once instead of once per layer.
    ``window``: the window_size the kernel gets (a sliding layer): HF's band in the mask is then
    redundant, and a mask of causality AND the band AND padding reaches the kernel as its per-key row."""
    if position_bias is not None or attention_mask is None:
        return causal_and_rest(mask, nq, nk, window)
    slot = (attention_mask._version, nq, nk, mask.dtype, mask.shape, window)
    last = _LAST_SPLIT[0]
    if last is not None and last[0]() is attention_mask and last[1] == slot:
        return last[2]
    answer = causal_and_rest(mask, nq, nk, window)
    _LAST_SPLIT[0] = (weakref.ref(attention_mask), slot, answer)
    return answer


def _dispatch(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """The ``"attnzoo"`` implementation: the module's own attnzoo kernel, else SDPA."""
    kernel = getattr(module, KERNEL_CHILD, None)
    if kernel is None:
        hf_record.warn_if_dropped(module)   # a model saved swapped, loaded without its kernels
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    return _run(kernel, module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs)


def _function_for(target: Target):
    """An attention function for a parameter-free variant; bare kernels are cached per head shape."""
    cache: dict = {}

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
        H, D = query.shape[1], query.shape[-1]
        slot = (H, D, query.device, query.dtype)
        if slot not in cache:
            # built at the model's first forward: the layer's projections are initialised and dropped,
            # which must not move the caller's random streams (generate's sampling would then depend
            # on whether this was the first call)
            cuda = [query.device] if query.device.type == "cuda" else []
            with torch.random.fork_rng(devices=cuda):
                cache[slot] = kernel_layer(target, H * D, H, D, device=query.device, dtype=query.dtype)
        kernel = cache[slot]
        kernel.train(module.training)
        return _run(kernel, module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs)
    attention.__name__ = f"attnzoo_{target.name}_attention"
    attention.__doc__ = f"attnzoo {target.spec!r} attention for transformers' AttentionInterface."
    return attention


def _mask_function(*args, **kwargs):
    """transformers' SDPA mask (bool, True = take part), never dropping a causal mask for is_causal."""
    from transformers.masking_utils import sdpa_mask
    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


def _adds_parameters(target: Target) -> bool:
    probe = kernel_layer(target, 8, 2, 4)
    return any(True for _ in probe.parameters()) or probe.keys_are_queries or probe.needs_key_tokens


def _runs_a_kernel_in_place(name: str) -> bool:
    """A registry name that is an attention function in a host model: a variant, or a wrapper that
    keeps the host's module layout (not "multihead"; not a class registered without a kernel)."""
    try:
        resolved = registry.resolve(name)
    except ValueError:
        return False
    return resolved.wrapper is None or not resolved.wrapper.in_host_models


def register_hf_attention(spec: Optional[str] = None, name: Optional[str] = None) -> list[str]:
    """Register attnzoo attention implementations with transformers; returns the names registered.

    No arguments: ``"attnzoo_<variant>"`` for every variant with its default arguments, plus the
    ``"attnzoo"`` dispatcher used by ``attnzoo.swap``. With ``spec`` (e.g. ``"sinkhorn(n_iters=5)"``):
    that spec under ``name`` (default ``"attnzoo_<variant>"``). Specs that add parameters raise
    ValueError (use ``attnzoo.swap``).
    """
    import transformers
    if int(transformers.__version__.split(".")[0]) < 5:
        raise ImportError(f"attnzoo's Hugging Face adapter needs transformers>=5, found {transformers.__version__}")
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    if spec is None:
        specs = {f"attnzoo_{v}": v for v in registry.available() if _runs_a_kernel_in_place(v)}
    else:
        target = resolve(spec, {})
        if name is None:
            name = f"attnzoo_{target.name}"
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty string, got {name!r}")
        specs = {name: spec}
    names = []
    for impl_name, s in specs.items():
        target = resolve(s, {})
        if _adds_parameters(target):
            if spec is None:
                continue
            raise ValueError(f"{s!r} adds parameters (or ties weights), so it cannot be a bare attention "
                             "function; use attnzoo.swap(model, spec) instead")
        AttentionInterface.register(impl_name, _function_for(target))
        AttentionMaskInterface.register(impl_name, _mask_function)
        names.append(impl_name)
    AttentionInterface.register(DISPATCH_NAME, _dispatch)
    AttentionMaskInterface.register(DISPATCH_NAME, _mask_function)
    return names + [DISPATCH_NAME]


# -- attnzoo.swap's adapter ------------------------------------------------------------------------
def _calls_attention_interface(cls: type) -> bool:
    forward = inspect.unwrap(getattr(cls, "forward", None))
    code = getattr(forward, "__code__", None)
    return code is not None and "ALL_ATTENTION_FUNCTIONS" in code.co_names


def recognises(module: nn.Module) -> bool:
    config = getattr(module, "config", None)
    if config is None or not hasattr(config, "_attn_implementation"):
        return False
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return not isinstance(module, PreTrainedModel) and _calls_attention_interface(type(module))


def unsupported_reason(module: nn.Module) -> Optional[str]:
    return None


def _needs(module: nn.Module) -> dict[str, str]:
    """What the HF module passes its attention function beyond q, k, v and the mask, in a user's words:
    Gemma 2's logit softcapping, gpt-oss's learned attention sinks."""
    needs = {}
    cap = getattr(module, "attn_logit_softcapping", None)
    if cap is None:
        cap = getattr(getattr(module, "config", None), "attn_logit_softcapping", None)
    if cap is not None:
        needs["softcap"] = f"logit softcapping (attn_logit_softcapping={cap})"
    if isinstance(getattr(module, "sinks", None), nn.Parameter):
        needs["sinks"] = "learned attention sinks (its `sinks` parameter)"
    return needs


def unsupported_for(module: nn.Module, target: Target) -> Optional[str]:
    """Why ``target``'s variant cannot run this module's attention (its math does not define what the
    module needs), or None."""
    needs = _needs(module)
    if not needs:
        return None
    record = target.build_layer(8, num_heads=2, head_dim=4).record  # the variant the layer runs
    for name, words in needs.items():
        if name not in record.extras:
            why = record.extras_refused.get(name, "its math does not define it")
            return f"this attention uses {words}, which {record.name} attention does not support: {why}"
    return None


def _heads(module: nn.Module) -> tuple[int, int, int]:
    config = module.config
    H = (getattr(module, "num_heads", None) or getattr(module, "num_attention_heads", None)
         or config.num_attention_heads)
    D = (getattr(module, "head_dim", None) or getattr(module, "attention_head_size", None)
         or getattr(config, "head_dim", None) or config.hidden_size // H)
    return int(H), int(D), int(config.hidden_size)


def plan(root: nn.Module, name: str, module: nn.Module, target: Target) -> Change:
    register_hf_attention()
    H, D, dim = _heads(module)
    ref = next(module.parameters(), None)
    kernel = kernel_layer(target, dim, H, D, device=None if ref is None else ref.device,
                          dtype=None if ref is None else ref.dtype)
    object.__setattr__(kernel, "_tokens", None)
    old_kernel = getattr(module, KERNEL_CHILD, None)
    added = [f"{KERNEL_CHILD}.{a}" for a in describe_new_parameters(kernel, set())]
    change = Change(name=name, source=type(module).__name__,
                    target=f"{type(module).__name__} + {type(kernel).__name__} kernel",
                    carried=[n for n, _ in module.named_parameters() if not n.startswith(KERNEL_CHILD + ".")],
                    added=added, dropped=param_names(old_kernel, KERNEL_CHILD + "."))

    def apply() -> None:
        config = module.config
        if config._attn_implementation != DISPATCH_NAME:
            object.__setattr__(module, _PREVIOUS_IMPLEMENTATION, config._attn_implementation)
        module.add_module(KERNEL_CHILD, kernel)
        kernel.train(module.training)
        hf_decode.unhook(module)
        # Fenchel's context tokens; a decoder's cache; a static cache, which the T5 preference refuses
        if kernel.needs_key_tokens or kernel.couples_queries or kernel.reads_positions:
            hf_decode.hook(module)
        config._attn_implementation_internal = DISPATCH_NAME
        hf_record.record(root, name, module, (target.name, target.kwargs))   # for save_pretrained
    change.apply = apply
    return change


def revert(root: nn.Module, name: str, module: nn.Module) -> Optional[Change]:
    kernel = getattr(module, KERNEL_CHILD, None)
    if kernel is None:
        return None
    change = Change(name=name, source=f"{type(module).__name__} + {type(kernel).__name__} kernel",
                    target=type(module).__name__,
                    carried=[n for n, _ in module.named_parameters() if not n.startswith(KERNEL_CHILD + ".")],
                    dropped=param_names(kernel, KERNEL_CHILD + "."))

    def apply() -> None:
        del module._modules[KERNEL_CHILD]
        hf_decode.unhook(module)
        hf_record.forget(module, name)
    change.apply = apply
    return change


def restore_implementations(root: nn.Module) -> None:
    """After an unswap: configs none of whose modules keep a kernel get their previous implementation."""
    configs, still_used, previous, noted = {}, set(), {}, []  # keyed by id() of configs alive in this call
    for m in root.modules():
        config = getattr(m, "config", None)
        if config is None or not recognises(m):
            continue
        configs[id(config)] = config
        if getattr(m, KERNEL_CHILD, None) is not None:
            still_used.add(id(config))
        if _PREVIOUS_IMPLEMENTATION in m.__dict__:
            previous.setdefault(id(config), m.__dict__[_PREVIOUS_IMPLEMENTATION])
            noted.append((m, id(config)))
    for key, config in configs.items():
        if key not in still_used and config._attn_implementation == DISPATCH_NAME:
            config._attn_implementation_internal = previous.get(key, "sdpa")
    for m, key in noted:
        if key not in still_used:
            object.__delattr__(m, _PREVIOUS_IMPLEMENTATION)
