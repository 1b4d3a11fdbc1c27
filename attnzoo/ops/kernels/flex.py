"""FlexAttention (CUDA only) with attnzoo's mask semantics: the ``flex`` backends of l2 and fenchel
and the fused T5 path run through ``flex_attention``.

FlexAttention compiles a score modifier into a fused kernel; ``flex_attention`` offers three terms on
top of scale * q.k: a float mask, minus a per-key term (L2's scale * ||k_j||^2; the ||q_i||^2 term
cancels in the softmax) and a per-head bias read by query-key offset, table[lut[j - i + Nq - 1], h]
(T5), whose gradient FlexAttention's backward returns (a captured tensor that requires grad). Masks
use the same preparation as the SDPA path (``sdpa.sdpa_mask``): bottom-right causal, rows with no key
opened and then zeroed; a causal block mask is built once per (Nq, Nk, device) and reused. The
backends accept CUDA tensors only; the forward logic is checked on CPU under no_grad by an opt-in
test (ATTNZOO_FLEX_CPU=1, tests/test_cpu_softmax_family.py), CUDA and the backward by
tests/test_triton_gpu.py and the GPU benchmark's correctness pass.
"""
from __future__ import annotations

import functools

import torch

from .sdpa import sdpa_mask


def flex_available() -> bool:
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


@functools.lru_cache(maxsize=1)
def compiled_flex_attention():
    """flex_attention wrapped by torch.compile once per process: every caller (these backends, the
    benchmark's FlexAttention baseline) shares one compiled function and so one dynamo cache, instead
    of a fresh torch.compile object, and a fresh compile, per call site or per call."""
    from torch.nn.attention.flex_attention import flex_attention
    return torch.compile(flex_attention, dynamic=False)


@functools.lru_cache(maxsize=32)
def _causal_block_mask(nq: int, nk: int, device: torch.device):
    """Top-left causal (j <= i) block mask for Nq == Nk; built once per shape: building it evaluates
    the predicate over the whole (Nq, Nk) grid."""
    from torch.nn.attention.flex_attention import create_block_mask
    return create_block_mask(lambda b, h, i, j: j <= i, None, None, nq, nk, device=device)


def flex_attention(q, k, v, mask, is_causal, scale, key_term=None, offset_bias=None):
    """softmax(scale q.k + mask_ij - key_term_j + table[lut[j - i + Nq - 1], h]) v with attnzoo's
    mask semantics; ``offset_bias`` is (table (num_buckets, H), lut (Nq + Nk - 1,) int) or None."""
    from torch.nn.attention.flex_attention import create_block_mask
    B, H, nq, _ = q.shape
    nk = k.shape[2]
    mask, causal, has_key = sdpa_mask(mask, is_causal, nq, nk, q.device, q.dtype)
    block_mask = None
    additive = None
    if causal:
        block_mask = _causal_block_mask(nq, nk, q.device)
    elif mask is not None and mask.dtype == torch.bool:
        full = mask.expand(B, H, nq, nk)
        block_mask = create_block_mask(lambda b, h, i, j: full[b, h, i, j], B, H, nq, nk, device=q.device)
    elif mask is not None:
        additive = mask.expand(B, H, nq, nk)

    def score_mod(score, b, h, i, j):
        if additive is not None:
            score = score + additive[b, h, i, j]
        if key_term is not None:
            score = score - key_term[b, h, j]
        if offset_bias is not None:
            score = score + offset_bias[0][offset_bias[1][j - i + (nq - 1)], h]
        return score

    out = compiled_flex_attention()(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale)
    if has_key is not None:
        out = torch.where(has_key, out, torch.zeros((), dtype=out.dtype, device=out.device))
    return out


def flex_reason(q, k, v, **kw):
    """A FlexAttention backend's ``supports``: CUDA, this torch build, no dropout."""
    if q.device.type != "cuda":
        return "FlexAttention runs here on CUDA tensors only (it has no backward on CPU)"
    if not flex_available():
        return "torch.nn.attention.flex_attention is not available in this torch build"
    if kw.get("dropout_p", 0.0) > 0:
        return "FlexAttention has no dropout on the weights"
    return None
