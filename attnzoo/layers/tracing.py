"""How attnzoo's layers meet torch's graph capturers.

torch.fx symbolic tracing (``torch.fx.symbolic_trace``, timm's and torchvision's feature extraction,
``get_graph_node_names``) runs ``forward`` on Proxy objects. An attnzoo layer's forward checks its
input and picks a kernel from the tensors' shapes, dtypes, devices and values, none of which a Proxy
has, so a tracer that enters the layer records it as ONE call instead (``call_module``, exactly as
for a leaf module): the traced model runs the layer as it is. timm's tracers are also told to treat the
layers as leaves (``adapters.timm.register_fx_leaves``), so they never enter them.

TorchScript cannot compile the layers (keyword arguments forwarded to variants, the dispatcher's
Python): ``torch.jit.script`` stops at ``__prepare_scriptable__`` with a message saying so.
torch.compile and torch.export (TorchDynamo) are the supported ways to capture a graph.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.fx


def fx_proxy(*values) -> Optional[torch.fx.Proxy]:
    """The first torch.fx Proxy among ``values``: symbolic tracing is running through this call."""
    return next((v for v in values if isinstance(v, torch.fx.Proxy)), None)


def record_as_one_call(module: torch.nn.Module, proxy: torch.fx.Proxy, args: tuple, kwargs: dict,
                       extra: Optional[dict] = None):
    """The Proxy of ``module(*args, **kwargs, **extra)`` recorded as one ``call_module`` node of the trace.
    ``extra``: the forward's ``**kwargs``, read only once the module is known not to be the trace's root
    (FX hands a root's ``**kwargs`` over as a Proxy)."""
    tracer = proxy.tracer
    if getattr(tracer, "root", None) is module:
        raise TypeError(f"{type(module).__name__} cannot be the root of an FX trace: its kernel checks and "
                        "dispatches on tensor values. Trace the model that contains it (the layer is recorded "
                        "as one call), or use torch.compile / torch.export")
    return tracer.create_proxy("call_module", tracer.path_of_module(module), args, {**kwargs, **(extra or {})})


def refuse_torchscript(module: torch.nn.Module):
    raise TypeError(f"{type(module).__name__} does not support TorchScript (torch.jit.script): attnzoo layers "
                    "forward keyword arguments to their variants and choose a kernel in Python. Use "
                    "torch.compile or torch.export, or torch.fx (the layer is traced as one call)")
