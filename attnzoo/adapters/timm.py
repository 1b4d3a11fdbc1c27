"""timm: ``timm.layers.Attention`` (ViT, DeiT, ... blocks) and EVA's fused-qkv ``EvaAttention``
(see timm_eva.py) <-> attnzoo layers.

attnzoo layers share timm's constructor, forward and submodule names (qkv, q_norm, k_norm, norm, proj,
gate), so a swap moves those submodules over as they are: the weights, their dtype/device and any
optimizer state keyed on them stay valid. Variants with extra parameters create them fresh.
"""
from __future__ import annotations

from typing import Optional

from torch import nn

from ..layers.base import AttentionLayer
from . import timm_eva
from .common import (Change, describe_new_parameters, exchange, get_origin, param_names, replace_child,
                     set_origin)
from .spec import Target

MOVED = ("qkv", "q_norm", "k_norm", "norm", "proj", "gate")


def _timm_attention():
    try:
        from timm.layers import Attention
    except ImportError:  # timm is optional
        return None
    return Attention


def register_fx_leaves() -> None:
    """Tell timm's FX tools (``create_feature_extractor``, ``get_graph_node_names``) to treat attnzoo's
    layers as leaves (layers/tracing.py); run when timm.layers loads (adapters/__init__.py)."""
    from timm.layers import register_notrace_module

    from ..layers.multihead import MultiheadAttention
    register_notrace_module(AttentionLayer)       # and every subclass: timm passes the list to isinstance
    register_notrace_module(MultiheadAttention)


def recognises(module: nn.Module) -> bool:
    timm_attention = _timm_attention()
    return (isinstance(module, AttentionLayer) or (timm_attention is not None and type(module) is timm_attention)
            or timm_eva.is_eva(module))


# timm attention classes whose layout differs; named so the report can say why
_UNSUPPORTED = {
    "AttentionRope": "rotary position embeddings are not part of attnzoo's layers",
    "DiffAttention": "differential attention (two softmax maps per head) has no attnzoo equivalent",
    "AttentionPoolLatent": "attention pooling with learned latent queries (separate q and kv projections)",
}


def unsupported_reason(module: nn.Module) -> Optional[str]:
    if timm_eva.is_eva(module) and module.qkv is None:
        return "EvaAttention with separate q/k/v projections (qkv_fused=False); only the fused layout is supported"
    name = type(module).__name__
    if name in _UNSUPPORTED and type(module).__module__.startswith("timm"):
        return _UNSUPPORTED[name]
    return None


def _constructor_kwargs(m: nn.Module) -> dict:
    """timm-constructor arguments that rebuild ``m``'s shapes (norms and weights are moved in after)."""
    return dict(attn_head_dim=m.head_dim, dim_out=m.proj.out_features, qkv_bias=m.qkv.bias is not None,
                proj_bias=m.proj.bias is not None, gated=getattr(m, "gate", None) is not None,
                attn_drop=m.attn_drop.p, proj_drop=m.proj_drop.p,
                device=m.qkv.weight.device, dtype=m.qkv.weight.dtype)


def _move(src: nn.Module, dst: nn.Module) -> list[str]:
    carried = []
    for sub in MOVED:
        mod = getattr(src, sub, None)
        if sub == "gate" and mod is None:
            continue
        setattr(dst, sub, mod)
        carried += param_names(mod, sub + ".")
    return carried


def plan(root: nn.Module, name: str, module: nn.Module, target: Target) -> Change:
    kw = _constructor_kwargs(module)
    head_dim = kw.pop("attn_head_dim")
    new = target.build_layer(module.qkv.in_features, module.num_heads, head_dim, **kw)
    moved_names = {n for sub in MOVED for n in param_names(getattr(new, sub, None), sub + ".")}
    added = describe_new_parameters(new, moved_names)
    eva = timm_eva.is_eva(module) or isinstance(module, timm_eva.EvaLayout)
    if eva:
        timm_eva.adopt(module, new)
    set_origin(new, get_origin(module) or type(module))
    change = Change(name=name, source=type(module).__name__, target=type(new).__name__, added=added)

    def apply() -> None:
        _move(module, new)
        if eva:
            timm_eva.move_biases(module, new)
        new.train(module.training)
        replace_child(root, name, new)()
    change.carried = [n for sub in MOVED for n in param_names(getattr(module, sub, None), sub + ".")]
    if eva:
        change.carried += [n for n in ("q_bias", "v_bias") if getattr(module, n, None) is not None]
    change.apply = apply
    return change


def revert(root: nn.Module, name: str, module: nn.Module) -> Optional[Change]:
    """attnzoo layer -> the timm class it came from (timm.layers.Attention when it was built by attnzoo)."""
    if not isinstance(module, AttentionLayer):
        return None
    cls = get_origin(module) or _timm_attention()
    if cls is None:
        return None
    kw = _constructor_kwargs(module)
    if module.gate is None:
        kw.pop("gated")  # older timm versions have no gate argument
    if isinstance(module, timm_eva.EvaLayout):
        for unused in ("dim_out", "qkv_bias", "proj_bias", "attn_head_dim"):
            kw.pop(unused)
        old = timm_eva.rebuild(module, cls, **kw)
    else:
        old = cls(module.qkv.in_features, num_heads=module.num_heads, **kw)
    kept = {n for sub in MOVED for n in param_names(getattr(module, sub, None), sub + ".")}
    kept |= {n for n in ("q_bias", "v_bias") if getattr(module, n, None) is not None}
    dropped = [n for n, _ in module.named_parameters() if n not in kept]
    change = Change(name=name, source=type(module).__name__, target=cls.__name__, carried=sorted(kept),
                    dropped=dropped)
    change.apply = exchange(root, name, module, old, _move)
    return change
