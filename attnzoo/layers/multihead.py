"""attnzoo.MultiheadAttention: a torch.nn.MultiheadAttention whose kernel is chosen by ``kind``.

It subclasses torch's module, built by torch's own constructor: ``isinstance(m, nn.MultiheadAttention)``
holds, and every attribute torch's module has is there with torch's meaning (``in_proj_weight`` or
``q/k/v_proj_weight``, ``in_proj_bias``, ``out_proj``, ``bias_k``, ``bias_v``, ``add_zero_attn``,
``_qkv_same_embed_dim``, ``dropout``, ``batch_first``, ``head_dim``, ``kdim``, ``vdim``), so
nn.MultiheadAttention state_dicts load unchanged and code that reads those attributes reads the truth.
Only ``forward`` differs: it runs the kind's kernel. Subclassing has one risk, torch code that sees an
nn.MultiheadAttention and runs torch's fused softmax kernel on its weights without calling forward:
nn.TransformerEncoderLayer's inference fast path (and nn.TransformerEncoder's nested tensors, which
only that path reads). torch skips that path while any submodule has a forward hook, so the module
registers a no-op forward pre-hook (``_no_fused_fast_path``); nested-tensor inputs are refused with
a message.

Masks follow torch's MHA convention (the opposite of SDPA's): a bool ``attn_mask`` or
``key_padding_mask`` marks with True the positions that must NOT take part; float masks are added.
``add_bias_kv`` / ``add_zero_attn`` add a learned / zero key and value that every query sees, as in
torch; the kernel gets them before the real keys (so that bottom-right causality and relative
positions of the real keys are unchanged) and the weights are returned in torch's column order (real
keys, bias, zero). In training with dropout, the returned weights are the ones after dropout and the
output is computed from them, as torch does.
"""
from __future__ import annotations

from fractions import Fraction
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import validate as V
from ..ops import variant as catalog
from ..ops.masking import causal_keep, split_causal
from ..ops.sizes import Shape
from . import multihead_packed, tracing
from .spec import split_kind
from .wrapper import Wrapper


def _no_fused_fast_path(module, args):
    """A forward pre-hook that does nothing: nn.TransformerEncoderLayer skips its fused softmax fast
    path (which reads nn.MultiheadAttention's weights without calling forward) while any submodule
    has a hook, so every call goes through attnzoo's kernel."""
    return None


class MultiheadAttention(nn.MultiheadAttention):
    """torch.nn.MultiheadAttention (a subclass: same constructor, attributes, parameters and forward)
    running the ``kind`` variant's kernel; see the module docstring for why it subclasses."""

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True,
                 add_bias_kv: bool = False, add_zero_attn: bool = False, kdim: Optional[int] = None,
                 vdim: Optional[int] = None, batch_first: bool = False, device=None, dtype=None,
                 kind: str = "softmax", backend: Optional[str] = None, **kind_kwargs) -> None:
        if embed_dim <= 0 or num_heads <= 0:
            raise ValueError(f"embed_dim and num_heads must be > 0, got {embed_dim} and {num_heads}")
        if embed_dim % num_heads != 0:
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        # torch's constructor: its parameters, attributes and initialisation exactly
        super().__init__(embed_dim, num_heads, dropout=dropout, bias=bias, add_bias_kv=add_bias_kv,
                         add_zero_attn=add_zero_attn, kdim=kdim, vdim=vdim, batch_first=batch_first,
                         device=device, dtype=dtype)
        kind, kind_kwargs = split_kind(kind, kind_kwargs)  # kind="sinkhorn(n_iters=5)" as in attnzoo.create
        self.kind = V.check_choice("kind", kind, catalog.names())
        V.check_dropout(dropout, "dropout")
        self.kind_kwargs = _check_kind_kwargs(self.kind, kind_kwargs, embed_dim // num_heads)
        self.backend = backend
        self.register_forward_pre_hook(_no_fused_fast_path)

    def __prepare_scriptable__(self):
        tracing.refuse_torchscript(self)

    def _project(self, query, key, value):
        E = self.embed_dim
        b = self.in_proj_bias
        bq, bk, bv = (None, None, None) if b is None else b.split(E)
        if self._qkv_same_embed_dim:
            wq, wk, wv = self.in_proj_weight.split(E)
        else:
            wq, wk, wv = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
        return F.linear(query, wq, bq), F.linear(key, wk, bk), F.linear(value, wv, bv)

    def _extra_keys(self, B: int, dtype, device):
        """(keys, values) of add_bias_kv / add_zero_attn, (B, H, e, hd) each in that order, or None."""
        ks, vs = [], []
        if self.bias_k is not None:
            ks.append(self.bias_k.to(dtype).expand(B, 1, self.embed_dim))
            vs.append(self.bias_v.to(dtype).expand(B, 1, self.embed_dim))
        if self.add_zero_attn:
            zero = torch.zeros(B, 1, self.embed_dim, dtype=dtype, device=device)
            ks.append(zero)
            vs.append(zero)
        if not ks:
            return None
        return tuple(torch.cat(t, 1).reshape(B, -1, self.num_heads, self.head_dim).transpose(1, 2) for t in (ks, vs))

    def _attend(self, q, k, v, attn_mask, is_causal, dropout_p, extra_keys: int = 0):
        """The kernel call on (B, H, N, hd) tensors; attnzoo.swap overrides it to run a layer's variant.
        ``extra_keys``: how many of the first keys are add_bias_kv / add_zero_attn's, not tokens."""
        fn = catalog.get(self.kind).functional
        return fn(q, k, v, attn_mask=attn_mask, is_causal=is_causal, dropout_p=dropout_p, backend=self.backend,
                  **self.kind_kwargs)

    def _check_inputs(self, query, key, value) -> None:
        if query.dim() not in (2, 3) or key.dim() != query.dim() or value.dim() != query.dim():
            raise ValueError(f"{type(self).__name__}: query, key and value must all be batched (3-D) or all "
                             f"unbatched (2-D, (L, E)), got {query.dim()}-D, {key.dim()}-D and {value.dim()}-D")
        for name, t, width in (("query", query, self.embed_dim), ("key", key, self.kdim), ("value", value, self.vdim)):
            if t.shape[-1] != width:
                raise ValueError(f"{type(self).__name__}: {name} must have {width} features (the last dim), "
                                 f"got shape {tuple(t.shape)}")
        if key.shape[:-1] != value.shape[:-1]:
            raise ValueError(f"{type(self).__name__}: key and value must agree in every dim but the last, got "
                             f"{tuple(key.shape)} and {tuple(value.shape)}")

    def forward(self, query, key, value, key_padding_mask=None, need_weights: bool = True, attn_mask=None,
                average_attn_weights: bool = True, is_causal: bool = False):
        """As torch.nn.MultiheadAttention. Unbatched (L, E) inputs whatever ``batch_first`` says.
        ``is_causal`` with an ``attn_mask`` is torch's hint that the mask is causal: when the mask keeps
        no later key (the causal mask, a causal band, packed blocks), the kernel runs with
        ``is_causal=True`` and the mask (none for exactly the causal mask): Sinkhorn then solves each
        row's problem as causality requires (``ops.masking.coupled_causal_rows``) instead of
        normalising columns over the masked square; a mask that keeps a later key is applied as given.
        ``is_causal`` alone (torch requires the mask) is causal."""
        proxy = tracing.fx_proxy(query, key, value, key_padding_mask, attn_mask)
        if proxy is not None:  # torch.fx symbolic tracing: this module is one call of the graph (tracing.py)
            return tracing.record_as_one_call(self, proxy, (query, key, value), dict(
                key_padding_mask=key_padding_mask, need_weights=need_weights, attn_mask=attn_mask,
                average_attn_weights=average_attn_weights, is_causal=is_causal))
        if any(t.is_nested and t.layout == torch.jagged for t in (query, key, value)):
            return multihead_packed.forward_nested(self, query, key, value, key_padding_mask, need_weights,
                                                   attn_mask, is_causal)
        refuse_nested(self, query, key, value)
        self._check_inputs(query, key, value)
        self_attention = query is key  # before the reshapes below make new tensors
        batched = query.dim() == 3
        if not batched:  # (L, E) -> (L, 1, E): sequence first, batch of one
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif self.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        L, B, _ = query.shape
        S = key.shape[0]
        H, hd = self.num_heads, self.head_dim
        if attn_mask is not None and (is_causal or (self_attention and catalog.get(self.kind).couples_queries)):
            # causality goes to the kernel as is_causal, with the mask when it holds more (a band, packed
            # blocks); torch's hint was wrong about a mask that keeps a later key: it applies as given.
            # In self-attention a variant that couples queries reads a mask that keeps no later key as
            # causality without the hint (as attnzoo.swap's torch.nn modules and the timm-facing layer do):
            # as one plain problem its column normalisation would let later tokens move earlier outputs
            attn_mask, is_causal = split_causal_mask(attn_mask, L, S)
        q, k, v = self._project(query, key, value)
        q, k, v = (t.reshape(t.shape[0], B, H, hd).permute(1, 2, 0, 3) for t in (q, k, v))
        mask = _sdpa_mask(attn_mask, key_padding_mask, B, H, L, S, q.dtype)
        extra = self._extra_keys(B, k.dtype, k.device)
        e = 0
        if extra is not None:  # first: the real keys keep their bottom-right causality and positions
            e = extra[0].shape[2]
            k, v = torch.cat([extra[0], k], 2), torch.cat([extra[1], v], 2)
            if mask is not None:  # every query sees them
                mask = F.pad(mask, (e, 0), value=True if mask.dtype == torch.bool else 0.0)
        dropout_p = self.dropout if self.training else 0.0
        weights = None
        if need_weights:
            # every variant is linear in v: running it on v = I gives its weight matrix exactly, after
            # dropout when dropout is on (torch's weights; the output is then computed from them)
            eye = torch.eye(S + e, dtype=q.dtype, device=q.device).expand(B, H, S + e, S + e)
            weights = self._attend(q, k, eye, mask, is_causal, dropout_p, extra_keys=e)
        if weights is not None and dropout_p > 0:
            out = weights @ v
        else:
            out = self._attend(q, k, v, mask, is_causal, dropout_p, extra_keys=e)
        out = out.permute(2, 0, 1, 3).reshape(L, B, self.embed_dim)
        out = self.out_proj(out)
        if batched and self.batch_first:
            out = out.transpose(0, 1)
        if not batched:
            out = out.squeeze(1)
        if not need_weights:
            return out, None
        if e:  # torch's column order: the real keys, then bias_k, then the zero key
            weights = torch.cat([weights[..., e:], weights[..., :e]], -1)
        if average_attn_weights:
            weights = weights.mean(1)
        if not batched:
            weights = weights.squeeze(0)
        return out, weights


def refuse_nested(module, *tensors) -> None:
    if any(t.is_nested for t in tensors):
        raise NotImplementedError(
            f"{type(module).__name__} does not take strided nested tensors (torch's fast-path input format): pass "
            "padded tensors with a key_padding_mask, or torch.jagged nested tensors, and build nn.TransformerEncoder "
            "with enable_nested_tensor=False (attnzoo.swap turns it off for the encoders it swaps)")


def _check_kind_kwargs(kind: str, kind_kwargs: dict, head_dim: int) -> dict:
    """The kind's own options, checked when the module is built (a typo or a bad value fails here, not
    at the first forward inside a host model): names against the kind's functional, values with its
    ``check`` on stand-in q, k, v of the head dim."""
    record = catalog.get(kind)
    unknown = sorted(set(kind_kwargs) - set(record.options))
    if unknown:
        raise TypeError(f"kind={kind!r} does not take {unknown}; its options are {sorted(record.options)}")
    scale = record.default_scale if record.default_scale is not None else head_dim ** -0.5
    catalog.check_on_stand_ins(record.check, head_dim, scale, {**record.options, **kind_kwargs})
    return dict(kind_kwargs)


def is_causal_mask(attn_mask: torch.Tensor, L: int, S: int) -> bool:
    """Is a torch-MHA mask ((L, S) or (B*H, L, S); bool True = masked, or float with -inf) exactly the
    causal mask that ``is_causal=True`` applies (key j hidden from query i when j > i + S - L; for
    L == S the upper triangle, as nn.Transformer.generate_square_subsequent_mask makes)?"""
    if attn_mask.dim() not in (2, 3) or tuple(attn_mask.shape[-2:]) != (L, S):
        return False
    keep = causal_keep(L, S, attn_mask.device)
    if attn_mask.dtype == torch.bool:
        return bool((attn_mask == ~keep).all())
    hidden = attn_mask == float("-inf")
    return bool((hidden == ~keep).all()) and bool((attn_mask.masked_fill(hidden, 0) == 0).all())


def split_causal_mask(attn_mask: torch.Tensor, L: int, S: int):
    """A torch-MHA mask ((L, S) or (B*H, L, S); bool True = masked, or float with -inf) -> (mask,
    is_causal) by ``ops.masking.split_causal``, the rule both adapters share: (None, True) for exactly
    the causal mask, (attn_mask, True) for one that keeps no later key but holds more (a causal band,
    packed blocks: a variant that couples queries then reads only its causal part), (attn_mask, False)
    for one that keeps a later key or does not have the (L, S) shape."""
    if attn_mask.dim() not in (2, 3) or tuple(attn_mask.shape[-2:]) != (L, S):
        return attn_mask, False
    reduced, causal = split_causal(~attn_mask if attn_mask.dtype == torch.bool else attn_mask, L, S)
    return (None if causal and reduced is None else attn_mask), causal


def _sdpa_mask(attn_mask, key_padding_mask, B, H, L, S, dtype):
    """torch-MHA masks (True = masked out; float added) -> one SDPA-style mask (B, H|1, L, S) or None."""
    def to_sdpa(m):
        return ~m if m.dtype == torch.bool else m.to(dtype)

    for name, m in (("attn_mask", attn_mask), ("key_padding_mask", key_padding_mask)):
        if m is not None and not (m.dtype == torch.bool or m.is_floating_point()):
            raise TypeError(f"{name} must be bool (True = masked out) or float (added to the logits), got {m.dtype}")

    mask = None
    if attn_mask is not None:
        if attn_mask.dim() == 2:
            if tuple(attn_mask.shape) != (L, S):
                raise ValueError(f"attn_mask must have shape (L, S) = ({L}, {S}) or (B*H, L, S), got {tuple(attn_mask.shape)}")
            mask = to_sdpa(attn_mask).view(1, 1, L, S)
        elif attn_mask.dim() == 3:
            if tuple(attn_mask.shape) != (B * H, L, S):
                raise ValueError(f"attn_mask must have shape (B*H, L, S) = ({B * H}, {L}, {S}), got {tuple(attn_mask.shape)}")
            mask = to_sdpa(attn_mask).view(B, H, L, S)
        else:
            raise ValueError(f"attn_mask must be 2-D or 3-D, got {attn_mask.dim()}-D")
    if key_padding_mask is not None:
        if tuple(key_padding_mask.shape) != (B, S):
            raise ValueError(f"key_padding_mask must have shape (B, S) = ({B}, {S}), got {tuple(key_padding_mask.shape)}")
        kpm = to_sdpa(key_padding_mask).view(B, 1, 1, S)
        if mask is None:
            mask = kpm
        elif mask.dtype == torch.bool and kpm.dtype == torch.bool:
            mask = mask & kpm
        else:
            as_float = [m if m.dtype != torch.bool else
                        torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill(~m, float("-inf"))
                        for m in (mask, kpm)]
            mask = as_float[0] + as_float[1]
    return mask


def projection_flops(s: Shape) -> Fraction:
    """The four projections of attnzoo.MultiheadAttention: in_proj 2 B N E 3E, out_proj 2 B N E E (E = H D)."""
    e = s.heads * s.head_dim
    return Fraction(2 * s.batch * s.seq_q * e * 3 * e + 2 * s.batch * s.seq_q * e * e)


def timed_module(embed_dim, num_heads, *, kind, backend, device, dtype, **layer_kwargs):
    """The module the benchmark times for "multihead": self-attention of (B, N, E) tokens."""
    module = MultiheadAttention(embed_dim, num_heads, batch_first=True, kind=kind, backend=backend, device=device,
                                dtype=dtype, **layer_kwargs)

    def forward(x, causal):
        return module(x, x, x, need_weights=False, is_causal=causal)[0]
    return forward, [p for p in module.parameters() if p.requires_grad]


MULTIHEAD = Wrapper(name="multihead", layer_class=MultiheadAttention, module_flops=projection_flops,
                    module_formula="in/out projections 8 B N E^2 (E = H D)", module_work="projections",
                    timed_module=timed_module,
                    in_host_models=True, parameters="nn.MultiheadAttention's",
                    paper="paper 002 eq (2.7)/(2.9); paper 001 (multi-head)")
