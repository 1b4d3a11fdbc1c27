"""The shared nn.Module shell: timm's Attention constructor, forward and submodule names.

Submodules are named ``qkv``, ``q_norm``, ``k_norm``, ``norm``, ``proj`` (and ``gate`` when gated)
exactly as in ``timm.layers.Attention``, so a timm state_dict loads with ``strict=True``. A variant
subclass only says which functional it calls (``variant``) and which keyword arguments it passes
(``kernel_kwargs``); it adds parameters when the paper's variant has them.
"""
from __future__ import annotations

import warnings
from typing import ClassVar, Optional

import torch
from torch import nn

from .. import functional as AF

# keyword arguments timm's Block / create_model may pass to an attention layer; accepted silently
_TIMM_EXTRA = {"depth", "fused_attn", "rope", "attn_type", "qk_norm_layer", "rotate_half"}


class AttentionLayer(nn.Module):
    variant: ClassVar[str] = "softmax"

    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = False, qk_norm: bool = False,
                 proj_bias: bool = True, attn_drop: float = 0.0, proj_drop: float = 0.0,
                 norm_layer: Optional[type] = None, *, scale_norm: bool = False, gated: bool = False,
                 attn_head_dim: Optional[int] = None, dim_out: Optional[int] = None,
                 backend: Optional[str] = None, device=None, dtype=None, **extra) -> None:
        super().__init__()
        unknown = sorted(set(extra) - _TIMM_EXTRA)
        if unknown:
            warnings.warn(f"{type(self).__name__} ignores unknown keyword arguments {unknown}", stacklevel=2)
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
        self.num_heads = num_heads
        self.head_dim = attn_head_dim
        self.attn_dim = num_heads * attn_head_dim
        self.scale = attn_head_dim ** -0.5
        self.backend = backend
        self.qkv = nn.Linear(dim, self.attn_dim * 3, bias=qkv_bias, **dd)
        self.q_norm = norm_layer(attn_head_dim, **dd) if qk_norm else nn.Identity()
        self.k_norm = norm_layer(attn_head_dim, **dd) if qk_norm else nn.Identity()
        self.attn_drop = nn.Dropout(attn_drop)
        self.norm = norm_layer(self.attn_dim, **dd) if scale_norm else nn.Identity()
        self.gate = nn.Linear(dim, self.attn_dim, bias=qkv_bias, **dd) if gated else None
        self.proj = nn.Linear(self.attn_dim, dim_out or dim, bias=proj_bias, **dd)
        self.proj_drop = nn.Dropout(proj_drop)

    # -- the parts a variant overrides ---------------------------------------------------------
    def kernel_kwargs(self) -> dict:
        """Variant keyword arguments passed to the functional on every call."""
        return {}

    def raw_qkv(self, x: torch.Tensor):
        """(q, k, v), each (B, H, N, head_dim), before q/k normalisation."""
        B, N, _ = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        return qkv.unbind(0)

    def project_qkv(self, x: torch.Tensor):
        q, k, v = self.raw_qkv(x)
        return self.q_norm(q), self.k_norm(k), v

    def attend(self, q, k, v, attn_mask=None, is_causal=False, x=None, **extra):
        fn = AF.VARIANT_FUNCTIONS[self.variant]
        return fn(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=self.scale,
                  dropout_p=self.attn_drop.p if self.training else 0.0, backend=self.backend,
                  **self.kernel_kwargs(), **extra)

    # -- timm's forward ------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False,
                **extra) -> torch.Tensor:
        self._check_input(x)
        B, N, _ = x.shape
        attn_mask = _heads_mask(attn_mask)
        q, k, v = self.project_qkv(x)
        out = self.attend(q, k, v, attn_mask=attn_mask, is_causal=is_causal, x=x, **extra)
        out = out.transpose(1, 2).reshape(B, N, self.attn_dim)
        out = self.norm(out)
        if self.gate is not None:
            out = out * self.gate(x).sigmoid()
        return self.proj_drop(self.proj(out))

    def _check_input(self, x) -> None:
        """x must be (B, N, dim) in the weights' dtype (any dtype under autocast) and on their device:
        say so naming this layer, instead of letting the qkv matmul fail with torch's shape message."""
        name, dim, w = type(self).__name__, self.qkv.in_features, self.qkv.weight
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
        kw = ", ".join(f"{k}={v!r}" for k, v in self.kernel_kwargs().items() if not isinstance(v, torch.Tensor))
        return f"variant={self.variant!r}, num_heads={self.num_heads}, head_dim={self.head_dim}" + (f", {kw}" if kw else "")


def _heads_mask(attn_mask):
    """timm and HF hand (B, N, N) masks; SDPA would broadcast them against heads, not batch."""
    if attn_mask is not None and attn_mask.dim() == 3:
        return attn_mask.unsqueeze(1)
    return attn_mask
