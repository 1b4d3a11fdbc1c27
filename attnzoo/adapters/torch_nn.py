"""torch.nn: ``nn.MultiheadAttention`` (alone or inside nn.TransformerEncoder/DecoderLayer) <->
attnzoo.MultiheadAttention running any attnzoo variant.

The projections (in_proj_weight / q,k,v_proj_weight, in_proj_bias, out_proj) are moved over as the same
Parameter objects. The variant runs through a bare attnzoo layer (``variant_layer``) so variants with
extra parameters (sigmoid's bias shift, Fenchel's preference, L2's tied keys) work here too.

Fast paths: attnzoo.MultiheadAttention carries a no-op forward hook, which turns off
nn.TransformerEncoderLayer's fused eval kernel (layers/multihead.py); nn.TransformerEncoder's
nested-tensor path (decided once, at construction) is switched off here for every encoder whose
layers were swapped, and switched back on by unswap.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..layers import tracing
from ..layers.multihead import MultiheadAttention, is_causal_mask, refuse_nested, split_causal_mask
from .common import Change, describe_new_parameters, exchange, get_origin, param_names, set_origin
from .kernel import kernel_layer, run_kernel
from .spec import Target

CAUSAL_QUERIES = "_attnzoo_causal_queries"  # set per call on a decoder layer's cross-attention
_DECODER_HOOK = "_attnzoo_decoder_hook"
_PROJ = ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight", "in_proj_bias", "bias_k", "bias_v")


class SwappedMultiheadAttention(MultiheadAttention):
    """attnzoo.MultiheadAttention whose kernel is an attnzoo layer's variant (extra parameters included)."""

    def __init__(self, embed_dim, num_heads, *args, target: Target, **kw):
        super().__init__(embed_dim, num_heads, *args, **kw)
        self.spec = target.spec
        self.variant_layer = kernel_layer(target, self.kdim, num_heads, self.head_dim,
                                          device=self.out_proj.weight.device, dtype=self.out_proj.weight.dtype)
        self.kind = self.variant_layer.kind
        if (self.bias_k is not None or self.add_zero_attn) and (self.variant_layer.needs_key_tokens
                                                               or self.variant_layer.keys_are_queries):
            raise ValueError(f"{target.spec!r} reads each key's token or ties keys to queries, and the keys "
                             "add_bias_kv / add_zero_attn add have neither")
        self._key_tokens: Optional[torch.Tensor] = None
        self._self_attention = False

    def forward(self, query, key, value, key_padding_mask=None, need_weights: bool = True, attn_mask=None,
                average_attn_weights: bool = True, is_causal: bool = False):
        kwargs = dict(key_padding_mask=key_padding_mask, need_weights=need_weights, attn_mask=attn_mask,
                      average_attn_weights=average_attn_weights, is_causal=is_causal)
        proxy = tracing.fx_proxy(query, key, value, key_padding_mask, attn_mask)
        if proxy is not None:  # torch.fx symbolic tracing: one call of the graph
            return tracing.record_as_one_call(self, proxy, (query, key, value), kwargs)
        refuse_nested(self, query, key, value)
        # Fenchel's context preference reads the key tokens, batch-first
        tokens = key if key.dim() == 2 else (key if self.batch_first else key.transpose(0, 1))
        self._key_tokens = tokens.unsqueeze(0) if key.dim() == 2 else tokens
        self._self_attention = query is key
        if not is_causal and attn_mask is not None:
            seq = 1 if query.dim() == 3 and self.batch_first else 0
            # in a swapped model a causal mask means causality, whether or not the caller passed torch's
            # is_causal hint: in self-attention any mask that keeps no later key (the triangle, a causal
            # band, packed blocks); elsewhere exactly the causal mask. It then reaches the kernel as
            # is_causal (with the mask when it holds more: layers/multihead.py's split_causal_mask)
            n_q, n_k = query.shape[seq], key.shape[seq]
            is_causal = (split_causal_mask(attn_mask, n_q, n_k)[1] if self._self_attention
                         else is_causal_mask(attn_mask, n_q, n_k))
        try:
            return super().forward(query, key, value, key_padding_mask=key_padding_mask, need_weights=need_weights,
                                   attn_mask=attn_mask, average_attn_weights=average_attn_weights,
                                   is_causal=is_causal)
        finally:
            self._key_tokens = None

    def _attend(self, q, k, v, attn_mask, is_causal, dropout_p, extra_keys: int = 0):
        return run_kernel(self.variant_layer, q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                          dropout_p=dropout_p, x=self._key_tokens, self_attention=self._self_attention,
                          causal_queries=getattr(self, CAUSAL_QUERIES, False) and not self._self_attention,
                          first_token_key=extra_keys)

    def extra_repr(self) -> str:
        return f"spec={self.spec!r}, embed_dim={self.embed_dim}, num_heads={self.num_heads}, batch_first={self.batch_first}"


def recognises(module: nn.Module) -> bool:
    return isinstance(module, nn.MultiheadAttention) or isinstance(module, MultiheadAttention)


def unsupported_reason(module: nn.Module) -> Optional[str]:
    return None


def _constructor_kwargs(m: nn.Module) -> dict:
    ref = m.out_proj.weight
    return dict(dropout=m.dropout, bias=m.in_proj_bias is not None, add_bias_kv=m.bias_k is not None,
                add_zero_attn=m.add_zero_attn, kdim=m.kdim, vdim=m.vdim, batch_first=m.batch_first,
                device=ref.device, dtype=ref.dtype)


def _move(src: nn.Module, dst: nn.Module) -> list[str]:
    carried = []
    for n in _PROJ:
        p = getattr(src, n, None)
        setattr(dst, n, p)  # Parameter or None (nn.Module keeps the None registered)
        if p is not None:
            carried.append(n)
    dst.out_proj = src.out_proj
    return carried + param_names(src.out_proj, "out_proj.")


def plan(root: nn.Module, name: str, module: nn.Module, target: Target) -> Change:
    new = SwappedMultiheadAttention(module.embed_dim, module.num_heads, target=target,
                                    **_constructor_kwargs(module))
    added = describe_new_parameters(new.variant_layer, set())
    added = ["variant_layer." + a for a in added]
    set_origin(new, get_origin(module) or (nn.MultiheadAttention if isinstance(module, MultiheadAttention)
                                           else type(module)))
    carried = [n for n in _PROJ if getattr(module, n, None) is not None] + param_names(module.out_proj, "out_proj.")
    change = Change(name=name, source=type(module).__name__, target=type(new).__name__, carried=carried,
                    added=added)
    change.apply = exchange(root, name, module, new, _move)
    return change


def revert(root: nn.Module, name: str, module: nn.Module) -> Optional[Change]:
    if not isinstance(module, MultiheadAttention):
        return None
    cls = get_origin(module) or nn.MultiheadAttention
    old = cls(module.embed_dim, module.num_heads, **_constructor_kwargs(module))
    kept = set(_PROJ) | {"out_proj.weight", "out_proj.bias"}
    dropped = [n for n, _ in module.named_parameters() if n not in kept]
    change = Change(name=name, source=type(module).__name__, target=cls.__name__,
                    carried=[n for n, _ in module.named_parameters() if n in kept], dropped=dropped)
    change.apply = exchange(root, name, module, old, _move)
    return change


def sync_nested_tensor_flags(root: nn.Module) -> None:
    """Turn the nested-tensor path off where attnzoo runs, restore the original choice where it left."""
    for m in root.modules():
        if not isinstance(m, nn.TransformerEncoder):
            continue
        swapped = any(isinstance(getattr(layer, "self_attn", None), MultiheadAttention) for layer in m.layers)
        if swapped and getattr(m, "use_nested_tensor", False):
            object.__setattr__(m, "_attnzoo_use_nested_tensor", True)
            m.use_nested_tensor = False
        elif not swapped and getattr(m, "_attnzoo_use_nested_tensor", False):
            m.use_nested_tensor = True
            object.__delattr__(m, "_attnzoo_use_nested_tensor")


def _note_causal_queries(layer: nn.TransformerDecoderLayer, args, kwargs) -> None:
    """Forward pre-hook: tell the layer's cross-attention whether this call's target is causal (then
    its queries must not see each other's future either; see kernel.attend_each_prefix)."""
    def arg(i, name, default):
        return args[i] if len(args) > i else kwargs.get(name, default)
    tgt, tgt_mask, tgt_is_causal = arg(0, "tgt", None), arg(2, "tgt_mask", None), arg(6, "tgt_is_causal", False)
    if not tgt_is_causal and tgt_mask is not None and tgt is not None:
        n = tgt.shape[1 if tgt.dim() == 3 and layer.self_attn.batch_first else 0]
        tgt_is_causal = split_causal_mask(tgt_mask, n, n)[1]
    object.__setattr__(layer.multihead_attn, CAUSAL_QUERIES, bool(tgt_is_causal))


def sync_decoder_hooks(root: nn.Module) -> None:
    """nn.TransformerDecoderLayers whose cross-attention runs attnzoo get the pre-hook above; layers
    swapped back lose it."""
    for m in root.modules():
        if not isinstance(m, nn.TransformerDecoderLayer):
            continue
        swapped = isinstance(getattr(m, "multihead_attn", None), SwappedMultiheadAttention)
        hook = getattr(m, _DECODER_HOOK, None)
        if swapped and hook is None:
            object.__setattr__(m, _DECODER_HOOK, m.register_forward_pre_hook(_note_causal_queries, with_kwargs=True))
        elif not swapped and hook is not None:
            hook.remove()
            object.__delattr__(m, _DECODER_HOOK)
