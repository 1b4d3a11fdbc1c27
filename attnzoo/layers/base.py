"""The shared nn.Module shell: timm's Attention constructor, forward and submodule names, and the one
call of a variant's functional.

Submodules are named ``qkv``, ``q_norm``, ``k_norm``, ``norm``, ``proj`` (and ``gate`` when gated)
exactly as in ``timm.layers.Attention``, so a timm state_dict loads with ``strict=True``. Everything
variant-specific comes from the variant's record (ops/<variant>/): its functional, its default scale,
and its layer hook, which takes the variant's constructor options (storing them and any parameters on
the layer) and returns the functional's extra keyword arguments on every call (a bias, log u,
templates). A host model that projects q, k and v itself (attnzoo.swap into torch.nn or Hugging Face)
calls ``attend`` and reads ``keys_are_queries``, ``needs_key_tokens``, ``couples_queries`` and
``uses_logit_scale``.
"""
from __future__ import annotations

import warnings
from typing import ClassVar, Optional

import torch
from torch import nn

from .. import functional  # noqa: F401  (declares the built-in variants)
from ..ops import logit_extras
from ..ops import variant as catalog
from ..ops.masking import split_causal
from ..ops.validate import close_match
from . import packed, tracing

# keyword arguments timm's Block / create_model may pass to an attention layer; accepted silently
TIMM_EXTRA = {"depth", "fused_attn", "rope", "attn_type", "qk_norm_layer", "rotate_half"}


class AttentionLayer(nn.Module):
    """timm's Attention running a variant's functional. ``kind`` names the variant for a class that
    is not one (a wrapper such as MaskedAttention); a variant's own class runs its variant."""
    variant: ClassVar[str] = "softmax"

    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = False, qk_norm: bool = False,
                 proj_bias: bool = True, attn_drop: float = 0.0, proj_drop: float = 0.0,
                 norm_layer: Optional[type] = None, *, scale_norm: bool = False, gated: bool = False,
                 attn_head_dim: Optional[int] = None, dim_out: Optional[int] = None,
                 backend: Optional[str] = None, device=None, dtype=None, kind: Optional[str] = None,
                 softcap: Optional[float] = None, sinks: bool = False, window_size=None, **extra) -> None:
        super().__init__()
        kind = self._check_kind(kind)
        record = catalog.get(kind)
        hook_options = record.hook.options()
        options = {name: extra.pop(name) for name in list(extra) if name in hook_options}
        unknown = sorted(set(extra) - TIMM_EXTRA)
        if unknown:
            warnings.warn(f"{type(self).__name__} ignores unknown keyword arguments {unknown}", stacklevel=3)
        if not isinstance(dim, int) or dim <= 0:
            raise ValueError(f"dim must be a positive int, got {dim!r}")
        if not isinstance(num_heads, int) or num_heads <= 0:
            raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")
        if attn_head_dim is None:
            if dim % num_heads != 0:
                raise ValueError(f"dim ({dim}) must be divisible by num_heads ({num_heads})")
            attn_head_dim = dim // num_heads
        if (qk_norm or scale_norm) and norm_layer is None:
            norm_layer = nn.LayerNorm  # timm asserts here; a sensible default is friendlier
        if not 0.0 <= float(attn_drop) < 1.0:
            raise ValueError(f"attn_drop must be in [0, 1), got {attn_drop}")
        dd = {"device": device, "dtype": dtype}
        self.kind = kind
        self.num_heads = num_heads
        self.head_dim = attn_head_dim
        self.attn_dim = num_heads * attn_head_dim
        self.scale = attn_head_dim ** -0.5 if record.default_scale is None else record.default_scale
        self.backend = backend
        self.qkv = nn.Linear(dim, self.attn_dim * 3, bias=qkv_bias, **dd)
        self.q_norm = norm_layer(attn_head_dim, **dd) if qk_norm else nn.Identity()
        self.k_norm = norm_layer(attn_head_dim, **dd) if qk_norm else nn.Identity()
        self.attn_drop = nn.Dropout(attn_drop)
        self.norm = norm_layer(self.attn_dim, **dd) if scale_norm else nn.Identity()
        self.gate = nn.Linear(dim, self.attn_dim, bias=qkv_bias, **dd) if gated else None
        self.proj = nn.Linear(self.attn_dim, dim_out or dim, bias=proj_bias, **dd)
        self.proj_drop = nn.Dropout(proj_drop)
        record.hook.setup(self, **options)
        self._logit_extras(record, softcap, sinks, window_size, dd)

    def _logit_extras(self, record, softcap, sinks, window_size, dd) -> None:
        """The layer's softcap, learned sinks (``sinks=True``: a parameter ``sinks`` of shape (H,), starting
        at 0) and window_size (ops/logit_extras.py), checked now: a variant that does not define one
        refuses it here, naming it."""
        self.softcap = logit_extras.check_softcap(softcap)
        self.window_size = logit_extras.check_window_size(window_size)
        if not isinstance(sinks, bool):
            raise TypeError(f"sinks must be True (learn one sink logit per head) or False, got {sinks!r}")
        logit_extras.refuse_undefined(record, {"softcap": self.softcap, "sinks": True if sinks else None})
        if sinks:  # no attribute otherwise: hosts look for a `sinks` parameter by name (gpt-oss's init)
            self.sinks = nn.Parameter(torch.zeros(self.num_heads, **dd))

    def _check_kind(self, kind: Optional[str]) -> str:
        own = type(self).variant
        if kind is None or kind == own:
            return own
        if catalog.is_declared(own):
            raise ValueError(f"{type(self).__name__} runs {own!r}; kind={kind!r} is for wrappers such as "
                             f"MaskedAttention (or build the {kind!r} layer: attnzoo.create({kind!r}, ...))")
        if not catalog.is_declared(kind):
            raise ValueError(f"kind must be one of {catalog.names()}, got {kind!r}{close_match(kind, catalog.names())}")
        return kind

    # -- what a host with its own projections reads ----------------------------------------------
    @property
    def record(self) -> catalog.Variant:
        """The variant's record, looked up once (a layer's kind is fixed when it is built)."""
        record = self.__dict__.get("_record")
        if record is None or record.name != self.kind:
            record = self.__dict__["_record"] = catalog.get(self.kind)
        return record

    @property
    def keys_are_queries(self) -> bool:
        """The keys are the query projection (L2's tie_qk): a host must pass k = q."""
        return self.record.hook.keys_are_queries(self)

    @property
    def needs_key_tokens(self) -> bool:
        """``attend`` reads the key tokens ``x`` (Fenchel's context preference)."""
        return self.record.hook.needs_key_tokens(self)

    @property
    def reads_positions(self) -> bool:
        """``attend`` reads the relative positions j - i of queries and keys (Fenchel's T5 preference)."""
        return self.record.hook.reads_positions(self)

    @property
    def couples_queries(self) -> bool:
        """One query's output depends on the other queries (Sinkhorn's column normalisation)."""
        return self.record.couples_queries

    @property
    def uses_logit_scale(self) -> bool:
        """False for a variant without logits (linear): a host's logit scale does not apply to it."""
        return self.record.default_scale is None

    # -- projections and the kernel call ---------------------------------------------------------
    def raw_qkv(self, x: torch.Tensor):
        """(q, k, v), each (B, H, N, head_dim), before q/k normalisation."""
        B, N, _ = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        return qkv.unbind(0)

    def project_qkv(self, x: torch.Tensor):
        q, k, v = self.raw_qkv(x)
        if self.keys_are_queries:
            k = q
        return self.q_norm(q), self.k_norm(k), v

    def attend(self, q, k, v, attn_mask=None, is_causal=False, x=None, *, scale: Optional[float] = None,
               dropout_p: Optional[float] = None, enable_gqa: bool = False, softcap: Optional[float] = None,
               sinks: Optional[torch.Tensor] = None, window_size=None, **forward_kwargs):
        """The variant's functional on (B, H, N, head_dim) q, k, v, with the hook's extra keyword
        arguments. ``scale`` and ``dropout_p`` default to the layer's own (attn_drop.p in training, 0 in
        eval); ``x`` are the key tokens (B, Nk, dim) for hooks that read them. ``enable_gqa=True``: k
        and v may hold fewer heads than q, each shared by H / H_kv query heads (SDPA's convention).
        ``softcap``, ``sinks``, ``window_size``: passed on when given (ops/logit_extras.py), else the
        layer's own (its constructor's; a call's value wins)."""
        record = self.record
        extra = record.hook.kernel_kwargs(self, q, k, v, x=x, attn_mask=attn_mask, is_causal=is_causal,
                                          **forward_kwargs)
        if dropout_p is None:
            dropout_p = self.attn_drop.p if self.training else 0.0
        if enable_gqa:
            extra["enable_gqa"] = True
        extra.update(self.logit_extras(softcap, sinks, window_size))
        return record.functional(q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                                 scale=self.scale if scale is None else scale, dropout_p=dropout_p,
                                 backend=self.backend, **extra)

    def packed_causal(self, is_causal: bool) -> bool:
        """The is_causal that ``attend`` computes with for a call's is_causal: a packed call that runs the
        variant's function without ``attend`` (layers/packed_attend.py) asks here. A subclass that
        overrides ``attend`` overrides this beside it (else its packed calls go through ``attend``)."""
        return is_causal

    def logit_extras(self, softcap=None, sinks=None, window_size=None) -> dict:
        """softcap / sinks / window_size for a kernel call: a call's value, else the layer's own (its
        constructor's); the ones that are neither are left out."""
        own = {"softcap": self.__dict__.get("softcap"), "sinks": self._parameters.get("sinks"),
               "window_size": self.__dict__.get("window_size")}
        given = {"softcap": softcap, "sinks": sinks, "window_size": window_size}
        return {name: own[name] if given[name] is None else given[name] for name in own
                if (own[name] if given[name] is None else given[name]) is not None}

    # -- timm's forward ------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False,
                cu_seqlens: Optional[torch.Tensor] = None, max_seqlen: Optional[int] = None, **extra) -> torch.Tensor:
        if (cu_seqlens is not None and type(x) is torch.Tensor) or (isinstance(x, torch.Tensor) and x.is_nested):
            # packed sequences: x (T, dim) with cu_seqlens, or a nested jagged (B, j, dim) tensor (packed.py)
            return packed.forward_packed(self, x, cu_seqlens, max_seqlen, attn_mask, is_causal, extra)
        if type(x) is not torch.Tensor or (attn_mask is not None and type(attn_mask) is not torch.Tensor):
            proxy = tracing.fx_proxy(x, attn_mask)
            if proxy is not None:  # torch.fx symbolic tracing: this layer is one call of the graph (tracing.py)
                return tracing.record_as_one_call(self, proxy, (x,), {"attn_mask": attn_mask,
                                                                      "is_causal": is_causal}, extra)
        self._check_input(x)
        B, N, _ = x.shape
        if attn_mask is not None and attn_mask.dim() == 3:  # timm and HF hand (B, N, N) masks (_heads_mask)
            attn_mask = _heads_mask(attn_mask)
        if attn_mask is not None and not is_causal and self.couples_queries:
            # self-attention: a mask that keeps no later key means causality, as in the torch.nn and HF
            # adapters (ops.masking.split_causal, the one rule); as a plain mask, a variant that couples
            # queries would let later tokens move earlier outputs through its column normalisation
            attn_mask, is_causal = split_causal(attn_mask, N, N)
        q, k, v = self.project_qkv(x)
        out = self.attend(q, k, v, attn_mask=attn_mask, is_causal=is_causal, x=x, **extra)
        out = out.transpose(1, 2).reshape(B, N, self.attn_dim)
        out = self.norm(out)
        if self.gate is not None:
            out = out * self.gate(x).sigmoid()
        return self.proj_drop(self.proj(out))

    def __prepare_scriptable__(self):
        tracing.refuse_torchscript(self)

    def _check_input(self, x) -> None:
        """x must be (B, N, dim) in the weights' dtype (any dtype under autocast) and on their device:
        say so naming this layer, instead of letting the qkv matmul fail with torch's shape message."""
        w = self.qkv.weight
        if (type(x) is torch.Tensor and x.dim() == 3 and x.shape[2] == w.shape[1] and x.dtype == w.dtype
                and x.device == w.device):
            return  # the common case, decided without building the messages' pieces
        name, dim = type(self).__name__, self.qkv.in_features
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: x must be a torch.Tensor of shape (B, N, dim={dim}), got {type(x).__name__}")
        if x.dim() != 3 or x.shape[-1] != dim:
            raise ValueError(f"{name}: x must have shape (B, N, dim={dim}), got {tuple(x.shape)}")
        if x.dtype != w.dtype and not (x.is_floating_point() and torch.is_autocast_enabled(x.device.type)):
            raise TypeError(f"{name}: x must have the layer's dtype {w.dtype}, got {x.dtype} (cast x or the layer "
                            f"with .to(), or run under torch.autocast)")
        if x.device != w.device:
            raise ValueError(f"{name}: x must be on the layer's device {w.device}, got {x.device}")

    def extra_repr(self) -> str:
        options = self.record.hook.describe(self)
        kw = ", ".join(f"{k}={v!r}" for k, v in options.items() if not isinstance(v, torch.Tensor))
        extras = [f"softcap={self.softcap!r}" if self.__dict__.get("softcap") is not None else "",
                  "sinks=True" if self._parameters.get("sinks") is not None else "",
                  f"window_size={self.window_size!r}" if self.__dict__.get("window_size") is not None else ""]
        kw = ", ".join(p for p in [kw, *extras] if p)
        kind = f", kind={self.kind!r}" if self.kind != self.variant else ""
        return (f"variant={self.variant!r}{kind}, num_heads={self.num_heads}, head_dim={self.head_dim}"
                + (f", {kw}" if kw else ""))


def _heads_mask(attn_mask):
    """timm and HF hand (B, N, N) masks; SDPA would broadcast them against heads, not batch."""
    if attn_mask is not None and attn_mask.dim() == 3:
        return attn_mask.unsqueeze(1)
    return attn_mask
