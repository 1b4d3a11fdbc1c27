"""Wrappers: registry names that run any variant (their ``kind``) inside another module, without being
variants themselves ("masked": the kind made causal; "multihead": the kind inside torch's
MultiheadAttention interface). Each declares here what the registry, the benchmark and the adapters
need to know about it, so none of them lists the wrappers by name."""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, Optional


@dataclass(frozen=True, eq=False)
class Wrapper:
    """name:          the registry name
    layer_class:      what ``attnzoo.create(name, ...)`` builds
    causal:           the kind always runs with is_causal=True
    module_flops:     ``(shape) -> forward FLOPs`` the wrapper adds around the kernel (None: nothing)
    module_formula:   the same in words; module_work: what that work is, in a word
    module_backward_factor: backward = this x module_flops
    timed_module:     ``(embed_dim, num_heads, *, kind, backend, device, dtype, **layer_kwargs) ->
                      (forward(x, causal), parameters)``: how the benchmark times the whole module,
                      when the wrapper adds work around the kernel
    in_host_models:   True when a host model gets the kind's layer for this name (multihead: timm
                      and Hugging Face keep their own module layout), by attnzoo.swap and, for
                      timm's ``attn_layer=``, by ``attnzoo.layer``
    """
    name: str
    layer_class: type
    causal: bool = False
    module_flops: Optional[Callable] = None
    module_formula: str = ""
    module_work: str = ""
    module_backward_factor: Fraction = Fraction(2)
    timed_module: Optional[Callable] = None
    in_host_models: bool = False
    complexity: str = "that of its kind"
    parameters: str = "kind"
    paper: str = ""
