"""Variants whose layer is only the shared shell plus a few kernel arguments."""
from __future__ import annotations

import torch

from .. import functional as AF
from ..ops import validate as V
from ..ops.masking import key_counts, split_mask
from ..ops.pointwise.reference import default_sigmoid_bias
from .base import AttentionLayer


class SoftmaxAttention(AttentionLayer):
    """softmax(q k^T / sqrt(d)) v: timm's Attention, through attnzoo's dispatcher."""
    variant = "softmax"


class L2Attention(AttentionLayer):
    """softmax(-||q - k||^2 / sqrt(d)) v. ``tie_qk=True`` uses W_Q (and its bias) for the keys too,
    Kim et al.'s Lipschitz form; the qkv weight keeps its shape so timm checkpoints still load."""
    variant = "l2"

    def __init__(self, dim, num_heads=8, *args, tie_qk: bool = False, **kw):
        super().__init__(dim, num_heads, *args, **kw)
        self.tie_qk = bool(tie_qk)

    def project_qkv(self, x):
        q, k, v = self.raw_qkv(x)
        if self.tie_qk:
            k = q
        return self.q_norm(q), self.k_norm(k), v

    def extra_repr(self):
        return super().extra_repr() + f", tie_qk={self.tie_qk}"


class SinkhornAttention(AttentionLayer):
    variant = "sinkhorn"

    def __init__(self, dim, num_heads=8, *args, n_iters: int = 3, eps: float = 1.0, cost: str = "l2", **kw):
        super().__init__(dim, num_heads, *args, **kw)
        if isinstance(n_iters, bool) or not isinstance(n_iters, int) or n_iters < 0:
            raise ValueError(f"n_iters must be an int >= 0, got {n_iters!r}")
        self.n_iters, self.eps, self.cost = n_iters, V.check_positive("eps", eps), V.check_choice("cost", cost, ("l2", "dot"))

    def kernel_kwargs(self):
        return {"n_iters": self.n_iters, "eps": self.eps, "cost": self.cost}


class SigmoidAttention(AttentionLayer):
    """sum_j sigmoid(s_ij + b) v_j. ``bias`` fixes b (default -log n); ``learnable_bias=True`` adds a
    learned per-head shift (initialised to 0) on top of it."""
    variant = "sigmoid"

    def __init__(self, dim, num_heads=8, *args, bias=None, learnable_bias: bool = False, **kw):
        super().__init__(dim, num_heads, *args, **kw)
        self.fixed_bias = None if bias is None else V.check_real("bias", bias)
        self.bias_shift = torch.nn.Parameter(torch.zeros(num_heads)) if learnable_bias else None

    def kernel_kwargs(self):
        return {"bias": self.fixed_bias}

    def attend(self, q, k, v, attn_mask=None, is_causal=False, x=None, **extra):
        if self.bias_shift is None:
            return super().attend(q, k, v, attn_mask=attn_mask, is_causal=is_causal)
        if self.fixed_bias is None:
            keep, _ = split_mask(attn_mask, is_causal, q.shape[-2], k.shape[-2], q.device)
            base = default_sigmoid_bias(key_counts(keep, k.shape[-2], q))
        else:
            base = torch.tensor(self.fixed_bias, dtype=q.dtype, device=q.device)
        bias = base + self.bias_shift.to(q.dtype).view(1, -1, 1, 1)
        return AF.sigmoid(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=self.scale, bias=bias,
                          dropout_p=self.attn_drop.p if self.training else 0.0, backend=self.backend)


class ReLUAttention(AttentionLayer):
    variant = "relu"


class LinearAttention(AttentionLayer):
    """Linear attention; its kernel uses no 1/sqrt(d) scale (see functional.linear)."""
    variant = "linear"

    def __init__(self, dim, num_heads=8, *args, feature_map: str = "elu", **kw):
        super().__init__(dim, num_heads, *args, **kw)
        self.feature_map = V.check_choice("feature_map", feature_map, ("elu", "relu", "identity"))
        self.scale = 1.0

    def kernel_kwargs(self):
        return {"feature_map": self.feature_map}


class MaskedAttention(AttentionLayer):
    """Causal self-attention (paper 002 sec 2.6) with any kernel: ``kind="sigmoid"``, default softmax.
    ``is_causal`` is always on; extra keyword arguments go to the kernel (e.g. n_iters)."""
    variant = "masked"

    def __init__(self, dim, num_heads=8, *args, kind: str = "softmax", kind_kwargs=None, **kw):
        from ..registry import split_layer_kwargs
        kernel_kw, layer_kw = split_layer_kwargs(kind, kw)
        super().__init__(dim, num_heads, *args, **layer_kw)
        self.kind = V.check_choice("kind", kind, AF.VARIANT_FUNCTIONS)
        self.kind_kwargs = {**(kind_kwargs or {}), **kernel_kw}
        if kind == "linear":
            self.scale = 1.0

    def attend(self, q, k, v, attn_mask=None, is_causal=False, x=None, **extra):
        fn = AF.VARIANT_FUNCTIONS[self.kind]
        return fn(q, k, v, attn_mask=attn_mask, is_causal=True, scale=self.scale,
                  dropout_p=self.attn_drop.p if self.training else 0.0, backend=self.backend,
                  **self.kind_kwargs, **extra)

    def extra_repr(self):
        return f"kind={self.kind!r}, num_heads={self.num_heads}, kernel_kwargs={self.kind_kwargs}"
