"""torch's ``F.scaled_dot_product_attention`` (SDPA) with attnzoo's semantics, on every device: the
``torch`` backends of softmax, l2 and fenchel run through ``sdpa_attention``.

attnzoo's semantics on top of SDPA's:
- causal is bottom-right aligned: SDPA's ``is_causal=True`` (top-left) is used only when Nq == Nk,
  otherwise the (Nq, Nk) bool mask is built once (not per head);
- a query row with no key returns zeros, forward and backward: such rows are opened to every key
  before SDPA (so it computes finite numbers there) and their output is replaced by zeros after,
  which also zeroes every gradient flowing through them;
- q, k and v are zero-padded to one head dim, a multiple of 8 on CUDA (SDPA's fused kernels, cuDNN
  and FlashAttention, need it).

A per-key logit term g_j (L2's -||k_j||^2, Fenchel's per-key log u) rides along as one more
coordinate, q' = [c q, 1], k' = [k, g] (``augment``), so SDPA runs its fastest mask-free kernel.
Half precision: a bf16/fp16 coordinate holding such a value would carry only 8 (11) bits, an
absolute logit error of ~0.4% of ||k||^2. Those values are computed in fp32 and split into two
coordinates, hi = x rounded to the input dtype and lo = (x - hi) rounded, with q' = 1 in both: the
kernel's fp32 dot product adds them back to ~16 (22) bits. float16's range is small too (L2's ||k||^2
passes 65504 at |k| = 256): there the coordinates hold x / s and q' holds s, s a power of two
(``float16_step``). Gradients flow through autograd
(d hi / dx = 1, d lo / dx = 0 once hi's dependence is counted), so they are exact as well.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..masking import causal_keep, split_mask


def sdpa_mask(attn_mask, is_causal, nq, nk, device, dtype):
    """(mask for SDPA or None, SDPA's is_causal, has_key or None); has_key (bool, (..., Nq, 1))
    marks the rows with at least one key when some row might have none."""
    if attn_mask is None:
        if not is_causal:
            return None, False, None
        if nq == nk:
            return None, True, None
        keep = causal_keep(nq, nk, device)
        if nq < nk:  # bottom-right: every row keeps key 0 .. i + (nk - nq) >= 0
            return keep, False, None
        attn_mask = keep
    elif is_causal:
        c = causal_keep(nq, nk, device)
        if attn_mask.dtype == torch.bool:
            attn_mask = attn_mask & c
        else:
            attn_mask = attn_mask.masked_fill(~c, -math.inf)
    if attn_mask.dtype == torch.bool:
        has_key = attn_mask.any(-1, keepdim=True)
        return attn_mask | ~has_key, False, has_key
    attn_mask = attn_mask.to(dtype)
    has_key = (attn_mask > -math.inf).any(-1, keepdim=True)
    return torch.where(has_key, attn_mask, torch.zeros((), dtype=dtype, device=device)), False, has_key


def _round_up_head_dims(q, k, v):
    """SDPA's fused kernels (cuDNN, FlashAttention-2, the CPU flash kernel) need one head dim for q,
    k and v, a multiple of 8 on CUDA; otherwise SDPA falls back to a kernel that stores the N x N
    weights or is slower. Zero columns change neither q.k nor the output's first Dv columns."""
    dqk, dv = q.shape[-1], v.shape[-1]
    target = max(dqk, dv)
    if q.device.type == "cuda":
        target = -(-target // 8) * 8
    if dqk < target:
        q, k = F.pad(q, (0, target - dqk)), F.pad(k, (0, target - dqk))
    if dv < target:
        v = F.pad(v, (0, target - dv))
    return q, k, v


def sdpa_attention(q, k, v, attn_mask, is_causal, scale, dropout_p, enable_gqa=False):
    mask, causal, has_key = sdpa_mask(attn_mask, is_causal, q.shape[-2], k.shape[-2], q.device, q.dtype)
    dv = v.shape[-1]
    q, k, v = _round_up_head_dims(q, k, v)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=causal,
                                         scale=scale, enable_gqa=enable_gqa)
    if out.shape[-1] != dv:  # v was padded to the common head dim
        out = out[..., :dv]
    if has_key is not None:
        out = torch.where(has_key, out, torch.zeros((), dtype=out.dtype, device=out.device))
    return out


def sdpa_with_sinks(q, k, v, attn_mask, is_causal, scale, dropout_p, enable_gqa, sinks):
    """SDPA with attention sinks (gpt-oss): one more key and value of zeros in front, whose logit
    (q . 0 = 0) gets the head's sink from a float mask column, so exp(sink) joins every row's normaliser
    and the sink adds nothing to the output; its gradient reaches ``sinks`` through the mask. Causality
    (bottom-right aligned) and ``attn_mask`` move into that mask, an (Nq, Nk + 1) float tensor: SDPA's
    fused kernels still run, without tile skipping (the fused Triton form is issue 29's)."""
    nq, nk, heads = q.shape[-2], k.shape[-2], q.shape[1]
    keep, bias = split_mask(attn_mask, is_causal, nq, nk, q.device)
    rest = torch.zeros((), dtype=q.dtype, device=q.device) if bias is None else bias.to(q.dtype)
    if keep is not None:
        rest = torch.where(keep, rest, torch.full((), -math.inf, dtype=q.dtype, device=q.device))
    rest = rest.reshape((1,) * (4 - rest.dim()) + tuple(rest.shape))
    batch = rest.shape[0]
    rest = rest.expand(batch, heads, nq, nk)
    sink = sinks.to(q.dtype).view(1, heads, 1, 1).expand(batch, heads, nq, 1)
    zeros_k = k.new_zeros(*k.shape[:-2], 1, k.shape[-1])
    zeros_v = v.new_zeros(*v.shape[:-2], 1, v.shape[-1])
    return sdpa_attention(q, torch.cat([zeros_k, k], -2), torch.cat([zeros_v, v], -2), torch.cat([sink, rest], -1),
                          False, scale, dropout_p, enable_gqa)


def at_least_fp32(dtype):
    return torch.promote_types(dtype, torch.float32)


def split_coordinate(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x (..., 1), fp32 -> the coordinates that carry it in ``dtype``: itself for fp32/fp64, (hi, lo)
    for bf16/fp16 (hi + lo == x to about twice the dtype's mantissa bits; see the module docstring)."""
    if dtype not in (torch.float16, torch.bfloat16):
        return x.to(dtype)
    hi = x.to(dtype)
    lo = (x - hi.to(x.dtype)).to(dtype)
    return torch.cat([hi, lo], dim=-1)


def float16_step(key_values: torch.Tensor) -> torch.Tensor:
    """A power of two s (0-dim, fp32) with |key_values| / s within float16's range: a coordinate holds
    key_values / s and q' holds s (both exact, s <= 2^15), so an L2 key with ||k||^2 > 65504 (|k| > 256)
    does not overflow to inf (a NaN output). Computed on the device (no host sync); NaN / inf keys are
    left out of the maximum, so they spoil only the rows they take part in. One s for the whole tensor
    keeps grouped-query heads consistent."""
    size = torch.nan_to_num(key_values.detach().abs(), nan=0.0, posinf=0.0).amax()
    return torch.exp2((torch.ceil(torch.log2(size.clamp_min(1.0))) - 14).clamp(0, 15))


def augment(q, k, q_coeff: float, key_values: torch.Tensor):
    """(q', k') with q'.k' = q_coeff * q.k + key_values_j (key_values (..., Nk, 1) fp32)."""
    if k.dtype == torch.float16:
        step = float16_step(key_values)
        extra = split_coordinate(key_values / step, k.dtype)
        q_extra = step.to(q.dtype).expand(q.shape[:-1] + (extra.shape[-1],))
    else:
        extra = split_coordinate(key_values, k.dtype)
        q_extra = torch.ones(q.shape[:-1] + (extra.shape[-1],), dtype=q.dtype, device=q.device)
    qa = q if q_coeff == 1.0 else q_coeff * q
    return torch.cat([qa, q_extra], dim=-1), torch.cat([k, extra.expand(k.shape[:-1] + (extra.shape[-1],))], dim=-1)


# -- how SDPA serves as a variant's "torch" backend -------------------------------------------------

DESCRIPTION = "F.scaled_dot_product_attention with attnzoo's mask semantics"


def mask_grad_on_cpu(q, k, v, **kw):
    """(auto only) On CPU, SDPA's fused kernel gives no gradient for an additive mask: SDPA would use
    its math kernel (N x N weights), which the blockwise path avoids. Named explicitly, 'torch' runs."""
    if q.device.type != "cpu" or not torch.is_grad_enabled():
        return None
    for name in ("attn_mask", "log_u"):
        t = kw.get(name)
        if isinstance(t, torch.Tensor) and t.requires_grad:
            return (f"{name} requires grad and on CPU SDPA has no fused kernel with a mask gradient (its math "
                    f"kernel would build the N x N weights); 'cpu' computes it blockwise")
    return None


def plain_sdpa(q, k, v, *, attn_mask=None, is_causal=False, scale, dropout_p=0.0, enable_gqa=False):
    """SDPA itself, for the calls that need none of ``sdpa_attention``'s adjustments."""
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                                          enable_gqa=enable_gqa)


def specialize_plain(q, k, v, *, attn_mask=None, is_causal=False, sinks=None, **_):
    """``plain_sdpa`` for a signature with no mask, no sinks, a causal pattern SDPA aligns as attnzoo
    does (Nq == Nk), and head dims SDPA's fused kernels take as they are; None otherwise
    (``sdpa_attention`` then builds masks, pads head dims and zeroes empty rows)."""
    if attn_mask is not None or sinks is not None or (is_causal and q.shape[-2] != k.shape[-2]):
        return None
    dqk, dv = q.shape[-1], v.shape[-1]
    if dqk != dv or (q.device.type == "cuda" and dqk % 8):
        return None
    return plain_sdpa


def register(variant: str, fn, supports=None, *, priority: int, description: str = DESCRIPTION, gqa: bool = False,
             specialize=None, extras=(), auto_prefers=None):
    """Register ``fn`` (a variant's form of SDPA) as its "torch" backend. SDPA's fused CPU kernel
    returns a zero row for a query holding NaN, so the dispatcher puts the NaN back on CPU tensors
    (on CUDA that would cost a pass over q and the output per call; benchmarks/gpu_speed.py's
    "nan-query" rows check cuDNN / FlashAttention there). ``auto_prefers``: the variant's own veto under
    auto, checked after ``mask_grad_on_cpu``."""
    from ..dispatch import all_of, register_backend
    register_backend(variant, "torch", fn, supports=supports, priority=priority, description=description,
                     auto_prefers=all_of(mask_grad_on_cpu, auto_prefers) if auto_prefers else mask_grad_on_cpu,
                     hides_query_nan_on=("cpu",), gqa=gqa, specialize=specialize, extras=extras)
